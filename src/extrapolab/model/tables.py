"""Distance tables shared by the fast attention paths (docs/attention.md).

A relative scheme's bias depends on the distance k = m - n only, so one [H|1, n] table for
k = 0..n-1 holds everything a layer needs. :class:`DistanceBias` builds it once per forward and
shares it by every layer; the Toeplitz path (:mod:`.toeplitz`) turns it into zero-copy Hankel
views for fused SDPA, the CUDA FlexAttention path (:mod:`.flex`) reads it in its ``score_mod``.
Neither ever builds an L x L tensor.
"""
from __future__ import annotations

import math

import torch

from ..positional.base import PositionalScheme, RelativeBias, causal_distance
from ..positional.positions import known_start


def is_toeplitz(scheme: PositionalScheme, allow_weight: bool = False) -> bool:
    """True when the additive term depends on m - n only (or is absent); a multiplicative kernel
    on q·k (KERPLE wht) must then also be a distance table and is accepted with ``allow_weight``."""
    if not scheme.has_bias:
        return not scheme.has_weight
    if not isinstance(scheme, RelativeBias) or type(scheme).bias is not RelativeBias.bias:
        return False
    return not scheme.has_weight or (allow_weight and type(scheme).weight is RelativeBias.weight)


def arange_start(pos: torch.Tensor) -> int | None:
    """p0 if ``pos == p0 + arange(len(pos))``, else None (one read of the device for one position: a decoded token's
    query; :func:`~extrapolab.positional.positions.span` also gives the largest, for a rotary table)."""
    n = pos.numel()
    if n == 0 or pos.dim() != 1:
        return None
    known = known_start(pos)
    if known is not None:
        return known
    p0 = int(pos[0])
    if n > 1 and (int(pos[-1]) - p0 != n - 1 or not bool(torch.all(pos[1:] - pos[:-1] == 1))):
        return None
    return p0


class DistanceBias:
    """One forward's distance tables ([H|1, n] for k = 0..n-1), shared by every layer.

    ``hankel`` turns a table into the reversed-query layout ext[x] = f(dmax - x): the bias (then
    window mask, then / tau; -inf for future keys) or, with ``kind="weight"``, the multiplicative
    kernel (0 for future keys). Without autograd, ext is a slice of one master vector kept in the
    scheme's table cache (grown by doubling, keyed on the parameter values for learned tables), so
    every layer, length and decoding step reuses it (a master built under ``inference_mode`` is
    rebuilt outside it: autograd may not save inference tensors, e.g. for input gradients after an
    evaluation); with autograd it is built once per forward and keeps its graph, so the gradient
    reaches the scheme's parameters once.
    """

    def __init__(self, scheme: PositionalScheme, device=None, dtype=torch.float32) -> None:
        self.scheme, self.device, self.dtype = scheme, device, dtype
        self._tables: dict = {}
        self._hankels: dict = {}
        self._fp: list = []  # parameter fingerprint, computed once per forward
        self._same_fp: dict = {}  # id(stored fingerprint) -> (it, equal to this forward's?)
        self._starts: dict = {}  # id(pos) -> (pos, arange_start(pos)); pos kept alive
        self._memo: dict = {}  # per-forward objects the layers share (see memo)
        self._increasing: dict = {}  # id(pos) -> (pos, strictly increasing?)
        self._children: dict = {}  # id(sub-scheme) -> DistanceBias (per-layer hybrids, see of)

    def of(self, scheme: PositionalScheme) -> "DistanceBias":
        """The tables of ``scheme``: this object for its own scheme, else one child per sub-scheme of
        a per-layer hybrid (``for_layer``), made once per forward and sharing the position memos."""
        if scheme is self.scheme:
            return self
        child = self._children.get(id(scheme))
        if child is None or child.scheme is not scheme:
            child = self._children[id(scheme)] = DistanceBias(scheme, self.device, self.dtype)
            child._starts, child._increasing = self._starts, self._increasing  # position checks only
        return child

    def increasing(self, pos: torch.Tensor) -> bool:
        """Strictly increasing positions, memoised (within this forward) like :meth:`starts`."""
        return _by_id(self._increasing, pos, lambda: pos.numel() < 2 or known_start(pos) is not None
                      or bool(torch.all(pos[1:] > pos[:-1])))

    def memo(self, key, make):
        """``make()`` once per forward for ``key``, shared by every layer: the flex path's block mask
        of a learnable table and its 0-d offset / 1/tau tensors, built on the device without a
        host-device synchronisation per layer."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = make()
        return hit

    def toeplitz_rows(self, layer: int) -> float | None:
        """The scheme's ``toeplitz_rows()`` for ``layer`` as a float, read from the device once per forward
        (one host-device synchronisation on CUDA, shared by the layers); None when it has none."""
        ts = self.memo(("toeplitz_rows",), lambda: _floats(self.scheme.toeplitz_rows()))
        return None if ts is None else ts[0] if len(ts) == 1 else ts[layer]

    def starts(self, pos: torch.Tensor) -> int | None:
        """:func:`arange_start`, memoised (within this forward) for position tensors layers share."""
        return _by_id(self._starts, pos, lambda: arange_start(pos))

    def layer_key(self, layer: int) -> int:
        """Layers with the same key share tables (all of them unless the scheme is layer-dependent)."""
        return layer if self.scheme.layer_dependent else 0

    def table(self, layer: int, n: int, kind: str = "bias") -> torch.Tensor:
        key = (kind, self.layer_key(layer))
        t = self._tables.get(key)
        if t is None or t.shape[-1] < n:
            every = None
            if kind == "bias" and self.scheme.has_bias and self.scheme.layer_dependent and self.scheme.learnable:
                every = self.scheme.distance_tables(n, self.device, self.dtype)  # [G, H, n] or None
            if every is not None and key[1] < every.shape[0]:  # all layers in one set of kernels (FIRE's MLPs)
                self._tables.update({("bias", g): every[g] for g in range(every.shape[0])})
                return every[key[1]][:, :n]
            if kind == "weight":
                dist = torch.arange(n, device=self.device)
                t = self.scheme.weight_from_distance(dist, key[1]).to(self.dtype)  # [H, n]
            elif self.scheme.has_bias:
                t = self.scheme.distance_table(n, key[1], self.device, self.dtype)  # [H, n]
            else:
                t = torch.zeros(1, n, device=self.device, dtype=self.dtype)  # [1, n]
            self._tables[key] = t
        return t[:, :n]

    def hankel(self, layer, dmax, size, window=None, tau=1.0, dtype=torch.float32, kind="bias"):
        """(ext [H|1, size] with ext[x] = f(dmax - x), largest distance with a finite bias)."""
        key = (kind, self.layer_key(layer), window, float(tau), dtype)
        traced = torch.compiler.is_compiling()  # train.compile: no cache across forwards, no read-back (one graph)
        if (self.scheme.has_bias and self.scheme.learnable and torch.is_grad_enabled()) or traced:
            mkey = key + (dmax, size)
            if mkey not in self._hankels:  # rebuilt every forward: no read-back of its reach (a sync per layer)
                self._hankels[mkey] = self._build(layer, dmax, size, window, tau, dtype, kind, reach=False)
            return self._hankels[mkey]
        cache = self.scheme._table_cache
        ckey = ("hankel", self.device) + key
        hit = self.scheme.cached(ckey)  # (master, big, tail, dfin, params): master[y] = f(big - y)
        if not self._fp:
            ps = [p.detach().reshape(-1) for p in self.scheme.parameters()] if self.scheme.has_bias else []
            self._fp.append(torch.cat(ps).clone() if ps else None)
        params = self._fp[0]
        same = hit is not None and self._same_params(hit[4], params)
        if hit is None or hit[1] < dmax or hit[2] < size - dmax - 1 or not same:
            grow = same
            big = max(dmax, 2 * hit[1] if grow else 0, 255)
            tail = max(size - dmax - 1, 2 * hit[2] if grow else 0, 256)
            with torch.no_grad():
                master, dfin = self._build(layer, big, big + 1 + tail, window, tau, dtype, kind)
            hit = cache[ckey] = (master, big, tail, dfin, params)
        start = hit[1] - dmax
        return hit[0][:, start:start + size], hit[3]

    def _same_params(self, stored: torch.Tensor | None, params: torch.Tensor | None) -> bool:
        """``stored`` (a cached table's parameter fingerprint) equals this forward's, compared once per forward
        for each stored fingerprint (the layers' tables built in one forward share one: a comparison reads a
        value back, once per layer on a GPU before)."""
        return _by_id(self._same_fp, stored, lambda: _same(stored, params))

    def _build(self, layer, dmax, size, window, tau, dtype, kind, reach=True) -> tuple[torch.Tensor, int]:
        """(ext, dfin): ``reach=False`` takes dfin from the window alone (no device read-back; keys past the
        table's last finite distance are then masked by their -inf, not skipped: the same numbers)."""
        t = self.table(layer, dmax + 1, kind)  # [H', dmax+1]
        d = dmax - torch.arange(size, device=t.device)  # [size] distance of ext slot x
        if kind == "weight":
            return t[:, d.clamp(0, dmax)].masked_fill(d < 0, 0.0).to(dtype).contiguous(), dmax
        ok = d >= 0 if window is None else (d >= 0) & (d < window)
        ext = t[:, d.clamp(0, dmax)].masked_fill(~ok, -math.inf)  # [H', size]
        if tau != 1.0:
            ext = ext / tau
        if not reach:
            return ext.to(dtype).contiguous(), dmax if window is None else max(0, min(dmax, int(window) - 1))
        finite = torch.isfinite(t.detach()).any(0)  # [dmax+1]
        if window is not None:
            finite = finite & (torch.arange(dmax + 1, device=t.device) < window)
        dfin = int(finite.nonzero().max()) if bool(finite.any()) else 0
        return ext.to(dtype).contiguous(), dfin

    def dense(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[H', Lq, Lk] with -inf for future keys (for the plain path)."""
        dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
        t = self.table(layer, int(dist.max().clamp(min=0)) + 1)
        return t[:, dist.clamp(min=0)].masked_fill(dist < 0, -math.inf)


def table_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 tables for fp64 activations (exactness tests), fp32 otherwise (also under bf16)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _floats(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else [float(x) for x in t.reshape(-1).tolist()]


def _by_id(memo: dict, obj, compute):
    """``compute()`` for ``obj``, once while ``memo`` lives: keyed by id(obj), obj kept alive beside the value (so its
    id is not reused by another object)."""
    hit = memo.get(id(obj))
    if hit is None or hit[0] is not obj:
        hit = memo[id(obj)] = (obj, compute())
    return hit[1]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

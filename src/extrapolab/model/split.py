"""The split path of :func:`.attention.attend` (docs/attention.md, row 7): schemes whose bias is a distance
table only up to a query position T (``scheme.toeplitz_rows()``; FIRE, Li et al. 2024 §3: for a query at
m <= L the normaliser ψ(max(L, m)) is ψ(L)). The queries at m <= T run on the Toeplitz path
(:mod:`.toeplitz`, HankelSDPA for the learnable table), the others per query block: without gradients on
the CPU from the scheme's rows by distance (``scheme.distance_rows``, a strided view as the fused kernel's
mask), otherwise as the fallback with the scheme's dense bias (:func:`.reference.dense_attention`);
attention rows are independent, so the outputs concatenate. Shapes: q [B,H,Lq,D], k/v [B,H,Lk,D].
"""
from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from ..positional.base import PositionalScheme
from .reference import dense_attention
from .sdpa import sdpa
from .tables import DistanceBias
from .toeplitz import toeplitz_attention

#: query rows per dense block beyond T: the block's bias and the temporaries of computing it stay near
#: 32·rows·keys bytes (chosen by hand; any size is exact)
SPLIT_BLOCK = 256
#: the largest buffer of rows by distance a scheme keeps from one forward to the next, bytes (4,096 tokens,
#: 4 heads: 18 MB). A fresh buffer per layer call cost FIRE's 4,096-token forward ~45 ms (0.39 s against
#: 0.34 s) in a process whose heap training had grown, as in the bench, where its pages are mapped anew
SCRATCH_KEEP = 64 * 2**20


def split_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int, db: DistanceBias, starts, n: int,
                    block: int | None, *, scale: float, tau: float, tau_h, tau_s, window: int | None,
                    block_size: int, memory_budget_mb: float) -> torch.Tensor:
    """Queries 0..n-1 (positions a..a+n-1 <= T) on the Toeplitz path with the scheme's
    distance table, queries n.. as the fallback with the scheme's dense bias of those rows. When every layer
    shares the scheme's bias (not ``layer_dependent``) and it fits the memory budget, the dense rows' bias
    is computed once per forward (``db.memo``) and shared; otherwise per query block. [B, H, Lq, D]."""
    a, c = starts
    Lq, Lk = q.shape[2], k.shape[2]
    hi = min(Lk, a + n - c)  # keys after the last low query are masked for it
    low = toeplitz_attention(q[:, :, :n], k[:, :, :hi], v[:, :, :hi], a, c, db, layer, scale=scale, tau=tau,
                             window=window, block=block, tau_h=tau_h) if n else q[:, :, :0]  # [B, H, n, D]
    rows = Lq - n
    if not torch.is_grad_enabled() and q.device.type == "cpu" and by_distance(scheme):
        hb = max(1, min(int(block_size), SPLIT_BLOCK))
        return torch.cat([low, _by_distance(q, k, v, q_pos, scheme, layer, db, starts, n, hb, scale=scale, tau=tau,
                                            tau_s=tau_s, window=window)], dim=2)
    per_row = q.shape[0] * q.shape[1] * Lk * 4  # bytes of one row's dense mask
    hb = max(1, min(int(block_size), SPLIT_BLOCK, int(memory_budget_mb * 2**20 // per_row)))
    dense = None
    if not scheme.layer_dependent and q.shape[1] * rows * Lk * 4 <= memory_budget_mb * 2**20:
        dense = db.memo(("split_rows", id(q_pos), id(k_pos), n),  # once per forward, for every layer
                        lambda: (q_pos, k_pos, _block_bias(scheme, q_pos[n:], k_pos, layer, hb)))[2]
    high, _ = dense_attention(q[:, :, n:], k, v, q_pos[n:], k_pos, scheme, layer, tau=tau, window=window,
                              bias=dense, block=hb, fused=True, tau_s=tau_s)  # [B, H, rows, D]
    return torch.cat([low, high], dim=2)


def scheme_dtype(scheme: PositionalScheme, q: torch.Tensor) -> torch.dtype:
    """The dtype of the scheme's parameters (its bias is computed in it), q's when it has none."""
    return next((p.dtype for p in scheme.parameters()), q.dtype)


def by_distance(scheme: PositionalScheme) -> bool:
    """Whether the scheme lays a block of rows out by distance (``distance_rows``; FIRE)."""
    return type(scheme).distance_rows is not PositionalScheme.distance_rows


def _block_bias(scheme, q_pos, k_pos, layer: int, rows: int) -> torch.Tensor:
    """[H, Lq, Lk] bias of increasing queries, computed per block of ``rows`` queries over the keys up to the
    block's last one (what :func:`.reference.dense_attention` reads); the rest stays -inf."""
    parts = []
    for s in range(0, q_pos.numel(), rows):
        qp = q_pos[s:s + rows]
        hi = int(torch.searchsorted(k_pos, qp[-1:], right=True))
        b = scheme.bias(qp, k_pos[:hi], layer)  # [H, bq, hi]
        parts.append(F.pad(b, (0, k_pos.numel() - hi), value=-math.inf))
    return torch.cat(parts, dim=1)


def _scratch(scheme: PositionalScheme, db: DistanceBias, numel: int, device, dtype) -> torch.Tensor:
    """A flat buffer of ``numel`` elements for :func:`_by_distance`: one per forward, shared by its layers
    (``db.memo``), and kept on the scheme for the next forwards (its ``_table_cache``, per thread, device and
    dtype; ``.to()`` drops it) while it is at most ``SCRATCH_KEEP`` bytes. Allocated outside inference mode,
    so no-grad and inference-mode forwards can both write it."""
    key = ("split_scratch", threading.get_ident(), torch.device(device), dtype)

    def make() -> torch.Tensor:
        kept = scheme._table_cache.pop(key, None)
        if kept is None or kept.numel() < numel:
            with torch.inference_mode(False):
                kept = torch.empty(numel, device=device, dtype=dtype)  # [numel]
        if numel * kept.element_size() <= SCRATCH_KEEP:
            scheme._table_cache[key] = kept
        return kept[:numel]

    return db.memo(key + (numel,), make)


def _by_distance(q, k, v, q_pos, scheme, layer: int, db: DistanceBias, starts, n: int, rows: int, *, scale: float,
                 tau: float, tau_s, window: int | None) -> torch.Tensor:
    """Queries n.. without gradients, per block of ``rows``: the scheme's rows by distance
    (``scheme.distance_rows``, G [H, R, W]) read as the mask over the keys in reverse order. Key j' of the
    reversed keys is at distance d_lo + r + j' from query r, so the mask is the zero-copy view G[h, r, r + j']
    (strides W + 1, 1): O(H·R·(Lk + R)) per block, and the scheme never evaluates b per (query, key). Every
    block lives in one buffer [H, rows, Lk + rows] (:func:`_scratch`: shared by the layers, kept between
    forwards); its first columns, the future keys (d < 0), are set to -inf once per layer call and stay so
    from one block to the next. [B, H, Lq - n, D]."""
    a, c = starts
    H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    kf, vf = k.flip(2), v.flip(2)  # [B, H, Lk, D]: newest key first
    Wm = Lk + rows
    buf = _scratch(scheme, db, H * rows * Wm, q.device, scheme_dtype(scheme, q)).view(H, rows, Wm)  # [H, rows, Wm]
    inf_cols = 0  # buf[..., :inf_cols] holds -inf
    outs = []
    for s in range(n, Lq, rows):
        e = min(Lq, s + rows)
        R, hi = e - s, min(Lk, a + e - c)  # rows; keys up to the block's last query
        d_lo = a + s - c - hi + 1  # distance from query s to the newest of those keys
        W, neg = hi + R - 1, min(hi + R - 1, max(0, -d_lo))  # columns; those at d < 0
        G = buf[:, :R, :W]  # [H, R, W], row stride Wm
        if neg > inf_cols:
            buf[..., inf_cols:neg].fill_(-math.inf)
        inf_cols = neg if neg < W else max(inf_cols, neg)  # the block writes columns neg..W-1
        if neg < W:
            scheme.distance_rows(q_pos[s:e], d_lo + neg, W - neg, layer, out=G[..., neg:])  # d >= 0
        if window is not None and window - d_lo < W:
            G[..., max(neg, window - d_lo):].fill_(-math.inf)  # distances >= window
        qb = q[:, :, s:e]  # [B, H, R, D]
        if tau_s is not None:  # per head: divides q·k and the bias alike
            G, qb = G / tau_s.reshape(-1, 1, 1).to(G.dtype), qb / tau_s[..., None].to(qb.dtype)
        if tau != 1.0 or G.dtype != q.dtype:
            G = (G / tau).to(q.dtype)
        mask = G.as_strided((1, H, R, hi), (0, G.stride(0), G.stride(1) + 1, 1), G.storage_offset())  # [1, H, R, hi]
        outs.append(sdpa(qb, kf[:, :, Lk - hi:], vf[:, :, Lk - hi:], mask,
                                                   scale=scale))  # [B, H, R, D]
    return torch.cat(outs, dim=2)

"""FIRE, functional interpolation for relative positions (Li, You, Guruganesh, Ainslie, Ontanon, Zaheer,
Sanghai, Yang, Kumar, Bhojanapalli, ICLR 2024, "Functional Interpolation for Relative Positions Improves
Long Context Transformers", arXiv 2310.04418, §3: the FIRE bias with progressive interpolation and
the log transform):

    b_h(i, j) = f_θ(ψ(i − j) / ψ(max(L, i)))_h,    ψ(x) = log(|c·x| + 1),    L = |L_mult|·L_tr
    f_θ = Linear(1, 32) → ReLU → Linear(32, H)

for a query at position i and a key at j ≤ i; c (init 0.1) and L_mult (init 1) are learned, L_tr
is the training length (``original_length``, the model's ``train_length``). The paper has no
official code; its appendix code is reproduced in github.com/chuanyang-Zheng/DAPE (``DAPE.py``,
class ``FIRE``, read for this file) and followed here: normaliser max(row's largest distance,
|L_multiplier·init_L|), ``log(|c·d| + 1) / (log(|c·norm| + 1) + 1e-6)`` (eps 1e-6 in the
denominator), MLP 1 → 32 → H with ReLU, c = 0.1, L_multiplier = 1.0 learnable, init_L fixed. Its
nn.Linear layers keep PyTorch's default initialisation (U(±1/sqrt(fan_in)) for weights and biases),
so ours are raw parameters with that initialisation (the model's own init of nn.Linear leaves them
alone). The row's largest distance is the query position i when keys start at 0: we use the
query's position, so a block of rows, a prefix and cached decoding all see the same bias.

Per layer or shared: the reproduction builds one FIRE module inside every attention layer (GPT-NeoX
``ParallelSelfAttention``), i.e. each layer has its own f_θ, c and L_mult; that is our default. The
paper's efficiency variant shares one FIRE across layers ("FIRE-Shared"): ``shared=True`` (the bias
is then computed once per forward and shared by the layers). We could not re-read the paper's own
text where this was written; the default follows the reproduction.

Fast path (docs/attention.md, the "split" path): for a query at i ≤ L the normaliser is the constant
ψ(L), so b is a function of i − j alone: a distance table (``bias_from_distance``, O(n·32·H) work)
on the Toeplitz path, HankelSDPA with the table's gradient in training at L_tr. ``toeplitz_rows``
tells attention up to which position that holds. Queries beyond L (each with its own ψ(i)) go by
f's linear pieces (``pieces``: f is piecewise linear in its scalar input with at most 32 breakpoints,
so f(x) = α_s + β_s·x on the piece s holding x, exactly the MLP, with the same gradients almost
everywhere): without gradients as blocks of rows laid out by distance (``distance_rows``: one pass
per block outside the bands of distances where rows change piece), with them as dense blocks from
``bias``. On FlexAttention the same pieces score the tiles of queries and keys that span few of them
(``flex_pieces``, model/flex_pieces.py): one multiply-add per score instead of the MLP's 32 units.

TRF: at a fixed query the bias is a function of the distance, but normalised by the query's own
position, ψ(i − j)/ψ(max(L, i)) ∈ [0, 1]: there is no fixed kernel in i − j for Qin et al.'s series
(``no_trf``); ``analyze bias`` draws the learned curves at several query positions instead.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import RelativeBias, SchemeError, causal_distance, flex_copies
from .registry import register

#: heads x inputs up to which :meth:`FIRE.piecewise` evaluates every head at once (a distance table; 16 MiB of fp32);
#: larger inputs (dense blocks) go head by head, bounding the temporaries to one head's
_ONE_PASS = 1 << 22


@register
class FIRE(RelativeBias):
    name = "fire"
    relative = False  # beyond L the normaliser ψ(i) depends on the query's position
    paper = "Li et al. 2024 (FIRE, ICLR) §3: b(i, j) = f_θ(ψ(i−j)/ψ(max(L, i))), ψ(x) = log(c·x + 1)"
    summary = "learned MLP of log-distance / log-query-position (progressive interpolation), c and L learned"
    no_trf = ("FIRE normalises distances by the query's own position (ψ(i−j)/ψ(max(L, i)) ∈ [0, 1]): no fixed "
              "kernel in i − j, so no formula for the TRF; analyze bias draws its curve at several query positions")

    def __init__(self, num_heads: int, layers: int = 4, shared: bool = False, width: int = 32, c: float = 0.1,
                 L_mult: float = 1.0, original_length: int = 512, eps: float = 1e-6) -> None:
        super().__init__(num_heads)
        if int(layers) < 1 or int(width) < 1 or int(original_length) < 1:
            raise SchemeError(f"fire needs layers, width and original_length >= 1, got layers={layers}, width={width}, "
                              f"original_length={original_length}")
        if not (math.isfinite(float(c)) and float(c) != 0 and math.isfinite(float(L_mult)) and float(L_mult) != 0):
            raise SchemeError(f"fire c and L_mult must be finite and non-zero, got c={c}, L_mult={L_mult}; "
                              "the paper starts from c=0.1, L_mult=1")
        if not float(eps) > 0:
            raise SchemeError(f"fire eps must be > 0, got {eps}")
        self.layers, self.shared, self.width = int(layers), bool(shared), int(width)
        self.c0, self.L_mult0, self.original_length, self.eps = float(c), float(L_mult), int(original_length), float(eps)
        self.layer_dependent = not self.shared
        G, H, W = 1 if self.shared else self.layers, self.num_heads, self.width

        def uniform(*shape, fan_in):  # nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(fan_in)
            return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        self.w1, self.b1 = uniform(G, W, fan_in=1), uniform(G, W, fan_in=1)  # Linear(1, W): [G, W] each
        self.w2, self.b2 = uniform(G, H, W, fan_in=W), uniform(G, H, fan_in=W)  # Linear(W, H): [G, H, W], [G, H]
        self.c = nn.Parameter(torch.full((G,), self.c0))  # [G]
        self.L_mult = nn.Parameter(torch.full((G,), self.L_mult0))  # [G]

    # ---- the formula ----------------------------------------------------------------------------
    def _g(self, layer: int) -> int:
        if self.shared:
            return 0
        if not 0 <= int(layer) < self.layers:
            raise SchemeError(f"fire has parameters for {self.layers} layers but layer {layer} attends; build it with "
                              "layers = the model's depth (GPT passes model.layers) or shared=true")
        return int(layer)

    def threshold(self, layer: int = 0) -> torch.Tensor:
        """L = |L_mult|·L_tr of ``layer`` (0-d tensor, with its gradient)."""
        return self.L_mult[self._g(layer)].abs() * self.original_length

    def psi(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """ψ(x) = log(|c·x| + 1)."""
        return torch.log1p((self.c[self._g(layer)] * x).abs())

    def normalised(self, dist: torch.Tensor, norm: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """ψ(dist) / (ψ(norm) + eps): the MLP's input (dist, norm broadcast together), computed as ψ(dist) times
        the reciprocal, exactly as :meth:`bias` does, so the distance table and dense blocks agree to the bit."""
        dt = self.c.dtype
        return self.psi(dist.to(dt), layer) * (1.0 / (self.psi(norm.to(dt), layer) + self.eps))

    def inv_norm(self, q_pos: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """1 / (ψ(max(L, m)) + eps) per query position m [Lq]: the factor every row's ψ(d) is scaled by."""
        dt = self.c.dtype
        return 1.0 / (self.psi(torch.maximum(q_pos.to(dt), self.threshold(layer).to(dt)), layer) + self.eps)

    def mlp(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """f_θ(x): x [...] -> [H, ...], the MLP as written (hidden [..., width])."""
        g = self._g(layer)
        hid = torch.relu(x[..., None] * self.w1[g] + self.b1[g])  # [..., W]
        return (hid @ self.w2[g].T + self.b2[g]).movedim(-1, 0)  # [H, ...]

    def pieces(self, layer: int = 0):
        """f_θ as linear pieces: (breakpoints t [K] sorted, α [H, K+1], β [H, K+1]) with f(x) = α_s + β_s·x
        for s = #{k : t_k < x}; t = -b1/w1 where each unit's ReLU switches, +inf for a unit with w1 = 0 (it never
        does: K = width always, so no boolean-mask selection, which would read its count back to the host in
        every layer on a GPU). α and β keep their graph to the MLP's parameters (which units are active on a piece
        is a detached choice)."""
        g = self._g(layer)
        return _pieces(self.w1[g], self.b1[g], self.w2[g], self.b2[g])

    def distance_tables(self, n: int, device=None, dtype=torch.float32) -> torch.Tensor | None:
        """[G, H, n]: every layer's distance table f_θ(ψ(d)/ψ(L)) at once, the per-layer formulas
        (:meth:`normalised`, :meth:`pieces`, :meth:`piecewise`) batched over the G layers: a training forward
        builds twelve layers' tables in ~25 kernels instead of ~25 per layer (FIRE's train step on an H100 was
        host-bound: 2,679 launches against NoPE's 930). None when shared (one table already)."""
        if self.shared:
            return None
        dt, H = self.c.dtype, self.num_heads
        dist = torch.arange(n, device=device, dtype=dt)  # [n]
        thr = (self.L_mult.abs() * self.original_length).to(dt)  # [G] L per layer
        psi = torch.log1p((self.c[:, None] * dist).abs())  # [G, n] ψ(d)
        x = psi * (1.0 / (torch.log1p((self.c * thr).abs()) + self.eps))[:, None]  # [G, n] ψ(d)/ψ(L)
        t, alpha, beta = _pieces(self.w1, self.b1, self.w2, self.b2)  # [G, K], [G, H, K+1] x2: every layer's
        s = torch.searchsorted(t.to(dt).contiguous(), x.detach().contiguous())  # [G, n] #{k : t_k < x}
        s = s[:, None].expand(-1, H, -1)  # [G, H, n]
        out = torch.addcmul(alpha.to(dt).gather(2, s), beta.to(dt).gather(2, s), x[:, None])  # [G, H, n]
        return out.to(dtype)

    def piecewise(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """f_θ(x) [H, ...] through :meth:`pieces`: one piece index per x, then α_s + β_s·x per head (two
        1-D gathers and one multiply-add; no [..., width] hidden tensor)."""
        t, alpha, beta = self.pieces(layer)
        s = torch.bucketize(x.detach().contiguous(), t.to(x.dtype).contiguous(), out_int32=True).reshape(-1)  # [N]
        flat = x.reshape(-1)
        alpha, beta = alpha.to(x.dtype), beta.to(x.dtype)
        if self.num_heads * flat.numel() <= _ONE_PASS:  # a distance table: all heads in three kernels
            return torch.addcmul(alpha.index_select(1, s), beta.index_select(1, s), flat).view(self.num_heads, *x.shape)
        if torch.is_grad_enabled() and (x.requires_grad or alpha.requires_grad):
            out = [torch.addcmul(alpha[h].index_select(0, s), beta[h].index_select(0, s), flat)
                   for h in range(self.num_heads)]
            return torch.stack(out).view(self.num_heads, *x.shape)  # [H, ...]
        out = x.new_empty(self.num_heads, flat.numel())  # [H, N]
        for h in range(self.num_heads):
            torch.addcmul(alpha[h].index_select(0, s), beta[h].index_select(0, s), flat, out=out[h])
        return out.view(self.num_heads, *x.shape)

    # ---- the scheme's hooks ---------------------------------------------------------------------
    def bias_from_distance(self, dist, layer=0):
        """The bias of queries at positions i <= L, a function of the distance only: f(ψ(d)/ψ(L))."""
        return self.piecewise(self.normalised(dist, self.threshold(layer), layer), layer)  # [H, ...]

    def bias(self, q_pos, k_pos, layer=0, dtype=None):
        """[H, Lq, Lk], -inf for future keys: f(ψ(i − j)/ψ(max(L, i))) at any positions (the normaliser
        follows each query's position, so any block of rows equals the slice of the whole). ψ is taken
        from one vector over the distances 0..max; contiguous positions read it as a zero-copy Hankel
        view (rows reversed), so a block costs a few passes over [Lq, Lk] per head."""
        dt = self.c.dtype
        Lq, Lk = q_pos.numel(), k_pos.numel()
        inv = self.inv_norm(q_pos, layer)  # [Lq]
        if not (Lq and Lk and _contiguous(q_pos) and _contiguous(k_pos)):
            dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
            dmax = int(dist.max().clamp(min=0)) if dist.numel() else 0
            psi = self.psi(torch.arange(dmax + 1, device=q_pos.device, dtype=dt), layer)  # [dmax+1] ψ(d)
            b = self.piecewise(psi[dist.clamp(min=0)] * inv[:, None], layer).masked_fill(dist < 0, -math.inf)
            return b if dtype is None else b.to(dtype)  # [H, Lq, Lk]
        # contiguous: query a + r, key c + j at distance a - c + r - j; with rows reversed (r' = Lq-1-r) that is
        # top - r' - j, top = a + Lq - 1 - c, so ψ is the zero-copy Hankel view vec[r' + j], vec[y] = ψ(top - y)
        off = int(q_pos[0]) - int(k_pos[0])  # a - c
        top = off + Lq - 1
        psi = self.psi(torch.arange(max(top, 0) + 1, device=q_pos.device, dtype=dt), layer)  # [top+1]
        vec = torch.cat([psi.flip(0) if top >= 0 else psi[:0], psi.new_zeros(Lq + Lk + max(0, -top))])
        hank = vec.as_strided((Lq, Lk), (1, 1), vec.storage_offset() + max(0, -top))  # [Lq, Lk], rows reversed
        b = self.piecewise((hank * inv.flip(0)[:, None]).flip(0), layer)  # [H, Lq, Lk]
        j0 = max(0, off + 1)  # the first key column that is in the future of some query
        if j0 < Lk:  # key j is in the future of query r when j > off + r
            fut = torch.arange(j0, Lk, device=q_pos.device)[None] > off + torch.arange(Lq, device=q_pos.device)[:, None]
            b[..., j0:].masked_fill_(fut, -math.inf)  # [H, Lq, Lk - j0]
        return b if dtype is None else b.to(dtype)

    @torch.no_grad()
    def distance_rows(self, q_pos, d_lo, width, layer=0, out=None):
        """G [H, Lq, width] = f_θ(ψ(d)/ψ(max(L, m_r))) at the distance d = d_lo + i, -inf for d < 0. On row r,
        x = ψ(d)·inv_r grows with d, so f changes piece at the distances D_k(r) = the first d with
        ψ(d) > t_k / inv_r, and over a block of rows the D_k(r) move little. Outside the bands
        [min_r D_k, max_r D_k) every row of a column is on one piece p and G = α_p + inv_r·(β_p·ψ(d)): one
        pass for all heads and columns. In a band f is the piece below plus the ramps of its breakpoints,
        f(x) = α_p + β_p·x + Σ_k (β_(k+1) − β_k)·max(x − t_k, 0) (f is continuous), one pass per band.
        Forward only (one host read of the band limits per block)."""
        dt, dev, H, R, W = self.c.dtype, q_pos.device, self.num_heads, q_pos.numel(), int(width)
        G = torch.empty(H, R, W, device=dev, dtype=dt) if out is None else out  # [H, R, W]
        neg = min(W, max(0, -int(d_lo)))  # columns at distances < 0: future keys
        G[..., :neg].fill_(-math.inf)
        start, end = max(0, int(d_lo)), int(d_lo) + W  # the distances [start, end) to fill
        if start >= end:
            return G
        psi = self.psi(torch.arange(end, device=dev, dtype=dt), layer)  # [end] ψ(0..end-1)
        inv = self.inv_norm(q_pos, layer)  # [R]
        t, alpha, beta, t_list, steps = self._frozen_pieces(layer, dt)  # [K], [H, K+1] x2, K floats, [K, H, 1, 1]
        # D_k(r) = searchsorted(ψ, t_k / inv_r) is monotone in inv_r, so its extremes over the rows are the
        # values at the largest and the smallest inv_r: two rows of searches instead of R
        ends = torch.stack([inv.max(), inv.min()])  # [2]
        D = torch.searchsorted(psi, (t[None, :] / ends[:, None]).contiguous(), right=True)  # [2, K]
        hi_t = D.amax(0)  # [K] max_r D_k(r), non-decreasing in k (so is every row's D_k(r))
        K = hi_t.numel()
        lohi = torch.cat([D.amin(0), hi_t]).tolist()  # one host read
        lo, hi = lohi[:K], lohi[K:]  # outside [lo_k, hi_k) all rows are on one side of t_k
        p = torch.searchsorted(hi_t, torch.arange(start, end, device=dev), right=True)  # [n] piece below the bands
        torch.addcmul(alpha[:, p][:, None, :], inv[None, :, None], (beta[:, p] * psi[start:])[:, None, :],
                      out=G[:, :, start - int(d_lo):])  # [H, R, n] α_p + inv_r·β_p·ψ(d)
        for k, (a, b) in enumerate(zip(lo, hi)):  # the band where some rows pass breakpoint k
            a, b = max(a, start), min(b, end)
            if a < b:
                ramp = torch.outer(inv, psi[a:b]).sub_(t_list[k]).clamp_(min=0)  # [R, b-a] max(x − t_k, 0)
                G[:, :, a - int(d_lo):b - int(d_lo)].addcmul_(steps[k], ramp)  # [H, R, b-a] += step_k·ramp
        return G

    def _frozen_pieces(self, layer: int, dt: torch.dtype):
        """:meth:`pieces` without gradients (t [K], α, β [H, K+1]), with t as floats and the slope each
        breakpoint adds, β_(k+1) − β_k, as [K, H, 1, 1]; kept while the layer's MLP holds the same values
        (compared in full: a few hundred numbers): every block of a forward, and every forward of an
        evaluation, reuses them."""
        g = self._g(layer)
        with torch.no_grad():
            now = torch.cat([self.w1[g], self.b1[g], self.w2[g].flatten(), self.b2[g]]).tolist()
            hit = self._table_cache.get(("pieces", g, dt))
            if hit is None or hit[0] != now:
                t, alpha, beta = (x.to(dt) for x in self.pieces(layer))
                steps = (beta[:, 1:] - beta[:, :-1]).T.contiguous()[:, :, None, None]  # [K, H, 1, 1]
                hit = self._table_cache[("pieces", g, dt)] = (now, t, alpha, beta, t.tolist(), steps)
        return hit[1:]

    def flex_bias(self, layer, a, c, Lq, n):
        """b_h for FlexAttention's score_mod: x = ψ(d)·(1/ψ(max(L, a + q_idx))) from two captured vectors, then
        f_θ as written, Linear(1, W) → ReLU → Linear(W, H) unrolled over the W hidden units (pointwise ops
        only, so the compiled kernel fuses them; every parameter keeps its gradient). No host read."""
        g, dt, dev = self._g(layer), self.c.dtype, self.c.device
        psi = self.psi(torch.arange(n, device=dev, dtype=dt), layer)  # [n] ψ(d)
        inv = self.inv_norm(torch.arange(Lq, device=dev, dtype=dt) + a, layer)  # [Lq] at the query positions
        W = self.width
        # [W] x W, [W] x W, [H, W] x W, [H]: one index per gradient-requiring tensor (flex_copies)
        w1, b1, w2, b2 = flex_copies(self.w1[g], W), flex_copies(self.b1[g], W), flex_copies(self.w2[g], W), self.b2[g]
        off = torch.full((), a - c, device=dev, dtype=torch.int64)  # filled on the device

        def bias(h, q_idx, kv_idx):
            x = psi[(q_idx - kv_idx + off).clamp(0, n - 1)] * inv[q_idx]
            out = b2[h]
            for u in range(W):
                out = out + w2[u][h, u] * torch.relu(x * w1[u][u] + b1[u][u])
            return out
        return bias

    @torch.no_grad()
    def flex_pieces(self, layer, a, c, Lq, n, dtype=torch.float32):
        """(ψ [n], ι [Lq], t [K], α [H, K+1], β [H, K+1]) in ``dtype``: f_θ's linear pieces (:meth:`pieces`) and its
        input x = ψ(d)·ι(a + i), ι(m) = 1/(ψ(max(L, m)) + eps), for the flex-pieces path (forward only). ψ is made
        non-decreasing and ι non-increasing by a running max / min (they are, up to the rounding of log1p), so a
        tile's bounds on x hold for every score in it exactly."""
        dt, dev = self.c.dtype, self.c.device
        psi = self.psi(torch.arange(n, device=dev, dtype=dt), layer).to(dtype).cummax(0).values  # [n]
        inv = self.inv_norm(torch.arange(Lq, device=dev, dtype=dt) + a, layer).to(dtype).cummin(0).values  # [Lq]
        t, alpha, beta = self.pieces(layer)
        return psi, inv, t.to(dtype), alpha.to(dtype), beta.to(dtype)

    def toeplitz_rows(self):
        """L per layer ([layers], or [1] when shared): queries at positions <= L see the distance table."""
        return (self.L_mult.detach().abs() * self.original_length)  # [G]

    def options(self):
        return {"layers": self.layers, "shared": self.shared, "width": self.width, "c": self.c0,
                "L_mult": self.L_mult0, "original_length": self.original_length, "eps": self.eps}


def _pieces(w1, b1, w2, b2):
    """f = Linear(1, W) -> ReLU -> Linear(W, H) as linear pieces, for one layer's parameters (w1, b1 [W], w2 [H, W],
    b2 [H]) or a stack of them (a leading [G]): breakpoints t [.., K] sorted, α and β [.., H, K+1]; see
    :meth:`FIRE.pieces`."""
    w1d, b1d = w1.detach(), b1.detach()
    nz = w1d != 0
    t = torch.where(nz, -b1d / torch.where(nz, w1d, 1.0), torch.inf).sort(-1).values  # [.., K]
    mids = torch.cat([t[..., :1] - 1, (t[..., 1:] + t[..., :-1]) / 2, t[..., -1:] + 1], -1)  # [.., K+1] (or +inf)
    active = torch.where(nz[..., None, :], mids[..., :, None] * w1d[..., None, :] + b1d[..., None, :] > 0,
                         b1d[..., None, :] > 0).to(w1.dtype)  # [.., K+1, W] units on in each piece
    alpha = b2[..., None] + (w2 * b1[..., None, :]) @ active.transpose(-1, -2)  # [.., H, K+1]
    beta = (w2 * w1[..., None, :]) @ active.transpose(-1, -2)  # [.., H, K+1]
    return t, alpha, beta


def _contiguous(pos: torch.Tensor) -> bool:
    """pos == pos[0] + arange(len(pos))."""
    n = pos.numel()
    return n > 0 and int(pos[-1]) - int(pos[0]) == n - 1 and (n < 3 or bool(torch.all(pos[1:] - pos[:-1] == 1)))

"""FIRE's rows on FlexAttention by linear pieces (docs/attention.md, row 7 on CUDA: ``flex-pieces``), forward only.

FIRE's bias (Li et al. 2024, §3) is f_θ(x), x = ψ(m − n)·ι(m), ι(m) = 1/(ψ(max(L, m)) + eps), with
f_θ = Linear(1, W) → ReLU → Linear(W, H): piecewise linear in x with K <= W breakpoints t_k, f_h(x) = α_h[s] +
β_h[s]·x on the piece s = #{k : t_k < x} (``FIRE.pieces``; the scheme hands them over through ``flex_pieces``).
The flex-rows path evaluates the MLP's W = 32 units at every score: FIRE's 32,768-token forward took 16.2x NoPE's
on an H200. But x is separable, ψ non-decreasing in the distance and ι non-increasing in the query, so over one of
FlexAttention's BLOCK x BLOCK tiles of queries [m0, m1] and keys [n0, n1]

    ψ(d_lo)·ι(m1) <= x <= ψ(d_hi)·ι(m0),    d_lo = max(0, m0 − n1), d_hi = m1 − n0 (within the window),

and the piece of every score in the tile lies in s_lo..s_hi, the buckets of those bounds. The bounds hold in
floating point too: the kernel forms x = ψ[d]·ι[m] from the same two vectors, and a rounded product is monotone in
each factor. Away from the diagonal x barely moves across a tile (d changes by at most 2·BLOCK, m by BLOCK), so
most tiles span at most :data:`SPAN` breakpoints; those are scored by the ``pieces`` call,

    b_h = α_h[s_lo] + β_h[s_lo]·x + Σ_{j<SPAN} (β_h[s_lo+j+1] − β_h[s_lo+j])·max(x − t[s_lo+j], 0),

f on its piece s_lo continued through the next SPAN breakpoints (f is continuous, so past t_k its slope changes by
β[k+1] − β[k]; the split path's ``distance_rows`` writes its bands the same way): every load but ψ[d] is the same for
the whole tile, and a score costs 1 + SPAN multiply-adds in place of the MLP's W = 32 units. The other tiles (near
the diagonal, where d and so x sweep many pieces) are scored by the ``rows`` call, the scheme's ``flex_bias`` (the
MLP per score) as :func:`.flex.flex_rows_path` does. Every visible tile is in exactly one call's block mask, and the
two outputs merge by log-sum-exp (model/twopass.py's merge): the same softmax, to the rounding of the pieces against
the MLP's sum. :func:`evaluations` counts the scores each call takes (the MLP evaluations saved: docs/attention.md).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import flex
from .twopass import merge

#: evaluation (no gradients) of FIRE's rows on FlexAttention takes this path instead of flex rows. NOT YET MEASURED
#: on a GPU (the goal: FIRE's 32,768-token forward <= 3x NoPE's, 16.2x on flex rows on an H200); False: flex rows
ENABLED = True
#: breakpoints a tile's range of x may span and still be scored by pieces (the score_mod's comparisons)
SPAN = 2


def applies(scheme, grad_needed: bool) -> bool:
    """:data:`ENABLED`, the scheme has linear pieces (``flex_pieces``: FIRE), and nothing needs a gradient."""
    return ENABLED and not grad_needed and scheme.has_flex_pieces


def tiles(psi, inv, t, Lq: int, Lk: int, off: int, window: int | None, block: int = flex.BLOCK):
    """(s_lo [QB, KB] int64: the lowest piece of each tile, few [QB, KB] bool: the tile spans <= SPAN breakpoints)
    for queries 0..Lq-1 over keys 0..Lk-1 at distance off + row - key; on the device, no host read."""
    dev, n = psi.device, psi.shape[0]
    r0 = torch.arange(0, Lq, block, device=dev)  # [QB]
    k0 = torch.arange(0, Lk, block, device=dev)  # [KB]
    r1, k1 = (r0 + block).clamp(max=Lq) - 1, (k0 + block).clamp(max=Lk) - 1
    d_lo = (off + r0[:, None] - k1[None]).clamp(0, n - 1)  # [QB, KB] smallest distance (0 on the diagonal)
    d_hi = off + r1[:, None] - k0[None]  # [QB, KB] largest
    if window is not None:
        d_hi = d_hi.clamp(max=int(window) - 1)
    d_hi = d_hi.clamp(0, n - 1)
    x_lo = psi[d_lo] * inv[r1][:, None]  # [QB, KB]
    x_hi = psi[d_hi] * inv[r0][:, None]
    s_lo = torch.bucketize(x_lo, t)  # #{k : t_k < x_lo}
    return s_lo, torch.bucketize(x_hi, t) - s_lo <= SPAN


def pieces_path(q, k, v, a: int, c: int, scheme, layer: int, *, scale: float, tau: float = 1.0,
                window: int | None = None, tau_h: torch.Tensor | None = None, block: int = flex.BLOCK) -> torch.Tensor:
    """q [B,H,Lq,D] at positions a.., k/v [B,H,Lk,D] at c.. (c <= a) -> out [B,H,Lq,D], without gradients: the tiles
    that span few pieces by pieces, the others by the scheme's ``flex_bias``, merged (module doc). ``tau_h`` [H|1]
    divides q and the bias per head. May raise :class:`.flex.Unavailable` (attend then takes the split path)."""
    q, calls = calls_of(q, k, a, c, scheme, layer, tau=tau, window=window, tau_h=tau_h, block=block)
    fn, acc, lse = flex.kernel(q.device.type), None, None
    for mod, bm, heavy in calls:
        o, l = flex.with_lse(fn, q, k, v, gather=True, heavy=heavy, score_mod=mod, block_mask=bm, scale=scale)
        acc, lse = merge(acc, lse, o, l.contiguous(), 0, q.shape[2])  # a row with no tile in a call: its lse -inf
    return acc.to(q.dtype)


def calls_of(q, k, a: int, c: int, scheme, layer: int, *, tau: float = 1.0, window: int | None = None,
             tau_h: torch.Tensor | None = None, block: int = flex.BLOCK):
    """(q divided by ``tau_h``, [(score_mod, block_mask, heavy)] of the ``pieces`` and the ``rows`` call)."""
    H, Lq, Lk, dev = q.shape[1], q.shape[2], k.shape[2], q.device
    n, off = a + Lq - c, a - c
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32  # FlexAttention's working precision
    psi, inv, t, alpha, beta = scheme.flex_pieces(layer, a, c, Lq, n, wp)  # [n], [Lq], [K], [H, K+1] x2
    s_lo, few = tiles(psi, inv, t, Lq, Lk, off, window, block)
    t_ext = torch.cat([t, t.new_full((SPAN,), math.inf)])  # [K + SPAN]: s_lo + j stays in range
    alpha, beta = alpha.expand(H, -1).contiguous(), beta.expand(H, -1).contiguous()  # [H, K+1]
    steps = F.pad(beta[:, 1:] - beta[:, :-1], (0, SPAN))  # [H, K + SPAN] the slope's change at each breakpoint
    off_t = torch.full((), off, device=dev, dtype=torch.int64)
    inv_tau = torch.full((), 1.0 / tau, device=dev, dtype=wp)
    inv_h = torch.ones(H, device=dev, dtype=wp) if tau_h is None else \
        (1.0 / tau_h.reshape(-1).to(dev, wp)).expand(H).contiguous()  # [H]
    if tau_h is not None:
        q = q / tau_h.view(1, -1, 1, 1).to(q.dtype)  # [B, H, Lq, D]

    def by_pieces(score, b, h, q_idx, kv_idx):
        x = psi[(q_idx - kv_idx + off_t).clamp(0, n - 1)] * inv[q_idx]
        lo = s_lo[q_idx // block, kv_idx // block]  # the same for the whole tile, as every load below but ψ's
        f = alpha[h, lo] + beta[h, lo] * x
        for j in range(SPAN):  # f is continuous: past breakpoint t_k its slope changes by steps_k
            f = f + steps[h, lo + j] * torch.relu(x - t_ext[lo + j])
        return (score + f * inv_h[h]) * inv_tau

    mlp = scheme.flex_bias(layer, a, c, Lq, n)

    def by_mlp(score, b, h, q_idx, kv_idx):
        return (score + mlp(h, q_idx, kv_idx) * inv_h[h]) * inv_tau

    d = torch.arange(n, device=dev)
    finite = torch.ones(n, dtype=torch.bool, device=dev) if window is None else d < window  # [n]
    return q, [(by_pieces, flex.block_mask(finite, Lq, Lk, off, block, select=few), False),
               (by_mlp, flex.block_mask(finite, Lq, Lk, off, block, select=~few), True)]


def evaluations(Lq: int, Lk: int, off: int, window: int | None, few: torch.Tensor,
                block: int = flex.BLOCK) -> tuple[int, int]:
    """(scores in tiles scored by the MLP, all visible scores) of a call: the MLP evaluations per head that
    flex-rows makes (all) and flex-pieces keeps (its ``rows`` call). Visible: off + row - key in [0, window)."""
    w = math.inf if window is None else int(window)
    rows = torch.arange(Lq, dtype=torch.int64)[:, None] + off  # [Lq, 1] the query's distance to key 0
    k0 = torch.arange(0, Lk, block, dtype=torch.int64)[None]  # [1, KB]
    k1 = (k0 + block).clamp(max=Lk) - 1
    lo = torch.maximum(k0, rows - (w - 1)) if w != math.inf else k0
    per = (torch.minimum(k1, rows) - lo + 1).clamp(min=0)  # [Lq, KB] visible keys of each row in each key block
    by_tile = torch.zeros(few.shape, dtype=torch.int64).index_add_(0, torch.arange(Lq) // block, per)  # [QB, KB]
    return int(by_tile[~few.cpu()].sum()), int(by_tile.sum())

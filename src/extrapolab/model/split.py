"""The split path of :func:`.attention.attend` (docs/attention.md, row 7): schemes whose bias is a distance
table only up to a query position T (``scheme.toeplitz_rows()``; FIRE, Li et al. 2024 §3: for a query at
m <= L the normaliser ψ(max(L, m)) is ψ(L)). The queries at m <= T run on the Toeplitz path
(:mod:`.toeplitz`, HankelSDPA for the learnable table), the others as the fallback with the scheme's
dense bias per query block (:func:`.reference.dense_attention`); attention rows are independent, so the
two outputs concatenate. Shapes: q [B,H,Lq,D], k/v [B,H,Lk,D].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..positional.base import PositionalScheme
from .reference import dense_attention
from .tables import DistanceBias
from .toeplitz import toeplitz_attention

#: query rows per dense block beyond T: the block's bias and the temporaries of computing it stay near
#: 32·rows·keys bytes (chosen by hand; any size is exact)
SPLIT_BLOCK = 256


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
                             window=window, block=block, tau_h=tau_h)  # [B, H, n, D]
    rows = Lq - n
    per_row = q.shape[0] * q.shape[1] * Lk * 4  # bytes of one row's dense mask
    hb = max(1, min(int(block_size), SPLIT_BLOCK, int(memory_budget_mb * 2**20 // per_row)))
    dense = None
    if not scheme.layer_dependent and q.shape[1] * rows * Lk * 4 <= memory_budget_mb * 2**20:
        dense = db.memo(("split_rows", id(q_pos), id(k_pos), n),  # once per forward, for every layer
                        lambda: (q_pos, k_pos, _block_bias(scheme, q_pos[n:], k_pos, layer, hb)))[2]
    high, _ = dense_attention(q[:, :, n:], k, v, q_pos[n:], k_pos, scheme, layer, tau=tau, window=window,
                              bias=dense, block=hb, fused=True, tau_s=tau_s)  # [B, H, rows, D]
    return torch.cat([low, high], dim=2)


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

"""Causal attention with any positional scheme, applied in one place (docs/architecture.md, "Attention paths").

Order, for every path: rotate q,k -> scale by 1/sqrt(d_head) -> (KERPLE wht kernels multiply
q·k) -> add the scheme's bias -> causal/window mask -> temperature -> softmax.

The softmax temperature tau divides the *whole* pre-softmax logit (scaled q·k plus bias), which
is Softmax_tau(l) of thesis §5.4 / Algorithm 1; tau = 1 is the identity.

Paths (all exact to fp32 tolerance against each other, see tests/test_attention*.py):
* ``sdpa``    fused ``scaled_dot_product_attention``: ``is_causal`` without a bias, else a 4-D
              [1, H|1, Lq, Lk] float mask (the layout the CPU flash kernel accepts);
* ``plain``   explicit matmul-softmax, the only path that returns attention probabilities;
* ``blocked`` query blocks; keys past a block's causal frontier or outside its window skipped.
``auto`` picks blocked when H·Lq·Lk floats exceed ``memory_budget_mb`` (on the Toeplitz path:
when Lq > min(block_size, 512), where skipping the causal upper triangle pays), else sdpa.

The Toeplitz/Hankel fast path for relative schemes (O(H·L) bias memory, fused kernels, learnable
distance tables) lives in :mod:`.toeplitz`; its names are re-exported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..positional.base import PositionalScheme, causal_distance
from .toeplitz import (  # noqa: F401 - re-exported: the fast path's names keep their old import path
    _TOEPLITZ_BLOCK,
    DistanceBias,
    HankelSDPA,
    _antidiag_sums,
    _table_dtype,
    _tiled_softmax,
    _toeplitz,
    arange_start,
    hankel_ok,
    hankel_view,
    is_toeplitz,
)

BiasFn = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def flush_denormals(enable: bool = True) -> bool:
    """Flush subnormal floats to zero (FTZ/DAZ) on this thread and on threads it creates later.

    Linear biases such as ALiBi's reach -100 and below, so exp() in a softmax can return subnormal
    numbers, which some CPUs handle far slower; flushing changes each probability by < 1.2e-38.
    Importing extrapolab never calls this: the CLI calls it at start-up (``EXTRAPOLAB_DENORMALS=keep``
    opts out) and the trainer when ``train.flush_denormals`` is true. Call it before torch starts
    its OpenMP threads, which inherit the mode. ``extrapolab bench`` measures its effect (the
    ``denormals`` rows). Returns whether the CPU supports it.
    """
    return bool(torch.set_flush_denormal(enable))


@dataclass
class AttnOptions:
    impl: str = "auto"  # auto | sdpa | plain | blocked
    block_size: int = 1024
    memory_budget_mb: float = 512.0
    temperature: float = 1.0
    window: int | None = None  # evaluate "windowed@w": keys with k >= w are masked
    need_probs: bool = False


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """[Lq, Lk] additive mask: -inf for future keys and (if window) keys at distance >= window."""
    dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
    bad = dist < 0
    if window is not None:
        bad = bad | (dist >= window)
    return torch.zeros(dist.shape, device=q_pos.device).masked_fill(bad, -math.inf)


def positional_logit_terms(
    scheme: PositionalScheme, q_pos, k_pos, layer: int, window: int | None, bias: torch.Tensor | None
):
    """(weight [H,Lq,Lk] | None, additive [H|1, Lq, Lk]) for this block: scheme bias + mask."""
    if isinstance(bias, DistanceBias):
        bias = None
    if bias is None and scheme.has_bias:
        bias = scheme.bias(q_pos, k_pos, layer)  # [H, Lq, Lk], -inf masked
    if bias is None or window is not None:
        m = window_mask(q_pos, k_pos, window)[None]  # [1, Lq, Lk]
        bias = m if bias is None else bias + m
    weight = scheme.weight(q_pos, k_pos, layer) if scheme.has_weight else None
    return weight, bias


# ---- dense paths -------------------------------------------------------------------------
def _manual(q, k, v, scale, weight, add, need_probs):
    """Plain path. q [B,H,Lq,D], k/v [B,H,Lk,D], add [H|1,Lq,Lk]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if weight is not None:
        s = s * weight.to(s.dtype)
    s = s + add.to(s.dtype)  # broadcast over batch
    p = torch.softmax(s if s.dtype == torch.float64 else s.float(), dim=-1).to(v.dtype)  # [B,H,Lq,Lk]
    out = torch.matmul(p, v)  # [B, H, Lq, D]
    return out, (p if need_probs else None)


def _sdpa(q, k, v, scale, add):
    mask = add.to(q.dtype)
    if mask.dim() == 3:
        mask = mask.unsqueeze(0)  # [1, H|1, Lq, Lk]: 4-D keeps the fused CPU kernel
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B,H,Lq,D]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scheme: PositionalScheme,
    layer: int = 0,
    opts: AttnOptions | None = None,
    bias: "torch.Tensor | DistanceBias | None" = None,
    rotate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B,H,Lq,D], k/v [B,H,Lk,D] (k, v not yet rotated) -> (out [B,H,Lq,D], probs | None).

    ``bias`` optionally passes a precomputed [H, Lq, Lk] scheme bias, or a :class:`DistanceBias`
    (one per forward, shared by layers); ``rotate=False`` when q, k were already rotated (KV cache).
    """
    opts = opts or AttnOptions()
    if rotate:
        q, k = scheme.rotate(q, k, q_pos, k_pos)  # rotate
    tau = float(opts.temperature)
    scale = 1.0 / math.sqrt(q.shape[-1]) / tau  # scale (and temperature)
    H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    impl = opts.impl
    too_big = H * Lq * Lk * 4 / 2**20 > opts.memory_budget_mb and Lq > opts.block_size
    if opts.need_probs:
        impl = "plain"
    if impl in ("sdpa", "auto") and not scheme.has_bias and not scheme.has_weight and opts.window is None \
            and tau == 1.0 and Lq == Lk and torch.equal(q_pos, k_pos):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out, None
    if impl != "plain" and (bias is None or isinstance(bias, DistanceBias)) \
            and is_toeplitz(scheme, allow_weight=True):
        starts = bias.starts if isinstance(bias, DistanceBias) else arange_start
        a, c = starts(q_pos), starts(k_pos)
        if a is not None and c is not None and c <= a:
            db = bias if isinstance(bias, DistanceBias) else DistanceBias(scheme, q.device, _table_dtype(q))
            blocked = impl == "blocked" or (impl == "auto" and Lq > min(opts.block_size, _TOEPLITZ_BLOCK))
            return _toeplitz(q, k, v, a, c, db, layer, opts, scale, tau, blocked), None
    if isinstance(bias, DistanceBias):
        bias = bias.dense(layer, q_pos, k_pos)  # [H', Lq, Lk]
    if impl in ("sdpa", "auto") and scheme.has_weight:
        impl = "blocked" if impl == "auto" and too_big else "plain"  # no fused multiplicative path
    if impl == "auto":
        impl = "blocked" if too_big else "sdpa"
    if impl == "blocked":
        return _blocked(q, k, v, q_pos, k_pos, scheme, layer, opts, scale, tau), None
    weight, add = positional_logit_terms(scheme, q_pos, k_pos, layer, opts.window, bias)
    if tau != 1.0:
        add = add / tau  # temperature divides the whole logit; scale already carries 1/tau
    if impl == "sdpa":
        return _sdpa(q, k, v, scale, add), None
    return _manual(q, k, v, scale, weight, add, opts.need_probs)


def _blocked(q, k, v, q_pos, k_pos, scheme, layer, opts, scale, tau):
    """Query blocks; keys limited to those a block can see (causal, window). O(H·block·Lk) memory."""
    B, H, Lq, D = q.shape
    out = torch.empty_like(q)  # [B, H, Lq, D]
    per_row = B * H * k.shape[2] * 4 * (3 if scheme.has_weight else 1)  # bytes of dense terms
    bs = max(1, min(int(opts.block_size), int(opts.memory_budget_mb * 2**20 // per_row)))
    sorted_keys = bool(torch.all(k_pos[1:] >= k_pos[:-1])) if k_pos.numel() > 1 else True
    for s in range(0, Lq, bs):
        e = min(Lq, s + bs)
        qp = q_pos[s:e]  # [bq]
        lo, hi = 0, k.shape[2]
        if sorted_keys:  # keys after the block's last query are all masked: skip them
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
            if opts.window is not None:
                lo = int(torch.searchsorted(k_pos, qp.min() - opts.window + 1))
        kp = k_pos[lo:hi]
        weight, add = positional_logit_terms(scheme, qp, kp, layer, opts.window, None)
        if tau != 1.0:
            add = add / tau
        qb, kb, vb = q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi]  # [B,H,bq,D], [B,H,bk,D]
        if weight is None:
            out[:, :, s:e] = _sdpa(qb, kb, vb, scale, add)
        else:
            out[:, :, s:e] = _manual(qb, kb, vb, scale, weight, add, False)[0]
    return out

"""The reference attention path and the one dense fallback (docs/attention.md).

Every path of :func:`.attention.attend` computes, for rotated q, k (rotary: Su et al. 2021, eq. 34):

    l = (q · k) / sqrt(d_head)                 scale (two-pass schemes, Self-Extend / ReRoPE: q', k'
                                               moved to far positions where m - n >= w)
    l = l * w(m - n)                           KERPLE "wht" kernels only (Chi 2024 thesis §3.7.3)
    l = l + b(m, n)                            the scheme's bias (ALiBi, T5, KERPLE, Sandwich, ...)
    l = -inf where n > m or m - n >= window    causal mask, evaluation-time "windowed@w"
    p = softmax(l / tau)                       the temperature divides the whole logit
                                               (Softmax_tau of the thesis §5.4, Algorithm 1)

:func:`logits` is that computation up to the temperature, in one place: the reference path, the
logits sink (``AttnOptions.logits_sink``, read by temperature alignment) and analysis/attn.py call
it. :func:`dense_attention` runs it in query blocks (keys past a block's causal frontier skipped),
either explicitly (matmul, softmax: the reference, the only path that returns probabilities or
feeds a sink) or, as the fallback for biases that are not a function of m - n and for positions
that are not contiguous, with each block's dense additive mask in fused SDPA.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..positional.base import PositionalScheme, causal_distance

#: ``sink(layer, logits, num_keys)``: tau = 1 logits [B, H, bq, bk] of consecutive query rows (-inf
#: where masked); the columns are the first bk of the call's ``num_keys`` keys (later keys are masked
#: for these rows).
LogitsSink = Callable[[int, torch.Tensor, int], None]


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] additive mask: -inf for future keys and (if window) keys at distance >= window."""
    dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
    bad = dist < 0
    if window is not None:
        bad = bad | (dist >= window)
    return torch.zeros(dist.shape, device=q_pos.device).masked_fill(bad, -math.inf)


def logit_terms(scheme: PositionalScheme, q_pos, k_pos, layer: int, window: int | None,
                bias: torch.Tensor | None = None):
    """(weight [H, Lq, Lk] | None, additive [H|1, Lq, Lk]): the scheme's multiplicative kernel, and
    its bias plus the causal/window mask. ``bias``: a precomputed [H, Lq, Lk] scheme bias."""
    if bias is None and scheme.has_bias:
        bias = scheme.bias(q_pos, k_pos, layer)  # [H, Lq, Lk], -inf masked
    if bias is None or window is not None:
        m = window_mask(q_pos, k_pos, window)[None]  # [1, Lq, Lk]
        bias = m if bias is None else bias + m
    weight = scheme.weight(q_pos, k_pos, layer) if scheme.has_weight else None
    return weight, bias


def logits(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """tau = 1 pre-softmax logits [B, H, Lq, Lk] of rotated q [B,H,Lq,D], k [B,H,Lk,D]; -inf masked.

    Two-pass schemes (Self-Extend, ReRoPE: ``scheme.second_pass()``) score keys at distance >= w
    with q, k moved to the scheme's far positions: one logit matrix, merged by the distance mask."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    two = scheme.second_pass()
    if two is not None:
        w, far = two
        qf, kf = far(q, k, q_pos, k_pos)  # [B, H, Lq|Lk, D] at the far positions
        near = causal_distance(q_pos, k_pos) < w  # [Lq, Lk]
        s = torch.where(near, s, torch.matmul(qf, kf.transpose(-1, -2)) * scale)
    weight, add = logit_terms(scheme, q_pos, k_pos, layer, window, bias)
    if weight is not None:
        s = s * weight.to(s.dtype)
    return s + add.to(s.dtype)  # [H|1, Lq, Lk] broadcast over the batch


def dense_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, *, tau: float = 1.0,
                    window: int | None = None, bias: torch.Tensor | None = None, block: int | None = None,
                    fused: bool = False, need_probs: bool = False, sink: LogitsSink | None = None):
    """q [B,H,Lq,D], k/v [B,H,Lk,D] (rotated) -> (out [B,H,Lq,D], probs [B,H,Lq,Lk] | None).

    ``block``: query rows per step (None: all at once; ``need_probs`` always takes one step).
    ``fused``: the fallback, each block's dense mask in fused SDPA (blocks whose logits a kernel
    multiplies, or that feed a ``sink``, stay explicit). Otherwise the reference: logits, sink,
    softmax(logits / tau) in fp32 (fp64 for fp64 inputs), then p @ v.
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bs = Lq if block is None or need_probs else max(1, min(int(block), Lq))
    # keys sorted by position: a block never needs keys after its last query (nor, fused, before
    # its window); probabilities keep every column
    skip = not need_probs and (Lk < 2 or bool(torch.all(k_pos[1:] >= k_pos[:-1])))
    explicit = not fused or scheme.has_weight or sink is not None
    outs, probs = [], None
    for s in range(0, Lq, bs):
        e = min(Lq, s + bs)
        qp, lo, hi = q_pos[s:e], 0, Lk
        if skip:
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
            if window is not None and not explicit:
                lo = int(torch.searchsorted(k_pos, qp.min() - window + 1))
        kp, bb = k_pos[lo:hi], None if bias is None else bias[..., s:e, lo:hi]
        qb, kb, vb = q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi]  # [B,H,bq,D], [B,H,bk,D]
        if not explicit:
            add = logit_terms(scheme, qp, kp, layer, window, bb)[1]  # [H|1, bq, bk]
            mask = (add / tau if tau != 1.0 else add).to(q.dtype)
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1, H|1, bq, bk]: 4-D keeps the fused CPU kernel
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=1.0 / math.sqrt(D) / tau))
            continue
        lg = logits(qb, kb, qp, kp, scheme, layer, window, bb)  # [B, H, bq, bk]
        if sink is not None:
            sink(layer, lg.detach(), Lk)
        p = torch.softmax((lg if lg.dtype == torch.float64 else lg.float()) / tau, dim=-1).to(v.dtype)
        outs.append(torch.matmul(p, vb))  # [B, H, bq, D]
        probs = p if need_probs else None
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), probs

"""The reference attention path and the one dense fallback (docs/attention.md).

Every path of :func:`.attention.attend` computes, for rotated q, k (rotary: Su et al. 2021, eq. 34):

    l = (q · k) / sqrt(d_head)                 scale (two-pass schemes, Self-Extend / ReRoPE: q', k'
                                               moved to far positions where m - n >= w)
    l = l * w(m - n)                           KERPLE "wht" kernels only (Chi 2024 thesis §3.7.3)
    l = l + b(m, n)                            the scheme's bias (ALiBi, T5, KERPLE, Sandwich, ...)
    l = l - s_h·(p_m - p_n)                    positions from content (FoX: p = -cumsum(log f))
    l = -inf where n > m or m - n >= window    causal mask, evaluation-time "windowed@w"
    l = scores(l)                              score-level hook over whole rows (CoPE, DAPE)
    l = l / tau_scheme[h, m]                   the scheme's temperature (head scale, log-n)
    p = softmax(l / tau)                       the temperature divides the whole logit
                                               (Softmax_tau of the thesis §5.4, Algorithm 1);
                                               or the scheme's ``normalize`` (stick-breaking)

:func:`logits` is that computation up to the option temperature tau, in one place: the reference
path, the logits sink (``AttnOptions.logits_sink``, read by temperature alignment) and
analysis/attn.py call it. :func:`dense_attention` runs it in query blocks (keys past a block's
causal frontier skipped), either explicitly (matmul, softmax: the reference, the only path that
returns probabilities, feeds a sink or runs score-level hooks) or, as the fallback for biases that
are not a function of m - n and for positions that are not contiguous, with each block's dense
additive mask in fused SDPA.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..positional.base import PositionalScheme, ScoreBlock, causal_distance
from .sdpa import sdpa

#: ``sink(layer, logits, num_keys)``: tau = 1 logits [B, H, bq, bk] of consecutive query rows (-inf
#: where masked); the columns are the first bk of the call's ``num_keys`` keys (later keys are masked
#: for these rows).
LogitsSink = Callable[[int, torch.Tensor, int], None]


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] bool: True where the key is not in the future and (if window) within it."""
    dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
    ok = dist >= 0
    return ok if window is None else ok & (dist < window)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] additive mask: -inf for future keys and (if window) keys at distance >= window."""
    ok = visible_mask(q_pos, k_pos, window)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, -math.inf)


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


def content_bias(scheme: PositionalScheme, layer: int, content, rows=slice(None), cols=slice(None)):
    """-s_h·(p_m - p_n) [B|1, H, bq, bk] (float64) for the query rows and key columns given."""
    pq, pk = content
    s = scheme.alibi_slopes(layer).to(device=pq.device, dtype=torch.float64).view(1, -1, 1, 1)  # [1, H, 1, 1]
    return -s * (pq[..., rows, None] - pk[..., None, cols])


def divide_finite(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """x / tau with -inf entries kept -inf and no gradient through them (a learnable tau would
    otherwise get inf · 0 = NaN from the masked entries)."""
    fin = torch.isfinite(x)
    return (x.masked_fill(~fin, 0.0) / tau).masked_fill(~fin, -math.inf)


def scheme_tau(scheme: PositionalScheme, q_pos: torch.Tensor, layer: int) -> torch.Tensor | None:
    """The scheme's temperature as [1, H|1, Lq|1] (float), or None."""
    t = scheme.temperature(q_pos, layer)
    return None if t is None else t.reshape(1, *t.shape[-2:])


def _rows(t: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    """Rows s..e of a [1, H|1, Lq|1] temperature as [1, H|1, bq|1, 1]."""
    if t is None:
        return None
    return (t if t.shape[-1] == 1 else t[..., s:e])[..., None]


def block_logits(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
                 bias: torch.Tensor | None = None, content=None, tau_s: torch.Tensor | None = None):
    """(logits [B, H, Lq, Lk], ScoreBlock | None) of rotated q [B,H,Lq,D], k [B,H,Lk,D]: every step up
    to the option temperature (module docstring); ``tau_s`` [1, H|1, Lq|1, 1] the scheme's.

    Two-pass schemes (Self-Extend, ReRoPE: ``scheme.second_pass()``) score keys at distance >= w
    with q, k moved to the scheme's far positions: one logit matrix, merged by the distance mask."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q * scale, k.transpose(-1, -2))  # [B, H, Lq, Lk]: scale the small side
    two = scheme.second_pass()
    if two is not None:
        w, far = two
        qf, kf = far(q, k, q_pos, k_pos)  # [B, H, Lq|Lk, D] at the far positions
        near = causal_distance(q_pos, k_pos) < w  # [Lq, Lk]
        s = torch.where(near, s, torch.matmul(qf * scale, kf.transpose(-1, -2)))
    weight, add = logit_terms(scheme, q_pos, k_pos, layer, window, bias)
    if weight is not None:
        s = s * weight.to(s.dtype)
    lg = s + add.to(s.dtype)  # [H|1, Lq, Lk] broadcast over the batch
    if content is not None:
        lg = lg + content_bias(scheme, layer, content).to(s.dtype)  # [B|1, H, Lq, Lk]
    blk = None
    if scheme.reference_only:
        vis = visible_mask(q_pos, k_pos, window)  # [Lq, Lk]
        b = torch.where(vis, add, 0.0) if scheme.has_bias or bias is not None else None  # 0 where not visible
        blk = ScoreBlock(q, k, q_pos, k_pos, s, b, vis, layer)
        lg = scheme.scores(lg, blk).masked_fill(~vis, -math.inf)
    if tau_s is not None:
        lg = divide_finite(lg, tau_s.to(lg.dtype))
    return lg, blk


def logits(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
           bias: torch.Tensor | None = None, *, content=None) -> torch.Tensor:
    """The logits [B, H, Lq, Lk] softmax sees at ``AttnOptions.temperature`` = 1, for rotated q
    [B,H,Lq,D], k [B,H,Lk,D]: scaled q·k, kernel, bias, content positions, mask (-inf), score hook,
    the scheme's own temperature. ``content``: (p_q, p_k) of a ``has_content`` scheme."""
    tau_s = scheme_tau(scheme, q_pos, layer)
    return block_logits(q, k, q_pos, k_pos, scheme, layer, window, bias, content,
                        None if tau_s is None else tau_s[..., None])[0]


def weights(lg: torch.Tensor, scheme: PositionalScheme, blk: ScoreBlock | None, tau: float = 1.0) -> torch.Tensor:
    """Attention weights from :func:`logits`: softmax(l / tau) in fp32 (fp64 for fp64), or the
    scheme's ``normalize`` (stick-breaking)."""
    x = lg if lg.dtype == torch.float64 else lg.float()
    x = x / tau if tau != 1.0 else x
    w = scheme.normalize(x, blk) if blk is not None else None
    return torch.softmax(x, dim=-1) if w is None else w


def probabilities(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
                  tau: float = 1.0, *, content=None) -> torch.Tensor:
    """Attention weights [B, H, Lq, Lk] of rotated q, k (the rows a reference call would use)."""
    tau_s = scheme_tau(scheme, q_pos, layer)
    lg, blk = block_logits(q, k, q_pos, k_pos, scheme, layer, window, None, content,
                           None if tau_s is None else tau_s[..., None])
    return weights(lg, scheme, blk, tau)


def dense_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, *, tau: float = 1.0,
                    window: int | None = None, bias: torch.Tensor | None = None, block: int | None = None,
                    fused: bool = False, need_probs: bool = False, sink: LogitsSink | None = None,
                    content=None, tau_s: torch.Tensor | None = None):
    """q [B,H,Lq,D], k/v [B,H,Lk,D] (rotated) -> (out [B,H,Lq,D], probs [B,H,Lq,Lk] | None).

    ``block``: query rows per step (None: all at once; ``need_probs`` always takes one step).
    ``fused``: the fallback, each block's dense mask in fused SDPA (blocks whose logits a kernel
    multiplies, that feed a ``sink`` or run score-level hooks stay explicit). Otherwise the
    reference: logits, sink, softmax(logits / tau) in fp32 (fp64 for fp64 inputs), then p @ v.
    ``content``: (p_q, p_k) positions from content; ``tau_s`` [1, H|1, Lq|1] the scheme's temperature.
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bs = Lq if block is None or need_probs else max(1, min(int(block), Lq))
    # keys sorted by position: a block never needs keys after its last query (nor, fused, before
    # its window); probabilities keep every column
    skip = not need_probs and (Lk < 2 or bool(torch.all(k_pos[1:] >= k_pos[:-1])))
    explicit = not fused or scheme.has_weight or sink is not None or bool(scheme.reference_only)
    outs, probs = [], None
    # the last block (widest key range) first: each later block's temporaries fit into memory freed by
    # the one before, where growing blocks would grow the heap by their sum (the sink keeps row order)
    starts = range(0, Lq, bs) if sink is not None else reversed(range(0, Lq, bs))
    for s in starts:
        e = min(Lq, s + bs)
        qp, lo, hi = q_pos[s:e], 0, Lk
        if skip:
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
            if window is not None and not explicit:
                lo = int(torch.searchsorted(k_pos, qp.min() - window + 1))
        kp, bb = k_pos[lo:hi], None if bias is None else bias[..., s:e, lo:hi]
        qb, kb, vb = q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi]  # [B,H,bq,D], [B,H,bk,D]
        cb = None if content is None else (content[0][..., s:e], content[1][..., lo:hi])
        ts = _rows(tau_s, s, e)  # [1, H|1, bq|1, 1]
        if not explicit:
            add = logit_terms(scheme, qp, kp, layer, window, bb)[1]  # [H|1, bq, bk]
            if cb is not None:
                add = add + content_bias(scheme, layer, cb)  # [B|1, H, bq, bk]
            if ts is not None:  # tau_m divides q·k and the bias alike
                add, qb = divide_finite(add, ts.to(add.dtype)), qb / ts.to(qb.dtype)
            mask = (add / tau if tau != 1.0 else add).to(q.dtype)
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1, H|1, bq, bk]: 4-D keeps the fused CPU kernel
            outs.append(sdpa(qb, kb, vb, mask, scale=1.0 / math.sqrt(D) / tau))
            continue
        lg, blk = block_logits(qb, kb, qp, kp, scheme, layer, window, bb, cb, ts)  # [B, H, bq, bk]
        if sink is not None:
            sink(layer, lg.detach(), Lk)
        p = weights(lg, scheme, blk, tau).to(v.dtype)
        outs.append(torch.matmul(p, vb))  # [B, H, bq, D]
        probs = p if need_probs else None
    if sink is None:
        outs.reverse()
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), probs

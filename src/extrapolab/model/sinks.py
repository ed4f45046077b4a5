"""Attention sinks in fused SDPA, exactly (docs/attention.md, "Attention sinks").

gpt-oss (OpenAI 2025, gpt-oss model card; ``gpt_oss/torch/model.py`` ``sdpa``, read for this file) learns one
sink logit s_h per head and puts it in the softmax denominator as one more column without a value:

    p_mn = exp(l_mn) / (exp(s_m) + Σ_n' exp(l_mn')),     out_m = Σ_n p_mn v_n

l the final logits (every temperature applied) and s_m = s_h / (tau·tau_s[h, m]) the sink after the same
temperatures (model/attention.py). Two fused forms compute it, both exact:

* ``lse`` (CPU): one call of the CPU flash kernel returns out and lse = log Σ_n exp(l_mn); then
  lse' = logaddexp(lse, s) and out' = out·exp(lse − lse') (= out·σ(lse − s)). Backward: the kernel's own
  backward given out' and lse' returns the exact dq, dk, dv (it recomputes P' = exp(S − lse') and
  dS = P' ⊙ (dP − rowsum(dO ⊙ out')), which is the gradient of the softmax with the sink), and
  ds = −exp(s − lse')·rowsum(dO ⊙ out'). Nothing is copied. Used when the mask needs no gradient.
* ``column`` (any device, any mask, autograd): the sink is one more key with a zero value: q' = [q, s/scale],
  k' = [k, 0], and the sink key [0, 1], so scale·q'·k_sink = s and every other logit is unchanged; a mask gets
  a visible column for it, and an ``is_causal`` call one more (dummy) query in front, whose output is dropped,
  so that the causal pattern over L + 1 keys is the sink plus the usual keys. In 16-bit kernels s/scale is
  split into hi + lo columns (both exact in 16 bits). On CUDA the head size is padded to a multiple of 8.

Shapes: q [B, H, Lq, D], k/v [B, H, Lk, D], ``rows`` (the sink logit per row, final units) [B|1, H, Lq|1].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .sdpa import sdpa

#: the CPU flash kernel returning (out, logsumexp) and its backward, private to torch (the Toeplitz and two-pass
#: paths call the same ops; their schemas are checked in tests/test_attention_paths.py)
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the kernel multiplies in: autocast's where it is on, else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


#: dtypes the CPU flash kernel runs (out, logsumexp) in
_LSE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


class _SinkFlash(torch.autograd.Function):
    """The ``lse`` form (module doc): forward and backward of the CPU flash kernel, lse and out corrected."""

    @staticmethod
    def forward(ctx, q, k, v, rows, mask, causal, scale):
        o, lse = CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)  # [B,H,Lq,D], [B,H,Lq]
        lse2 = torch.logaddexp(lse, rows.to(lse.dtype))  # [B, H, Lq] with the sink
        out = o * (lse - lse2).exp().unsqueeze(-1).to(o.dtype)  # [B, H, Lq, D]
        ctx.save_for_backward(q, k, v, out, lse2, rows)
        ctx.mask, ctx.causal, ctx.scale = mask, causal, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse2, rows = ctx.saved_tensors
        g = g.contiguous()
        dq, dk, dv = CPU_FLASH_BWD(g, q, k, v, out, lse2, 0.0, ctx.causal, attn_mask=ctx.mask, scale=ctx.scale)
        p_sink = (rows.to(lse2.dtype) - lse2).exp()  # [B, H, Lq] the sink's probability
        drows = -(p_sink * (g * out).sum(-1).to(lse2.dtype)).to(rows.dtype)  # [B, H, Lq]
        return dq, dk, dv, drows, None, None, None


def lse_form(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the ``lse`` form applies: CPU kernels present, a dtype they run, autocast off or matching, and
    a mask (if any) that needs no gradient (the kernel's backward returns none for it)."""
    return (q.device.type == "cpu" and CPU_FLASH is not None and CPU_FLASH_BWD is not None
            and compute_dtype(q) == q.dtype and q.dtype in _LSE_DTYPES
            and not (mask is not None and mask.requires_grad and torch.is_grad_enabled()))


def _float_mask(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A boolean mask (True = visible) as 0 / -inf in ``dtype``; a float mask cast to it."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
    return mask.to(dtype)


def _split(x: torch.Tensor, low) -> list[torch.Tensor]:
    """x as one column, or hi + lo columns each exact in the 16-bit ``low`` (their sum ~2^-16 relative)."""
    if low is None:
        return [x]
    hi = x.to(low).to(x.dtype)
    return [hi, (x - hi).to(low).to(x.dtype)]


def column_form(q, k, v, rows, mask=None, *, is_causal: bool = False, scale: float) -> torch.Tensor:
    """The ``column`` form (module doc): the sink as one more key with a zero value, through fused SDPA."""
    B, H, Lq, D = q.shape
    dt = compute_dtype(q)
    low = dt if dt in (torch.float16, torch.bfloat16) else None
    x = (rows.to(torch.float64) / scale).expand(B, H, Lq)  # [B, H, Lq]: scale·x = the sink logit
    cols = torch.stack(_split(x, low), -1).to(q.dtype)  # [B, H, Lq, E]
    E = cols.shape[-1]
    pad = (-(D + E)) % 8 if q.device.type == "cuda" else 0  # CUDA flash kernels: head size % 8
    qx = torch.cat([q, cols, q.new_zeros(B, H, Lq, pad)], -1)  # [B, H, Lq, D+E+pad]
    kx = F.pad(k, (0, E + pad))  # [B, H, Lk, D+E+pad]: real keys add nothing to the sink columns
    sink = k.new_zeros(B, H, 1, D + E + pad)
    sink[..., D:D + E] = 1.0  # the sink key: scale·q'·k_sink = s
    kx = torch.cat([sink, kx], 2)  # [B, H, 1+Lk, ..]: the sink first
    vx = F.pad(v, (0, E + pad, 1, 0))  # [B, H, 1+Lk, D+E+pad]: zero value for the sink, zero columns
    if is_causal:  # one dummy query in front: row 1+i sees the sink and keys 0..i
        qx = F.pad(qx, (0, 0, 1, 0))  # [B, H, 1+Lq, ..]
        return sdpa(qx, kx, vx, None, is_causal=True, scale=scale)[:, :, 1:, :D]
    m = None
    if mask is not None:  # the sink's column is visible to every row
        m = F.pad(mask, (1, 0), value=True) if mask.dtype == torch.bool else F.pad(mask, (1, 0), value=0.0)
    return sdpa(qx, kx, vx, m, scale=scale)[..., :D]


def sink_sdpa(q, k, v, rows, mask=None, *, is_causal: bool = False, scale: float) -> torch.Tensor:
    """softmax([q·k·scale + mask, sink]) v without the sink's column: the ``lse`` form on the CPU where it
    applies, else the ``column`` form (module doc). ``rows`` [B|1, H, Lq|1] the sink logit of each row in
    final units (temperatures applied); ``mask`` bool (True = visible) or additive, broadcastable to
    [B, H, Lq, Lk]. Returns [B, H, Lq, D]."""
    B, H, Lq, _ = q.shape
    if lse_form(q, mask):
        r = rows.expand(B, H, Lq).contiguous()  # [B, H, Lq]
        return _SinkFlash.apply(q, k, v, r, _float_mask(mask, q.dtype), bool(is_causal), float(scale))
    return column_form(q, k, v, rows, mask, is_causal=is_causal, scale=scale)

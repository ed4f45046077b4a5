"""Two-pass attention of Self-Extend and ReRoPE (docs/attention.md): our GPT and Hugging Face models.

A two-pass scheme (``scheme.second_pass()`` returns ``(w, far)``, positional/rope_twopass.py)
scores keys at distance m - n < w with the rotated q, k (the near pass, plain RoPE) and keys at
m - n >= w with ``far(q, k)``, the same vectors at the scheme's far positions. Each pass is one
fused attention call over its own keys, returning its output and log-sum-exp, and the two merge
exactly (the merge FlashAttention does between key tiles):

    l = log(e^l_near + e^l_far),   out = e^(l_near - l)·out_near + e^(l_far - l)·out_far

Both masks depend on the distance only, so with the queries reversed each is a zero-copy Hankel
view of one O(L) vector (as in :mod:`.toeplitz`), and a block of queries touches only the keys
its masks leave visible: the near pass its block + w - 1 keys, the far pass the keys at least w
behind. No L x L tensor, not even per block. Backward: the merged output is one softmax over the
union of both key sets, so the fused kernel's own backward, called once per pass with the merged
output and log-sum-exp, returns each pass's exact gradients (dS = P ⊙ (dP - rowsum(dO ⊙ O)) with
P = e^(S - l) and O, l the merged ones); autograd then carries them through ``far`` and the
rotation to q and k.

The fused kernel is the CPU's ``aten::_scaled_dot_product_flash_attention_for_cpu`` (out,
logsumexp) and its ``_backward`` (schemas checked in tests/test_attention_paths.py). Elsewhere
(CUDA, positions that are not contiguous, keys that do not end at the last query) the reference
path runs: explicit merged logits (``reference.logits``), one query block at a time.
Shapes: q [B,H,Lq,D], k/v [B,H,Lk,D]; masks ext [1, Lq+Lk-1].
"""
from __future__ import annotations

import math

import torch

from ..positional.base import PositionalScheme
from .reference import dense_attention
from .toeplitz import CPU_FLASH, TOEPLITZ_BLOCK, hankel_ok, hankel_view

#: backward of :data:`.toeplitz.CPU_FLASH`; private to torch like it (schema checked in the tests)
CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def masks(dmax: int, size: int, w: int, window: int | None, dtype, device):
    """(near, far) Hankel vectors [1, size]: slot x holds distance dmax - x; 0 where that pass sees
    the distance (near: 0 <= d < w, far: d >= w; both below ``window`` if given), -inf elsewhere."""
    d = dmax - torch.arange(size, device=device)  # [size]
    top = math.inf if window is None else window
    near = (d >= 0) & (d < min(w, top))
    far = (d >= w) & (d < top)
    zero = torch.zeros(1, size, dtype=dtype, device=device)
    return zero.masked_fill(~near[None], -math.inf), zero.masked_fill(~far[None], -math.inf)


def plan(Lq: int, Lk: int, w: int, window: int | None, block: int) -> list[tuple]:
    """Query blocks over reversed rows (row r = query Lq-1-r, keys ending at the last query):
    ``(r0, r1, (lo, hi) near keys, (rf, lo, hi) far rows r0..rf-1 and keys, or None)``. Every
    row of a call sees at least one key (its own position near, position 0 far)."""
    dmax = Lk - 1
    wn = w if window is None else min(w, window)
    out = []
    for r0 in range(0, Lq, block):
        r1 = min(Lq, r0 + block)
        near = (max(0, dmax - (r1 - 1) - wn + 1), min(Lk, dmax - r0 + 1))
        rf, far = min(r1, dmax - w + 1), None
        if (window is None or window > w) and rf > r0:
            far = (rf, 0 if window is None else max(0, dmax - (rf - 1) - window + 1), dmax - r0 - w + 1)
        out.append((r0, r1, near, far))
    return out


def _merge(o1, l1, o2, l2):
    """Merge rows 0..n-1 of pass 1 with pass 2 (n rows); returns (out, lse) for all rows of pass 1."""
    n = o2.shape[2]
    acc = torch.promote_types(o1.dtype, torch.float32)
    lse = torch.logaddexp(l1[:, :, :n], l2)  # [B, H, n]
    head = o1[:, :, :n].to(acc) * (l1[:, :, :n] - lse).exp()[..., None].to(acc) \
        + o2.to(acc) * (l2 - lse).exp()[..., None].to(acc)  # [B, H, n, D]
    if n == o1.shape[2]:
        return head.to(o1.dtype), lse
    return torch.cat((head.to(o1.dtype), o1[:, :, n:]), 2), torch.cat((lse, l1[:, :, n:]), 2)


def fused_forward(qn, kn, qf, kf, v, geom):
    """(out, lse) over reversed queries; geom = (plan, ext_near, ext_far, scale)."""
    blocks, ext_n, ext_f, scale = geom
    outs, lses = [], []
    for r0, r1, (lo, hi), far in blocks:
        m = hankel_view(ext_n, r0 + lo, r1 - r0, hi - lo)  # [1, 1, bq, bk]
        o, lse = CPU_FLASH(qn[:, :, r0:r1], kn[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=m, scale=scale)
        if far is not None:
            rf, flo, fhi = far
            m = hankel_view(ext_f, r0 + flo, rf - r0, fhi - flo)
            o2, l2 = CPU_FLASH(qf[:, :, r0:rf], kf[:, :, flo:fhi], v[:, :, flo:fhi], 0.0, False, attn_mask=m,
                               scale=scale)
            o, lse = _merge(o, lse, o2, l2)
        outs.append(o)  # [B, H, bq, D]
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


class TwoPassSDPA(torch.autograd.Function):
    """Both passes fused, merged by log-sum-exp; gradients from the fused backward (module doc)."""

    @staticmethod
    def forward(ctx, qn, kn, qf, kf, v, geom):
        out, lse = fused_forward(qn, kn, qf, kf, v, geom)
        ctx.save_for_backward(qn, kn, qf, kf, v, out, lse)
        ctx.geom = geom
        return out

    @staticmethod
    def backward(ctx, g):
        qn, kn, qf, kf, v, out, lse = ctx.saved_tensors
        blocks, ext_n, ext_f, scale = ctx.geom
        g = g.contiguous()
        dqn, dqf = torch.zeros_like(qn), torch.zeros_like(qf)
        dkn, dkf, dv = torch.zeros_like(kn), torch.zeros_like(kf), torch.zeros_like(v)
        for r0, r1, (lo, hi), far in blocks:
            m = hankel_view(ext_n, r0 + lo, r1 - r0, hi - lo)
            gq, gk, gv = CPU_FLASH_BWD(g[:, :, r0:r1], qn[:, :, r0:r1], kn[:, :, lo:hi], v[:, :, lo:hi],
                                       out[:, :, r0:r1], lse[:, :, r0:r1], 0.0, False, attn_mask=m, scale=scale)
            dqn[:, :, r0:r1] = gq
            dkn[:, :, lo:hi] += gk
            dv[:, :, lo:hi] += gv
            if far is not None:
                rf, flo, fhi = far
                m = hankel_view(ext_f, r0 + flo, rf - r0, fhi - flo)
                gq, gk, gv = CPU_FLASH_BWD(g[:, :, r0:rf], qf[:, :, r0:rf], kf[:, :, flo:fhi], v[:, :, flo:fhi],
                                           out[:, :, r0:rf], lse[:, :, r0:rf], 0.0, False, attn_mask=m,
                                           scale=scale)
                dqf[:, :, r0:rf] = gq
                dkf[:, :, flo:fhi] += gk
                dv[:, :, flo:fhi] += gv
        return dqn, dkn, dqf, dkf, dv, None


def fused_ok(q: torch.Tensor, starts: tuple, Lq: int, Lk: int) -> bool:
    """The fused path applies: CPU kernels present, contiguous positions, keys ending at the last query."""
    a, c = starts
    return (CPU_FLASH is not None and CPU_FLASH_BWD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16) and hankel_ok(q.device)
            and a is not None and c is not None and c <= a and c + Lk == a + Lq)


def twopass_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int, starts: tuple, *,
                      scale: float, tau: float = 1.0, window: int | None = None, block: int | None = None):
    """q [B,H,Lq,D], k/v [B,H,Lk,D] rotated by ``scheme.rotate`` (the near pass) -> [B,H,Lq,D].

    ``scale`` multiplies q·k and already carries 1/tau; ``starts`` = first positions of
    contiguous queries / keys (None where not contiguous); ``block`` query rows per step."""
    w, far = scheme.second_pass()
    Lq, Lk = q.shape[2], k.shape[2]
    bs = max(1, int(block)) if block else min(Lq, TOEPLITZ_BLOCK)
    if not fused_ok(q, starts, Lq, Lk):
        return dense_attention(q, k, v, q_pos, k_pos, scheme, layer, tau=tau, window=window, block=bs)[0]
    qf, kf = far(q, k, q_pos, k_pos)  # [B, H, Lq|Lk, D] at the far positions
    ext_n, ext_f = masks(Lk - 1, Lq + Lk - 1, w, window, q.dtype, q.device)
    geom = (plan(Lq, Lk, w, window, bs), ext_n, ext_f, scale)
    rev = Lq > 1
    qn, qf = (q.flip(2), qf.flip(2)) if rev else (q, qf)  # reversed rows: masks become Hankel views
    if torch.is_grad_enabled() and any(t.requires_grad for t in (qn, k, qf, kf, v)):
        out = TwoPassSDPA.apply(qn, k, qf, kf, v, geom)
    else:
        out = fused_forward(qn, k, qf, kf, v, geom)[0]
    return out.flip(2) if rev else out

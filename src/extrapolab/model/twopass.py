"""Multi-pass attention (docs/attention.md): Self-Extend and ReRoPE (two passes), dual chunk
attention (three), on our GPT and Hugging Face models.

A multi-pass scheme (``scheme.second_pass()`` returns a ``Passes``, positional/rope_twopass.py)
scores every causal key in exactly one pass; pass i scores its keys (a distance band
d_lo <= m - n < d_hi, optionally a range of chunks floor(m/s) - floor(n/s)) with q, k moved to
that pass's positions. Each pass is one fused attention call per query block over its own keys,
returning its output and log-sum-exp, and the passes merge exactly (the merge FlashAttention does
between key tiles):

    l = log(sum_i e^l_i),   out = sum_i e^(l_i - l)·out_i

With the queries reversed, a distance band is a zero-copy Hankel view of one O(L) vector (as in
:mod:`.toeplitz`); query blocks are cut at chunk boundaries, so inside a block a range of chunks
is a contiguous slice of keys. A block touches only the keys each pass leaves visible (near pass:
block + w - 1 keys; far pass: the keys at least w behind; DCA: its own chunk, the previous one,
the rest), and a call whose keys are all visible to all its rows runs without a mask. No L x L
tensor, not even per block. Backward: the merged output is one softmax over the union of the
passes' key sets, so the fused kernel's own backward, called once per pass with the merged output
and log-sum-exp, returns each pass's exact gradients (dS = P ⊙ (dP - rowsum(dO ⊙ O)) with
P = e^(S - l) and O, l the merged ones); autograd then carries them through the moves and the
rotation to q and k.

The fused kernel is the CPU's ``aten::_scaled_dot_product_flash_attention_for_cpu`` (out,
logsumexp) and its ``_backward`` (schemas checked in tests/test_attention_paths.py). Elsewhere
(CUDA, positions that are not contiguous, keys that do not end at the last query) the reference
path runs: explicit merged logits (``reference.logits``), one query block at a time.
Shapes: q [B,H,Lq,D], k/v [B,H,Lk,D]; band masks [1, Lq+Lk-1].
"""
from __future__ import annotations

import math

import torch

from ..positional.base import PositionalScheme
from ..positional.rope_twopass import Pass
from .reference import dense_attention
from .toeplitz import CPU_FLASH, TOEPLITZ_BLOCK, hankel_ok, hankel_view

#: backward of :data:`.toeplitz.CPU_FLASH`; private to torch like it (schema checked in the tests)
CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def band_vector(dmax: int, size: int, d_lo: int, d_hi: float, dtype, device) -> torch.Tensor:
    """Hankel vector [1, size]: slot x holds distance dmax - x; 0 where d_lo <= d < d_hi, else -inf."""
    d = dmax - torch.arange(size, device=device)  # [size]
    ok = (d >= d_lo) & (d < d_hi)
    return torch.zeros(1, size, dtype=dtype, device=device).masked_fill(~ok[None], -math.inf)


def block_plan(passes, Lq: int, Lk: int, a: int, window: int | None, block: int) -> list[tuple]:
    """Query blocks over reversed rows (row r = query Lq-1-r at position a + Lq-1-r; the Lk keys end
    at the last query): ``(r0, r1, calls)``, each call ``(i, ra, rb, lo, hi, band)``: pass i over rows
    ra..rb-1 and keys lo..hi-1, ``band`` = (d_lo, d_hi) of its Hankel mask or None when every key of
    the call is visible to every row. Rows without a key in a pass get no call of it; blocks end at
    every chunk boundary of a pass with chunks; keys of no pass are in no call (not seen)."""
    top = a + Lq - 1  # position of row 0
    c = top + 1 - Lk  # position of key 0
    win = math.inf if window is None else int(window)
    chunks = {p.chunk for p in passes if p.chunk}
    out, r0 = [], 0
    while r0 < Lq:
        m_top = top - r0
        r1 = min([Lq, r0 + block] + [r0 + m_top % s + 1 for s in chunks])  # one chunk per block
        m_bot = top - (r1 - 1)
        calls = []
        for i, p in enumerate(passes):
            s_lo, s_hi = c, top + 1  # the pass's keys are positions s_lo..s_hi-1 ...
            if p.keys is not None:  # ... its own range of positions ...
                s_lo = max(s_lo, p.keys[0])
                s_hi = s_hi if p.keys[1] is None else min(s_hi, p.keys[1])
            if p.chunk:  # ... its chunks, counted back from the block's
                C = m_top // p.chunk
                if p.c_hi is not None:
                    s_lo = max(s_lo, (C - p.c_hi) * p.chunk)
                s_hi = min(s_hi, (C - p.c_lo + 1) * p.chunk)
            D = min(win, math.inf if p.d_hi is None else p.d_hi)  # ... at distances d_lo <= d < D
            m_lo = max(m_bot, s_lo + p.d_lo)  # rows with a key: s_lo + d_lo <= m <= s_hi + D - 2
            m_hi = m_top if D == math.inf else min(m_top, s_hi + D - 2)
            if s_lo >= s_hi or D <= p.d_lo or m_lo > m_hi:
                continue
            lo = s_lo if D == math.inf else max(s_lo, m_lo - D + 1)
            hi = min(s_hi, m_hi - p.d_lo + 1)
            full = m_lo - (hi - 1) >= p.d_lo and m_hi - lo < D  # every (row, key) of the call visible
            calls.append((i, top - m_hi, top - m_lo + 1, lo - c, hi - c, None if full else (p.d_lo, D)))
        out.append((r0, r1, calls))
        r0 = r1
    return out


def plan(Lq: int, Lk: int, w: int, window: int | None, block: int) -> list[tuple]:
    """The two-band case (near 0 <= d < w, far d >= w: Self-Extend, ReRoPE) of :func:`block_plan`
    as ``(r0, r1, (lo, hi) near keys, (rf, lo, hi) far rows r0..rf-1 and keys, or None)``."""
    out = []
    for r0, r1, calls in block_plan((Pass(0, w), Pass(w)), Lq, Lk, Lk - Lq, window, block):
        near = next((lo, hi) for i, _, _, lo, hi, _ in calls if i == 0)
        far = next(((rb, lo, hi) for i, _, rb, lo, hi, _ in calls if i == 1), None)
        out.append((r0, r1, near, far))
    return out


def merge(acc, lse, o, l, start: int, rows: int):
    """Merge one call's (o [B,H,n,D], l [B,H,n]) into rows start..start+n-1 of the block's (acc, lse)."""
    n = o.shape[2]
    if acc is None and n == rows:
        return o, l
    dt = torch.promote_types(o.dtype, torch.float32)
    if acc is None:
        acc = o.new_zeros(*o.shape[:2], rows, o.shape[3], dtype=dt)  # [B, H, rows, D]
        lse = l.new_full((*l.shape[:2], rows), -math.inf)  # [B, H, rows]
    elif acc.dtype != dt:
        acc = acc.to(dt)
    sl = slice(start, start + n)
    new = torch.logaddexp(lse[:, :, sl], l)  # [B, H, n]
    acc[:, :, sl] = acc[:, :, sl] * (lse[:, :, sl] - new).exp()[..., None].to(dt) \
        + o.to(dt) * (l - new).exp()[..., None].to(dt)  # [B, H, n, D]
    lse[:, :, sl] = new
    return acc, lse


def _mask(geom, band, r: int, lo: int, rows: int, cols: int):
    return None if band is None else hankel_view(geom[2][band], r + lo, rows, cols)  # [1, 1, rows, cols]


def fused_forward(qs, ks, v, geom):
    """(out, lse) over reversed queries; ``qs`` the distinct moved q (reversed rows), ``ks`` the distinct
    moved k; geom = (blocks, (q index, k index) per pass, band vectors, scale)."""
    blocks, idx, _, scale = geom
    outs, lses = [], []
    for r0, r1, calls in blocks:
        acc = lse = None
        for i, ra, rb, lo, hi, band in calls:
            qi, ki = idx[i]
            o, l = CPU_FLASH(qs[qi][:, :, ra:rb], ks[ki][:, :, lo:hi], v[:, :, lo:hi], 0.0, False,
                             attn_mask=_mask(geom, band, ra, lo, rb - ra, hi - lo), scale=scale)  # [B,H,n,D], [B,H,n]
            acc, lse = merge(acc, lse, o, l, ra - r0, r1 - r0)
        outs.append(acc.to(v.dtype))  # [B, H, bq, D]
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


class MultiPassSDPA(torch.autograd.Function):
    """Every pass fused, merged by log-sum-exp; gradients from the fused backward (module doc).
    Inputs: v, geom, the number of q tensors, then the distinct q tensors and the distinct k tensors."""

    @staticmethod
    def forward(ctx, v, geom, nq, *tensors):
        qs, ks = tensors[:nq], tensors[nq:]
        out, lse = fused_forward(qs, ks, v, geom)
        ctx.save_for_backward(v, out, lse, *tensors)
        ctx.geom, ctx.nq = geom, nq
        return out

    @staticmethod
    def backward(ctx, g):
        v, out, lse, *tensors = ctx.saved_tensors
        qs, ks = tensors[:ctx.nq], tensors[ctx.nq:]
        blocks, idx, _, scale = ctx.geom
        g = g.contiguous()
        dqs, dks, dv = [torch.zeros_like(x) for x in qs], [torch.zeros_like(x) for x in ks], torch.zeros_like(v)
        for _, _, calls in blocks:
            for i, ra, rb, lo, hi, band in calls:
                qi, ki = idx[i]
                gq, gk, gv = CPU_FLASH_BWD(g[:, :, ra:rb], qs[qi][:, :, ra:rb], ks[ki][:, :, lo:hi], v[:, :, lo:hi],
                                           out[:, :, ra:rb], lse[:, :, ra:rb], 0.0, False,
                                           attn_mask=_mask(ctx.geom, band, ra, lo, rb - ra, hi - lo), scale=scale)
                dqs[qi][:, :, ra:rb] += gq
                dks[ki][:, :, lo:hi] += gk
                dv[:, :, lo:hi] += gv
        return (dv, None, None, *dqs, *dks)


def fused_ok(q: torch.Tensor, starts: tuple, Lq: int, Lk: int) -> bool:
    """The fused path applies: CPU kernels present, contiguous positions, keys ending at the last query."""
    a, c = starts
    return (CPU_FLASH is not None and CPU_FLASH_BWD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16) and hankel_ok(q.device)
            and a is not None and c is not None and c <= a and c + Lk == a + Lq)


def _distinct(tensors) -> tuple[list, list[int]]:
    """(the distinct tensors by identity, each input's index among them)."""
    uniq, index = [], []
    for t in tensors:
        j = next((n for n, u in enumerate(uniq) if u is t), None)
        if j is None:
            uniq.append(t)
            j = len(uniq) - 1
        index.append(j)
    return uniq, index


def twopass_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int, starts: tuple, *,
                      scale: float, tau: float = 1.0, window: int | None = None, block: int | None = None):
    """q [B,H,Lq,D], k/v [B,H,Lk,D] rotated by ``scheme.rotate`` (plain RoPE) -> [B,H,Lq,D].

    ``scale`` multiplies q·k and already carries 1/tau; ``starts`` = first positions of
    contiguous queries / keys (None where not contiguous); ``block`` query rows per step."""
    multi = scheme.second_pass()
    Lq, Lk = q.shape[2], k.shape[2]
    bs = max(1, int(block)) if block else min(Lq, TOEPLITZ_BLOCK)
    if not fused_ok(q, starts, Lq, Lk):
        return dense_attention(q, k, v, q_pos, k_pos, scheme, layer, tau=tau, window=window, block=bs)[0]
    pairs = multi.moved(q, k, q_pos, k_pos)  # [(q_i [B,H,Lq,D], k_i [B,H,Lk,D])] at each pass's positions
    qs, iq = _distinct([p[0] for p in pairs])
    ks, ik = _distinct([p[1] for p in pairs])
    blocks = block_plan(multi.passes, Lq, Lk, starts[0], window, bs)
    bands = {b for _, _, calls in blocks for *_, b in calls if b is not None}
    vecs = {b: band_vector(Lk - 1, Lq + Lk - 1, *b, q.dtype, q.device) for b in bands}
    geom = (blocks, list(zip(iq, ik)), vecs, scale)
    rev = Lq > 1
    qs = [x.flip(2) for x in qs] if rev else qs  # reversed rows: distance bands become Hankel views
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*qs, *ks, v)):
        out = MultiPassSDPA.apply(v, geom, len(qs), *qs, *ks)
    else:
        out = fused_forward(qs, ks, v, geom)[0]
    return out.flip(2) if rev else out

"""Positions from content on FlexAttention (FoX), their gradient from a kernel of ours (docs/attention.md, "Positions
from content on the flex path").

FoX's bias is of the ALiBi form with positions from content, b(m, n) = -s_h·(p_m - p_n), p = -cumsum(log f) (Lin et al.
2025 §2; :mod:`..positional.fox`). The folded path (:mod:`.folded`) adds the key term as extra head dimensions of flash
SDPA, which on a GPU pads the head size 64 to 72 and so runs a wider flash kernel. Here FlexAttention computes

    score_mod: s -> (s + (c[b, h, kv_idx] - c[b, h, q_idx])) / tau,    c = s_h·p  (hi + lo fp32 halves, detached)

at head size 64, and returns its log-sum-exp; the key term's gradient is added beside it. The row term c_m is constant
along a softmax row, so its gradient is exactly zero (Σ_n dS_mn = 0 for dS = P ⊙ (dP - Δ)): all of c's gradient is the
key term's, d c_n = (1/tau) Σ_m dS_mn, a column sum of dS (the official FoX kernel's row and column sums of dS,
zhixuan-lin/forgetting-transformer ``ops/forgetting_attention.py``). One Triton program per (key block, batch and head)
recomputes P and dP for the query blocks at or after its keys and sums their columns: two of attention's seven matmuls
per tile, each output written by one program (no atomics). Where Triton does not run the same tiles run in PyTorch.

c is split into an fp32 hi part and the fp32 remainder, differenced separately (hi_n - hi_m is exact for close
positions), so the bias keeps ~48 bits although p grows with the length (a cumulative sum).
"""
from __future__ import annotations

import functools

import torch

from ..positional.turn import interpreting
from . import flex, table_grad

BLOCK = 64  # queries and keys per tile


def flex_content_path(q, k, v, c: torch.Tensor, *, scale: float, tau: float = 1.0, window: int | None = None,
                      scheme=None) -> torch.Tensor:
    """q, k, v [B, H, L, D] at the same positions; c [B|1, H|1, L] (float64) the key term s_h·p with its graph ->
    out [B, H, L, D] = softmax((q·k·scale + c_n - c_m) / tau) v, causal (and m - n < window). Raises
    :class:`.flex.Unavailable` where the compiled kernel cannot run it (attend() then takes the folded path)."""
    B, H, L, _ = q.shape
    dev = q.device
    cd = c.detach().expand(B, H, L)
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32  # FlexAttention's working precision
    hi = cd.to(wp)  # [B, H, L]
    lo = (cd - hi.to(cd.dtype)).to(wp)  # [B, H, L] the remainder (0 in fp64)
    inv_tau = torch.full((), 1.0 / tau, device=dev, dtype=wp)

    def mod(score, b, h, q_idx, kv_idx):
        return (score + ((hi[b, h, kv_idx] - hi[b, h, q_idx]) + (lo[b, h, kv_idx] - lo[b, h, q_idx]))) * inv_tau

    def finite():  # [L] the visible distances: all, up to the window
        d = torch.arange(L, device=dev)
        return torch.ones_like(d, dtype=torch.bool) if window is None else d < window

    bm = flex.kept_mask(scheme, ("flexcontent", dev, L, window), finite, L, L, 0)
    if not (torch.is_grad_enabled() and c.requires_grad):
        return flex.kernel(dev.type)(q, k, v, gather=False, score_mod=mod, block_mask=bm, scale=scale)
    out, lse = flex.with_lse(flex.kernel(dev.type), q, k, v, gather=False, score_mod=mod, block_mask=bm, scale=scale)
    return attach(out, lse, q, k, v, c, hi, lo, scale=scale, inv_tau=1.0 / tau, window=window)


def attach(out, lse, q, k, v, c, hi, lo, *, scale: float, inv_tau: float, window: int | None = None,
           block: int = BLOCK) -> torch.Tensor:
    """out [B, H, L, D] computed with c detached -> the same values, whose backward also gives c [B|1, H|1, L] its
    gradient (the key term's; the row term's is zero). hi, lo [B, H, L]: the fp32 halves of c the kernel read."""
    meta = (float(scale), float(inv_tau), None if window is None else int(window), int(block))
    return _KeyTerm.apply(out, c, lse.detach(), q.detach(), k.detach(), v.detach(), hi, lo, meta)


class _KeyTerm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, c, lse, q, k, v, hi, lo, meta):
        ctx.save_for_backward(out.detach(), lse, q, k, v, hi, lo)
        ctx.meta, ctx.c_shape, ctx.c_dtype = meta, c.shape, c.dtype
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        if not ctx.needs_input_grad[1]:
            return dout, None, None, None, None, None, None, None, None
        out, lse, q, k, v, hi, lo = ctx.saved_tensors
        dc = key_gradient(q, k, v, out, lse, dout, hi, lo, *ctx.meta)  # [B, H, L]
        dims = tuple(i for i, n in enumerate(ctx.c_shape) if n == 1 and dc.shape[i] != 1)
        if dims:  # to c's broadcast shape (sum over () would reduce every dimension)
            dc = dc.sum(dims, keepdim=True)
        return dout, dc.to(ctx.c_dtype), None, None, None, None, None, None, None


def key_gradient(q, k, v, out, lse, dout, hi, lo, scale: float, inv_tau: float, window: int | None,
                 block: int = BLOCK) -> torch.Tensor:
    """d loss / d c_n = inv_tau · Σ_m dS_mn [B, H, L] (fp32; module doc)."""
    lse, delta = table_grad.row_stats(q, out, lse, dout)
    reach = q.shape[2] if window is None else min(int(window), q.shape[2])
    return table_grad.kernel_or_torch(q, _launch, _columns_torch, q, k, v, dout, lse, delta, hi, lo, scale, inv_tau,
                                      reach, block)


def _columns_torch(q, k, v, dout, lse, delta, hi, lo, scale, inv_tau, reach, block):
    """The kernel's column sums in PyTorch, query block by query block (O(B·H·block·L) at a time)."""
    B, H, L, _ = q.shape
    wp = delta.dtype
    c = hi.to(wp) + lo.to(wp)  # [B, H, L]
    dc = torch.zeros(B, H, L, dtype=wp, device=q.device)
    n = torch.arange(L, device=q.device)
    for r0 in range(0, L, block):
        r1 = min(L, r0 + block)
        m = n[r0:r1]  # [bq]
        d = m[:, None] - n[None]  # [bq, L]
        vis = (d >= 0) & (d < reach)
        s = q[:, :, r0:r1].to(wp) @ k.to(wp).transpose(-1, -2) * scale  # [B, H, bq, L]
        logit = (s + (c[:, :, None, :] - c[:, :, r0:r1, None])) * inv_tau
        P = torch.where(vis & (lse[:, :, r0:r1, None] > -torch.inf), torch.exp(logit - lse[:, :, r0:r1, None]), 0.0)
        dp = dout[:, :, r0:r1].to(wp) @ v.to(wp).transpose(-1, -2)  # [B, H, bq, L]
        dc += (P * (dp - delta[:, :, r0:r1, None])).sum(2)
    return dc * inv_tau


def _launch(q, k, v, dout, lse, delta, hi, lo, scale, inv_tau, reach, block):
    triton = table_grad._triton()
    B, H, L, D = q.shape
    nb = -(-L // block)
    tiles = torch.empty(B, H, nb, block, block, dtype=torch.float32, device=q.device)  # each program's dS sum
    x = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout)]
    hi, lo = hi.contiguous(), lo.contiguous()
    grid = (nb, B * H)
    _kernel(interpreting() and not q.is_cuda)[grid](
        *x, lse, delta, hi, lo, tiles, H, L, reach, *x[0].stride()[:3], *x[1].stride()[:3], *x[2].stride()[:3],
        *x[3].stride()[:3], *lse.stride()[:2], *delta.stride()[:2], scale, inv_tau, D,
        BLOCK=block, BLOCK_D=max(16, triton.next_power_of_2(D)), UPCAST=not q.is_cuda,
        PREC=table_grad.dot_precision(q), num_warps=4)
    return tiles.sum(-2).flatten(-2)[..., :L]  # [B, H, L]: the columns' sums (a reduction in the kernel would be
    # tl.sum, a jit function Triton's interpreter cannot call when triton was imported before TRITON_INTERPRET)


@functools.cache
def _kernel(interpret: bool):
    """The Triton kernel, decorated on first use (``interpret`` keys the interpreter's copy apart)."""
    import triton
    import triton.language as tl

    @triton.jit
    def key_grad_kernel(Q, K, V, DO, LSE, DELTA, HI, LO, G, H, L, REACH, sqb, sqh, sql, skb, skh, skl, svb, svh, svl,
                        sob, soh, sol, slb, slh, sdb, sdh, scale, inv_tau, D, BLOCK: tl.constexpr,
                        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        r = tl.program_id(0)  # key block
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        i = tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        dm = cols[None, :] < D
        keys = r * BLOCK + i  # [BN]
        km = keys < L
        Kb, Vb = K + b * skb + h * skh, V + b * svb + h * svh
        kt = tl.load(Kb + keys[:, None] * skl + cols[None, :], mask=km[:, None] & dm, other=0.0)  # [BN, BD]
        vt = tl.load(Vb + keys[:, None] * svl + cols[None, :], mask=km[:, None] & dm, other=0.0)  # [BN, BD]
        if UPCAST:  # Triton's interpreter multiplies 16-bit operands wrongly: fp32 there
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        Cb = (b * H + h) * L  # hi, lo are contiguous [B, H, L]
        kh = tl.load(HI + Cb + keys, mask=km, other=0.0)  # [BN]
        kl = tl.load(LO + Cb + keys, mask=km, other=0.0)
        acc = tl.full([BLOCK, BLOCK], 0.0, tl.float32)  # Σ_p dS over this key block's query blocks
        Qb, Ob = Q + b * sqb + h * sqh, DO + b * sob + h * soh
        Lb, Db = LSE + b * slb + h * slh, DELTA + b * sdb + h * sdh
        last = tl.minimum(L - 1, r * BLOCK + BLOCK - 1 + REACH - 1) // BLOCK  # the last query block that sees a key
        for p in range(r, last + 1):
            rows = p * BLOCK + i  # [BM]
            rm = rows < L
            q = tl.load(Qb + rows[:, None] * sql + cols[None, :], mask=rm[:, None] & dm, other=0.0)  # [BM, BD]
            do = tl.load(Ob + rows[:, None] * sol + cols[None, :], mask=rm[:, None] & dm, other=0.0)  # [BM, BD]
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            lse = tl.load(Lb + rows, mask=rm, other=0.0)  # [BM]
            dl = tl.load(Db + rows, mask=rm, other=0.0)
            qh = tl.load(HI + Cb + rows, mask=rm, other=0.0)
            ql = tl.load(LO + Cb + rows, mask=rm, other=0.0)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale  # [BM, BN] fp32
            logit = (s + ((kh[None, :] - qh[:, None]) + (kl[None, :] - ql[:, None]))) * inv_tau
            dist = rows[:, None] - keys[None, :]
            ok = (dist >= 0) & (dist < REACH) & rm[:, None] & km[None, :] & (lse[:, None] > float("-inf"))
            P = tl.exp(tl.where(ok, logit - lse[:, None], float("-inf")))  # 0 where masked, no overflow
            dp = tl.dot(do, tl.trans(vt), input_precision=PREC)  # [BM, BN] fp32
            acc += P * (dp - dl[:, None])
        out = G + (bh * tl.num_programs(0) + r).to(tl.int64) * (BLOCK * BLOCK)
        tl.store(out + i[:, None] * BLOCK + i[None, :], acc * inv_tau)

    return key_grad_kernel


"""The gradient of a learnable distance table, computed beside FlexAttention instead of inside it (docs/attention.md,
"Learnable tables on the flex path").

FlexAttention differentiates a captured tensor that its ``score_mod`` indexes with one fp32 atomic add per score
element (torch's ``zeros_and_scatter``): training T5 or KERPLE through it took 15-16x bias-free attention on an
H100 (docs/results/gpu-h100-2026-11-26.md). Here the flex kernel runs with the table *detached* (its dq, dk, dv are
exact for a constant bias) and returns its log-sum-exp; :func:`attach` hangs the table's own gradient on the output.
For the logits l = (q·k·scale + b[h, d]) · inv_tau, d = off + m - n, of a softmax with output O and incoming
gradient dO (the flash-attention backward, Dao 2023, Algorithm 2):

    P = exp(l - lse),   dP = dO · vᵀ,   dS = P ⊙ (dP - Δ),  Δ = rowsum(dO ⊙ O),   db[h, d] = inv_tau · Σ_{m-n=d-off} dS

Two of flash attention's seven matmuls per tile, and no atomics: a tile of BLOCK x BLOCK (queries x keys) whose
block indices differ by δ = p - r sees the distances off + δ·BLOCK + (i - j) only, the same for every such tile,
so one program per (δ, batch and head) sums its tiles elementwise in registers, stores one BLOCK x BLOCK tile
(no other program writes there), and the diagonals of those few tiles are summed afterwards in PyTorch (exact,
deterministic). On CUDA (and on the CPU under ``TRITON_INTERPRET=1``, how CI checks it) this is one Triton
kernel; elsewhere, or if Triton cannot compile it (one warning), the same tiles in PyTorch.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ..positional.turn import interpreting

BLOCK = 64  # queries and keys per tile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCRATCH_MB = 256  # above this the kernel's per-program tiles are summed over batch groups inside the kernel
_FAILED: list = []  # the kernel failed to compile once (warned); the PyTorch tiles from then on


def _triton():
    try:
        import triton
    except ImportError:
        return None
    return triton


def kernel_applies(q: torch.Tensor) -> bool:
    """The Triton kernel runs for these tensors (CUDA, or the CPU under Triton's interpreter)."""
    return (not _FAILED and q.dtype in _DTYPES and (q.is_cuda or (q.device.type == "cpu" and interpreting()))
            and _triton() is not None)


def attach(out: torch.Tensor, lse: torch.Tensor, q, k, v, table: torch.Tensor, *, off: int, scale: float,
           inv_tau: float, window: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """out [B, H, Lq, D] of attention with the table detached -> the same values, whose backward also gives
    ``table`` [H, n] (the live tensor the score_mod read detached) its gradient. lse [B, H, Lq] (natural log),
    q [B, H, Lq, D] at positions off.. relative to k, v [B, H, Lk, D]; distances d >= n, or >= window, are masked."""
    meta = (int(off), float(scale), float(inv_tau), None if window is None else int(window), int(block))
    return _TableGrad.apply(out, table, lse.detach(), q.detach(), k.detach(), v.detach(), meta)


class _TableGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, table, lse, q, k, v, meta):
        ctx.save_for_backward(out.detach(), lse, q, k, v, table.detach())
        ctx.meta = meta
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        out, lse, q, k, v, table = ctx.saved_tensors
        dtab = table_gradient(q, k, v, out, lse, dout, table, *ctx.meta) if ctx.needs_input_grad[1] else None
        return dout, dtab, None, None, None, None, None


def table_gradient(q, k, v, out, lse, dout, table, off: int, scale: float, inv_tau: float, window: int | None,
                   block: int = BLOCK) -> torch.Tensor:
    """d loss / d table [H, n] (see the module doc), in the table's dtype."""
    B, H, Lq, _ = q.shape
    Lk, n = k.shape[2], table.shape[-1]
    reach = min(n, window) if window is not None else n
    nq, nk = -(-Lq // block), -(-Lk // block)
    dmin = max(-(nk - 1), -((off + block - 1) // block))  # lowest block offset with a distance >= 0
    dmax = min(nq - 1, (reach - 1 - off + block - 1) // block)  # highest with a distance < reach
    if dmax < dmin or reach <= 0:
        return torch.zeros_like(table)
    lse, delta = row_stats(q, out, lse, dout)
    tab = table.detach().to(delta.dtype).expand(H, n).contiguous()  # [H, n]
    tiles = kernel_or_torch(q, _launch, _tiles_torch, q, k, v, dout, lse, delta, tab, off, scale, inv_tau, reach, dmin,
                            dmax, block)  # [H, nδ, block, block]
    return _diagonals(tiles, off, dmin, n, block).to(table.dtype)


def row_stats(q, out, lse, dout) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, Δ = rowsum(dO ⊙ O)) [B, H, Lq] in the working precision (fp64 for fp64 inputs, else fp32): what the
    flash-attention backward needs per query row besides q, k, v and dO."""
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32
    return lse.to(wp), (dout.to(wp) * out.to(wp)).sum(-1)


def kernel_or_torch(q, launch, torch_form, *args):
    """``launch(*args)`` where the Triton kernel runs for ``q`` (:func:`kernel_applies`), else ``torch_form(*args)``;
    a kernel that fails to compile (Triton's own error) warns once (:func:`failed`) and the PyTorch form answers."""
    if kernel_applies(q):
        try:
            return launch(*args)
        except Exception as err:  # noqa: BLE001 -- only Triton's own compile / resource errors are ours
            if not _triton_error(err):
                raise
            failed(err)
    return torch_form(*args)


def dot_precision(q: torch.Tensor) -> str:
    """``tl.dot``'s input precision for operands of q's dtype: "ieee" for fp32 (Triton's default on a GPU is TF32, a
    10-bit mantissa: the fp32 GPU tests saw the tables' gradients 1e-3 to 1e-2 off the plain path on an H100),
    else Triton's default "tf32", which 16-bit operands ignore."""
    return "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"


def failed(err: Exception) -> None:
    """A gradient kernel (this module's or :mod:`.flex_content`'s) did not compile: one warning, and the PyTorch
    tiles for every later call of either (same values, slower)."""
    _FAILED.append(err)
    warnings.warn(f"a gradient kernel beside FlexAttention did not compile ({type(err).__name__}); learnable tables' "
                  "and content positions' gradients on the flex path use PyTorch tiles from now on (same values, "
                  "slower)", RuntimeWarning, stacklevel=3)


def _triton_error(err: Exception) -> bool:
    triton = _triton()
    kinds = tuple(getattr(mod, name) for mod, name in (
        (getattr(getattr(triton, "compiler", None), "errors", None), "CompilationError"),
        (getattr(getattr(triton, "runtime", None), "errors", None), "OutOfResources")) if mod and hasattr(mod, name))
    return isinstance(err, kinds)


def _diagonals(tiles: torch.Tensor, off: int, dmin: int, n: int, block: int) -> torch.Tensor:
    """tiles [H, nδ, BLOCK, BLOCK] (block offsets δ = dmin..) -> [H, n]: entry (i, j) of tile δ is distance
    off + δ·BLOCK + i - j."""
    H, nd = tiles.shape[:2]
    skew = F.pad(tiles.flip(-1), (0, block)).flatten(-2)[..., :block * (2 * block - 1)]  # [H, nδ, B(2B-1)]
    diag = skew.unflatten(-1, (block, 2 * block - 1)).sum(-2)  # [H, nδ, 2B-1]: u = i - j + B - 1
    per = torch.zeros(H, nd + 1, block, dtype=diag.dtype, device=diag.device)  # block δ' covers off + δ'·B + t
    per[:, 1:] += diag[..., block - 1:]  # i >= j: t = i - j in block δ
    per[:, :-1, 1:] += diag[..., :block - 1]  # i < j: block δ - 1, t = B + i - j
    flat = per.flatten(1)  # [H, (nδ + 1)·B], entry x at distance first + x
    first = off + (dmin - 1) * block
    lo = max(0, -first)  # entries at negative distances (masked, zero) dropped
    start = first + lo
    flat = flat[:, lo:lo + max(0, n - start)]
    out = torch.zeros(H, n, dtype=flat.dtype, device=flat.device)
    out[:, start:start + flat.shape[1]] = flat
    return out


def _tiles_torch(q, k, v, dout, lse, delta, tab, off, scale, inv_tau, reach, dmin, dmax, block):
    """The kernel's tiles in PyTorch: for each block offset δ, every (query block p, key block p - δ) at once."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    nq, nk = -(-Lq // block), -(-Lk // block)

    def blocks(x, L, nb):  # [B, H, L, ...] -> [B, H, nb, block, ...] zero-padded
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, nb * block - L))
        return x.unflatten(2, (nb, block))
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb, ob = blocks(q.to(wp), Lq, nq), blocks(dout.to(wp), Lq, nq)  # [B, H, nq, blk, D]
    kb, vb = blocks(k.to(wp), Lk, nk), blocks(v.to(wp), Lk, nk)  # [B, H, nk, blk, D]
    lb, db = blocks(lse, Lq, nq), blocks(delta, Lq, nq)  # [B, H, nq, blk]
    qok = blocks(torch.ones(1, 1, Lq, dtype=torch.bool, device=q.device), Lq, nq)  # [1, 1, nq, blk]
    kok = blocks(torch.ones(1, 1, Lk, dtype=torch.bool, device=q.device), Lk, nk)
    i = torch.arange(block, device=q.device)
    out = []
    for d in range(dmin, dmax + 1):
        p0, p1 = max(0, d), min(nq, nk + d)
        dist = off + d * block + i[:, None] - i[None]  # [blk, blk]
        vis = (dist >= 0) & (dist < reach)
        bias = tab[:, dist.clamp(0, tab.shape[1] - 1)]  # [H, blk, blk]
        if p1 <= p0:
            out.append(torch.zeros(H, block, block, dtype=wp, device=q.device))
            continue
        s = qb[:, :, p0:p1] @ kb[:, :, p0 - d:p1 - d].transpose(-1, -2) * scale  # [B, H, np, blk, blk]
        logit = (s + bias[None, :, None]) * inv_tau
        ok = vis & qok[:, :, p0:p1, :, None] & kok[:, :, p0 - d:p1 - d, None, :] & (lb[:, :, p0:p1, :, None] > -torch.inf)
        P = torch.where(ok, torch.exp(logit - lb[:, :, p0:p1, :, None]), 0.0)
        dp = ob[:, :, p0:p1] @ vb[:, :, p0 - d:p1 - d].transpose(-1, -2)  # [B, H, np, blk, blk]
        out.append((P * (dp - db[:, :, p0:p1, :, None])).sum((0, 2)) * inv_tau)  # [H, blk, blk]
    return torch.stack(out, 1)  # [H, nδ, blk, blk]


def _launch(q, k, v, dout, lse, delta, tab, off, scale, inv_tau, reach, dmin, dmax, block):
    """The Triton kernel's tiles [H, nδ, BLOCK, BLOCK], summed over batch."""
    triton = _triton()
    B, H, Lq, D = q.shape
    Lk, nd = k.shape[2], dmax - dmin + 1
    groups = B  # one program per (δ, batch, head); fewer when the scratch would pass SCRATCH_MB
    while groups > 1 and groups * H * nd * block * block * 4 > SCRATCH_MB * 2**20:
        groups = -(-groups // 2)
    per = -(-B // groups)
    tiles = torch.empty(groups, H, nd, block, block, dtype=torch.float32, device=q.device)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    x = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
    grid = (nd, groups * H)
    _kernel(interpreting() and not q.is_cuda)[grid](
        *x, dout, lse, delta, tab, tiles, B, H, Lq, Lk, tab.shape[1], off, reach, dmin, -(-Lq // block),
        -(-Lk // block), per, *x[0].stride()[:3], *x[1].stride()[:3], *x[2].stride()[:3], *dout.stride()[:3],
        *lse.stride()[:2], *delta.stride()[:2], scale, inv_tau, D,
        BLOCK=block, BLOCK_D=max(16, triton.next_power_of_2(D)), UPCAST=not q.is_cuda, PREC=dot_precision(q),
        num_warps=4)
    return tiles.sum(0)


@functools.cache
def _kernel(interpret: bool):
    """The Triton kernel, decorated on first use (``interpret`` keys the interpreter's copy apart)."""
    import triton
    import triton.language as tl

    @triton.jit
    def table_grad_kernel(Q, K, V, DO, LSE, DELTA, T, G, B, H, Lq, Lk, N, OFF, REACH, DMIN, NQB, NKB, PER,
                          sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, slb, slh, sdb, sdh,
                          scale, inv_tau, D, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                          UPCAST: tl.constexpr, PREC: tl.constexpr):
        j = tl.program_id(0)  # block offset δ = DMIN + j
        gh = tl.program_id(1)
        g, h = gh // H, gh % H  # batch group, head
        dlt = DMIN + j
        i = tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK_D)
        dist = OFF + dlt * BLOCK + i[:, None] - i[None, :]  # [BM, BN] distance of each tile entry
        vis = (dist >= 0) & (dist < REACH)
        bias = tl.load(T + h * N + tl.minimum(tl.maximum(dist, 0), N - 1), mask=vis, other=0.0)  # [BM, BN]
        acc = tl.full([BLOCK, BLOCK], 0.0, tl.float32)  # (tl.zeros is a jit function the interpreter may not patch)
        p_lo = tl.maximum(dlt, 0)
        p_hi = tl.minimum(NQB, NKB + dlt)
        dm = cols[None, :] < D
        b0 = g * PER
        Qb, Kb, Vb, Ob = Q + b0 * sqb + h * sqh, K + b0 * skb + h * skh, V + b0 * svb + h * svh, DO + b0 * sob + h * soh
        Lb, Db = LSE + b0 * slb + h * slh, DELTA + b0 * sdb + h * sdh  # advanced one batch entry per pass
        for _ in range(b0, tl.minimum(B, b0 + PER)):
            for p in range(p_lo, p_hi):
                rows = p * BLOCK + i  # [BM] query rows
                keys = (p - dlt) * BLOCK + i  # [BN] key rows
                rm, km = rows < Lq, keys < Lk
                q = tl.load(Qb + rows[:, None] * sql + cols[None, :], mask=rm[:, None] & dm,
                            other=0.0)  # [BM, BD]
                do = tl.load(Ob + rows[:, None] * sol + cols[None, :], mask=rm[:, None] & dm,
                             other=0.0)  # [BM, BD]
                kt = tl.load(Kb + keys[:, None] * skl + cols[None, :], mask=km[:, None] & dm,
                             other=0.0)  # [BN, BD]
                vt = tl.load(Vb + keys[:, None] * svl + cols[None, :], mask=km[:, None] & dm,
                             other=0.0)  # [BN, BD]
                lse = tl.load(Lb + rows, mask=rm, other=0.0)  # [BM]
                dl = tl.load(Db + rows, mask=rm, other=0.0)  # [BM]
                if UPCAST:  # Triton's interpreter multiplies 16-bit operands wrongly: fp32 there
                    q, kt, do, vt = q.to(tl.float32), kt.to(tl.float32), do.to(tl.float32), vt.to(tl.float32)
                s = tl.dot(q, tl.trans(kt), input_precision=PREC) * scale  # [BM, BN], fp32
                logit = (s + bias) * inv_tau
                ok = vis & rm[:, None] & km[None, :] & (lse[:, None] > float("-inf"))
                P = tl.exp(tl.where(ok, logit - lse[:, None], float("-inf")))  # 0 where masked, no overflow
                dp = tl.dot(do, tl.trans(vt), input_precision=PREC)  # [BM, BN], fp32
                acc += P * (dp - dl[:, None])
            Qb, Kb, Vb, Ob, Lb, Db = Qb + sqb, Kb + skb, Vb + svb, Ob + sob, Lb + slb, Db + sdb
        out = G + (g * H + h).to(tl.int64) * (tl.num_programs(0) * BLOCK * BLOCK) + j * BLOCK * BLOCK
        tl.store(out + i[:, None] * BLOCK + i[None, :], acc * inv_tau)

    return table_grad_kernel

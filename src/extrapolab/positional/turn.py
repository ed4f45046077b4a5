"""The rotation every rotary scheme applies, y = x * C + swap(x) * S (RoFormer eq. 34 written per pair, see
:mod:`.rotary`; xPos's rows carry its decay in C and S, Sun et al. 2023 §3.2), eager or as one fused kernel.

Eager, the rotation is a flip copy, a multiply and an add forward and about as many kernels backward, each
reading and writing all of q or k: on one H100 (bf16, GPT-2 small, 16 x 512; docs/results/gpu-h100-2026-11-26.md)
rotary's train step took 1.23x NoPE's and its attention alone 2.2x, for arithmetic that is nothing beside
the attention. On CUDA the rotation is one Triton kernel instead (as flash-attn's ``apply_rotary`` and
Liger's RoPE kernel do): it reads x, C and S once, computes in fp32, writes y once; backward is the
same kernel with S read at the pair's other member, dx_i = g_i C_i + g_(i^1) S_(i^1) (the transpose of
the rotation, exact for any C and S, xPos's decayed rows included). C and S never take a gradient here:
the tables are buffers; a table that requires one runs eagerly.

The kernel runs where Triton does: CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1`` (Triton's
interpreter: how CI checks the kernel against the eager formula without a GPU); without Triton (the CPU
install has it through the ``kernels`` extra; CUDA builds of torch bring their own) every rotation is
eager. ``ENABLED = False`` keeps every rotation eager (an A/B of the two). Triton is imported on first
use, never on import of this module.
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = True  # the fused kernel where it runs (CUDA, or Triton's interpreter on the CPU); False: eager
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def eager(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """x [..., L, d] * C [L, d] + swap(x) * S [L, d], swap exchanging the members of each pair."""
    swapped = x.unflatten(-1, (x.shape[-1] // 2, 2)).flip(-1).flatten(-2)  # [..., L, d/2, 2] -> [..., L, d]
    out = x * C  # [..., L, d]; mul saves x and C, not its output, so adding in place is safe
    return out.addcmul_(swapped, S)


def interpreting() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # the CPU build without the kernels extra: eager everywhere
        return None
    return triton.__version__


def fused_applies(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> bool:
    """Whether :func:`turn` takes the kernel for these tensors (else the eager formula)."""
    if not ENABLED or not (x.is_cuda or (x.device.type == "cpu" and interpreting())):
        return False
    if x.dtype not in _DTYPES or C.dtype != x.dtype or S.dtype != x.dtype or x.dim() > 4 or x.shape[-1] % 2:
        return False
    if C.shape != x.shape[-2:] or S.shape != x.shape[-2:] or C.device != x.device or S.device != x.device:
        return False
    if C.requires_grad or S.requires_grad or x.numel() == 0 or torch.compiler.is_compiling():
        return False  # compiled graphs fuse the eager formula themselves
    return _triton_version() is not None


def without_kernel(fn):
    """``fn`` with every rotation eager during its calls (an A/B of the kernel beside the eager formula: the bench's
    ``SCHEME+eager`` rows wrap a model's forward in it; the backward follows what the forward ran)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        global ENABLED
        was, ENABLED = ENABLED, False
        try:
            return fn(*args, **kwargs)
        finally:
            ENABLED = was
    return run


def turn(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """x * C + swap(x) * S for x [..., L, d] and C, S [L, d]: one fused kernel where it runs, else eager."""
    if fused_applies(x, C, S):
        return _Turns.apply(x, C, S)[0]
    return eager(x, C, S)


def turn_pair(q: torch.Tensor, k: torch.Tensor, Cq, Sq, Ck, Sk) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`turn` of q by (Cq, Sq) and of k by (Ck, Sk): both in one kernel launch forward and one backward where
    the kernel runs for both (a layer's rotation: each launch costs the host more than the GPU's work here)."""
    if q.dtype == k.dtype and q.shape[-1] == k.shape[-1] and fused_applies(q, Cq, Sq) and fused_applies(k, Ck, Sk):
        return _Turns.apply(q, Cq, Sq, k, Ck, Sk)
    return turn(q, Cq, Sq), turn(k, Ck, Sk)


class _Turns(torch.autograd.Function):
    """One or two operands, flat (x, C, S[, x, C, S]): one launch forward, one backward for the x that need it."""

    @staticmethod
    def forward(ctx, *flat):
        ops = [flat[i:i + 3] for i in range(0, len(flat), 3)]
        ctx.save_for_backward(*(t for _, C, S in ops for t in (C, S)))
        return tuple(launch(ops, transpose=False))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        tables = ctx.saved_tensors  # C, S of each operand
        want = [g is not None and ctx.needs_input_grad[3 * i] for i, g in enumerate(grads)]
        todo = [(g, tables[2 * i], tables[2 * i + 1]) for i, g in enumerate(grads) if want[i]]
        out = iter(launch(todo, transpose=True) if todo else ())
        return tuple(t for w in want for t in (next(out) if w else None, None, None))


@functools.cache
def _kernel(interpret: bool):
    """The Triton kernel, decorated on first use (``interpret`` keys the interpreter's copy apart)."""
    import triton
    import triton.language as tl

    @triton.jit
    def turn_kernel(X0, C0, S0, Y0, NBH0, H0, L0, sxb0, sxh0, sxl0, syb0, syh0, syl0, scl0, ssl0,
                    X1, C1, S1, Y1, NBH1, H1, L1, sxb1, sxh1, sxl1, syb1, syh1, syl1, scl1, ssl1, D,
                    TRANSPOSE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        first = tl.program_id(2) == 0  # the grid's third axis picks the operand: q (0) or k (1)
        X, C, S = tl.where(first, X0, X1), tl.where(first, C0, C1), tl.where(first, S0, S1)  # operand's pointers
        Y = tl.where(first, Y0, Y1)
        H = tl.where(first, H0, H1)
        bh = tl.program_id(0)
        L = tl.where(bh < tl.where(first, NBH0, NBH1), tl.where(first, L0, L1), 0)  # no rows past this operand's B·H
        sxb, sxh, sxl = tl.where(first, sxb0, sxb1), tl.where(first, sxh0, sxh1), tl.where(first, sxl0, sxl1)
        syb, syh, syl = tl.where(first, syb0, syb1), tl.where(first, syh0, syh1), tl.where(first, syl0, syl1)
        scl, ssl = tl.where(first, scl0, scl1), tl.where(first, ssl0, ssl1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
        rows = (tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)  # [BL] positions
        cols = tl.arange(0, BLOCK_D)  # [BD] head dimensions
        pair = cols ^ 1  # the other member of each pair
        mask = (rows[:, None] < L) & (cols[None, :] < D)  # [BL, BD]
        xrow = X + b * sxb + h * sxh + rows[:, None] * sxl  # [BL, 1] pointers
        x = tl.load(xrow + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BL, BD]
        xs = tl.load(xrow + pair[None, :], mask=mask, other=0.0).to(tl.float32)  # [BL, BD] swap(x)
        c = tl.load(C + rows[:, None] * scl + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:  # backward: dx_i = g_i C_i + g_(i^1) S_(i^1)
            s = tl.load(S + rows[:, None] * ssl + pair[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            s = tl.load(S + rows[:, None] * ssl + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * c + xs * s  # [BL, BD] in fp32, one rounding on the store
        tl.store(Y + b * syb + h * syh + rows[:, None] * syl + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    return turn_kernel


def _operand(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(y, the kernel's arguments for one operand): y [..., L, d] in x's layout where x is dense."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    C = C if C.stride(-1) == 1 else C.contiguous()
    S = S if S.stride(-1) == 1 else S.contiguous()
    y = torch.empty_like(x)  # x's strides when x is dense (a transposed q stays transposed), else contiguous
    x4, y4 = x, y
    while x4.dim() < 4:
        x4, y4 = x4.unsqueeze(0), y4.unsqueeze(0)  # [B, H, L, d]
    B, H, L, _ = x4.shape
    return y, [x4, C, S, y4, B * H, H, L, x4.stride(0), x4.stride(1), x4.stride(2), y4.stride(0), y4.stride(1),
               y4.stride(2), C.stride(0), S.stride(0)]


def launch(ops: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], transpose: bool) -> list[torch.Tensor]:
    """One kernel launch for one or two operands (x [..., L, d], C [L, d], S [L, d]) of one head size: their y."""
    import triton

    outs, args = zip(*(_operand(*op) for op in ops))
    D = ops[0][0].shape[-1]
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_L = max(1, min(triton.next_power_of_2(max(a[6] for a in args)), 4096 // BLOCK_D))
    grid = (max(a[4] for a in args), triton.cdiv(max(a[6] for a in args), BLOCK_L), len(args))
    second = args[1] if len(args) > 1 else args[0]  # one operand: the second set is never read (grid z = 1)
    _kernel(interpreting() and not ops[0][0].is_cuda)[grid](
        *args[0], *second, D, TRANSPOSE=transpose, BLOCK_L=BLOCK_L, BLOCK_D=BLOCK_D, num_warps=4)
    return list(outs)

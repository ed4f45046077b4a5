"""FlexAttention tile choices per device, dtype, head size and score_mod (docs/attention.md, "Tiles").

Without max-autotune, torch compiles FlexAttention with ONE config per pass (its heuristic default for the
device, dtype and head size; ``torch/_inductor/template_heuristics/triton.py``) and, where that config does
not fit the device's shared memory, fails with ``InductorError: ... No valid triton configs. OutOfMemoryError:
out of resource``: there is no second candidate. torch's H100 default for 16-bit inputs at head size 64 is a
128 x 128 tile with 3 stages: 112 KiB of Q/K/V staging, and a ``score_mod`` that gathers from a captured
tensor indexed by (query, key) -- a distance table ``b[h, q_idx - kv_idx]`` -- makes Triton's pipeliner stage
that [BLOCK_M, BLOCK_N] gather as well (fp32, one copy per extra stage): 240 KiB, over the H100's 227 KiB
(measured on an H100 with torch 2.11: "Required: 247808 Hardware limit: 232448"; fp32 inputs, whose default
tile is 128 x 32, compiled).

So :func:`plan` picks the tiles itself where the score_mod gathers: the largest forward rung of
:data:`LADDER` whose shared memory (:func:`fwd_shared_bytes`) fits the device's opt-in limit, with its
backward, passed as ``fwd_``/``bwd_``-prefixed ``kernel_options`` (each pass its own); then one smaller
rung, which :class:`.flex.Compiled` tries once when the first fails "out of resource". Where nothing is
gathered (or inputs are fp32) the first choice is torch's own default (``None``). The rungs are torch's own
configs: (128, 64, 3, 4) is its A100 default and first autotune candidate, (64, 64, 64, 64, 3, 4) its H100
backward for head sizes below 64 (pytorch/pytorch#133254, #138493: smaller blocks for score_mods that load).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: shared memory left unclaimed by the estimate (Triton's own barriers, scalars, the mask's block indices)
MARGIN = 8 * 1024


@dataclass(frozen=True)
class Rung:
    """One tile choice: forward (BLOCK_M, BLOCK_N, num_stages, num_warps) and backward
    (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps)."""

    fwd: tuple[int, int, int, int]
    bwd: tuple[int, int, int, int, int, int]

    def options(self) -> dict:
        """``kernel_options`` for flex_attention, each pass its own (``fwd_``/``bwd_`` prefixes)."""
        m, n, s, w = self.fwd
        m1, n1, m2, n2, s2, w2 = self.bwd
        return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": s, "fwd_num_warps": w,
                "bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
                "bwd_num_stages": s2, "bwd_num_warps": w2}


#: largest first; each backward keeps torch's constraints BLOCK_N1 % BLOCK_M1 == 0, BLOCK_M2 % BLOCK_N2 == 0
LADDER = (
    Rung((128, 64, 3, 4), (64, 64, 64, 64, 3, 4)),
    Rung((64, 64, 3, 4), (32, 64, 64, 32, 3, 4)),
    Rung((64, 64, 2, 4), (32, 32, 32, 32, 2, 4)),
    Rung((32, 32, 2, 4), (16, 16, 16, 16, 1, 4)),
)


@dataclass(frozen=True)
class Device:
    """What the choice depends on: compute capability and shared memory per block (opt-in), bytes."""

    capability: tuple[int, int]
    shared_bytes: int


#: opt-in shared memory per block by compute capability, where the driver does not report it
_SHARED_BY_CAPABILITY = {(9, 0): 232448, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (10, 0): 232448}


def device_info(device: torch.device) -> Device | None:
    """The CUDA device's capability and opt-in shared memory per block; None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    cap = (int(props.major), int(props.minor))
    shared = getattr(props, "shared_memory_per_block_optin", 0) or _SHARED_BY_CAPABILITY.get(cap, 101376)
    return Device(cap, int(shared))


def fwd_shared_bytes(block_m: int, block_n: int, stages: int, head_dim: int, elem: int, gather: bool) -> int:
    """Shared memory of one forward program: the Q tile, K and V tiles per stage, and (with a gather from a
    captured [M, N]-indexed tensor) one fp32 [BLOCK_M, BLOCK_N] copy per extra stage. Inferred from Triton's
    pipeliner (it stages every load feeding a dot) and checked against the H100 figures in the module doc."""
    staged = elem * head_dim * (block_m + 2 * block_n * stages)
    return staged + ((stages - 1) * block_m * block_n * 4 if gather else 0)


#: the first rung of a heavy score_mod (FIRE's rows beyond L: a W-unit MLP unrolled per score element, ~100
#: registers' worth of live values per element): FIRE's 32,768-token forward on an H100 took 15.4x NoPE's with
#: 64 x 64 tiles and 2 stages (2026-11-26) and 69.0x with the (128, 64, 3, 4) rung (2026-11-27; same score_mod,
#: no gradient); on an H200 16.2x on this rung (2026-11-27, docs/results/gpu-h200-2026-11-27.md): a bigger tile
#: holds more elements per thread and spills. Its forward only: with a gradient the backward keeps torch's own
#: tiles (:func:`forward_only`), since this rung's 32 x 32 backward did not compile for FIRE's rows on that H200
#: (Triton ``CompilationError`` in the dq loop, fp32) where torch's default had (H100, 2026-11-27)
HEAVY = LADDER[2]


def forward_only(options: dict) -> dict:
    """``options`` without its backward keys: the backward then takes torch's own tiles."""
    return {k: v for k, v in options.items() if not k.startswith("bwd_")}


def plan(device: Device | None, dtype: torch.dtype, head_dim: int, gather: bool,
         heavy: bool = False, grad: bool = False) -> list[dict | None]:
    """The kernel options to try, in order: [first, smaller rung]. ``None`` = torch's own default config.

    With a gather and 16-bit inputs the first is the largest rung that fits ``device``'s shared memory;
    otherwise torch's default, whose shapes fit wherever nothing is gathered (and fp32's default tiles are
    small). A ``heavy`` score_mod (per-element work beyond a gather: FIRE's MLP) starts at :data:`HEAVY` in any
    dtype; with a gradient (``grad``) at its forward with torch's backward, then at the first choice of a score_mod
    that is not heavy (what FIRE's rows trained on before :data:`HEAVY`). Off CUDA (eager FlexAttention) there is
    nothing to choose: [None]."""
    if device is None:
        return [None]
    if heavy:
        if grad:
            return [forward_only(HEAVY.options()), plan(device, dtype, head_dim, gather)[0]]
        return [HEAVY.options(), LADDER[-1].options()]
    elem = torch.empty((), dtype=dtype).element_size()
    fits = [r for r in LADDER
            if fwd_shared_bytes(*r.fwd[:3], head_dim, elem, gather) <= device.shared_bytes - MARGIN]
    fits = fits or [LADDER[-1]]
    if gather and elem < 4:
        first = fits[0]
        rest = fits[1:2] or ([LADDER[-1]] if first != LADDER[-1] else [])
        return [first.options()] + [r.options() for r in rest]
    return [None, fits[min(1, len(fits) - 1)].options()]


def describe(options: dict | None) -> str:
    """'fwd 128x64 s3 w4 / bwd 64x64x64x64 s3 w4', or "torch's default" for None (or for a missing pass)."""
    if options is None:
        return "torch's default"
    f = [options[f"fwd_{k}"] for k in ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps")]
    if "bwd_BLOCK_M1" not in options:
        return f"fwd {f[0]}x{f[1]} s{f[2]} w{f[3]} / bwd torch's default"
    b = [options[f"bwd_{k}"] for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")]
    return f"fwd {f[0]}x{f[1]} s{f[2]} w{f[3]} / bwd {b[0]}x{b[1]}x{b[2]}x{b[3]} s{b[4]} w{b[5]}"


def _chain(err: BaseException | None):
    """The exception and its causes (inductor's ``inner_exception``, ``__cause__``, ``__context__``), 8 at most."""
    for _ in range(8):
        if err is None:
            return
        yield err
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__


def out_of_resource(err: BaseException) -> bool:
    """Is this the compile failure a smaller tile can fix (Triton's OutOfResources, reported by inductor as
    "No valid triton configs ... out of resource")? Looks through the exception's causes."""
    return any("out of resource" in f"{e}" or "No valid triton configs" in f"{e}"
               or type(e).__name__ == "OutOfResources" for e in _chain(err))


def compile_failure(err: BaseException) -> str | None:
    """Why a FlexAttention compile failed where other tiles may compile: "out of resource" (shared memory), or
    "Triton compile error" (Triton rejected the generated kernel for these tiles: on an H200 the heavy rung's
    32 x 32 backward for FIRE's rows, 2026-11-27); None for anything else (a bug, which is raised)."""
    if out_of_resource(err):
        return "out of resource"
    for e in _chain(err):
        if type(e).__name__ == "CompilationError" and type(e).__module__.startswith("triton"):
            return "Triton compile error"
        if type(e).__name__ == "InductorError" and str(e).startswith("CompilationError"):
            return "Triton compile error"
    return None

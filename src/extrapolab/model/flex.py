"""FlexAttention path of :func:`.attention.attend` for relative biases on CUDA (docs/attention.md).

FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels"; ``torch.nn.attention.flex_attention``) compiles one fused kernel from a
``score_mod`` and a block-sparse mask. Here, for queries at positions a + i and keys at c + j
(distance d = a - c + i - j), with the scheme's distance tables b, w [H, n] (:class:`.tables.DistanceBias`):

    score_mod: s -> (s · w[h, d] + b[h, d]) / tau      s = q·k / sqrt(d_head); w only for KERPLE wht
    mask:      d >= 0, d < n and some head's b[·, d] finite (and d < window for windowed@w)

A scheme whose rows are not one distance table (FIRE beyond L: each query its own normaliser) writes its
own term instead (``scheme.flex_bias``, :func:`flex_rows_path`): score_mod s -> (s + b_h(q_idx, kv_idx)) / tau,
b evaluated inside the kernel from the tensors it captures, under the causal (or window) block mask.

The mask covers causal attention, the windowed scheme, evaluation-time windows, T5/KERPLE/ALiBi/
Sandwich/Qin (all distances), and each sliding-dilated level's dilation (RegularGPT eq. 6.1:
finite only at d = j·C^l), from one rule: the table's finite pattern. The :class:`BlockMask` is
built from prefix sums of that pattern per 128 x 128 block (O((L/128)^2) integers, no L x L
tensor): blocks where every distance is visible are "full" (no mask_mod call), blocks with none
are skipped. It is cached per (shape, offset, window, layer) on the scheme. Tables that need a
gradient (KERPLE, T5, sliding-dilated r) are captured tensors of the ``score_mod``; FlexAttention
returns their gradient on CUDA. Offsets and 1/tau are captured 0-d tensors, so new values do not
recompile.

The compiled kernel (:class:`Compiled`, one per process) is ``torch.compile(flex_attention,
dynamic=False, fullgraph=True)``. Dynamo keeps one graph per guard set (batch, lengths, dtype,
grad / no_grad / inference mode, learnable or fixed table) and past its ``recompile_limit`` (8 by
default) would run flex_attention *eagerly*, materialising the full [B, H, Lq, Lk] scores, with
one log line. Here each call raises the limit to :data:`RECOMPILE_LIMIT` for itself only (a scoped
``torch._dynamo.config.patch``) and, with ``fullgraph=True``, hitting it raises instead of running
eagerly: :func:`.attention.attend` then runs that shape on the Toeplitz path and warns once, naming
the shape. q, k, v are made contiguous first, so strides never split the cache.

No host-device synchronisation per layer: offsets and 1/tau are filled on the device
(``torch.full``, never ``torch.tensor`` from host data), and a learnable table's block mask is built
on the device once per forward (:meth:`.tables.DistanceBias.memo`, shared by the layers) instead of
being keyed on a count read back from the device.

On CPU, torch 2.13 runs FlexAttention only without input gradients (and unfused in eager mode):
:func:`.attention.attend` never picks it there automatically; the tests run the CPU forward against
the reference path for every registered scheme, and drive the compiled kernel past its limit on the
CPU (inductor compiles FlexAttention's forward there).
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from . import flex_tiles, table_grad
from .reference import divide_finite
from .tables import DistanceBias

BLOCK = 128  # FlexAttention's default sparse block size (queries x keys)
#: compiled graphs the kernel may keep per process (torch's own default is 8): a GPU sweep needs
#: ~12 per bias scheme (train, validation, each evaluation length and batch, bf16 and fp32)
RECOMPILE_LIMIT = 64
#: the automatic rule takes FlexAttention only for sequences at least this long (docs/attention.md): below
#: it the Toeplitz path (the distance table's dense mask, memory-efficient SDPA) is faster on an H100 -- at
#: 16 x 512 Qin's train step took 1.11x NoPE's there against flex's 1.54x, its forward 1.50x against 1.87x
#: (docs/results/gpu-h100-2026-11-27.md; no length between 512 and 32,768 measured yet) -- and a compile per new length
#: costs more than it saves; smoke runs (L = 32) and the regular-language tasks (a random length per step)
#: then never compile
MIN_LENGTH = 1024
#: learnable distance tables on this path train with their gradient from :mod:`.table_grad` (the flex kernel reads
#: them detached: no atomics); False: FlexAttention's own gradient, one fp32 atomic add per score element (T5 2.98x
#: NoPE's train step on an H100, docs/results/gpu-h100-2026-11-26.md)
TABLE_GRAD = True
#: the automatic rule trains learnable tables here too (else on the Toeplitz path's dense mask). Off, as measured on
#: an H100 (GPT-2 small, bf16, 16 x 512, docs/results/gpu-h100-2026-11-27.md): train step x NoPE's on this path
#: with table_grad's kernel against the dense mask's: T5 2.08 vs 1.29, KERPLE-log 2.05 vs 1.22, FIRE 4.79 vs 2.28
AUTO_TABLE_GRAD = False
#: the automatic rule runs positions from content (FoX) on FlexAttention too, their gradient from
#: :mod:`.flex_content`'s kernel (else the folded path: flash SDPA with extra head dimensions). Off, as measured on
#: that H100: FoX's train step 2.02x NoPE's here against 1.81x on the folded path
AUTO_CONTENT = False
#: a scheme that declares a closed form of its bias (``scheme.closed_form``: KERPLE, Qin) has FlexAttention compute
#: it per score (a log1p, a power) instead of gathering it from the [H, n] table: no [M, N] gather, so torch's
#: default tiles apply (docs/attention.md, "Forms of the score_mod"). NOT YET MEASURED on a GPU (KERPLE-log's and
#: Qin's 32,768-token forwards took 3.89x and 3.82x NoPE's with the gather on an H200); False: the gather
CLOSED_FORM = True
MIN_TORCH = (2, 6)  # BlockMask.from_kv_blocks(seq_lengths=...) and the CPU template used here
_COMPILED: list = []  # the compiled kernel, made on first CUDA use


class Unavailable(RuntimeError):
    """The compiled kernel cannot run this call; ``reason`` says why in a few words (for the one-line warning)."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(reason)
        self.reason, self.hint = reason, hint


class RecompileLimit(Unavailable):
    """The compiled kernel holds its ``limit`` graphs and this call needs a new one."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"FlexAttention holds its {limit} compiled graphs",
                         "raise extrapolab.model.flex.RECOMPILE_LIMIT to compile more")
        self.limit = limit


class OutOfResource(Unavailable):
    """Every tile rung of :func:`.flex_tiles.plan` failed to compile: "out of resource" (shared memory), or
    Triton rejected the generated kernel (:func:`.flex_tiles.compile_failure`)."""

    def __init__(self, tried: list, why: str = "out of resource") -> None:
        what = ("cannot compile it within the GPU's shared memory" if why == "out of resource" else
                f"did not compile it ({why})")
        super().__init__(f"FlexAttention {what} (tiles tried: " + "; ".join(flex_tiles.describe(o) for o in tried)
                         + ")", "see docs/attention.md, Tiles")


def available() -> bool:
    """FlexAttention importable and torch >= 2.6."""
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def supported(device: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Can the compiled kernel run on this device, head size and dtype?"""
    return (device == "cuda" and available() and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def pays(device: str, Lq: int, Lk: int, head_dim: int, dtype: torch.dtype) -> bool:
    """The automatic rule: a whole sequence (Lq = Lk) of at least :data:`MIN_LENGTH` tokens that
    :func:`supported` accepts, while the compiled kernel has room for another graph."""
    room = not (_COMPILED and _COMPILED[0].full)
    return Lq == Lk and Lq >= MIN_LENGTH and supported(device, head_dim, dtype) and room


class Compiled:
    """``torch.compile(flex_attention, dynamic=False, fullgraph=True)`` that may keep ``limit`` graphs; a call
    that needs one more raises :class:`RecompileLimit` instead of running flex_attention eagerly (dense scores).
    The limit applies to its own calls only.

    Each call passes the tiles of :func:`.flex_tiles.plan` for its device, dtype, head size and whether the
    score_mod gathers (``gather``); a compile that fails "out of resource", or that Triton rejects for these tiles
    (:func:`.flex_tiles.compile_failure`), is retried once on the plan's smaller rung, and when that fails too
    the call raises :class:`OutOfResource` (attend() then takes the Toeplitz or split path with a one-line
    warning). With gradients the backward is compiled together with the forward
    (``force_non_lazy_backward_lowering``), so a backward that does not fit fails here too, where the next
    rung can still be tried, and never later inside ``loss.backward()``. The rung that compiled is kept per
    (device, dtype, head size, gather, grad, heavy); :attr:`events` records every first call of a new shape (its
    options, whether it compiled, seconds) for ``extrapolab bench``."""

    def __init__(self, limit: int = RECOMPILE_LIMIT) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.limit, self.full = int(limit), False
        self.fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        self.rung: dict = {}  # (device, dtype, head size, gather, grad, heavy) -> plan index; None: none fits
        self.seen: set = set()  # shapes called before (their first call compiled)
        self.why: dict = {}  # key -> the last compile failure's kind (flex_tiles.compile_failure)
        self.events: list[dict] = []

    def __call__(self, q, k, v, *, gather: bool = True, heavy: bool = False, **kw):
        from torch._dynamo import config as dcfg, exc

        limits = {"recompile_limit": self.limit, "fail_on_recompile_limit_hit": True,
                  "accumulated_recompile_limit": max(4 * self.limit, dcfg.accumulated_recompile_limit)}
        grad = torch.is_grad_enabled()  # a captured table may need the gradient when q, k, v do not
        key = (str(q.device), q.dtype, q.shape[-1], bool(gather), grad, bool(heavy))
        options = flex_tiles.plan(flex_tiles.device_info(q.device), q.dtype, q.shape[-1], gather, heavy, grad)
        start = self.rung.get(key, 0)
        if start is None:
            raise OutOfResource(options, self.why.get(key, "out of resource"))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # one layout per shape
        for i in range(start, len(options)):
            shape = key + (tuple(q.shape), k.shape[2], i)
            t0 = time.perf_counter()
            try:
                with dcfg.patch(**limits), _backward_with_forward(grad):
                    out = self.fn(q, k, v, kernel_options=options[i], **kw)
            except exc.FailOnRecompileLimitHit:
                self.full = True
                raise RecompileLimit(self.limit) from None
            except Exception as err:  # noqa: BLE001 -- only a failure other tiles may fix is ours to handle
                why = flex_tiles.compile_failure(err)
                if why is None:
                    raise
                self.why[key] = why
                self._event(shape, options[i], why, time.perf_counter() - t0)
                continue
            if shape not in self.seen:
                self.seen.add(shape)
                self._event(shape, options[i], "compiled", time.perf_counter() - t0)
            self.rung[key] = i
            return out
        self.rung[key] = None
        raise OutOfResource(options[start:], self.why[key])

    def _event(self, shape, options, status: str, seconds: float) -> None:
        dev, dtype, D, gather, grad, heavy, qshape, Lk, rung = shape
        self.events.append({"device": dev, "dtype": str(dtype).replace("torch.", ""), "head_dim": D,
                            "gather": gather, "heavy": heavy, "grad": grad, "q_shape": list(qshape), "Lk": Lk,
                            "rung": rung, "options": flex_tiles.describe(options), "status": status,
                            "seconds": round(seconds, 3)})


def _backward_with_forward(grad: bool):
    """Compile the backward at the forward's compile (so its failure is caught there), where torch has the
    switch; a no-op without gradients."""
    from contextlib import nullcontext

    from torch._functorch import config as fcfg

    if not grad or not hasattr(fcfg, "force_non_lazy_backward_lowering"):
        return nullcontext()
    return fcfg.patch(force_non_lazy_backward_lowering=True)


def _eager(q, k, v, *, gather: bool = True, heavy: bool = False, **kw):
    """Eager flex_attention (CPU tests): no tiles to choose."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, **kw)


def kernel(device: str):
    """The compiled kernel on CUDA (:class:`Compiled`, one per process), eager flex_attention elsewhere."""
    if device != "cuda":
        return _eager
    if not _COMPILED:
        _COMPILED.append(Compiled())
    return _COMPILED[0]


def unavailable_warning(q: torch.Tensor, k: torch.Tensor, learnable: bool, why: Unavailable,
                        path: str = "Toeplitz") -> str:
    """The one line printed (once per shape) when a call the compiled kernel cannot run takes the Toeplitz
    (or split) path instead."""
    B, H, Lq, D = q.shape
    return (f"{why.reason}: shape B={B} H={H} Lq={Lq} Lk={k.shape[2]} D={D} "
            f"{str(q.dtype).replace('torch.', '')} grad={torch.is_grad_enabled()} learnable={learnable} runs on the "
            f"{path} path instead; {why.hint}")


def warn_unavailable(q, k, learnable: bool, why: Unavailable, path: str = "Toeplitz") -> None:
    warnings.warn(unavailable_warning(q, k, learnable, why, path), RuntimeWarning, stacklevel=3)


def score_mod_for(bias: torch.Tensor, weight: torch.Tensor | None, off: torch.Tensor, inv_tau: torch.Tensor):
    """score_mod(s, b, h, q_idx, kv_idx) = (s · weight[h, d] + bias[h, d]) · inv_tau, d = off + q_idx - kv_idx."""
    n = bias.shape[-1]

    if weight is None:
        def score_mod(score, b, h, q_idx, kv_idx):
            d = (q_idx - kv_idx + off).clamp(0, n - 1)
            return (score + bias[h, d]) * inv_tau
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            d = (q_idx - kv_idx + off).clamp(0, n - 1)
            return (score * weight[h, d] + bias[h, d]) * inv_tau
    return score_mod


def score_mod_alibi(slopes: torch.Tensor, off: torch.Tensor, inv_tau: torch.Tensor):
    """score_mod = (s - slopes[h] · d) · inv_tau, d = off + q_idx - kv_idx: ALiBi in closed form (Press et al. 2022
    §3), a per-head scalar load and arithmetic instead of a gather from an [H, n] table, so torch's default tiles fit
    (docs/attention.md, "Tiles")."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return (score - slopes[h] * (q_idx - kv_idx + off)) * inv_tau
    return score_mod


def score_mod_closed(f, off: torch.Tensor, inv_tau: torch.Tensor, n: int, dtype: torch.dtype,
                     inv_h: torch.Tensor | None = None):
    """score_mod = (s + f(h, d) · inv_h[h]) · inv_tau, d = off + q_idx - kv_idx as a float of ``dtype`` (clamped to
    [0, n - 1]: masked scores are never read): a scheme's closed form (``scheme.closed_form``) evaluated per score,
    its [H] parameters scalar loads; ``inv_h`` [H] a per-head 1/temperature of the bias (None: 1)."""
    if inv_h is None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return (score + f(h, (q_idx - kv_idx + off).clamp(0, n - 1).to(dtype))) * inv_tau
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return (score + f(h, (q_idx - kv_idx + off).clamp(0, n - 1).to(dtype)) * inv_h[h]) * inv_tau
    return score_mod


def score_mod_scaled(inv_tau: torch.Tensor):
    """score_mod = s · inv_tau: a scheme whose bias is a pure mask (``mask_only``: windowed) needs only the block mask."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * inv_tau
    return score_mod


def table_form(scheme, layer: int, learn: bool = False, closed: bool = True) -> str:
    """How the flex path writes a distance-table scheme's score_mod: "mask" (``mask_only``: no term), "alibi"
    (the ALiBi form, closed form from the slopes), "closed" (the scheme's ``closed_form``, with :data:`CLOSED_FORM`)
    or "table" (a gather from the [H, n] table, the only form whose tiles :func:`.flex_tiles.plan` shrinks).
    ``learn``: the table needs a gradient in this call; the closed form reads the parameters detached, so it
    applies then only where :mod:`.table_grad` supplies the gradient (:func:`tracks_table`); ``closed`` False (the
    call's ``AttnOptions.exact_routes``): never the closed form."""
    if scheme.mask_only and not scheme.has_weight:
        return "mask"
    if not scheme.has_weight and not scheme.learnable and scheme.alibi_slopes(layer) is not None:
        return "alibi"
    if (closed and CLOSED_FORM and not scheme.has_weight and (not learn or tracks_table(scheme))
            and scheme.closed_form(layer) is not None):
        return "closed"
    return "table"


def path_name(scheme, layer: int, learn: bool, closed: bool = True) -> str:
    """What `attend` counts for a call of :func:`flex_attention_path`: "flex-closed" for a closed form, else "flex"."""
    return "flex-closed" if table_form(scheme, layer, learn, closed) == "closed" else "flex"


def mask_mod_for(finite: torch.Tensor, off: torch.Tensor):
    """mask_mod(b, h, q_idx, kv_idx): distance d = off + q_idx - kv_idx is in [0, n) and finite[d]."""
    n = finite.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx + off
        return (d >= 0) & (d < n) & finite[d.clamp(0, n - 1)]
    return mask_mod


def _ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sel [QB, KB] bool -> (count [1, 1, QB], indices [1, 1, QB, KB]) with selected blocks first."""
    idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)  # [QB, KB]
    return sel.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]


def block_mask(finite: torch.Tensor, Lq: int, Lk: int, off: int, block: int = BLOCK,
               select: torch.Tensor | None = None):
    """BlockMask of :func:`mask_mod_for` for Lq queries over Lk keys, without an Lq x Lk tensor; ``select``
    [QB, KB] bool keeps only those blocks (the flex-pieces path splits the tiles between two calls).

    For a (query block, key block) pair the distances that occur are exactly the integers in
    [q_lo - k_hi, q_hi - k_lo]; the prefix sums of ``finite`` count the visible ones.
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev, n = finite.device, finite.shape[0]
    cnt = F.pad(finite.to(torch.int64).cumsum(0), (1, 0))  # [n + 1]: visible distances below x
    q_lo = torch.arange(0, Lq, block, device=dev)  # [QB]
    k_lo = torch.arange(0, Lk, block, device=dev)  # [KB]
    q_hi, k_hi = (q_lo + block).clamp(max=Lq) - 1, (k_lo + block).clamp(max=Lk) - 1
    d_lo = off + q_lo[:, None] - k_hi[None]  # [QB, KB] smallest distance in the block
    d_hi = off + q_hi[:, None] - k_lo[None]  # [QB, KB] largest
    seen = cnt[(d_hi + 1).clamp(0, n)] - cnt[d_lo.clamp(0, n)]  # [QB, KB] visible distances
    whole = ((q_hi - q_lo + 1 == block)[:, None]) & ((k_hi - k_lo + 1 == block)[None])  # [QB, KB]
    full = whole & (d_lo >= 0) & (d_hi < n) & (seen == d_hi - d_lo + 1)  # edge blocks stay partial
    partial = (seen > 0) & ~full
    if select is not None:
        full, partial = full & select, partial & select
    off_t = torch.full((), off, device=dev, dtype=torch.int64)  # filled on the device: no host copy
    mod = mask_mod_for(finite, off_t)
    if select is not None:  # the mask_mod says it too: eager FlexAttention (the CPU) reads the mask_mod alone
        sel, inner = select.contiguous(), mod

        def mod(b, h, q_idx, kv_idx):
            return inner(b, h, q_idx, kv_idx) & sel[q_idx // block, kv_idx // block]
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block,
                                    mask_mod=mod, seq_lengths=(Lq, Lk))


def _finite(table: torch.Tensor, window: int | None) -> torch.Tensor:
    fin = torch.isfinite(table.detach()).any(0)  # [n] some head sees distance d
    if window is not None:
        fin = fin & (torch.arange(fin.shape[0], device=fin.device) < window)
    return fin


def flex_attention_path(q, k, v, a: int, c: int, db: DistanceBias, layer: int, *, scale: float,
                        tau: float = 1.0, window: int | None = None,
                        tau_h: torch.Tensor | None = None, closed: bool = True) -> torch.Tensor:
    """q [B,H,Lq,D] at positions a.., k/v [B,H,Lk,D] at c.. (c <= a) -> out [B,H,Lq,D].

    ``tau_h`` [H|1]: the scheme's per-head temperature, dividing q and the table per head; ``closed`` False: the
    gathered table even where the scheme has a closed form (:func:`table_form`).
    Raises :class:`RecompileLimit` when the compiled kernel is full (attend() then takes the
    Toeplitz path). No host-device synchronisation (module doc)."""
    H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    n = a + Lq - c  # distances 0 .. dmax
    scheme = db.scheme
    bias = db.table(layer, n).expand(H, n).contiguous()  # [H, n]; graph kept for learnable tables
    if tau_h is not None:
        q = q / tau_h.view(1, -1, 1, 1).to(q.dtype)  # [B, H, Lq, D]
        bias = divide_finite(bias, tau_h.view(-1, 1).to(bias.dtype))  # [H, n]
    weight = db.table(layer, n, "weight").expand(H, n).contiguous() if scheme.has_weight else None
    key = ("flexmask", q.device, Lq, Lk, a - c, window, db.layer_key(layer))
    if scheme.learnable:  # the finite pattern of this forward's table, built on the device once
        bm = db.memo(key, lambda: block_mask(_finite(bias, window), Lq, Lk, a - c))
    else:
        bm = kept_mask(scheme, key, lambda: _finite(bias, window), Lq, Lk, a - c)
    dev = q.device
    off = db.memo(("off", dev, a - c), lambda: torch.full((), a - c, device=dev, dtype=torch.int64))
    inv_tau = db.memo(("inv_tau", dev, float(tau), bias.dtype),
                      lambda: torch.full((), 1.0 / tau, device=dev, dtype=bias.dtype))
    learn = bias.requires_grad and torch.is_grad_enabled()
    form = table_form(scheme, layer, learn, closed)
    if form == "mask":
        mod = score_mod_scaled(inv_tau)
    elif form == "alibi":
        slopes = scheme.alibi_slopes(layer).to(dev, torch.float32)  # [H]
        if tau_h is not None:
            slopes = slopes / tau_h.reshape(-1).to(slopes)
        mod = score_mod_alibi(slopes.expand(H).contiguous(), off, inv_tau)
    elif form == "closed" or (tracks_table(scheme) and learn):
        gather = form != "closed"
        if gather:
            mod = score_mod_for(bias.detach(), weight, off, inv_tau)  # no captured gradient: no atomics in flex
        else:  # the scheme's formula per score (its parameters detached), no [M, N] gather
            inv_h = None if tau_h is None else (1.0 / tau_h.reshape(-1).to(dev, bias.dtype)).expand(H).contiguous()
            mod = score_mod_closed(scheme.closed_form(layer, bias.dtype, dev), off, inv_tau, n, bias.dtype, inv_h)
        if not learn:
            return kernel(dev.type)(q, k, v, gather=False, score_mod=mod, block_mask=bm, scale=scale)
        out, lse = with_lse(kernel(dev.type), q, k, v, gather=gather, score_mod=mod, block_mask=bm, scale=scale)
        return table_grad.attach(out, lse, q, k, v, bias, off=a - c, scale=scale, inv_tau=1.0 / tau, window=window)
    else:
        mod = score_mod_for(bias, weight, off, inv_tau)
    return kernel(dev.type)(q, k, v, gather=form == "table", score_mod=mod, block_mask=bm, scale=scale)


def tracks_table(scheme) -> bool:
    """A learnable additive table (no multiplicative kernel) trains with :mod:`.table_grad`'s gradient."""
    return TABLE_GRAD and scheme.learnable and not scheme.has_weight


def with_lse(fn, q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [B, H, Lq] natural log) from flex_attention (``return_aux`` from torch 2.9, ``return_lse`` before)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return fn(q, k, v, return_lse=True, **kw)
    out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return out, aux.lse


def kept_mask(scheme, key: tuple, finite, Lq: int, Lk: int, off: int):
    """The BlockMask of a pattern that does not change with the scheme's parameters, kept on the scheme as
    (finite, BlockMask): the tensor lets ``cached`` see inference mode."""
    hit = scheme.cached(key)
    if hit is None:
        fin = finite()  # [n]
        hit = scheme._table_cache[key] = (fin, block_mask(fin, Lq, Lk, off))
    return hit[1]


def flex_rows_path(q, k, v, a: int, c: int, scheme, layer: int, *, scale: float, tau: float = 1.0,
                   window: int | None = None, tau_h: torch.Tensor | None = None) -> torch.Tensor:
    """q [B,H,Lq,D] at positions a.., k/v [B,H,Lk,D] at c.. (c <= a) -> out [B,H,Lq,D] for a scheme with
    ``flex_bias`` (FIRE, whose rows beyond L each have their own normaliser): score_mod = (s + b_h(m, n)) / tau,
    b evaluated per (query, key) inside the kernel, so no mask and no table of rows exists; the block mask is
    causal (and the window). ``tau_h`` [H|1] divides q and the bias per head. Raises :class:`RecompileLimit`
    when the compiled kernel is full (attend() then takes the split path). No host read."""
    H, Lq, Lk, dev = q.shape[1], q.shape[2], k.shape[2], q.device
    n = a + Lq - c  # distances 0 .. n - 1
    bias = scheme.flex_bias(layer, a, c, Lq, n)

    def finite():  # [n] every distance is visible, up to the window
        d = torch.arange(n, device=dev)
        return torch.ones_like(d, dtype=torch.bool) if window is None else d < window

    bm = kept_mask(scheme, ("flexrows", dev, Lq, Lk, a - c, window), finite, Lq, Lk, a - c)
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32  # FlexAttention's working precision
    inv_tau = torch.full((), 1.0 / tau, device=dev, dtype=wp)
    if tau_h is None:
        def mod(score, b, h, q_idx, kv_idx):
            return (score + bias(h, q_idx, kv_idx)) * inv_tau
    else:
        q = q / tau_h.view(1, -1, 1, 1).to(q.dtype)  # [B, H, Lq, D]
        inv_h = (1.0 / tau_h.reshape(-1).to(wp)).expand(H).contiguous()  # [H]

        def mod(score, b, h, q_idx, kv_idx):
            return (score + bias(h, q_idx, kv_idx) * inv_h[h]) * inv_tau
    return kernel(dev.type)(q, k, v, gather=True, heavy=True, score_mod=mod, block_mask=bm, scale=scale)

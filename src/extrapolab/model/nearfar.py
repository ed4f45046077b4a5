"""Near-far attention (docs/attention.md, path row 4c): a bias that is a per-head constant beyond a distance (T5).

For one whole sequence (queries = keys at the same contiguous positions) and a scheme whose bias is the constant
c_h = b_h(D) at every distance d >= D (``scheme.constant_beyond``; T5, Raffel et al. 2020: every distance from
max_distance on shares the last bucket), each query's keys split in two:

    near  0 <= m - n < D:  the distance table b_h(m - n), a band of D keys per query;
    far   m - n >= D:      the constant c_h. Softmax over these keys alone is plain causal attention of the queries
                           from D on over the keys up to L - D (both shifted by D, so "causal" is the usual triangle),
                           and the constant only shifts that pass's log-sum-exp by c_h / tau.

The two merge exactly by log-sum-exp, l = log(e^l_near + e^l_far), out = e^(l_near - l)·out_near +
e^(l_far - l)·out_far: model/twopass.py's merge, the one FlashAttention applies between key tiles. Work: one causal
flash pass over L - D queries plus a band of O(L·D) scores; no L x L tensor, no gather over the whole square.

Two forms of the same computation:

* ``fused`` (the CPU): the band through model/twopass.py's fused passes (Pass(0, D) per query block, its Hankel
  band vector carrying the table), the far keys in one causal call of the CPU flash kernel, each returning its
  log-sum-exp;
* ``flex`` (CUDA): one FlexAttention call over the band (a block mask of the band only: two key blocks per query
  block at D = 128) and one call for the far keys: SDPA's flash kernel through
  ``aten::_scaled_dot_product_flash_attention``, which returns its log-sum-exp (16-bit inputs; the kernel NoPE's
  causal path runs), else FlexAttention without a score_mod (:data:`FAR_KERNEL` "flex", fp32). On the CPU the same
  form runs on eager FlexAttention and the CPU flash kernel (the tests).

Forward only (evaluation): the table's gradient would be the band's dS sums by distance plus, for c_h, the far
pass's probability mass; not built, so `attend` takes this path without gradients only.
"""
from __future__ import annotations

import math
import warnings

import torch

from ..io import UserError
from ..positional.rope_twopass import Pass
from . import flex
from .tables import DistanceBias
from .toeplitz import CPU_FLASH, hankel_ok
from .twopass import block_plan, fused_forward, merge

#: `auto` takes the near-far path on CUDA (evaluation of a whole sequence from flex.MIN_LENGTH tokens, where the flex
#: path would run). NOT YET MEASURED on a GPU: T5's 32,768-token forward took 3.85x NoPE's on FlexAttention with the
#: gathered table on an H200 (docs/results/gpu-h200-2026-11-27.md), the goal is 1.5x; False returns it there
AUTO_CUDA = True
#: `auto` takes it on the CPU from :data:`CPU_MIN_LENGTH` tokens (evaluation). Off: on the 2-core CPU (one layer, 4
#: heads of 32, 1 thread, shared with other jobs) it took 1.12-1.65x causal SDPA's time at 2,048-16,384 tokens where
#: the Toeplitz path's query blocks (dense masks over the keys up to each block) took 1.03-1.22x (docs/attention.md)
AUTO_CPU = False
CPU_MIN_LENGTH = 4096
#: the far pass on CUDA: "sdpa" (SDPA's flash kernel with its log-sum-exp; 16-bit inputs) or "flex" (FlexAttention
#: with the causal block mask and no score_mod); fp32 inputs always take "flex"
FAR_KERNEL = "sdpa"
#: SDPA's CUDA flash kernel returning (out, logsumexp, ...); private to torch (its schema is checked in the tests)
CUDA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_FLASH_FAILED: list = []  # the CUDA flash call raised once: later far passes take FlexAttention


def applies(impl: str, far: int | None, grad: bool, Lq: int, Lk: int, starts: tuple, window) -> bool:
    """The call's shape allows the near-far path: a scheme constant beyond a distance D < L, a whole sequence at
    contiguous positions (queries = keys), no evaluation window, no gradients. ``impl="nearfar"`` on a scheme
    without such a D, or with gradients, is a one-line error."""
    if impl == "nearfar" and far is None:
        raise UserError("impl='nearfar' needs a bias that is constant beyond a distance (T5: constant_beyond); "
                        "use impl='auto'")
    if impl == "nearfar" and grad:
        raise UserError("impl='nearfar' runs forward only (evaluation, no gradients); train with impl='auto'")
    a, c = starts
    return (far is not None and not grad and Lq == Lk and Lq > far and a is not None and a == c
            and window is None)


def pays(device: str, L: int, head_dim: int, dtype: torch.dtype) -> bool:
    """The automatic rule (where :func:`applies` holds): CUDA where FlexAttention would run (:func:`.flex.pays`)
    and :data:`AUTO_CUDA`; the CPU from :data:`CPU_MIN_LENGTH` tokens with its fused kernel and :data:`AUTO_CPU`."""
    if device == "cuda":
        return AUTO_CUDA and flex.pays(device, L, L, head_dim, dtype)
    return device == "cpu" and AUTO_CPU and L >= CPU_MIN_LENGTH and fused_ok(dtype)


def fused_ok(dtype: torch.dtype) -> bool:
    """The CPU form runs: the flash kernel with its log-sum-exp, honouring Hankel-view masks, for this dtype."""
    return (CPU_FLASH is not None and dtype in (torch.float32, torch.float64, torch.bfloat16)
            and hankel_ok(torch.device("cpu")))


def nearfar_attention(q, k, v, db: DistanceBias, layer: int, D: int, *, scale: float, tau: float = 1.0,
                      tau_h: torch.Tensor | None = None, block: int = 512, form: str | None = None) -> torch.Tensor:
    """q, k, v [B, H, L, d] of one whole sequence -> out [B, H, L, d]; ``scale`` = 1/sqrt(d) (without tau);
    ``tau_h`` [H|1] the scheme's per-head temperature (divides q and the bias); ``form`` "fused" or "flex" (None:
    fused on the CPU where it runs, flex elsewhere). May raise :class:`.flex.Unavailable` (flex form)."""
    H, L = q.shape[1], q.shape[2]
    tab = db.table(layer, D + 1).expand(H, D + 1)  # [H, D + 1]: b(0..D-1) the band, b(D) the far constant
    if tau_h is not None:
        q = q / tau_h.view(1, -1, 1, 1).to(q.dtype)  # [B, H, L, d]
        tab = tab / tau_h.view(-1, 1).to(tab.dtype)
    form = form or ("fused" if q.device.type == "cpu" and fused_ok(q.dtype) else "flex")
    if form == "fused":
        return _fused(q, k, v, tab, D, scale, tau, block, db.scheme)
    return _flex(q, k, v, tab, D, scale, tau, db.scheme)


def _fused(q, k, v, tab, D: int, scale: float, tau: float, block: int, scheme) -> torch.Tensor:
    """The CPU form: the band through model/twopass.py's fused passes (one pass, Pass(0, D), per query block over
    reversed queries: its Hankel vector carries the table), the far keys in one causal flash call, merged."""
    L, dev = q.shape[2], q.device
    plan = block_plan((Pass(0, D),), L, L, 0, None, block)
    # every call carries the table (one whose keys are all in the band would otherwise get no mask)
    plan = [(r0, r1, [(i, ra, rb, lo, hi, (0, D)) for i, ra, rb, lo, hi, _ in calls]) for r0, r1, calls in plan]
    d = (L - 1) - torch.arange(2 * L - 1, device=dev)  # [2L-1] the distance of Hankel slot x
    near = (tab[:, d.clamp(0, D - 1)] / tau).masked_fill(~((d >= 0) & (d < D))[None], -math.inf)  # [H, 2L-1]
    o, lse = fused_forward([q.flip(2)], [k], v, (plan, [(0, 0)], {(0, D): near.to(q.dtype)}, scale / tau))
    return _with_far(q, k, v, o.flip(2), lse.flip(2), tab, D, scale, tau, scheme)


def _flex(q, k, v, tab, D: int, scale: float, tau: float, scheme) -> torch.Tensor:
    """The CUDA form: FlexAttention over the band, a causal flash call over the far keys, merged."""
    H, L, dev = q.shape[1], q.shape[2], q.device
    wp = torch.float64 if q.dtype == torch.float64 else torch.float32  # FlexAttention's working precision
    inv_tau = torch.full((), 1.0 / tau, device=dev, dtype=wp)
    off = torch.zeros((), device=dev, dtype=torch.int64)
    band = tab[:, :D].to(wp).contiguous()  # [H, D]
    bm = flex.kept_mask(scheme, ("nearfar", dev, L, D), lambda: torch.arange(L, device=dev) < D, L, L, 0)
    o, lse = flex.with_lse(flex.kernel(dev.type), q, k, v, gather=True, block_mask=bm, scale=scale,
                           score_mod=flex.score_mod_for(band, None, off, inv_tau))  # [B, H, L, d], [B, H, L]
    return _with_far(q, k, v, o, lse, tab, D, scale, tau, scheme)


def _with_far(q, k, v, o, lse, tab, D: int, scale: float, tau: float, scheme) -> torch.Tensor:
    """The band's (o [B, H, L, d], lse [B, H, L]) merged with the far pass of the queries from D on; the far
    constant b(D) shifts its log-sum-exp."""
    H, L = q.shape[1], q.shape[2]
    o_f, l_f = far_pass(q[:, :, D:], k[:, :, :L - D], v[:, :, :L - D], scale, tau, scheme)  # [B,H,L-D,d], [B,H,L-D]
    l_f = l_f + (tab[:, D].to(l_f.dtype) / tau).view(1, H, 1)
    acc, lse = merge(None, None, o, lse.contiguous(), 0, L)  # lse is updated in place below (a copy if a view)
    acc, _ = merge(acc, lse, o_f, l_f, D, L)
    return acc.to(q.dtype)


def far_pass(q, k, v, scale: float, tau: float, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, n, d], lse [B, H, n]) of causal attention (row i sees keys 0..i) at logits q·k·scale/tau:
    a fused SDPA kernel with its log-sum-exp (:func:`sdpa_lse`) when :data:`FAR_KERNEL` is "sdpa" and one runs
    here, else FlexAttention with the causal block mask."""
    if FAR_KERNEL == "sdpa":
        got = sdpa_lse(q, k, v, scale / tau)
        if got is not None:
            return got
    n, dev = q.shape[2], q.device
    bm = flex.kept_mask(scheme, ("nearfar-far", dev, n), lambda: torch.ones(n, dtype=torch.bool, device=dev),
                        n, n, 0)
    inv_tau = torch.full((), 1.0 / tau, device=dev, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return flex.with_lse(flex.kernel(dev.type), q, k, v, gather=False, block_mask=bm, scale=scale,
                         score_mod=flex.score_mod_scaled(inv_tau))


def sdpa_lse(q, k, v, scale: float):
    """(out, lse natural log [B, H, n]) of causal SDPA from a fused kernel that returns its log-sum-exp, or None
    where none runs: the CPU flash kernel (fp32, fp64, bf16), CUDA's flash kernel (fp16, bf16, head size a
    multiple of 8 up to 256). A CUDA call that raises warns once and is not tried again."""
    if q.device.type == "cpu" and fused_ok(q.dtype):
        return CPU_FLASH(q, k, v, 0.0, True, scale=scale)
    if (q.device.type != "cuda" or CUDA_FLASH is None or _FLASH_FAILED or q.dtype not in (torch.float16, torch.bfloat16)
            or q.shape[-1] % 8 or q.shape[-1] > 256):
        return None
    try:
        out = CUDA_FLASH(q, k, v, 0.0, True, False, scale=scale)
        if tuple(out[1].shape) != tuple(q.shape[:3]):  # the merge needs lse [B, H, n]
            raise RuntimeError(f"its log-sum-exp has shape {tuple(out[1].shape)}, not {tuple(q.shape[:3])}")
    except RuntimeError as err:  # e.g. a GPU the flash kernel does not support: FlexAttention instead
        _FLASH_FAILED.append(str(err))
        why = (str(err) or type(err).__name__).splitlines()[0]
        warnings.warn(f"SDPA's flash kernel refused the near-far path's far pass ({why}); it runs on FlexAttention "
                      "instead", RuntimeWarning, stacklevel=3)
        return None
    return out[0], out[1]

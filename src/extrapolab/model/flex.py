"""FlexAttention path of :func:`.attention.attend` for relative biases on CUDA (docs/attention.md).

FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels"; ``torch.nn.attention.flex_attention``) compiles one fused kernel from a
``score_mod`` and a block-sparse mask. Here, for queries at positions a + i and keys at c + j
(distance d = a - c + i - j), with the scheme's distance tables b, w [H, n] (:class:`.tables.DistanceBias`):

    score_mod: s -> (s · w[h, d] + b[h, d]) / tau      s = q·k / sqrt(d_head); w only for KERPLE wht
    mask:      d >= 0, d < n and some head's b[·, d] finite (and d < window for windowed@w)

The mask covers causal attention, the windowed scheme, evaluation-time windows, T5/KERPLE/ALiBi/
Sandwich/Qin (all distances), and each sliding-dilated level's dilation (RegularGPT eq. 6.1:
finite only at d = j·C^l), from one rule: the table's finite pattern. The :class:`BlockMask` is
built from prefix sums of that pattern per 128 x 128 block (O((L/128)^2) integers, no L x L
tensor): blocks where every distance is visible are "full" (no mask_mod call), blocks with none
are skipped. It is cached per (shape, offset, window, layer) on the scheme. Tables that need a
gradient (KERPLE, T5, sliding-dilated r) are captured tensors of the ``score_mod``; FlexAttention
returns their gradient on CUDA. Offsets and 1/tau are captured 0-d tensors, so new values do not
recompile. ``torch.compile(flex_attention, dynamic=False)`` is made once per process and reused
(one compiled kernel per shape).

On CPU, torch 2.13 runs FlexAttention only without input gradients (and only unfused in eager
mode): :func:`.attention.attend` never picks it there automatically; the tests run the CPU forward
against the reference path for every registered scheme.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .tables import DistanceBias

BLOCK = 128  # FlexAttention's default sparse block size (queries x keys)
_COMPILED: list = []  # the compiled flex_attention, made on first CUDA use


def available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def supported(device: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Does the automatic rule use FlexAttention for this device, head size and dtype?"""
    return (device == "cuda" and available() and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def kernel(device: str):
    """The compiled flex_attention on CUDA (one per process), the eager one elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device != "cuda":
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


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


def block_mask(finite: torch.Tensor, Lq: int, Lk: int, off: int, block: int = BLOCK):
    """BlockMask of :func:`mask_mod_for` for Lq queries over Lk keys, without an Lq x Lk tensor.

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
    off_t = torch.tensor(off, device=dev)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block,
                                    mask_mod=mask_mod_for(finite, off_t), seq_lengths=(Lq, Lk))


def _finite(table: torch.Tensor, window: int | None) -> torch.Tensor:
    fin = torch.isfinite(table.detach()).any(0)  # [n] some head sees distance d
    if window is not None:
        fin = fin & (torch.arange(fin.shape[0], device=fin.device) < window)
    return fin


def flex_attention_path(q, k, v, a: int, c: int, db: DistanceBias, layer: int, *, scale: float,
                        tau: float = 1.0, window: int | None = None) -> torch.Tensor:
    """q [B,H,Lq,D] at positions a.., k/v [B,H,Lk,D] at c.. (c <= a) -> out [B,H,Lq,D]."""
    H, Lq, Lk = q.shape[1], q.shape[2], k.shape[2]
    n = a + Lq - c  # distances 0 .. dmax
    scheme = db.scheme
    bias = db.table(layer, n).expand(H, n).contiguous()  # [H, n]; graph kept for learnable tables
    weight = db.table(layer, n, "weight").expand(H, n).contiguous() if scheme.has_weight else None
    fin = _finite(bias, window)  # [n]
    # the finite pattern is structural for every registered scheme; a learnable one is re-keyed
    # on its count in case a user's table grows or loses -inf entries while training
    tag = int(fin.sum()) if scheme.learnable else None
    key = ("flexmask", q.device, Lq, Lk, a - c, window, db.layer_key(layer), tag)
    hit = scheme.cached(key)  # (finite, BlockMask): the tensor lets ``cached`` see inference mode
    if hit is None:
        hit = scheme._table_cache[key] = (fin, block_mask(fin, Lq, Lk, a - c))
    bm = hit[1]
    off = torch.tensor(a - c, device=q.device)
    inv_tau = torch.tensor(1.0 / tau, device=q.device, dtype=bias.dtype)
    mod = score_mod_for(bias, weight, off, inv_tau)
    return kernel(q.device.type)(q, k, v, score_mod=mod, block_mask=bm, scale=scale)

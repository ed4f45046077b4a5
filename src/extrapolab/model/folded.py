"""ALiBi-form biases at any positions, exact inside the fused causal kernel (docs/attention.md).

A bias of the ALiBi form b(m, n) = -s_h·(p_m - p_n), with p the token positions (ALiBi, Press et
al. 2022 §3, at positions with gaps such as randomized positions, Ruoss et al. 2023) or positions
computed from content (FoX's p = -cumsum(log f), Lin et al. 2025 eq. 6), splits into a row term
-s_h·p_m, constant along a softmax row and so without effect, and a key term +s_h·p_n. The key
term is one extra head dimension:

    q' = [q, 1],   k' = [k, s_h·(p_n - r)·sqrt(d)]   =>   q'·k' / sqrt(d) = q·k / sqrt(d) + s_h·(p_n - r)

for any per-row constant r, so plain ``scaled_dot_product_attention`` (the fused flash kernel, with
``is_causal`` when queries are the keys) computes softmax(q·k/sqrt(d) + b) forward and backward,
and the gradient reaches p (and so FoX's forget gate). v gets a zero column so the kernel sees one
head size; the output drops it.

Order of operations (model/reference.py): the temperature divides the whole logit. The layer's tau
is in the kernel's scale; a per-query (and per-head) tau_m of the scheme divides the row of q',
[q, 1] / tau_m, so it scales q·k and the bias alike and the dropped row term stays constant.
Windows and queries after a KV cache take a boolean mask per query block, O(block · keys), never
L x L.

Precision: r is p at the block's last query, so every visible key carries s_h·(p_n - r) <= 0
(p non-decreasing) and the keys next to a query are small numbers. Query blocks are at most
:data:`FOLD_BLOCK` rows for long inputs, which bounds |s_h·(p_n - r)| near the diagonal by the
range of p over one block. When the kernel runs in 16 bits (a bf16/fp16 input or autocast), the
key column is split into hi + lo columns, both exact in 16 bits (and q's into hi, hi, lo with a
per-query tau), so the kernel's fp32 accumulation restores ~16 more bits. On CUDA the head size
is padded with zero columns to a multiple of 8, which the flash kernels need.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: query rows per call for long inputs: the re-centring block (see the module docstring)
FOLD_BLOCK = 512


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the kernel multiplies in: autocast's where it is on, else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _split(x: torch.Tensor, low: torch.dtype | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """x as one column (fp32/fp64 kernels) or as hi + lo, each exact in the 16-bit ``low``; in ``dtype``."""
    if low is None:
        return [x.to(dtype)]
    hi = x.to(low)
    return [hi.to(dtype), (x - hi.to(x.dtype)).to(low).to(dtype)]


def _extra(c: torch.Tensor, t: torch.Tensor | None, low, dtype) -> tuple[list, list]:
    """(query columns, key columns) whose products sum to t·c (t = 1 when None), exactly in fp32 and
    to ~2^-16 relative in 16 bits: t·c ~ th·ch + th·cl + tl·ch."""
    cs = _split(c, low, dtype)
    if t is None:
        return [None] * len(cs), cs
    ts = _split(t, low, dtype)
    if low is None:
        return ts, cs
    return [ts[0], ts[0], ts[1]], [cs[0], cs[1], cs[0]]


def folded_attention(q, k, v, q_pos, k_pos, slopes, pq, pk, *, base_scale: float, scale: float,
                     tau_rows: torch.Tensor | None = None, window: int | None = None,
                     block: int | None = None, same: bool = False) -> torch.Tensor:
    """softmax((q·k·base_scale - s_h·(p_m - p_n)) / tau) v through fused SDPA: q [B,H,Lq,D],
    k/v [B,H,Lk,D] at increasing token positions q_pos [Lq], k_pos [Lk] (queries at or after
    their keys: full sequences, or chunks after a KV cache); slopes [H]; pq [B|1,H|1,Lq],
    pk [B|1,H|1,Lk] the ALiBi-form positions (non-decreasing); ``scale`` = base_scale / tau_layer;
    ``tau_rows`` [B|1,H|1,Lq] a further per-query divisor. ``block``: query rows per call (None:
    one). ``same``: queries and keys are the same increasing positions (then one call is plain
    ``is_causal``). Returns [B, H, Lq, D]."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dt = compute_dtype(q)
    low = dt if dt in (torch.float16, torch.bfloat16) else None
    s = slopes.to(device=q.device, dtype=torch.float64).view(1, -1, 1) / base_scale  # [1, H, 1]
    one_call = same and block is None and window is None
    bs = Lq if block is None else max(1, min(int(block), Lq))
    outs = []
    for r0 in range(0, Lq, bs):
        r1 = min(Lq, r0 + bs)
        lo, hi, mask = 0, Lk, None
        if not one_call:
            qp = q_pos[r0:r1]
            hi = int(torch.searchsorted(k_pos, qp[-1:], right=True))  # keys after the last query: masked
            if window is not None:
                lo = int(torch.searchsorted(k_pos, qp[:1] - int(window) + 1))
            kp = k_pos[lo:hi]
            need = not (int(kp[-1]) <= int(qp[0]) and (window is None or int(qp[-1]) - int(kp[0]) < window))
            if need:  # some (query, key) pair of the block is masked
                dist = qp[:, None] - kp[None]  # [bq, bk]
                ok = dist >= 0
                if window is not None:
                    ok = ok & (dist < window)
                mask = ok[None, None]  # [1, 1, bq, bk]
        ref = pq[..., r1 - 1:r1]  # [B|1, H|1, 1] p at the block's last query
        c = (pk[..., lo:hi] - ref) * s  # [B|1, H, bk]: <= 0 for visible keys
        t = None if tau_rows is None else 1.0 / tau_rows[..., r0:r1].to(torch.float64)  # [B|1, H|1, bq]
        qx, kx = _extra(c, t, low, q.dtype)
        qb = q[:, :, r0:r1]
        if t is not None:
            qb = qb * t.to(q.dtype)[..., None]  # [B, H, bq, D] / tau_m
        bq, bk = r1 - r0, hi - lo
        q_cols = [x.expand(B, H, bq)[..., None] if x is not None else qb.new_ones(B, H, bq, 1) for x in qx]
        k_cols = [x.expand(B, H, bk)[..., None] for x in kx]
        pad = (-(D + len(kx))) % 8 if q.device.type == "cuda" else 0  # CUDA flash kernels: head size % 8
        zq = [qb.new_zeros(B, H, bq, pad)] if pad else []
        qf = torch.cat([qb, *q_cols, *zq], dim=-1)  # [B, H, bq, D + e]
        kf = torch.cat([k[:, :, lo:hi], *k_cols, *([k.new_zeros(B, H, bk, pad)] if pad else [])], dim=-1)
        vf = F.pad(v[:, :, lo:hi], (0, qf.shape[-1] - D))  # [B, H, bk, D + e]: zero columns
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, is_causal=one_call, scale=scale)
        outs.append(o[..., :D])  # [B, H, bq, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def fold_block(Lq: int, block_size: int, blocked: bool) -> int | None:
    """Query rows per call: ``block_size`` when blocked, :data:`FOLD_BLOCK` (re-centring) for long
    inputs, else one call."""
    if blocked:
        return max(1, int(block_size))
    return FOLD_BLOCK if Lq > FOLD_BLOCK else None


def token_positions(pos: torch.Tensor) -> torch.Tensor:
    """Token positions [L] as ALiBi-form positions [1, 1, L] (float64)."""
    return pos.to(torch.float64).view(1, 1, -1)

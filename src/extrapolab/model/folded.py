"""ALiBi-form biases at any positions, exact inside the fused causal kernel (docs/attention.md).

A bias of the ALiBi form b(m, n) = -s_h·(p_m - p_n), with p the token positions (ALiBi, Press et
al. 2022 §3, at positions with gaps such as randomized positions, Ruoss et al. 2023) or positions
computed from content (FoX: p = -cumsum(log f), Lin et al. 2025 §2), splits into a row term
-s_h·p_m, constant along a softmax row and so without effect, and a key term +s_h·p_n. The key
term is one extra head dimension:

    q' = [q, 1],   k' = [k, s_h·(p_n - r)·sqrt(d)]   =>   q'·k' / sqrt(d) = q·k / sqrt(d) + s_h·(p_n - r)

for any per-row constant r, so plain ``scaled_dot_product_attention`` (the fused flash kernel, with
``is_causal`` when queries are the keys) computes softmax(q·k/sqrt(d) + b) forward and backward,
and the gradient reaches p (and so FoX's forget gate). v gets zero columns so the kernel sees one
head size; the output drops them.

Order of operations (model/reference.py): the temperature divides the whole logit. The layer's tau
is in the kernel's scale; a per-query (and per-head) tau_m of the scheme divides the row of q',
[q, 1] / tau_m, so it scales q·k and the bias alike and the dropped row term stays constant.
Windows and queries after a KV cache take a boolean mask per call, O(rows · keys), never L x L.
An attention sink (model.sinks, :mod:`.sinks`) is one more column of the softmax, so the dropped row term
is no longer without effect there: the sink's logit is shifted by it too, s + s_h·(p_m - r)/tau.

Precision: the kernel adds s_h·(p_n - r)·sqrt(d) to q·k in fp32, so its rounding is relative to
|p_n - r| for the keys next to a query, where softmax needs it most. A whole input takes one
``is_causal`` call (on the CPU far faster than several calls over query blocks) with its rows
re-centred in G <= :data:`FOLD_GROUPS` groups of at least :data:`FOLD_GROUP` queries, r_g = p at
the group's middle query, one extra column per group: q' = [q, onehot(g)], k' = [k, s·(p_n - r_1)
·sqrt(d), ..., s·(p_n - r_G)·sqrt(d)] (the zeros of the one-hot add nothing). Calls with a mask
(windows, chunks after a KV cache, ``impl="blocked"``) take at most FOLD_GROUP rows each. When the
kernel runs in 16 bits (bf16/fp16 inputs or autocast), each key column is split into hi + lo
columns, both exact in 16 bits (with a per-query tau, q's column into hi, hi, lo), so the fp32
accumulation keeps ~16 more bits. On CUDA the head size is padded with zero columns to a multiple
of 8, which the flash kernels need.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .sdpa import sdpa
from .sinks import compute_dtype, sink_sdpa

#: query rows that share one re-centring point at least, and rows per call with a mask (module docstring)
FOLD_GROUP = 512
#: re-centring columns of a whole-input call at most (its groups grow beyond FOLD_GROUP rows past 8·512 tokens)
FOLD_GROUPS = 8


def _split(x: torch.Tensor, low: torch.dtype | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """x as one column (fp32/fp64 kernels) or as hi + lo, each exact in the 16-bit ``low``; in ``dtype``."""
    if low is None:
        return [x.to(dtype)]
    hi = x.to(low)
    return [hi.to(dtype), (x - hi.to(x.dtype)).to(low).to(dtype)]


def _columns(c: torch.Tensor, tq: torch.Tensor, exact_q: bool, low, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(query columns [.., bq, E], key columns [.., bk, E]) whose row-by-column products sum to
    tq·c over the G groups: exactly in fp32, to ~2^-16 relative in 16 bits (t·c ~ th·ch + th·cl +
    tl·ch; th·ch + th·cl when t is exact, a one-hot)."""
    cs = _split(c, low, dtype)  # each [.., bk, G]
    if low is None:
        return tq.to(dtype), cs[0]
    if exact_q:  # a one-hot (or ones) is exact in 16 bits: its hi half only
        th = tq.to(low).to(dtype)  # [.., bq, G]
        return torch.cat([th, th], -1), torch.cat(cs, -1)
    ts = _split(tq, low, dtype)  # each [.., bq, G]
    return torch.cat([ts[0], ts[0], ts[1]], -1), torch.cat([cs[0], cs[1], cs[0]], -1)


def _call(q, k, v, pq, pk, s, *, r0, r1, lo, hi, mask, causal, tau_rows, low, scale, sink_rows=None):
    """One fused call: queries r0..r1 over keys lo..hi, re-centred in groups of FOLD_GROUP rows; with
    ``sink_rows`` [1, H, Lq|1] (final units) the attention sink of each row (:mod:`.sinks`)."""
    B, H, _, D = q.shape
    bq, bk = r1 - r0, hi - lo
    G = min(FOLD_GROUPS, max(1, -(-bq // FOLD_GROUP)))
    gs = -(-bq // G)  # rows per group
    if G == 1:  # one group (a training length): the same numbers in a slice and a column of ones, 10 kernels fewer
        grp = None
        refs = pq[..., r0 + bq // 2:r0 + bq // 2 + 1]  # [B|1, H|1, 1] p at the middle query
        tq = torch.ones(bq, 1, device=q.device, dtype=torch.float64)  # [bq, 1]
    else:
        grp = torch.arange(bq, device=q.device) // gs  # [bq] group of each row
        mids = r0 + torch.clamp(torch.arange(G, device=q.device) * gs + gs // 2, max=bq - 1)  # [G]
        refs = pq[..., mids]  # [B|1, H|1, G] p at each group's middle query
        tq = (grp[:, None] == torch.arange(G, device=q.device)).to(torch.float64)  # [bq, G] one-hot, no read-back
    c = (pk[..., lo:hi, None] - refs[..., None, :]) * s[..., None]  # [B|1, H, bk, G]
    qb = q[:, :, r0:r1]
    if tau_rows is not None:
        t = 1.0 / tau_rows[..., r0:r1].to(torch.float64)  # [B|1, H|1, bq]
        tq = tq * t[..., None]  # [B|1, H|1, bq, G]
        qb = qb * t.to(q.dtype)[..., None]  # [B, H, bq, D]: q·k / tau_m
    qx, kx = _columns(c, tq, tau_rows is None, low, q.dtype)
    E = qx.shape[-1]
    pad = (-(D + E)) % 8 if q.device.type == "cuda" else 0  # CUDA flash kernels: head size % 8
    qf = torch.cat([qb, qx.expand(B, H, bq, E), qb.new_zeros(B, H, bq, pad)], dim=-1)  # [B, H, bq, D+E+pad]
    kf = torch.cat([k[:, :, lo:hi], kx.expand(B, H, bk, E), k.new_zeros(B, H, bk, pad)], dim=-1)
    vf = F.pad(v[:, :, lo:hi], (0, E + pad))  # [B, H, bk, D+E+pad]: zero columns
    if sink_rows is not None:  # the kernel's logits are shifted by the dropped row term; so is the sink
        sr = sink_rows if sink_rows.shape[-1] == 1 else sink_rows[..., r0:r1]  # [1, H, bq|1]
        shift = (pq[..., r0:r1] - (refs if grp is None else refs[..., grp])) * s  # [B|1, H, bq]: s_h·(p_m - r_g)
        if tau_rows is not None:
            shift = shift * t
        sr = sr.to(torch.float64) + shift * scale  # [B|1, H, bq]
        return sink_sdpa(qf, kf, vf, sr, mask, is_causal=causal, scale=scale)[..., :D]
    o = sdpa(qf, kf, vf, mask, is_causal=causal, scale=scale)
    return o[..., :D]  # [B, H, bq, D]


def folded_attention(q, k, v, q_pos, k_pos, slopes, pq, pk, *, base_scale: float, scale: float,
                     tau_rows: torch.Tensor | None = None, window: int | None = None,
                     block: int | None = None, same: bool = False,
                     sink_rows: torch.Tensor | None = None, starts: tuple | None = None) -> torch.Tensor:
    """softmax((q·k·base_scale - s_h·(p_m - p_n)) / tau) v through fused SDPA: q [B,H,Lq,D],
    k/v [B,H,Lk,D] at increasing token positions q_pos [Lq], k_pos [Lk] (queries at or after
    their keys: full sequences, or chunks after a KV cache); slopes [H]; pq [B|1,H|1,Lq],
    pk [B|1,H|1,Lk] the ALiBi-form positions (non-decreasing); ``scale`` = base_scale / tau_layer;
    ``tau_rows`` [B|1,H|1,Lq] a further per-query divisor. ``block``: query rows per call (None:
    one ``is_causal`` call when ``same``, else FOLD_GROUP). ``same``: queries and keys are the same
    increasing positions. ``sink_rows`` [1, H, Lq|1]: the attention-sink logit of each row, temperatures
    applied (model.sinks, :mod:`.sinks`). ``starts`` (a, c): the positions are a.. and c.. (contiguous), so each
    call's key range comes from them instead of from the device (a read-back per call: per layer when decoding).
    Returns [B, H, Lq, D]."""
    Lq, Lk = q.shape[2], k.shape[2]
    dt = compute_dtype(q)
    low = dt if dt in (torch.float16, torch.bfloat16) else None
    s = slopes.to(device=q.device, dtype=torch.float64).view(1, -1, 1) / base_scale  # [1, H, 1]
    if same and window is None and not block:  # the whole input in one is_causal call
        return _call(q, k, v, pq, pk, s, r0=0, r1=Lq, lo=0, hi=Lk, mask=None, causal=True,
                     tau_rows=tau_rows, low=low, scale=scale, sink_rows=sink_rows)
    bs = max(1, min(int(block or FOLD_GROUP), Lq))
    if same and window is None and bs == Lq:
        return _call(q, k, v, pq, pk, s, r0=0, r1=Lq, lo=0, hi=Lk, mask=None, causal=True,
                     tau_rows=tau_rows, low=low, scale=scale, sink_rows=sink_rows)
    outs = []
    for r0 in range(0, Lq, bs):
        r1 = min(Lq, r0 + bs)
        qp = q_pos[r0:r1]
        if starts is not None and starts[0] is not None and starts[1] is not None:  # contiguous: host arithmetic
            a, c = starts
            hi = max(0, min(Lk, a + r1 - c))  # keys at positions <= the last query
            lo = 0 if window is None else max(0, min(hi, a + r0 - int(window) + 1 - c))
            kp = k_pos[lo:hi]
            masked = not (c + hi - 1 <= a + r0 and (window is None or a + r1 - 1 - (c + lo) < window))
        else:
            hi = int(torch.searchsorted(k_pos, qp[-1:], right=True))  # keys after the last query: masked
            lo = 0 if window is None else int(torch.searchsorted(k_pos, qp[:1] - int(window) + 1))
            kp = k_pos[lo:hi]
            masked = not (int(kp[-1]) <= int(qp[0]) and (window is None or int(qp[-1]) - int(kp[0]) < window))
        mask = None
        if masked:
            dist = qp[:, None] - kp[None]  # [bq, bk]: some (query, key) pair of the call is masked
            ok = dist >= 0
            mask = (ok if window is None else ok & (dist < window))[None, None]  # [1, 1, bq, bk]
        outs.append(_call(q, k, v, pq, pk, s, r0=r0, r1=r1, lo=lo, hi=hi, mask=mask, causal=False,
                          tau_rows=tau_rows, low=low, scale=scale, sink_rows=sink_rows))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


#: the automatic rule evaluates ALiBi's form at contiguous positions here on CUDA (no gradient, a whole sequence of
#: at least flex.MIN_LENGTH tokens) instead of on FlexAttention: on an H100 this path ran FoX's forward at 1.53x
#: NoPE's at 32,768 tokens where ALiBi's flex forward took 2.69x (docs/results/gpu-h100-2026-11-27.md), and at
#: 8,192 tokens 1.95x against 2.54x (the first H100 run) -- the same flash SDPA call with FoX's gates on top.
#: Measured for ALiBi itself on an H200 at 32,768 tokens: 1.41x NoPE's here, 2.82x on FlexAttention (`alibi@flex`;
#: docs/results/gpu-h200-2026-11-27.md)
LONG_EVAL = True


def pays_long_eval(device: str, impl: str, grad: bool, Lq: int, Lk: int, min_length: int) -> bool:
    """Does `auto` fold a contiguous ALiBi-form bias (:data:`LONG_EVAL`)?"""
    return LONG_EVAL and impl == "auto" and device == "cuda" and not grad and Lq == Lk and Lq >= min_length


def fold_block(block_size: int, blocked: bool) -> int | None:
    """Query rows per call: ``block_size`` when blocked, else as the re-centring allows (None)."""
    return max(1, int(block_size)) if blocked else None


def token_positions(pos: torch.Tensor) -> torch.Tensor:
    """Token positions [L] as ALiBi-form positions [1, 1, L] (float64)."""
    return pos.to(torch.float64).view(1, 1, -1)

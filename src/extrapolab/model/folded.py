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

Launches: a GPU's train step of GPT-2 small at 16 x 512 is host-bound, every eager operator one kernel launch
(FoX on an H200: 1,724 launches a step against NoPE's 922, 47.1 ms for 27.9 ms of kernels;
docs/results/gpu-h200-2026-11-27.md). So a training call (one group) takes its query columns and zero padding
from a cache, the hi/lo split's backward is one kernel (:class:`_HiLo`), the re-centring point r gets no gradient
(the softmax cancels it: exact), and no tensor is sliced on its whole range: on the CPU, with bf16 autocast, a
one-layer FoX model's train step dispatched 130 operators (NoPE's: 74); these take it to 115 (and FoX's gate
logit, computed outside autocast, to 107).
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
#: the head size the fused kernels need a multiple of, per device type (CUDA's flash kernels: 8), reached with zero
#: columns
HEAD_MULTIPLE = {"cuda": 8}


class _HiLo(torch.autograd.Function):
    """x (fp32/fp64) -> (hi, lo), each exact in the 16-bit ``low``, hi + lo = x to ~2^-16 relative: one rounding
    and one mixed-dtype subtraction forward. Backward d(x) = d(hi): lo is x's rounding residue, whose derivative is
    0 -- what autograd of the same arithmetic gives, in one kernel instead of seven and without rounding -d(lo) to
    16 bits on its way back through hi."""

    @staticmethod
    def forward(ctx, x, low):
        ctx.dtype = x.dtype
        hi = x.to(low)
        return hi, (x - hi).to(low)  # x - hi in x's dtype (type promotion: one kernel)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dhi, dlo):
        return (None if dhi is None else dhi.to(ctx.dtype)), None


def _split(x: torch.Tensor, low: torch.dtype | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """x as one column (fp32/fp64 kernels) or as hi + lo, each exact in the 16-bit ``low``; in ``dtype``."""
    if low is None:
        return [x.to(dtype)]
    return [t.to(dtype) for t in _HiLo.apply(x, low)]


#: constants of the fold (a call's zero padding, a one-group call's query columns), built once per key
_CONST: dict = {}


def _const(key: tuple, build) -> torch.Tensor:
    """The cached tensor of ``key`` (dtype and device in it), built by ``build()`` on first use; tensors built in
    inference mode are kept apart (autograd may not use them). Code torch.compile traces builds its own (the
    graph holds its constants)."""
    if torch.compiler.is_compiling():
        return build()
    key = key + (torch.is_inference_mode_enabled(),)
    hit = _CONST.get(key)
    if hit is None:
        if len(_CONST) >= 64:  # shapes vary (decoding chunks): keep the cache small
            _CONST.clear()
        hit = _CONST[key] = build()
    return hit


def _zeros(shape: tuple, dtype, device) -> torch.Tensor:
    """Zeros of ``shape`` (an expanded cached scalar: nothing to launch)."""
    zero = _const(("zero", dtype, torch.device(device)), lambda: torch.zeros((), dtype=dtype, device=device))
    return zero.expand(shape)


def _ones_columns(bq: int, E: int, pad: int, dtype, device) -> torch.Tensor:
    """[bq, E + pad]: a one-group call's query columns (a column of ones, in 16 bits its hi half twice), then
    ``pad`` zero columns; cached, so a training step builds none."""
    def build():  # built on the device (no host data copied in)
        return F.pad(torch.ones(bq, E, dtype=dtype, device=device), (0, pad))  # [bq, E + pad]
    return _const(("ones", bq, E, pad, dtype, torch.device(device)), build)


def _padded(cols: list[torch.Tensor], pad: int) -> torch.Tensor:
    """The columns side by side, then ``pad`` zero columns: [.., E + pad]."""
    x = cols[0]
    return torch.cat(cols + ([_zeros((*x.shape[:-1], pad), x.dtype, x.device)] if pad else []), -1)


def _columns(c: torch.Tensor, tq: torch.Tensor | None, exact_q: bool, low, dtype,
             pad: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(query columns [.., bq, E + pad], key columns [.., bk, E + pad]) whose row-by-column products sum to
    tq·c over the G groups, then ``pad`` zero columns: exactly in fp32, to ~2^-16 relative in 16 bits (t·c ~
    th·ch + th·cl + tl·ch; th·ch + th·cl when t is exact, a one-hot). ``tq`` None: the query columns are
    :func:`_ones_columns`' (one group, exact), and only the key columns are built (query columns None)."""
    cs = _split(c, low, dtype)  # each [.., bk, G]: c, or its hi and lo halves
    if low is not None and not exact_q:  # t not exact in 16 bits: its hi and lo halves too
        ts = _split(tq, low, dtype)  # each [.., bq, G]
        qcols, kcols = [ts[0], ts[0], ts[1]], [cs[0], cs[1], cs[0]]
    else:  # t exact (a one-hot, ones; or an fp32 kernel): t against each of c's columns
        qcols, kcols = (None if tq is None else [tq.to(dtype)] * len(cs)), cs
    return (None if qcols is None else _padded(qcols, pad)), _padded(kcols, pad)


def _rows(x: torch.Tensor, a: int, b: int, dim: int = -1) -> torch.Tensor:
    """x's entries a..b-1 along ``dim``; x itself for all of them (a whole-range slice would cost its backward a
    zero-filled copy)."""
    return x if a == 0 and b == x.shape[dim] else x.narrow(dim, a, b - a)


def _call(q, k, v, pq, pk, s, *, r0, r1, lo, hi, mask, causal, tau_rows, low, scale, sink_rows=None):
    """One fused call: queries r0..r1 over keys lo..hi, re-centred in groups of FOLD_GROUP rows; with
    ``sink_rows`` [1, H, Lq|1] (final units) the attention sink of each row (:mod:`.sinks`)."""
    B, H, _, D = q.shape
    bq, bk = r1 - r0, hi - lo
    G = min(FOLD_GROUPS, max(1, -(-bq // FOLD_GROUP)))
    gs = -(-bq // G)  # rows per group
    E = G * (1 if low is None else 2 if tau_rows is None else 3)  # bias columns
    pad = (-(D + E)) % HEAD_MULTIPLE.get(q.device.type, 1)  # zero columns: CUDA flash kernels take head size % 8
    if G == 1:  # one group (a training length): a slice, and query columns of ones (cached when exact)
        grp = None
        refs = pq[..., r0 + bq // 2:r0 + bq // 2 + 1].detach()  # [B|1, H|1, 1] p at the middle query
        tq = None if tau_rows is None else torch.ones(bq, 1, device=q.device, dtype=torch.float64)  # [bq, 1]
    else:
        grp = torch.arange(bq, device=q.device) // gs  # [bq] group of each row
        mids = r0 + torch.clamp(torch.arange(G, device=q.device) * gs + gs // 2, max=bq - 1)  # [G]
        refs = pq[..., mids].detach()  # [B|1, H|1, G] p at each group's middle query
        tq = (grp[:, None] == torch.arange(G, device=q.device)).to(torch.float64)  # [bq, G] one-hot, no read-back
    # refs detached: r is constant along each row (and shifts the sink alike), so the softmax cancels it and its
    # gradient is 0 -- autograd would spend a zero-filled slice, a negation and a sum per layer to find that out
    c = (_rows(pk, lo, hi)[..., None] - refs[..., None, :]) * s[..., None]  # [B|1, H, bk, G]
    qb = _rows(q, r0, r1, -2)
    if tau_rows is not None:
        t = 1.0 / tau_rows[..., r0:r1].to(torch.float64)  # [B|1, H|1, bq]
        tq = tq * t[..., None]  # [B|1, H|1, bq, G]
        qb = qb * t.to(q.dtype)[..., None]  # [B, H, bq, D]: q·k / tau_m
    qx, kx = _columns(c, tq, tau_rows is None, low, q.dtype, pad)
    if qx is None:
        qx = _ones_columns(bq, E, pad, q.dtype, q.device)  # [bq, E + pad]
    W = E + pad
    qf = torch.cat([qb, qx.expand(B, H, bq, W)], dim=-1)  # [B, H, bq, D + E + pad]
    kf = torch.cat([_rows(k, lo, hi, -2), kx.expand(B, H, bk, W)], dim=-1)
    vf = F.pad(_rows(v, lo, hi, -2), (0, W))  # [B, H, bk, D + E + pad]: zero columns
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

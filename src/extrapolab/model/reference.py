"""The reference attention path and the one dense fallback (docs/attention.md).

Every path of :func:`.attention.attend` computes, for rotated q, k (rotary: Su et al. 2021, eq. 34):

    l = (q · k) / sqrt(d_head)                 scale (multi-pass schemes, Self-Extend / ReRoPE / DCA:
                                               q', k' moved to each pass's positions in its region)
    l = l * w(m - n)                           KERPLE "wht" kernels only (Chi 2024 thesis §3.7.3)
    l = l + b(m, n)                            the scheme's bias (ALiBi, T5, KERPLE, Sandwich, ...)
    l = l - s_h·(p_m - p_n)                    positions from content (FoX: p = -cumsum(log f))
    l = -inf where n > m or m - n >= window    causal mask, evaluation-time "windowed@w"
    l = scores(l)                              score-level hook over whole rows (CoPE, DAPE)
    l = l - F[m, n],  F = Σ_{k<m} S[k, n]      selection accumulated over earlier queries (selective
                                               attention: ``accumulate``), every head
    l = l / tau_scheme[h, m]                   the scheme's temperature (head scale, log-n), times
                                               SSMax's 1 / (s_h·log n_m) (model.ssmax)
    p = softmax([l, sink_h] / tau)             the temperature divides the whole logit
                                               (Softmax_tau of the thesis §5.4, Algorithm 1), the sink
                                               logit s_h / tau_scheme[h, m] too (model.sinks: one more
                                               column without a value, dropped after the softmax);
                                               or the scheme's ``normalize`` (stick-breaking)

:func:`logits` is that computation up to the option temperature tau, in one place: the reference
path, the logits sink (``AttnOptions.logits_sink``, read by temperature alignment) and
analysis/attn.py call it. :func:`dense_attention` runs it in query blocks (keys past a block's
causal frontier skipped), either explicitly (matmul, softmax: the reference, the only path that
returns probabilities, feeds a sink or runs score-level hooks) or, as the fallback for biases that
are not a function of m - n and for positions that are not contiguous, with each block's dense
additive mask in fused SDPA.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..positional.base import PositionalScheme, ScoreBlock, causal_distance
from ..positional.positions import known_start
from .sdpa import sdpa
from .sinks import sink_sdpa

#: ``sink(layer, logits, num_keys)``: tau = 1 logits [B, H, bq, bk] of consecutive query rows (-inf
#: where masked); the columns are the first bk of the call's ``num_keys`` keys (later keys are masked
#: for these rows).
LogitsSink = Callable[[int, torch.Tensor, int], None]


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] bool: True where the key is not in the future and (if window) within it."""
    dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
    ok = dist >= 0
    return ok if window is None else ok & (dist < window)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] additive mask: -inf for future keys and (if window) keys at distance >= window."""
    ok = visible_mask(q_pos, k_pos, window)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, -math.inf)


def logit_terms(scheme: PositionalScheme, q_pos, k_pos, layer: int, window: int | None,
                bias: torch.Tensor | None = None):
    """(weight [H, Lq, Lk] | None, additive [H|1, Lq, Lk]): the scheme's multiplicative kernel, and
    its bias plus the causal/window mask. ``bias``: a precomputed [H, Lq, Lk] scheme bias."""
    if bias is None and scheme.has_bias:
        bias = scheme.bias(q_pos, k_pos, layer)  # [H, Lq, Lk], -inf masked
    if bias is None or window is not None:
        m = window_mask(q_pos, k_pos, window)[None]  # [1, Lq, Lk]
        bias = m if bias is None else bias + m
    weight = scheme.weight(q_pos, k_pos, layer) if scheme.has_weight else None
    return weight, bias


def content_bias(scheme: PositionalScheme, layer: int, content, rows=slice(None), cols=slice(None)):
    """-s_h·(p_m - p_n) [B|1, H, bq, bk] (float64) for the query rows and key columns given, or None when the
    scheme's content is not in ALiBi form (selective attention keeps its state there)."""
    if scheme.alibi_slopes(layer) is None:
        return None
    pq, pk = content
    s = scheme.alibi_slopes(layer).to(device=pq.device, dtype=torch.float64).view(1, -1, 1, 1)  # [1, H, 1, 1]
    return -s * (pq[..., rows, None] - pk[..., None, cols])


def divide_finite(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """x / tau with -inf entries kept -inf and no gradient through them (a learnable tau would
    otherwise get inf · 0 = NaN from the masked entries)."""
    fin = torch.isfinite(x)
    return (x.masked_fill(~fin, 0.0) / tau).masked_fill(~fin, -math.inf)


def scheme_tau(scheme: PositionalScheme, q_pos: torch.Tensor, layer: int) -> torch.Tensor | None:
    """The scheme's temperature as [1, H|1, Lq|1] (float), or None."""
    t = scheme.temperature(q_pos, layer)
    return None if t is None else t.reshape(1, *t.shape[-2:])


def keys_seen(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """n_m [Lq] (long): the keys at positions <= m (and, with a window, > m - w) of increasing ``k_pos``, i.e.
    the number of keys query m attends to; m + 1 in a sequence from position 0."""
    hi = torch.searchsorted(k_pos, q_pos, right=True)  # [Lq]
    if window is None:
        return hi
    return hi - torch.searchsorted(k_pos, q_pos - int(window) + 1)


def ssmax_tau(s: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """SSMax (Nakanishi 2025, arXiv 2501.19399, eq. 2: z -> softmax((s·log n)·z)) as a temperature
    [1, H, Lq] = 1 / (s_h·log n_m), n_m from :func:`keys_seen`. Where s_h·log n_m = 0 (a query that sees one key)
    it is +inf: that query's logits (and sink) become 0, as (s·log 1)·z, with a zero gradient to s (no NaN)."""
    logn = torch.log(keys_seen(q_pos, k_pos, window).clamp(min=1).to(s.dtype))  # [Lq]
    beta = s.reshape(-1, 1) * logn  # [H, Lq] the multiplier s_h·log n
    nz = beta != 0
    inv = 1.0 / torch.where(nz, beta, torch.ones_like(beta))  # safe where beta = 0
    return torch.where(nz, inv, torch.full_like(beta, math.inf))[None]  # [1, H, Lq]


def row_tau(scheme: PositionalScheme, q_pos, k_pos, layer: int, ssmax: torch.Tensor | None = None,
            window: int | None = None) -> torch.Tensor | None:
    """The per-head, per-query temperature attention divides the logits by besides the option's tau:
    the scheme's (:func:`scheme_tau`) times SSMax's (:func:`ssmax_tau`, ``ssmax`` = s [H]); [1, H|1, Lq|1] or None."""
    t = scheme_tau(scheme, q_pos, layer)
    if ssmax is None:
        return t
    u = ssmax_tau(ssmax, q_pos, k_pos, window)  # [1, H, Lq]
    return u if t is None else t * u


def sink_rows(sinks: torch.Tensor | None, tau_s: torch.Tensor | None) -> torch.Tensor | None:
    """The sink logit of every head and query at option tau 1: s_h / tau_s[h, m], [1, H, Lq|1] (None without sinks)."""
    if sinks is None:
        return None
    r = sinks.reshape(1, -1, 1)  # [1, H, 1]
    return r if tau_s is None else r / tau_s.to(r.dtype)


def _rows(t: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    """Rows s..e of a [1, H|1, Lq|1] temperature as [1, H|1, bq|1, 1]."""
    if t is None:
        return None
    return (t if t.shape[-1] == 1 else t[..., s:e])[..., None]


def block_logits(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
                 bias: torch.Tensor | None = None, content=None, tau_s: torch.Tensor | None = None):
    """(logits [B, H, Lq, Lk], ScoreBlock | None) of rotated q [B,H,Lq,D], k [B,H,Lk,D]: every step up
    to the option temperature (module docstring); ``tau_s`` [1, H|1, Lq|1, 1] the scheme's.

    Multi-pass schemes (Self-Extend, ReRoPE, DCA: ``scheme.second_pass()``) score each key in one
    pass, with q, k moved to that pass's positions: one logit matrix, merged by the passes' regions."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q * scale, k.transpose(-1, -2))  # [B, H, Lq, Lk]: scale the small side
    multi = scheme.second_pass()
    if multi is not None:
        for p, (qp, kp) in zip(multi.passes, multi.moved(q, k, q_pos, k_pos)):  # [B, H, Lq|Lk, D] each
            if qp is not q or kp is not k:  # a pass that moves nothing is plain RoPE: s already
                s = torch.where(p.region(q_pos, k_pos), torch.matmul(qp * scale, kp.transpose(-1, -2)), s)
        if not multi.complete:  # keys of no pass are not seen (StreamingLLM: neither sink nor window)
            seen = torch.stack([p.region(q_pos, k_pos) for p in multi.passes]).any(0)  # [Lq, Lk]
            s = s.masked_fill(~seen, -math.inf)
    weight, add = logit_terms(scheme, q_pos, k_pos, layer, window, bias)
    if weight is not None:
        s = s * weight.to(s.dtype)
    lg = s + add.to(s.dtype)  # [H|1, Lq, Lk] broadcast over the batch
    cb = None if content is None else content_bias(scheme, layer, content)
    if cb is not None:
        lg = lg + cb.to(s.dtype)  # [B|1, H, Lq, Lk]
    blk = None
    if scheme.reference_only:
        vis = visible_mask(q_pos, k_pos, window)  # [Lq, Lk]
        b = torch.where(vis, add, 0.0) if scheme.has_bias or bias is not None else None  # 0 where not visible
        blk = ScoreBlock(q, k, q_pos, k_pos, s, b, vis, layer)
        lg = scheme.scores(lg, blk).masked_fill(~vis, -math.inf)
        sel = scheme.accumulate(lg, blk)  # [B, Lq, Lk] or None
        if sel is not None:  # F[m, n] = the keys' state before this block + the block's earlier rows
            acc = sel.cumsum(1).sub_(sel)  # [B, Lq, Lk]: the rows before each row (a few dozen: lg's dtype)
            if content is not None:
                acc.add_(content[1][:, :1].to(acc.dtype))  # [B, 1, Lk]: the state kept per key (float64)
            lg = lg - acc[:, None]  # [B, H, Lq, Lk]: F, every head; -inf stays -inf
            blk.added = sel.sum(1, dtype=torch.float64)  # [B, Lk]
    if tau_s is not None:
        lg = divide_finite(lg, tau_s.to(lg.dtype))
    return lg, blk


def logits(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
           bias: torch.Tensor | None = None, *, content=None, ssmax: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [B, H, Lq, Lk] softmax sees at ``AttnOptions.temperature`` = 1, for rotated q
    [B,H,Lq,D], k [B,H,Lk,D]: scaled q·k, kernel, bias, content positions, mask (-inf), score hook,
    selection, the scheme's own temperature (and SSMax's, ``ssmax`` = s [H]). ``content``: (p_q, p_k) of a
    ``has_content`` scheme. An attention sink is not a column here (see :func:`weights`)."""
    tau_s = row_tau(scheme, q_pos, k_pos, layer, ssmax, window)
    return block_logits(q, k, q_pos, k_pos, scheme, layer, window, bias, content,
                        None if tau_s is None else tau_s[..., None])[0]


def weights(lg: torch.Tensor, scheme: PositionalScheme, blk: ScoreBlock | None, tau: float = 1.0,
            sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights from :func:`logits`: softmax(l / tau) in fp32 (fp64 for fp64), or the
    scheme's ``normalize`` (stick-breaking). ``sink`` [1, H, bq|1, 1]: the sink logit at tau 1, one more
    column of the softmax, dropped after it (the rows then sum to 1 - the sink's weight)."""
    x = lg if lg.dtype == torch.float64 else lg.float()
    x = x / tau if tau != 1.0 else x
    if sink is not None:  # gpt-oss: cat([l, s]) -> softmax -> drop the sink's column
        col = (sink.to(x.dtype) / tau).expand(*x.shape[:-1], 1)  # [B, H, bq, 1]
        return torch.softmax(torch.cat([x, col], -1), dim=-1)[..., :-1]
    w = scheme.normalize(x, blk) if blk is not None else None
    return torch.softmax(x, dim=-1) if w is None else w


def probabilities(q, k, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, window: int | None = None,
                  tau: float = 1.0, *, content=None, sinks: torch.Tensor | None = None,
                  ssmax: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights [B, H, Lq, Lk] of rotated q, k (the rows a reference call would use); ``sinks``,
    ``ssmax`` [H] the layer's sink logits and SSMax scales (model options). With ``rows`` (indices into the
    queries), q holds every query and only those rows come back, [B, H, len(rows), Lk]: a scheme that
    accumulates a selection (selective attention) needs the queries before each row."""
    if rows is not None and scheme.accumulates:
        return _streamed_rows(q, k, q_pos, k_pos, scheme, layer, window, tau, content, sinks, ssmax, rows)
    if rows is not None:
        q, q_pos = q[:, :, rows], q_pos[rows]
        content = None if content is None else (content[0][..., rows], content[1])
    tau_s = row_tau(scheme, q_pos, k_pos, layer, ssmax, window)
    lg, blk = block_logits(q, k, q_pos, k_pos, scheme, layer, window, None, content,
                           None if tau_s is None else tau_s[..., None])
    srows = sink_rows(sinks, tau_s)
    return weights(lg, scheme, blk, tau, None if srows is None else srows[..., None])


def _streamed_rows(q, k, q_pos, k_pos, scheme, layer, window, tau, content, sinks, ssmax, rows, block: int = 64):
    """:func:`probabilities` of ``rows`` for an accumulating scheme: every query up to the last row in blocks of
    ``block`` rows, in order, the keys' selection state carried from block to block; [B, H, len(rows), Lk]."""
    B, H, _, _ = q.shape
    Lk = k.shape[2]
    rows = torch.as_tensor(rows, dtype=torch.long, device=q_pos.device)
    state = torch.zeros(B, H, Lk, dtype=torch.float64, device=q.device) if content is None \
        else content[1].to(torch.float64)  # [B, H, Lk] the keys' accumulated selection
    pq = content[0] if content is not None else state[..., :0]
    tau_s = row_tau(scheme, q_pos, k_pos, layer, ssmax, window)  # [1, H|1, Lq|1]
    srows = sink_rows(sinks, tau_s)
    out = q.new_zeros(B, H, rows.numel(), Lk, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for s in range(0, int(rows.max()) + 1, block):
        e = min(int(rows.max()) + 1, s + block)
        hi = int(torch.searchsorted(k_pos, q_pos[s:e].max(), right=True))
        lg, blk = block_logits(q[:, :, s:e], k[:, :, :hi], q_pos[s:e], k_pos[:hi], scheme, layer, window, None,
                               (pq[..., s:e], state[..., :hi]), _rows(tau_s, s, e))  # [B, H, bq, hi]
        state[..., :hi] += blk.added[:, None]  # [B, H, hi]
        want = ((rows >= s) & (rows < e)).nonzero().flatten()  # indices into rows
        if want.numel():
            w = weights(lg, scheme, blk, tau, _rows(srows, s, e))  # [B, H, bq, hi]
            out[:, :, want, :hi] = w[:, :, rows[want] - s].to(out.dtype)
    return out


def dense_attention(q, k, v, q_pos, k_pos, scheme: PositionalScheme, layer: int = 0, *, tau: float = 1.0,
                    window: int | None = None, bias: torch.Tensor | None = None, block: int | None = None,
                    fused: bool = False, need_probs: bool = False, sink: LogitsSink | None = None,
                    content=None, tau_s: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """q [B,H,Lq,D], k/v [B,H,Lk,D] (rotated) -> (out [B,H,Lq,D], probs [B,H,Lq,Lk] | None).

    ``block``: query rows per step (None: all at once; ``need_probs`` always takes one step).
    ``fused``: the fallback, each block's dense mask in fused SDPA (blocks whose logits a kernel
    multiplies, that feed a ``sink`` or run score-level hooks stay explicit). Otherwise the
    reference: logits, sink, softmax(logits / tau) in fp32 (fp64 for fp64 inputs), then p @ v.
    ``content``: (p_q, p_k) positions from content; ``tau_s`` [1, H|1, Lq|1] the scheme's temperature;
    ``sinks`` [1, H, Lq|1] the attention-sink logit of each row at tau 1 (:func:`sink_rows`). For an
    accumulating scheme (selective attention) the blocks run in order and the keys' state, ``content[1]``,
    is updated in place at the end (a KV cache then holds it for the next call).
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bs = Lq if block is None or need_probs else max(1, min(int(block), Lq))
    # keys sorted by position: a block never needs keys after its last query (nor, fused, before
    # its window); probabilities keep every column
    q0, k0 = known_start(q_pos), known_start(k_pos)  # contiguous positions known on the host: no device reads
    skip = not need_probs and (Lk < 2 or k0 is not None or bool(torch.all(k_pos[1:] >= k_pos[:-1])))
    explicit = not fused or scheme.has_weight or sink is not None or bool(scheme.reference_only)
    acc = scheme.accumulates and content is not None
    state = content[1].to(torch.float64, copy=True) if acc else None  # [B, H, Lk] the keys' accumulated selection
    outs, probs = [], None
    # the last block (widest key range) first: each later block's temporaries fit into memory freed by
    # the one before, where growing blocks would grow the heap by their sum (the sink and a selection
    # state keep row order: then each block writes into one output allocated up front, as small tensors
    # kept between growing blocks would split the freed memory)
    ordered = sink is not None or acc
    starts = range(0, Lq, bs) if ordered else reversed(range(0, Lq, bs))
    whole = q.new_empty(B, H, Lq, v.shape[-1]) if ordered and bs < Lq else None  # [B, H, Lq, Dv]
    for s in starts:
        e = min(Lq, s + bs)
        qp, lo, hi = q_pos[s:e], 0, Lk
        if skip and q0 is not None and k0 is not None:  # the same searches on the host
            hi = min(Lk, max(0, q0 + e - k0))
            if window is not None and not explicit:
                lo = min(Lk, max(0, q0 + s - window + 1 - k0))
        elif skip:
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))
            if window is not None and not explicit:
                lo = int(torch.searchsorted(k_pos, qp.min() - window + 1))
        kp, bb = k_pos[lo:hi], None if bias is None else bias[..., s:e, lo:hi]
        qb, kb, vb = q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi]  # [B,H,bq,D], [B,H,bk,D]
        cb = None if content is None else (content[0][..., s:e], (state if acc else content[1])[..., lo:hi])
        ts = _rows(tau_s, s, e)  # [1, H|1, bq|1, 1]
        sk = _rows(sinks, s, e)  # [1, H, bq|1, 1]
        if not explicit:
            add = logit_terms(scheme, qp, kp, layer, window, bb)[1]  # [H|1, bq, bk]
            cbias = None if cb is None else content_bias(scheme, layer, cb)
            if cbias is not None:
                add = add + cbias  # [B|1, H, bq, bk]
            if ts is not None:  # tau_m divides q·k and the bias alike
                add, qb = divide_finite(add, ts.to(add.dtype)), qb / ts.to(qb.dtype)
            mask = (add / tau if tau != 1.0 else add).to(q.dtype)
            mask = mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1, H|1, bq, bk]: 4-D keeps the fused CPU kernel
            scale = 1.0 / math.sqrt(D) / tau
            outs.append(sdpa(qb, kb, vb, mask, scale=scale) if sk is None else
                        sink_sdpa(qb, kb, vb, sk[..., 0] / tau, mask, scale=scale))
            continue
        lg, blk = block_logits(qb, kb, qp, kp, scheme, layer, window, bb, cb, ts)  # [B, H, bq, bk]
        if acc:  # the keys' state after this block's queries (in place: no new tensor kept per block)
            state[..., lo:hi] += blk.added[:, None]  # [B, H, bk]
        if sink is not None:
            sink(layer, lg.detach(), Lk)
        p = weights(lg, scheme, blk, tau, sk).to(v.dtype)
        o = torch.matmul(p, vb)  # [B, H, bq, D]
        if whole is not None:
            whole[:, :, s:e] = o
        else:
            outs.append(o)
        probs = p if need_probs else None
    if whole is not None:
        outs = [whole]
    if acc:
        with torch.no_grad():  # the state a KV cache keeps per key (functional within this call)
            content[1].copy_(state.detach())
    if not ordered:
        outs.reverse()
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), probs

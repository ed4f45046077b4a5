"""Causal attention with any positional scheme, applied in one place: :func:`attend`.

docs/attention.md has the order of operations (rotate -> scale by 1/sqrt(d_head) -> KERPLE "wht"
multiply -> bias -> causal/window mask -> temperature -> softmax, written out in
:mod:`.reference`) and the table of which path runs when, with the tests that prove each path
equal to the reference. The paths, chosen by :func:`select_path`:

* ``reference``  :mod:`.reference`, explicit matmul-softmax (query blocks when large); the only
                 path that returns probabilities or feeds a logits sink;
* ``causal``     NoPE / rotary / absolute schemes: fused SDPA with ``is_causal``;
* ``toeplitz``   :mod:`.toeplitz`, relative biases at contiguous positions: Hankel-view masks in
                 fused SDPA (CPU), HankelSDPA for learnable tables, tiled softmax for wht kernels;
* ``flex``       :mod:`.flex`, relative biases on CUDA: FlexAttention ``score_mod`` + block masks; for a
                 scheme with ``flex_bias`` (FIRE beyond L) its own term per (query, key), no mask;
* ``folded``     :mod:`.folded`, ALiBi-form biases -s_h·(p_m - p_n) at any increasing positions
                 (ALiBi with gaps or random positions, FoX's positions from content, a per-query
                 temperature): the key term as one extra head dimension of the fused causal kernel;
* ``fallback``   :mod:`.reference` with each query block's dense mask in fused SDPA, for biases
                 that are not a function of m - n and positions that are not contiguous;
* ``twopass``    :mod:`.twopass`, Self-Extend / ReRoPE (``scheme.second_pass()``): near and far
                 passes fused, merged by log-sum-exp;
* ``nearfar``    :mod:`.nearfar`, a bias constant beyond a distance D (T5) in evaluation: plain causal flash over the
                 far keys (the constant shifts its log-sum-exp) merged with a band of D keys that carries the table;
* ``split``      :mod:`.split`, schemes whose bias is a distance table only up to a query position T
                 (``scheme.toeplitz_rows()``: FIRE up to L): the queries at m <= T on the Toeplitz path,
                 the others as the fallback; attention rows are independent, so the outputs concatenate.

Schemes with score-level hooks (``reference_only``: CoPE, DAPE, stick-breaking, selective attention) always
take the reference path, in query blocks of min(``block_size``, :data:`SCORE_BLOCK`) rows.

Model options of a layer (docs/attention.md, "Model options"): ``sinks`` (gpt-oss's sink logit per head, one
more softmax column without a value: carried by the reference, causal, folded and fallback paths,
:mod:`.sinks`; the two-pass, Toeplitz, flex and split paths hand such calls to those) and ``ssmax`` (SSMax's
s_h: a temperature per query, multiplied into the scheme's). A rotation that widens q and k (PoPE) gets v
padded with zero columns to their head size, the output cut back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Sequence

import torch
import torch.nn.functional as F

from ..io import UserError
from ..positional.base import PositionalScheme
from . import flex, flex_pieces, nearfar
from .flex_content import flex_content_path
from .folded import fold_block, folded_attention, pays_long_eval, token_positions
from .reference import LogitsSink, dense_attention, row_tau, sink_rows
from .sinks import sink_sdpa
from .split import split_attention
from .tables import DistanceBias, arange_start, is_toeplitz, table_dtype
from .toeplitz import TOEPLITZ_BLOCK, toeplitz_attention
from .twopass import twopass_attention

#: "folded": an ALiBi-form bias (``alibi_slopes``) at increasing positions on the folded path (row 4 of
#: docs/attention.md's table) even where its positions are contiguous, e.g. to time it beside FlexAttention
#: "nearfar": the near-far path (row 4c) for a bias constant beyond a distance (T5), evaluation only
IMPLS = ("auto", "sdpa", "plain", "blocked", "flex", "folded", "nearfar")
#: query rows per block for schemes with score-level hooks: a block over keys up to its last query
#: holds L·rows/2 masked entries, so small blocks skip most of the upper triangle (chosen by hand)
SCORE_BLOCK = 64


def flush_denormals(enable: bool = True) -> bool:
    """Flush subnormal floats to zero (FTZ/DAZ) on this thread and on threads it creates later.

    Linear biases such as ALiBi's reach -100 and below, so exp() in a softmax can return subnormal
    numbers, which some CPUs handle far slower; flushing changes each probability by < 1.2e-38.
    Importing extrapolab never calls this: the CLI calls it at start-up (``EXTRAPOLAB_DENORMALS=keep``
    opts out) and the trainer when ``train.flush_denormals`` is true. Call it before torch starts
    its OpenMP threads, which inherit the mode. ``extrapolab bench`` measures its effect (the
    ``denormals`` rows). Returns whether the CPU supports it.
    """
    return bool(torch.set_flush_denormal(enable))


def layer_temperatures(tau: float | Sequence[float], n: int, what: str = "") -> list[float]:
    """One softmax temperature per layer of ``n``: a single tau repeated, or a sequence of exactly n,
    each positive and finite; otherwise a one-line UserError. ``what`` names the n layers in it
    (default "a {n}-layer model"). The one place a temperature becomes its per-layer list: our GPT
    and RegularGPT, the alignment targets and the Hugging Face temperature hooks (hf/hooks.py) call it."""
    taus = [float(tau)] * n if isinstance(tau, Real) else [float(t) for t in tau]
    if len(taus) != n:
        raise UserError(f"got {len(taus)} per-layer temperatures for {what or f'a {n}-layer model'}; "
                        "give one per layer or a single float")
    if any(not (t > 0 and math.isfinite(t)) for t in taus):
        raise UserError(f"softmax temperatures must be positive and finite, got {taus}")
    return taus


def temperature_record(tau: float | Sequence[float]) -> float | list[float]:
    """The temperature as results record it (JSON-safe): a float, or the list of per-layer floats."""
    return float(tau) if isinstance(tau, Real) else [float(t) for t in tau]


@dataclass
class AttnOptions:
    impl: str = "auto"  # auto | sdpa | plain | blocked | flex (see select_path)
    block_size: int = 1024
    memory_budget_mb: float = 512.0
    #: softmax temperature tau dividing the whole logit: one value, or one per layer (alignment)
    temperature: float | Sequence[float] = 1.0
    window: int | None = None  # evaluate "windowed@w": keys with k >= w are masked
    need_probs: bool = False
    #: called by the reference path with every layer's tau = 1 logits, per query block (see
    #: :data:`.reference.LogitsSink`); setting it routes every layer through the reference path
    logits_sink: LogitsSink | None = None
    #: a dict to count the paths attend() ran, per call ({"flex": 12, "toeplitz": 2}), fallbacks included:
    #: what `extrapolab bench` prints per scheme and row; None (default) counts nothing
    paths: dict | None = None
    #: the exact routes of docs/attention.md where their switches allow them: the near-far path for T5
    #: (nearfar.AUTO_CUDA / AUTO_CPU), closed-form score_mods (flex.CLOSED_FORM), FIRE's pieces (flex_pieces.ENABLED);
    #: False: the paths as before them, the gathered table and FIRE's MLP at every score (bench's SCHEME+table rows)
    exact_routes: bool = True

    def ran(self, path: str) -> None:
        """Count one call of ``path`` in :attr:`paths` (when it is a dict)."""
        if self.paths is not None:
            self.paths[path] = self.paths.get(path, 0) + 1

    def tau(self, layer: int) -> float:
        """The temperature of layer ``layer``."""
        t = self.temperature
        if isinstance(t, Real):
            return float(t)
        if not 0 <= layer < len(t):
            raise UserError(f"AttnOptions.temperature has {len(t)} per-layer values but layer {layer} "
                            "attends; give one temperature per layer or a single float")
        return float(t[layer])

    def check_layers(self, n: int, what: str = "") -> None:
        """A one-line UserError unless the temperature fits a model of ``n`` layers (see
        :func:`layer_temperatures`); models call it once per forward, so a per-layer list that is
        too long is refused rather than its tail ignored."""
        if not isinstance(self.temperature, Real) or self.temperature != 1.0:
            layer_temperatures(self.temperature, n, what)


def _contiguous_starts(bias, q_pos, k_pos) -> tuple[int | None, int | None]:
    starts = bias.starts if isinstance(bias, DistanceBias) else arange_start
    return starts(q_pos), starts(k_pos)


def select_path(device: str, scheme: PositionalScheme, opts: AttnOptions, q_shape, Lk: int, *,
                same_pos: bool, starts: tuple, dense_bias: bool, grad: bool, dtype=torch.float32,
                folded: bool = False, tau_rows: bool = False, split: int | None = None, sinks: bool = False,
                same_keys: bool = False, far: int | None = None):
    """(path, query rows per block or None) for :func:`attend`; pure, so tests can ask about CUDA.

    q_shape [B, H, Lq, D]; ``same_pos``: queries and keys at the same positions; ``starts``: the
    first positions (a, c) of contiguous query / key positions, None where not contiguous;
    ``folded``: the scheme's bias has the ALiBi form (``alibi_slopes``) and the positions increase;
    ``tau_rows``: the scheme's temperature varies over query positions; ``split``: for schemes with
    ``toeplitz_rows`` (FIRE), how many of the (increasing) queries lie at positions <= T, whose bias is
    the distance table; ``sinks``: the layer has attention sinks (model.sinks), which the reference, causal,
    folded and fallback paths carry and the two-pass, Toeplitz, flex and split paths do not (such calls take
    the reference path, the folded path for the ALiBi form, or the fallback). Schemes with positions from
    content (``has_content``) never take the causal or Toeplitz paths; ``same_keys``: the queries are the keys
    (a whole sequence), where such a scheme may take FlexAttention (``flex-content``); ``far``: the scheme's
    ``constant_beyond`` distance (T5), where an evaluation may take the near-far path (``nearfar``).
    """
    _, H, Lq, D = q_shape
    impl = opts.impl
    if impl not in IMPLS:
        raise UserError(f"unknown attention impl {impl!r}; use one of {', '.join(IMPLS)}")
    blocked = impl == "blocked"
    too_big = H * Lq * Lk * 4 / 2**20 > opts.memory_budget_mb and Lq > opts.block_size
    block = int(opts.block_size) if blocked or too_big else None
    if opts.need_probs or opts.logits_sink is not None or impl == "plain" or scheme.reference_only:
        if impl == "flex" and scheme.reference_only:
            raise UserError(f"scheme {scheme.name!r} runs on the reference path only ({scheme.reference_only}); "
                            "use impl='auto'")
        if scheme.reference_only and not opts.need_probs:  # small blocks skip most masked (future) keys
            return "reference", min(int(opts.block_size), SCORE_BLOCK)
        return "reference", (None if opts.need_probs else int(opts.block_size) if opts.logits_sink else block)
    if impl == "flex" and sinks:
        raise UserError("impl='flex' does not carry attention sinks (model.sinks); use impl='auto'")
    if scheme.second_pass() is not None:  # Self-Extend / ReRoPE: near + far pass, merged by log-sum-exp
        if sinks:  # the passes' merge has no sink column: explicit merged logits with it, in small blocks
            return "reference", min(int(opts.block_size), SCORE_BLOCK)
        return "twopass", min(int(opts.block_size), TOEPLITZ_BLOCK)
    content = scheme.has_content
    bias_free = not scheme.has_bias and not scheme.has_weight and not content
    if bias_free and opts.window is None and same_pos and not blocked:
        return "causal", None
    a, c = starts
    plain = not dense_bias and a is not None and c is not None and c <= a and not content and not tau_rows
    toeplitz = plain and (is_toeplitz(scheme, allow_weight=True) or (split is not None and split >= Lq))

    def take_flex(kind: str = "table") -> bool:
        """Asked for, or `auto` where it pays; never with input gradients on the CPU. ``kind``: "table" (a distance
        table), "rows" (FIRE's own term beyond L) or "content" (FoX). `auto` trains learnable tables on the dense
        mask's path (T5 1.31x NoPE's step on an H100, flex 2.98x with its own atomic gradient) unless
        ``flex.AUTO_TABLE_GRAD`` (a distance table read detached, its gradient from table_grad), and content
        positions on the folded path unless ``flex.AUTO_CONTENT`` (their gradient from flex_content)."""
        if not (impl == "flex" or (impl == "auto" and not bias_free and flex.pays(device, Lq, Lk, D, dtype))):
            return False
        if impl == "auto" and kind == "content" and not flex.AUTO_CONTENT:
            return False
        if impl == "auto" and grad and scheme.learnable and kind != "content" and not (
                kind == "table" and flex.AUTO_TABLE_GRAD and flex.tracks_table(scheme)):
            return False
        if device == "cpu" and grad:
            raise UserError("impl='flex' on CPU has no backward in torch (FlexAttention); "
                            "use impl='auto' on CPU or run on CUDA")
        return True

    near_far = nearfar.applies(impl, far, grad, Lq, Lk, starts, opts.window) and not dense_bias
    if impl == "folded" and not (folded and not dense_bias):
        raise UserError(f"impl='folded' needs an ALiBi-form bias at increasing positions (ALiBi, FoX); scheme "
                        f"{scheme.name!r} has none here: use impl='auto'")
    long_fold = pays_long_eval(device, impl, grad, Lq, Lk, flex.MIN_LENGTH)  # ALiBi's evaluation on CUDA
    if folded and not dense_bias and (content or tau_rows or not toeplitz or sinks or impl == "folded" or long_fold):
        if content and same_keys and not tau_rows and not sinks and not blocked and take_flex("content"):
            return "flex-content", None  # the key term in FlexAttention's score_mod
        return "folded", fold_block(opts.block_size, blocked)
    if sinks:  # the Toeplitz, flex and split kernels have no sink column: each block's dense mask with it
        return "fallback", block
    if toeplitz:
        if near_far and not scheme.has_weight and (impl == "nearfar" or (
                impl == "auto" and opts.exact_routes and nearfar.pays(device, Lq, D, dtype))):
            return "nearfar", min(int(opts.block_size), TOEPLITZ_BLOCK)
        if take_flex():
            return "flex", None
        tb = min(int(opts.block_size), TOEPLITZ_BLOCK)
        return "toeplitz", (tb if blocked or (impl == "auto" and Lq > tb) else None)
    if plain and split is not None and scheme.has_flex_bias and take_flex("rows"):  # the scheme's own score_mod
        return "flex", None
    if plain and split is not None:  # queries up to T (if any) on the Toeplitz path, the rest in row blocks
        tb = min(int(opts.block_size), TOEPLITZ_BLOCK)
        return "split", (tb if blocked or (impl == "auto" and split > tb) else None)
    return "fallback", block


def _increasing(bias, pos: torch.Tensor) -> bool:
    """Strictly increasing positions (memoised per forward by a shared :class:`DistanceBias`)."""
    if isinstance(bias, DistanceBias):
        return bias.increasing(pos)
    return pos.numel() < 2 or bool(torch.all(pos[1:] > pos[:-1]))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scheme: PositionalScheme,
    layer: int = 0,
    opts: AttnOptions | None = None,
    bias: "torch.Tensor | DistanceBias | None" = None,
    rotate: bool = True,
    *,
    content: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    ssmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B,H,Lq,D], k/v [B,H,Lk,D] (k, v not yet rotated) -> (out [B,H,Lq,D], probs | None).

    ``scheme`` is resolved for ``layer`` here (``for_layer``: per-layer hybrids). ``bias`` optionally
    passes a precomputed [H, Lq, Lk] scheme bias, or a :class:`DistanceBias` (one per forward,
    shared by layers); ``rotate=False`` when q, k were already rotated (KV cache). ``content``:
    (p_q [B, H, Lq], p_k [B, H, Lk]) from ``scheme.content_positions`` (FoX, selective attention), which such
    schemes need. Model options of the layer (docs/attention.md): ``sinks`` [H], one learned sink logit per
    head in the softmax denominator (gpt-oss); ``ssmax`` [H], SSMax's s_h (logits times s_h·log n).
    """
    opts = opts or AttnOptions()
    scheme = scheme.for_layer(layer)
    if isinstance(bias, DistanceBias):
        bias = bias.of(scheme)
    if scheme.has_content and content is None:
        raise UserError(f"scheme {scheme.name!r} computes positions from the layer input; call attend() with "
                        "content=(p_q, p_k) from scheme.content_positions (GPT's blocks do)")
    if sinks is not None:
        check_sinks(sinks, q.shape[1], scheme, opts)
    if rotate:
        q, k = scheme.rotate(q, k, q_pos, k_pos)
    Dv = v.shape[-1]
    if q.shape[-1] != Dv:  # PoPE's complex form: fused kernels take one head size, so v gets zero columns
        v = F.pad(v, (0, q.shape[-1] - Dv))  # [B, H, Lk, D']
    out, probs = _run(q, k, v, q_pos, k_pos, scheme, layer, opts, bias, content, sinks, ssmax)
    return (out if out.shape[-1] == Dv else out[..., :Dv]), probs


def check_sinks(sinks: torch.Tensor, heads: int, scheme: PositionalScheme, opts: AttnOptions) -> None:
    """One-line UserErrors for attention sinks that cannot apply: the wrong shape, a scheme whose weights are not
    a softmax, or a logits sink (temperature alignment reads softmax rows over keys only)."""
    if sinks.shape != (heads,):
        raise UserError(f"attention sinks need one logit per head, shape ({heads},), got {tuple(sinks.shape)}")
    if scheme.replaces_softmax:
        raise UserError(f"attention sinks add a column to the softmax, but scheme {scheme.name!r} uses "
                        f"{scheme.replaces_softmax} instead; drop model.sinks or pick a softmax scheme")
    if opts.logits_sink is not None:
        raise UserError("temperature alignment reads softmax rows over the keys, but model.sinks adds a learned sink "
                        "column to every row; align a model without sinks")


def _run(q, k, v, q_pos, k_pos, scheme, layer, opts, bias, content, sinks, ssmax):
    """:func:`attend` after rotation: choose the path and run it (q, k rotated, v of q's head size)."""
    tau = opts.tau(layer)
    base = 1.0 / math.sqrt(q.shape[-1])
    scale = base / tau
    dense = bias if isinstance(bias, torch.Tensor) else None
    tau_s = row_tau(scheme, q_pos, k_pos, layer, ssmax, opts.window)  # [1, H|1, Lq|1] or None
    tau_rows = tau_s is not None and tau_s.shape[-1] > 1
    srows = sink_rows(sinks, tau_s)  # [1, H, Lq|1] at option tau 1, or None
    slopes = scheme.alibi_slopes(layer) if dense is None else None
    Lq, Lk = q.shape[2], k.shape[2]
    bias_free = not scheme.has_bias and not scheme.has_weight and content is None and opts.window is None
    same = (bias_free or slopes is not None) and Lq == Lk and (q_pos is k_pos or torch.equal(q_pos, k_pos))  # (a device sync: only when it matters)
    starts = _contiguous_starts(bias, q_pos, k_pos) if dense is None else (None, None)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    folded = slopes is not None and (starts[0] is None or starts[1] is None or content is not None or tau_rows
                                     or sinks is not None or opts.impl == "folded"
                                     or pays_long_eval(q.device.type, opts.impl, grad, Lq, Lk, flex.MIN_LENGTH)) \
        and _increasing(bias, q_pos) and _increasing(bias, k_pos)
    db, split = bias if isinstance(bias, DistanceBias) else None, None
    if dense is None and starts[0] is not None and scheme.toeplitz_rows() is not None:
        db = db or DistanceBias(scheme, q.device, table_dtype(q))
        split = max(0, min(Lq, math.floor(db.toeplitz_rows(layer)) - starts[0] + 1))  # queries at a.. <= T
    far = scheme.constant_beyond(layer) if dense is None else None
    path, block = select_path(q.device.type, scheme, opts, q.shape, Lk, same_pos=same and bias_free,
                              starts=starts, dense_bias=dense is not None, grad=grad, dtype=q.dtype,
                              folded=folded, tau_rows=tau_rows, split=split, sinks=sinks is not None,
                              same_keys=same, far=far)
    if path == "causal":
        if tau_s is not None:  # per head and query: dividing q's rows divides the whole logit
            q = q / tau_s[..., None].to(q.dtype)
        opts.ran(path)
        if srows is not None:
            return sink_sdpa(q, k, v, srows / tau, is_causal=True, scale=scale), None
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), None
    if path == "twopass":  # no bias: a scheme temperature divides q's rows, as on the causal path
        if tau_s is not None:
            q = q / tau_s[..., None].to(q.dtype)
        opts.ran(path)
        return twopass_attention(q, k, v, q_pos, k_pos, scheme, layer, starts, scale=scale, tau=tau,
                                 window=opts.window, block=block), None
    if path == "flex-content":  # FoX: positions from content as a FlexAttention score_mod (model/flex_content.py)
        try:
            c = content[1] * slopes.to(content[1].device, torch.float64).view(1, -1, 1)  # [B|1, H, Lk] s_h·p
            out = flex_content_path(q, k, v, c, scale=base, tau=tau, window=opts.window, scheme=scheme)
            opts.ran(path)
            return out, None
        except flex.Unavailable as why:  # never a traceback: the folded path
            flex.warn_unavailable(q, k, scheme.learnable, why, "folded")
            path, block = "folded", None
    if path == "folded":
        pq, pk = content if content is not None else (token_positions(q_pos), token_positions(k_pos))
        rows = None if tau_s is None else tau_s.expand(1, tau_s.shape[1], Lq)  # [1, H|1, Lq]
        opts.ran(path)
        return folded_attention(q, k, v, q_pos, k_pos, slopes, pq, pk, base_scale=base, scale=scale,
                                tau_rows=rows, window=opts.window, block=block, same=same,
                                sink_rows=None if srows is None else srows / tau, starts=starts), None
    tau_h = None if tau_s is None else tau_s.reshape(-1)  # [H|1]: per head only on these paths
    if path == "flex" and split is not None and split < Lq:  # rows beyond T: the scheme's flex_bias per element
        try:
            needs_grad = torch.is_grad_enabled() and (grad or scheme.learnable)
            if opts.exact_routes and flex_pieces.applies(scheme, needs_grad):
                out = flex_pieces.pieces_path(q, k, v, *starts, scheme, layer, scale=base, tau=tau,
                                              window=opts.window, tau_h=tau_h)  # tiles of few pieces: no MLP
                opts.ran("flex-pieces")
                return out, None
            out = flex.flex_rows_path(q, k, v, *starts, scheme, layer, scale=base, tau=tau, window=opts.window,
                                      tau_h=tau_h)
            opts.ran("flex-rows")
            return out, None
        except flex.Unavailable as why:  # never the eager dense fallback nor a traceback: the split path
            flex.warn_unavailable(q, k, scheme.learnable, why, "split")
            tb = min(int(opts.block_size), TOEPLITZ_BLOCK)
            path, block = "split", (tb if split > tb else None)
    if path == "split":
        opts.ran(path)
        return split_attention(q, k, v, q_pos, k_pos, scheme, layer, db, starts, split, block, scale=scale,
                               tau=tau, tau_h=tau_h, tau_s=tau_s, window=opts.window, block_size=opts.block_size,
                               memory_budget_mb=opts.memory_budget_mb), None
    if path == "nearfar":  # a bias constant beyond `far` (T5): flash over the far keys + the table's band
        db = db or DistanceBias(scheme, q.device, table_dtype(q))
        try:
            out = nearfar.nearfar_attention(q, k, v, db, layer, far, scale=base, tau=tau, tau_h=tau_h, block=block)
            opts.ran(path)
            return out, None
        except flex.Unavailable as why:  # the band's FlexAttention kernel cannot run it: the Toeplitz path
            flex.warn_unavailable(q, k, scheme.learnable, why)
            path, block = "toeplitz", min(int(opts.block_size), TOEPLITZ_BLOCK) if Lq > TOEPLITZ_BLOCK else None
    if path in ("toeplitz", "flex"):
        db = db or DistanceBias(scheme, q.device, table_dtype(q))
        if path == "flex":
            try:
                out = flex.flex_attention_path(q, k, v, *starts, db, layer, scale=base, tau=tau,
                                               window=opts.window, tau_h=tau_h, closed=opts.exact_routes)
                learn = scheme.learnable and torch.is_grad_enabled()
                opts.ran(flex.path_name(scheme, layer, learn, opts.exact_routes))
                return out, None
            except flex.Unavailable as why:  # never the eager dense fallback nor a traceback: the Toeplitz path
                flex.warn_unavailable(q, k, scheme.learnable, why)
                block = min(int(opts.block_size), TOEPLITZ_BLOCK) if q.shape[2] > TOEPLITZ_BLOCK else None
        opts.ran("toeplitz")
        return toeplitz_attention(q, k, v, *starts, db, layer, scale=scale, tau=tau,
                                  window=opts.window, block=block, tau_h=tau_h), None
    if path == "fallback" and block is not None:  # rows per block within the memory budget
        per_row = q.shape[0] * q.shape[1] * k.shape[2] * 4 * (3 if scheme.has_weight else 1)
        block = max(1, min(block, int(opts.memory_budget_mb * 2**20 // per_row)))
    opts.ran(path)
    return dense_attention(q, k, v, q_pos, k_pos, scheme, layer, tau=tau, window=opts.window, bias=dense,
                           block=block, fused=path == "fallback", need_probs=opts.need_probs,
                           sink=opts.logits_sink, content=content, tau_s=tau_s, sinks=srows)

"""The one interface every positional scheme implements (docs/architecture.md, docs/attention.md).

A scheme is an ``nn.Module`` whose hooks are all no-ops by default; attention
(``model/attention.py``) asks for each one at its place in the one order of operations:

* ``embed(positions, dim)``      -> [L, dim] added to the token embeddings (absolute schemes), or None
* ``rotate(q, k, q_pos, k_pos)`` -> (q, k) rotated per position (rotary), identity by default; it may
                                    change their head size (PoPE: 2·d), attention then pads v to it
* ``bias(q_pos, k_pos, layer)``  -> [H, Lq, Lk] additive bias on the *scaled* logits
                                    q·k/sqrt(d_head), ``-inf`` where masked, or None
* ``alibi_slopes(layer)``        -> [H] when the whole bias has the ALiBi form -slope_h·(p_m - p_n),
                                    p the token positions (ALiBi) or the content positions below
* ``content_positions(x, layer, past)`` -> p [B, H, L] from the layer's attention input x (FoX's
                                    forget gate); ``past`` [B, H] continues a KV cache. More generally the
                                    per-token values a ``has_content`` scheme keeps beside each key (the
                                    KV cache stores them): selective attention's accumulated selection
* ``temperature(q_pos, layer)``  -> tau [H|1, Lq|1] dividing the whole logit (per head, per query),
                                    times ``AttnOptions.temperature``; or None
* ``scores(logits, block)``      -> logits of a query block, seeing whole rows and all heads
                                    (CoPE, DAPE); reference path only
* ``normalize(logits, block)``   -> attention weights replacing softmax (stick-breaking), or None
* ``accumulate(logits, block)``  -> S [B, bq, bk] >= 0: how much each query masks each key for every later
                                    query (selective attention); the reference path subtracts the running
                                    sum F from every head's logits and keeps F per key; or None
* ``for_layer(layer)``           -> the scheme a layer uses (per-layer hybrids); ``self`` by default
* ``toeplitz_rows()``            -> [layers|1] position T_l up to which every query's bias is the distance
                                    table ``bias_from_distance(m - n)`` (FIRE: queries at m <= L), or None
* ``distance_rows(q_pos, d_lo, width, layer, out)`` -> [H, Lq, width] the bias of a block of queries as a
                                    function of the distance, G[h, r, i] = b_h(m_r, m_r - (d_lo + i)),
                                    -inf for d < 0 (forward only; FIRE beyond L), or None
* ``flex_bias(layer, a, c, Lq, n)`` -> bias(h, q_idx, kv_idx) of the queries at a.. over the keys at c..,
                                    pointwise on captured tensors: the scheme's own FlexAttention term
                                    where its rows are not one distance table (FIRE beyond L), or None
* ``constant_beyond(layer)``     -> D when b_h(d) = b_h(D) for every distance d >= D (T5: the last bucket from
                                    max_distance on), or None: attention may score those keys by plain flash
                                    attention merged with a band of D keys (the near-far path)
* ``closed_form(layer, dtype, device)`` -> f(h, d) = b_h(d) for float distances d, pointwise on [H] tensors it
                                    captures (detached): FlexAttention's score_mod computes it instead of
                                    gathering from the [H, n] table (KERPLE, Qin), or None
* ``flex_pieces(layer, a, c, Lq, n, dtype)`` -> (ψ [n], ι [Lq], t [K], α [H, K+1], β [H, K+1]) when the bias is
                                    b_h(m, n) = α_h[s] + β_h[s]·x with x = ψ[m − n]·ι[m] and s = #{k : t_k < x}
                                    (FIRE's MLP as linear pieces, forward only), or None

Relative schemes (bias depends only on the distance k = m - n >= 0) subclass
:class:`RelativeBias` and implement only ``bias_from_distance(dist, layer)``; the base class
turns that into the blocked ``bias`` (gather from an O(H·L) distance table, causal mask) so no
scheme ever needs the full L x L matrix.

The KERPLE "wht" kernels (thesis §3.7.3) *multiply* q·k by a positive kernel instead of adding
to it; they also implement ``weight_from_distance`` and the attention module applies it on its
plain/blocked path (``has_weight``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .positions import inference_mode, inference_tensor


class SchemeError(ValueError):
    """Bad scheme name or parameter; the message is one line that names the fix."""


@dataclass
class ScoreBlock:
    """What the score-level hooks (``scores``, ``normalize``) see of one query block, on the
    reference path: rotated q [B, H, bq, D] and k [B, H, bk, D] at positions q_pos [bq], k_pos [bk]
    (every key the block's rows may see, in order), ``qk`` = q·k / sqrt(d_head) (times a "wht"
    kernel; every entry finite), ``bias`` the scheme's additive term [H|1, bq, bk] with 0 where not
    visible (None without a bias), ``visible`` [bq, bk] the causal/window mask (True = visible),
    ``layer`` the layer index. Keys beyond ``visible`` are future or out-of-window tokens: a hook must
    not read them (the contract tests check that a prefix gives the same output as the whole). ``added``
    [B, bk] is set by the reference path for an ``accumulate`` scheme: the block's selection summed over its
    rows, which the keys' state gains after the block."""

    q: torch.Tensor
    k: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    qk: torch.Tensor
    bias: torch.Tensor | None
    visible: torch.Tensor
    layer: int
    added: torch.Tensor | None = None


class PositionalScheme(nn.Module):
    #: registry id, e.g. "alibi"
    name: ClassVar[str] = "base"
    #: "none" | "absolute" | "rotary" | "bias" | "content" (positions from the layer input, FoX) |
    #: "score" (score-level hooks: CoPE, DAPE, stick-breaking) | "hybrid" (a scheme per layer)
    kind: ClassVar[str] = "none"
    #: spec row and paper/equation
    paper: ClassVar[str] = ""
    #: one-line description shown by `extrapolab schemes`
    summary: ClassVar[str] = ""
    #: bias depends only on m - n (Toeplitz); learned APE and NoPE are trivially "relative"
    relative: ClassVar[bool] = True
    #: bias differs per layer (RegularGPT sliding-dilated levels)
    layer_dependent: ClassVar[bool] = False
    #: q·k is multiplied by a positional kernel (KERPLE wht variants)
    has_weight: ClassVar[bool] = False
    #: ``content_positions`` returns per-token values kept beside each key: positions computed from the layer
    #: input (FoX, with ``alibi_slopes``), or the state of ``accumulate`` (selective attention)
    has_content: ClassVar[bool] = False
    #: the bias is 0 wherever it is finite (a pure mask: windowed attention): fused kernels need only the mask
    mask_only: ClassVar[bool] = False
    #: non-empty for schemes with score-level hooks: why no fused kernel can run them (shown by
    #: ``extrapolab bench``); attention then always takes the reference path, in query blocks
    reference_only: ClassVar[str] = ""
    #: non-empty when ``normalize`` replaces softmax, saying by what: softmax statistics (Algorithm 1's
    #: P_max and entropy, the temperature alignment) do not describe such a scheme's attention
    replaces_softmax: ClassVar[str] = ""
    #: non-empty when the theoretical receptive field (Qin et al. 2024, eq. 22) has no formula for
    #: this scheme, saying why (analysis/theory.py reports it instead of a verdict)
    no_trf: ClassVar[str] = ""

    def __init__(self, num_heads: int, **_: object) -> None:
        super().__init__()
        if int(num_heads) < 1:
            raise SchemeError(f"num_heads must be >= 1, got {num_heads}; pass --set model.heads=8")
        self.num_heads = int(num_heads)
        self._table_cache: dict[tuple, object] = {}

    def cached(self, key: tuple):
        """``_table_cache[key]`` (a tensor, or a tuple whose first item is one), or None when
        missing or built under ``inference_mode`` while autograd now runs: autograd may not save
        inference tensors (e.g. input gradients for an ERF after an evaluation)."""
        hit = self._table_cache.get(key)
        t = hit[0] if isinstance(hit, tuple) else hit
        if t is not None and inference_tensor(t) and not inference_mode():
            return None
        return hit

    def on_device(self, key: tuple, device, make) -> torch.Tensor:
        """``make()`` -- a constant built on the host (frequencies, slopes) -- on ``device``, copied there once and
        kept in the table cache. A host-to-device copy on every call is a blocking copy on CUDA: the host waits for
        every queued kernel, once per layer (FoX's slopes did that in every training step)."""
        k = ("on_device", str(torch.device(device))) + tuple(key)
        hit = self.cached(k)
        if hit is None:
            hit = self._table_cache[k] = make().to(device)
        return hit

    # ---- hooks -------------------------------------------------------------------------
    def embed(self, positions: torch.Tensor, dim: int) -> torch.Tensor | None:
        return None

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) at their positions, [B, H, Lq|Lk, D'] with D' the head size attention scales by (1/sqrt(D')):
        D for a rotation, 2·D for PoPE's complex form (attention pads v with zeros to D' for fused kernels)."""
        return q, k

    def bias(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int = 0
    ) -> torch.Tensor | None:
        return None

    def weight(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int = 0
    ) -> torch.Tensor | None:
        return None

    def second_pass(self):
        """None: one attention pass (every scheme but the multi-pass RoPE extensions). Multi-pass
        schemes (Self-Extend, ReRoPE, DCA; positional/rope_twopass.py) return ``Passes``: each key
        is scored in one of its passes (a distance band and chunk range), with the rotated q, k moved
        to that pass's positions (model/twopass.py, docs/attention.md)."""
        return None

    def for_layer(self, layer: int) -> "PositionalScheme":
        """The scheme layer ``layer`` attends with: ``self``, except for per-layer hybrids. Resolved
        in one place per layer (``Block.forward``, ``attend``); the result's own ``for_layer`` is itself."""
        return self

    def toeplitz_rows(self) -> torch.Tensor | None:
        """None, or T [layers|1] (one value when the layers share it): for a query at position m <= T_l the
        bias of layer l is ``bias_from_distance(m - n, l)``, a distance table, while ``bias`` holds for every
        query (FIRE: the normaliser ψ(max(L, m)) is ψ(L) up to m = L). Attention then runs those queries on
        the Toeplitz path and the others on dense blocks (docs/attention.md, the "split" path); it reads T
        once per forward. Detached, no host read here."""
        return None

    def distance_rows(self, q_pos: torch.Tensor, d_lo: int, width: int, layer: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
        """None, or G [H, Lq, width] with G[h, r, i] = b_h(q_pos[r], q_pos[r] - d) at the distance d = d_lo + i
        (-inf for d < 0): a block of rows of ``bias`` laid out by distance instead of by key, for a forward
        without gradients, written into ``out`` (that shape and the scheme's dtype, rows may be strided) when
        given. The split path reads it through a strided view over keys in reverse order (docs/attention.md),
        so a scheme whose rows are cheap by distance (FIRE: f_θ is linear on bands of distances) never
        evaluates its bias per (query, key)."""
        return None

    def flex_bias(self, layer: int, a: int, c: int, Lq: int, n: int):
        """None, or ``bias(h, q_idx, kv_idx)`` -> the bias b_h(a + q_idx, c + kv_idx) for the Lq queries at
        positions a.. over keys at c.. (distance d = a - c + q_idx - kv_idx, 0 <= d < n; the mask is the
        caller's), written with pointwise tensor ops on tensors it captures (its parameters keep their
        graph): FlexAttention's ``score_mod`` evaluates it per (query, key) inside one fused kernel, so a
        scheme whose rows are not one distance table (FIRE beyond L: each query its own normaliser) needs
        no mask (docs/attention.md, row 7 on CUDA). No host read. Each captured tensor that requires a
        gradient may be indexed ONCE (FlexAttention's compiled backward scatters one index per tensor; a second
        is "multiple indexing operations on the same tensor"): index copies from :func:`flex_copies` instead."""
        return None

    def constant_beyond(self, layer: int = 0) -> int | None:
        """None, or a distance D >= 1 with b_h(d) = b_h(D) for every d >= D (T5: every distance from max_distance on
        shares the last bucket). A query's keys at distances >= D then score as plain causal attention whose
        log-sum-exp the constant shifts, merged exactly with a band of the D nearest keys that carries the table
        (docs/attention.md, the near-far path). The constant is read from the scheme's own distance table at D."""
        return None

    def closed_form(self, layer: int = 0, dtype: torch.dtype = torch.float32, device=None):
        """None, or ``f(h, d)`` -> b_h(d) for a float tensor of distances d >= 0 in ``dtype``, written with pointwise
        tensor ops on [H] tensors it captures (detached, on ``device``): FlexAttention's score_mod then evaluates the
        bias where it is cheap (a log1p, a power) instead of gathering it from the [H, n] distance table, whose
        [M, N] gather shrinks the kernel's tiles (docs/attention.md, "Forms of the score_mod"). It must equal
        ``bias_from_distance`` to rounding (tests/test_schemes_contract.py)."""
        return None

    def flex_pieces(self, layer: int, a: int, c: int, Lq: int, n: int, dtype: torch.dtype = torch.float32):
        """None, or (ψ [n], ι [Lq], t [K], α [H, K+1], β [H, K+1]), all detached in ``dtype``, when the bias of the
        query at a + i over the key at c + j (distance d = a - c + i - j, 0 <= d < n) is piecewise linear in a
        separable input: b_h = α_h[s] + β_h[s]·x with x = ψ[d]·ι[i] and s = #{k : t_k < x} (t sorted ascending,
        ψ non-decreasing, ι positive and non-increasing). FIRE's MLP is such a function of its input (forward
        only): the flex-pieces path then evaluates one piece per score where a tile of queries and keys spans
        few pieces, and ``flex_bias`` elsewhere (model/flex_pieces.py)."""
        return None

    def alibi_slopes(self, layer: int = 0) -> torch.Tensor | None:
        """[H] float64 when this layer's whole additive term is -slope_h·(p_m - p_n) (ALiBi form),
        with p the token positions or, for ``has_content`` schemes, ``content_positions``; else None.
        Attention then folds the key term into one extra head dimension (docs/attention.md), exact
        at any positions, gaps and random draws included. On the scheme's device (a buffer, or
        :meth:`on_device`): attention calls it per layer, and a host tensor would be copied each time."""
        return None

    def content_positions(self, x: torch.Tensor, layer: int = 0,
                          past: torch.Tensor | None = None) -> torch.Tensor | None:
        """Positions from content: x [B, L, C] (the layer's attention input) -> p [B, H, L] float64,
        non-decreasing along the sequence; ``past`` [B, H] is the position of the last cached key
        (a KV cache continues from it). Only ``has_content`` schemes return a tensor."""
        return None

    def temperature(self, q_pos: torch.Tensor, layer: int = 0) -> torch.Tensor | None:
        """tau [H|1, Lq|1] (> 0) dividing the whole logit of each head and query position, on top of
        ``AttnOptions.temperature``; None for 1. Per head only ([H, 1]) keeps every fast path."""
        return None

    def scores(self, logits: torch.Tensor, block: ScoreBlock) -> torch.Tensor:
        """Score-level hook: logits [B, H, bq, bk] of a query block (scaled q·k, bias, -inf masked)
        -> new logits of the same shape; sees whole rows and all heads. Masked entries stay -inf
        whatever it returns. Only ``reference_only`` schemes override it."""
        return logits

    def normalize(self, logits: torch.Tensor, block: ScoreBlock) -> torch.Tensor | None:
        """Attention weights [B, H, bq, bk] from the logits after the temperature, replacing softmax
        (stick-breaking); None keeps softmax. Weights of masked keys must be 0."""
        return None

    def accumulate(self, logits: torch.Tensor, block: ScoreBlock) -> torch.Tensor | None:
        """Selection S [B, bq, bk] >= 0 (0 where not visible) from a block's logits [B, H, bq, bk] after the
        score hook: query row r masks key c by S[:, r, c] for every LATER query (selective attention,
        Leviathan et al. 2025). The reference path keeps F[n] = Σ S[k, n] over the queries k seen so far per
        key (in ``content``, so the KV cache carries it), subtracts F from every head's logits and adds this
        block's S after it. Only ``reference_only`` and ``has_content`` schemes override it; None: no selection."""
        return None

    # ---- metadata ----------------------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        return self.kind == "bias"

    @property
    def accumulates(self) -> bool:
        """The scheme masks keys for later queries (``accumulate``; selective attention)."""
        return type(self).accumulate is not PositionalScheme.accumulate

    @property
    def has_flex_bias(self) -> bool:
        """The scheme writes its own FlexAttention term (``flex_bias``; FIRE)."""
        return type(self).flex_bias is not PositionalScheme.flex_bias

    @property
    def has_flex_pieces(self) -> bool:
        """The scheme's bias is linear pieces of a separable input (``flex_pieces``; FIRE)."""
        return type(self).flex_pieces is not PositionalScheme.flex_pieces

    @property
    def learnable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def check_length(self, length: int) -> None:
        """Raise a one-line error if the scheme cannot encode `length` positions."""

    def options(self) -> dict:
        """The resolved options (saved with each run and shown by `extrapolab schemes`)."""
        return {}

    def constrain_(self) -> None:
        """Project learnable parameters back into their constraint set (after an optimizer step)."""

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in {"heads": self.num_heads, **self.options()}.items())


class Delegating:
    """Mixin of a scheme built around another one (DAPE's and selective attention's ``base``, a layer type's
    window or chunk around its ``inner``): rotation, temperature, length checks and parameter constraints
    are that scheme's. ``delegate`` names the attribute that holds it."""

    delegate = "base"

    def rotate(self, q, k, q_pos, k_pos):
        return getattr(self, self.delegate).rotate(q, k, q_pos, k_pos)

    def temperature(self, q_pos, layer=0):
        return getattr(self, self.delegate).temperature(q_pos, layer)

    def check_length(self, length: int) -> None:
        getattr(self, self.delegate).check_length(length)

    def constrain_(self) -> None:
        getattr(self, self.delegate).constrain_()


def flex_copies(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` tensors equal to ``t`` for a ``flex_bias`` that indexes ``t`` n times: where ``t`` requires a
    gradient, every index after the first reads its own clone (the gradients flow back through the clones and
    add up in ``t``), since FlexAttention's compiled backward takes one index per gradient-requiring captured
    tensor (docs/attention.md, "What a score_mod may gather"); ``t`` itself n times where none is needed."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return [t] * n
    return [t] + [t.clone() for _ in range(n - 1)]


def causal_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """dist[i, j] = q_pos[i] - k_pos[j]; negative means a future key (masked)."""
    return q_pos.reshape(-1, 1) - k_pos.reshape(1, -1)  # [Lq, Lk]


class RelativeBias(PositionalScheme):
    """A scheme whose additive bias is a function of k = m - n >= 0 only."""

    kind: ClassVar[str] = "bias"
    relative: ClassVar[bool] = True

    def bias_from_distance(self, dist: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """dist: long tensor [...] of non-negative distances -> float [H, ...] bias (may be -inf)."""
        raise NotImplementedError

    def weight_from_distance(self, dist: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Multiplicative kernel on q·k, [H, ...]; only for ``has_weight`` schemes."""
        raise NotImplementedError

    def distance_tables(self, n: int, device=None, dtype=torch.float32) -> torch.Tensor | None:
        """[G, H, n]: every layer's table for distances 0..n-1 at once, for a learnable layer-dependent scheme that
        can batch its layers (a training forward then builds them in one set of kernels instead of one per layer);
        None (the default): :class:`~extrapolab.model.tables.DistanceBias` builds them layer by layer."""
        return None

    # ---- distance tables: O(H·L) work, then a gather ----------------------------------
    def distance_table(
        self, n: int, layer: int = 0, device=None, dtype=torch.float32
    ) -> torch.Tensor:
        """[H, n] bias for distances 0..n-1. Cached for parameter-free schemes (grows by doubling)."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if self.learnable:
            dist = torch.arange(n, device=device)
            return self.bias_from_distance(dist, layer).to(dtype)  # [H, n]
        key = (layer, device, dtype)
        cached = self.cached(key)
        if cached is None or cached.shape[-1] < n:
            size = max(n, 2 * (cached.shape[-1] if cached is not None else 0), 256)
            with torch.no_grad():
                dist = torch.arange(size, device=device)
                cached = self.bias_from_distance(dist, layer).to(dtype).contiguous()  # [H, size]
            self._table_cache[key] = cached
        return cached[:, :n]

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int = 0, dtype=torch.float32):
        dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
        n = int(dist.max().clamp(min=0).item()) + 1
        table = self.distance_table(n, layer, q_pos.device, dtype)  # [H, n]
        out = table[:, dist.clamp(min=0)]  # [H, Lq, Lk]
        return out.masked_fill(dist < 0, -math.inf)

    def weight(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int = 0):
        if not self.has_weight:
            return None
        dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
        w = self.weight_from_distance(dist.clamp(min=0), layer)  # [H, Lq, Lk]
        return w.masked_fill(dist < 0, 0.0)

    def _apply(self, fn, *args, **kwargs):  # .to()/.cuda() invalidate cached tables
        self._table_cache.clear()
        return super()._apply(fn, *args, **kwargs)


def alibi_style_ratios(num_heads: int) -> torch.Tensor:
    """h·8/H for h = 1..H: ALiBi's exponents, reused as Sandwich's compression ratios."""
    return torch.arange(1, num_heads + 1, dtype=torch.float64) * 8.0 / num_heads  # [H]

"""Layer types: each layer attends with its type's scheme, options and window or chunk (the layouts of
Gemma 3, Cohere's Command A, Llama 4 and SmolLM3: positional/layouts.py; docs/attention.md, "Layer types").

A model option, ``model.layer_types`` (one type name per layer, or a pattern repeated over the layers)
with ``model.types`` ({name: :class:`LayerType`}), builds one :class:`Layout`: a scheme whose
``for_layer(l)`` is the scheme of layer l's type, resolved in one place per layer (``Block.forward``,
``attend``), as Hugging Face builds ``layer_types`` and ``rope_parameters`` per type (transformers 5).
Each type's scheme is registered (``rotary`` with its own ``base``, ``none``, ``alibi``, ...), built
once with its own options and its own distance tables (``DistanceBias.of``), so layers of one type
share it. A type may restrict its keys:

* ``window: w`` -- sliding-window attention (Beltagy et al. 2020, Longformer §3.1; Gemma 3's local
  layers): keys at distance m - n < w, the Sandwich paper's hard window (§3.3) over the type's scheme,
  as one distance table (:class:`SlidingWindow`), so it runs on the Toeplitz / flex paths with no
  L x L tensor, and a KV cache keeps only the newest w - 1 keys of such a layer;
* ``chunk: c`` -- chunked attention (Llama 4's RoPE layers): keys in the query's own chunk,
  floor(n / c) = floor(m / c) (transformers' ``chunked_overlay``). The mask depends on absolute
  positions, so it is no distance table: :class:`Chunked` holds it as its ``bias`` (the reference path
  and the analyses read it), and GPT's blocks attend chunk by chunk (model/chunked.py: one fused call
  per chunk group, never L x L); a KV cache keeps the newest c - 1 keys.

The old ``hybrid`` scheme (positional/hybrid.py) is the layout with types ``rope`` and ``nope``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .base import Delegating, PositionalScheme, RelativeBias, SchemeError, causal_distance
from .registry import REGISTRY, build, scheme_params

#: the one type a layer list may name without defining it: the model's own scheme, every key visible
FULL = "full"


@dataclass
class LayerType:
    """One layer type: its scheme (``""``: the model's ``model.scheme``, whose ``scheme_params`` these
    update), the scheme's options, and at most one key restriction (0 = none)."""

    scheme: str = ""
    scheme_params: dict = field(default_factory=dict)
    #: sliding window: keys at distance < window only (Longformer §3.1; Gemma 3 local layers)
    window: int = 0
    #: chunked attention: keys in the query's chunk floor(p / chunk) only (Llama 4 RoPE layers)
    chunk: int = 0


def as_layer_type(spec, where: str) -> LayerType:
    """A :class:`LayerType` from itself or a plain mapping (a config read without its types)."""
    if isinstance(spec, LayerType):
        return spec
    if not isinstance(spec, dict):
        raise SchemeError(f"{where} must be a mapping like {{scheme: rotary, window: 16}}, got {spec!r}")
    keys = set(LayerType.__dataclass_fields__)
    bad = sorted(set(spec) - keys)
    if bad:
        raise SchemeError(f"{where} has no field {bad[0]!r}; a layer type has {', '.join(sorted(keys))}")
    return LayerType(**spec)


def expand_types(layer_types, layers: int) -> list[str]:
    """One type name per layer: ``layer_types`` itself (one per layer) or a pattern repeated over the
    layers; a pattern whose length does not divide ``layers`` is a one-line error."""
    names = [str(t) for t in layer_types]
    n = len(names)
    if n == 0 or int(layers) % n:
        raise SchemeError(f"model.layer_types has {n} entries, which does not divide model.layers={layers}; "
                          f"give one type per layer ({layers} entries) or a pattern whose length divides {layers}")
    return names * (int(layers) // n)


def _toeplitz_bias(s: PositionalScheme) -> bool:
    """The scheme's bias is one distance table (positional cannot ask model.tables.is_toeplitz)."""
    return isinstance(s, RelativeBias) and type(s).bias is RelativeBias.bias and s.toeplitz_rows() is None


def _check_inner(inner: PositionalScheme, what: str) -> None:
    why = ("its score-level hooks see whole rows" if inner.reference_only else
           "it computes positions from the layer input" if inner.has_content else
           "it attends in two passes" if inner.second_pass() is not None else
           "its kernel multiplies q·k" if inner.has_weight else "")
    if not why and inner.has_bias and not _toeplitz_bias(inner):
        why = "its bias is not one table of the distance"
    if why:
        raise SchemeError(f"a {what} cannot restrict scheme {inner.name!r} ({why}); give that type no "
                          f"{what}, or a scheme such as rotary, none or alibi")


class SlidingWindow(Delegating, RelativeBias):
    """``inner``'s rotation (and bias) with a hard window: -inf at distance >= w (Sandwich paper §3.3),
    as one relative scheme, so the Toeplitz / flex paths run it (docs/attention.md)."""

    delegate = "inner"

    paper = "Beltagy et al. 2020 (Longformer) §3.1 sliding window; Sandwich paper §3.3 hard window"
    summary = "a layer type's scheme with keys at distance < w only"

    def __init__(self, num_heads: int, inner: PositionalScheme, window: int) -> None:
        super().__init__(num_heads)
        if int(window) < 1:
            raise SchemeError(f"a layer window must be >= 1, got {window}; e.g. --set model.types.sliding.window=16")
        _check_inner(inner, "window")
        self.inner, self.window = inner, int(window)
        self.name = f"{inner.name}+window{self.window}"
        self.relative = inner.relative
        self.mask_only = not inner.has_bias  # 0 inside the window: a fused kernel needs only the mask

    @property
    def cache_keep(self) -> int:
        """Cached keys a later query of this layer can still see."""
        return self.window - 1

    def bias_from_distance(self, dist, layer=0):
        if self.inner.has_bias:
            b = self.inner.bias_from_distance(dist, layer)  # [H, ...]
        else:
            b = torch.zeros(dist.shape, dtype=torch.float64, device=dist.device).expand(self.num_heads, *dist.shape)
        return b.masked_fill(dist >= self.window, -math.inf)  # [H, ...]

    def options(self):
        return {"window": self.window, **self.inner.options()}


class Chunked(Delegating, PositionalScheme):
    """``inner`` with chunked attention: a query at m sees the keys n <= m with floor(n / c) = floor(m / c)
    (Llama 4; transformers' ``chunked_overlay``). ``bias`` is that mask (plus ``inner``'s bias), which the
    reference path and the analyses read; GPT's blocks attend chunk by chunk instead (model/chunked.py)."""

    delegate = "inner"

    kind = "bias"
    relative = False
    paper = "Llama 4 chunked attention (transformers Llama4 attention_chunk_size, chunked_overlay)"
    summary = "a layer type's scheme with keys in the query's own chunk of c positions"

    def __init__(self, num_heads: int, inner: PositionalScheme, chunk: int) -> None:
        super().__init__(num_heads)
        if int(chunk) < 1:
            raise SchemeError(f"a layer chunk must be >= 1, got {chunk}; e.g. --set model.types.chunked.chunk=16")
        _check_inner(inner, "chunk")
        self.inner, self.chunk = inner, int(chunk)
        self.name = f"{inner.name}+chunk{self.chunk}"

    @property
    def cache_keep(self) -> int:
        return self.chunk - 1

    def bias(self, q_pos, k_pos, layer=0, dtype=torch.float32):
        dist = causal_distance(q_pos, k_pos)  # [Lq, Lk]
        same = (q_pos.reshape(-1, 1) // self.chunk) == (k_pos.reshape(1, -1) // self.chunk)  # [Lq, Lk]
        if self.inner.has_bias:
            b = self.inner.bias(q_pos, k_pos, layer).to(dtype)  # [H, Lq, Lk]
        else:
            b = torch.zeros(dist.shape, dtype=dtype, device=q_pos.device).expand(self.num_heads, *dist.shape)
        return b.masked_fill(~(same & (dist >= 0)), -math.inf)  # [H, Lq, Lk]

    def options(self):
        return {"chunk": self.chunk, **self.inner.options()}


class Layout(PositionalScheme):
    """A scheme per layer type (module doc). ``layer_types``: one name per layer (after
    :func:`expand_types`); ``types``: {name: LayerType}; ``default``: (scheme, params) of a type that
    names no scheme; ``sizes``: model sizes a type's scheme may take (dim, layers, head_dim, init_std,
    original_length); ``context``: L_tr, which no window or chunk may exceed."""

    name = "layout"
    kind = "hybrid"
    layer_dependent = True
    relative = True
    paper = "per-layer types: Gemma 3 (arXiv 2503.19786), Yang et al. 2025 (arXiv 2501.18795), Llama 4, SmolLM3"
    summary = "each layer its type's scheme, options and window or chunk"

    def __init__(self, num_heads: int, layer_types: list[str], types: dict, *, default: tuple[str, dict] = ("rotary", {}),
                 sizes: dict | None = None, context: int | None = None, build_unused: bool = False) -> None:
        super().__init__(num_heads)
        self.layer_types = [str(t) for t in layer_types]
        self.types = {str(k): as_layer_type(v, f"model.types.{k}") for k, v in (types or {}).items()}
        used = list(dict.fromkeys(self.layer_types))
        for t in used:
            if t not in self.types and t != FULL:
                known = ", ".join(dict.fromkeys([*self.types, FULL]))
                raise SchemeError(f"unknown layer type {t!r} in model.layer_types; define it under model.types "
                                  f"(e.g. --set 'model.types.{t}={{window: 16}}') or use one of: {known}")
        if FULL in used:
            self.types.setdefault(FULL, LayerType())
        self.default = (str(default[0]), dict(default[1] or {}))
        self._sizes = dict(sizes or {})
        reserved = set(dir(self))
        schemes = {}
        for t in (self.types if build_unused else used):
            if not t.isidentifier() or t in reserved:
                raise SchemeError(f"layer type name {t!r} is not usable (not an identifier, or a name the layout "
                                  "itself uses); rename it, e.g. sliding, full, local, global")
            schemes[t] = self._build(t, self.types[t], context)
            self.add_module(t, schemes[t])  # state-dict keys scheme.<type>.*: the old hybrid's rope / nope
        self._per_layer = [schemes[t] for t in self.layer_types]  # a plain list: not registered twice

    def _build(self, t: str, spec: LayerType, context: int | None) -> PositionalScheme:
        name = spec.scheme or self.default[0]
        params = {**(self.default[1] if not spec.scheme else {}), **(spec.scheme_params or {})}
        cls = REGISTRY.get(name)
        if cls is None or cls.kind in ("absolute", "hybrid"):
            kind = "an absolute scheme (its embedding is added once, at the input)" if cls is not None and \
                cls.kind == "absolute" else "itself per-layer" if cls is not None else "not a registered scheme"
            raise SchemeError(f"layer type {t!r}: scheme {name!r} is {kind}; give a per-layer scheme such as rotary, "
                              "none, nope-headscale or alibi")
        accepted = scheme_params(cls)
        try:
            inner = build(name, self.num_heads, **params,
                          **{k: v for k, v in self._sizes.items() if k in accepted and k not in params})
        except SchemeError as e:  # the scheme's own fix names model.scheme_params: here it is the type's
            raise SchemeError(f"layer type {t!r}: " + str(e).replace("model.scheme_params", f"model.types.{t}."
                              "scheme_params")) from None
        for what, size in (("window", spec.window), ("chunk", spec.chunk)):
            if size and context and int(size) > int(context):
                raise SchemeError(f"layer type {t!r}: {what} {size} is larger than the context model.train_length="
                                  f"{context}, so it never restricts a training sequence; give a {what} <= {context} "
                                  f"or drop it (a full layer)")
        if spec.window and spec.chunk:
            raise SchemeError(f"layer type {t!r} has a window and a chunk; give it one of them (or two types)")
        try:
            if spec.window:
                return SlidingWindow(self.num_heads, inner, spec.window)
            return Chunked(self.num_heads, inner, spec.chunk) if spec.chunk else inner
        except SchemeError as e:
            raise SchemeError(f"layer type {t!r}: {e}") from None

    def for_layer(self, layer: int) -> PositionalScheme:
        if not 0 <= int(layer) < len(self._per_layer):
            raise SchemeError(f"the layout has {len(self._per_layer)} layers but layer {layer} attends; build it with "
                              "model.layers layer types")
        return self._per_layer[int(layer)]

    def type_of(self, layer: int) -> str:
        return self.layer_types[int(layer)]

    def rotate(self, q, k, q_pos, k_pos):
        raise SchemeError(f"{self.name} rotates per layer: call scheme.for_layer(layer).rotate(...) (attend and "
                          "GPT's blocks do)")

    def check_length(self, length: int) -> None:
        for s in dict.fromkeys(self._per_layer):
            s.check_length(length)

    def constrain_(self) -> None:
        for s in self.children():
            s.constrain_()

    def options(self):
        return {"layer_types": list(self.layer_types),
                "types": {k: asdict(v) for k, v in self.types.items() if k in self.layer_types}}

"""The published layer layouts, at our sizes (``model.layout``; positional/layout.py builds them).

Each layout is its source's rule for which layer gets which type, applied to ``model.layers`` as the
source's own configuration code applies it to any depth (transformers 5.23: a layer is global when
(l + 1) % period == 0), and the types' schemes and options as published. Windows and chunks are the
one size we scale: the published ones (Gemma 3: 1,024 of a 32k pre-training context; Command A: 4,096;
Llama 4: chunks of 8,192) would leave windows of 2 tokens at L_tr = 64, so every layout here uses
w = c = L_tr / 4 unless ``model.types`` sets it (``--set model.types.sliding.window=32``).

| layout | period | local layers | global layers | source |
| --- | --- | --- | --- | --- |
| ``gemma3`` | 6 (5:1) | ``sliding``: RoPE θ = 10,000, window w | ``full``: RoPE θ = 1,000,000 | Gemma Team 2025, Gemma 3 Technical Report, arXiv 2503.19786, §2.1 (5:1 local/global, local RoPE base 10k, global 1M); transformers ``Gemma3TextConfig`` |
| ``rnope-swa`` | 4 (3:1) | ``sliding``: RoPE, window w | ``full``: NoPE | Yang et al. 2025, arXiv 2501.18795, §5 (RNoPE-SWA); Cohere's Command A as transformers' ``Cohere2`` builds it (RoPE only on sliding layers) |
| ``irope`` | 4 (3:1) | ``chunked``: RoPE, chunks of c | ``full``: NoPE with q·(1 + β·ln(1 + floor((m + 1)/c))), β = 0.1 | Meta 2025, Llama 4 ("iRoPE"); transformers ``Llama4TextConfig`` (``no_rope_layers``, ``attention_chunk_size``, ``floor_scale`` = the chunk, ``attn_scale``) |
| ``smollm3`` | 4 (3:1) | ``rope``: RoPE, full attention | ``nope``: NoPE, full attention | Hugging Face 2025, SmolLM3 (``no_rope_layer_interval`` = 4); transformers ``SmolLM3Config`` |

Not carried over: Gemma 3's and Llama 4's QK-norm, Gemma's logit soft-capping and sandwich norms, the
sizes and the RoPE scaling the models add when they extend their context after pre-training.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeError
from .layout import LayerType


@dataclass(frozen=True)
class Published:
    period: int  # layer l is global when (l + 1) % period == 0
    local: str  # the other layers' type
    cite: str
    glob: str = "full"  # the global layers' type

    def layer_types(self, layers: int) -> list[str]:
        return [self.glob if (l + 1) % self.period == 0 else self.local for l in range(int(layers))]


LAYOUTS = {
    "gemma3": Published(6, "sliding", "Gemma Team 2025, Gemma 3 Technical Report, arXiv 2503.19786, §2.1"),
    "rnope-swa": Published(4, "sliding", "Yang et al. 2025, Rope to Nope and Back Again, arXiv 2501.18795, §5"),
    "irope": Published(4, "chunked", "Meta 2025, Llama 4 (iRoPE); transformers Llama4TextConfig"),
    "smollm3": Published(4, "rope", "Hugging Face 2025, SmolLM3; transformers SmolLM3Config", "nope"),
}


def size(train_length: int) -> int:
    """The window / chunk of every layout at L_tr (module doc): L_tr / 4, at least 1."""
    return max(1, int(train_length) // 4)


def layout_types(name: str, train_length: int) -> dict[str, LayerType]:
    w = size(train_length)
    if name == "gemma3":
        return {"sliding": LayerType("rotary", {"base": 10_000.0}, window=w),
                "full": LayerType("rotary", {"base": 1_000_000.0})}
    if name == "rnope-swa":
        return {"sliding": LayerType("rotary", {}, window=w), "full": LayerType("none")}
    if name == "irope":
        return {"chunked": LayerType("rotary", {}, chunk=w),
                "full": LayerType("nope-llama4", {"beta": 0.1, "floor": w})}
    return {"rope": LayerType("rotary"), "nope": LayerType("none")}


def published(name: str, layers: int, train_length: int) -> tuple[list[str], dict[str, LayerType]]:
    """(layer_types, types) of layout ``name`` for a model of ``layers`` layers at L_tr = ``train_length``."""
    spec = LAYOUTS.get(str(name))
    if spec is None:
        raise SchemeError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)} or list the types in "
                          "model.layer_types")
    kinds = spec.layer_types(layers)
    if spec.glob not in kinds:
        raise SchemeError(f"layout {name} puts a global layer at every {spec.period}th layer, so model.layers={layers} "
                          f"has none; use model.layers >= {spec.period}")
    return kinds, layout_types(name, train_length)

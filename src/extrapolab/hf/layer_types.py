"""Layer types of a Hugging Face model (transformers 5: ``config.layer_types``, ``rope_parameters`` nested per
type): what the bridge reads, and ``--rope KIND:ARGS@TYPE``, a rewrite of one type's RoPE (hf/load.py).

Gemma 3 builds one rotary embedding per layer type from ``rope_parameters[type]`` (``sliding_attention``:
θ = 10k, ``full_attention``: θ = 1M) and runs each layer with its type's; OLMo 3 scales RoPE on its full
layers only (transformers#45945). ``--rope yarn:4@full`` rewrites ``rope_parameters["full_attention"]``
alone (``@full_attention`` or ``@full``: a short name ending in ``_attention``), ``--rope yarn:4`` every
type's; the model is then built by transformers from the new parameters, so its own code runs.

Two transformers details the rewrite follows (transformers 5.23, ``modeling_rope_utils``): YaRN reads
``truncate`` from the top level of ``config.rope_parameters``, not from the type's dict, so a per-type
``truncate=false`` is written at the top level as well (transformers ignores keys there that are not
layer types); and a layer type whose parameters are ``None`` is a NoPE layer, which no rewrite touches.
"""
from __future__ import annotations

from collections import Counter

from ..io import UserError

SUFFIX = "_attention"


def nested_types(config) -> list[str]:
    """The layer types ``config.rope_parameters`` is nested under ([] for one flat dict)."""
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict):
        return []
    if hasattr(config, "nested_rope_parameter_keys"):
        return list(config.nested_rope_parameter_keys(rp))
    labels = getattr(config, "layer_types", None) or ()
    return [k for k in rp if k in labels]


def short(name: str) -> str:
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name


def resolve(config, name: str, text: str) -> str:
    """The nested key ``@name`` means (``full`` -> ``full_attention``), or a one-line error naming the choices."""
    keys = nested_types(config)
    if not keys:
        kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
        if kinds and name not in kinds and name + SUFFIX not in kinds:
            raise UserError(f"--rope {text}: this {config.model_type} model has no layer type {name!r}; its types: "
                            f"{', '.join(short(k) for k in kinds)}")
        shared = f" (its layer types {', '.join(short(k) for k in kinds)} share one rotary embedding)" if kinds else ""
        raise UserError(f"--rope {text}: this {config.model_type} model has one rope_parameters for every layer (no "
                        f"per-type rope_parameters){shared}; drop @{name}")
    for key in (name, name + SUFFIX):
        if key in keys:
            return key
    raise UserError(f"--rope {text}: this model has no layer type {name!r}; its types: "
                    f"{', '.join(short(k) for k in keys)}")


def summary(config) -> dict | None:
    """What the run record keeps of the model's layer types: counts per type, the pattern's first period,
    the sliding window and each type's rope_parameters; None for a model without ``layer_types``."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        return None
    rp = getattr(config, "rope_parameters", None) or {}
    nested = nested_types(config)
    return {"counts": dict(Counter(kinds)), "first": kinds[: min(len(kinds), 12)],
            "sliding_window": getattr(config, "sliding_window", None),
            "rope_parameters": {k: rp[k] for k in nested} if nested else None}

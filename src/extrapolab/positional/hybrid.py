"""RoPE/NoPE layer hybrids (Yang et al. 2025, "Rope to Nope and Back Again: A New Hybrid Attention
Strategy", arXiv 2501.18795, §4: RoPE in most layers, NoPE in every k-th, the RoPE layers optionally
with a sliding window, "RNoPE-SWA"; SmolLM3 and Llama 4's "iRoPE" use NoPE every 4th layer).

A scheme per layer through the ``for_layer`` hook, resolved in one place per layer (``Block.forward``
and ``attend``): layer l uses the NoPE scheme when (l + 1) % every == 0, as Hugging Face's SmolLM3
and Llama 4 configurations build ``no_rope_layers`` from ``no_rope_layer_interval`` (layers 3, 7,
11, ... for every = 4), or when l is in ``nope_layers``; every other layer uses the RoPE scheme.
Both are registered schemes, built with their own options (``rope="rotary"``, ``rope_params``;
``nope="none"`` or e.g. ``"nope-headscale"``, ``nope_params``). ``rope_window`` w masks keys at
distance >= w in the RoPE layers (Sandwich paper §3.3's window as their bias), which keeps them on
the Toeplitz path; the NoPE layers stay global. Each sub-scheme keeps its own distance tables
(``DistanceBias.of``) and the KV cache stores each layer's keys as that layer rotated them, so
cached decoding equals the parallel forward.
"""
from __future__ import annotations

import math

import torch

from .base import PositionalScheme, RelativeBias, SchemeError
from .registry import REGISTRY, build, scheme_params, register

#: model sizes the hybrid passes on to a sub-scheme that takes them (FoX, NoPE head scale, ...)
_MODEL_FIELDS = ("dim", "layers", "head_dim", "init_std")


class WindowedScheme(RelativeBias):
    """``inner``'s rotation (or embedding) with a hard window: bias 0 for k < w, -inf beyond
    (Sandwich paper §3.3), as one relative scheme so the Toeplitz path runs it."""

    paper = "Sandwich paper §3.3 window over another scheme's rotation"
    summary = "a scheme's rotation with a hard window of w keys"

    def __init__(self, num_heads: int, inner: PositionalScheme, window: int) -> None:
        super().__init__(num_heads)
        if inner.has_bias or inner.has_weight or inner.has_content or inner.reference_only:
            raise SchemeError(f"rope_window needs a RoPE scheme without a bias of its own, got {inner.name!r}")
        if int(window) < 1:
            raise SchemeError(f"rope_window must be >= 1, got {window}; e.g. rope_window=512")
        self.inner, self.window = inner, int(window)
        self.name = f"{inner.name}+window{self.window}"

    def rotate(self, q, k, q_pos, k_pos):
        return self.inner.rotate(q, k, q_pos, k_pos)

    def temperature(self, q_pos, layer=0):
        return self.inner.temperature(q_pos, layer)

    def check_length(self, length: int) -> None:
        self.inner.check_length(length)

    def bias_from_distance(self, dist, layer=0):
        z = torch.zeros(dist.shape, dtype=torch.float64, device=dist.device).masked_fill(dist >= self.window, -math.inf)
        return z.unsqueeze(0).expand(self.num_heads, *dist.shape)  # [H, ...]


@register
class Hybrid(PositionalScheme):
    name = "hybrid"
    kind = "hybrid"
    layer_dependent = True
    relative = True
    paper = "Yang et al. 2025 (Rope to Nope and Back Again) §4; SmolLM3 / Llama 4 iRoPE: NoPE every k-th layer"
    summary = "RoPE in most layers, NoPE every k-th ((l+1) % every == 0), optional window on the RoPE layers"

    def __init__(self, num_heads: int, layers: int = 4, every: int = 4, nope_layers: list | None = None,
                 rope: str = "rotary", rope_params: dict | None = None, nope: str = "none",
                 nope_params: dict | None = None, rope_window: int | None = None, dim: int = 128,
                 head_dim: int = 32, init_std: float = 0.02) -> None:
        super().__init__(num_heads)
        if int(layers) < 1 or int(every) < 1:
            raise SchemeError(f"hybrid needs layers >= 1 and every >= 1, got layers={layers}, every={every}")
        self.layers, self.every = int(layers), int(every)
        self.nope_layers = None if nope_layers is None else sorted({int(x) for x in nope_layers})
        if self.nope_layers is not None and any(not 0 <= x < self.layers for x in self.nope_layers):
            raise SchemeError(f"hybrid nope_layers must lie in 0..{self.layers - 1}, got {nope_layers}")
        self.rope_name, self.nope_name = str(rope), str(nope)
        self.rope_params, self.nope_params = dict(rope_params or {}), dict(nope_params or {})
        self.rope_window = None if rope_window is None else int(rope_window)
        sizes = {"dim": int(dim), "layers": self.layers, "head_dim": int(head_dim), "init_std": float(init_std)}
        self._sizes = sizes
        rope_s = self._sub(self.rope_name, self.rope_params, sizes, "rope")
        self.rope = rope_s if self.rope_window is None else WindowedScheme(num_heads, rope_s, self.rope_window)
        self.nope = self._sub(self.nope_name, self.nope_params, sizes, "nope")

    def _sub(self, name: str, params: dict, sizes: dict, role: str) -> PositionalScheme:
        cls = REGISTRY.get(name)
        if cls is None or cls.kind in ("absolute", "hybrid"):
            kind = "an absolute scheme (its embedding is added once, at the input)" if cls is not None and \
                cls.kind == "absolute" else "a hybrid" if cls is not None else "not a registered scheme"
            raise SchemeError(f"hybrid {role}={name!r} is {kind}; give a per-layer scheme such as rotary, none, "
                              "nope-headscale or alibi")
        accepted = scheme_params(cls)
        extra = {k: v for k, v in sizes.items() if k in accepted and k not in params}
        return build(name, self.num_heads, **params, **extra)

    def is_nope(self, layer: int) -> bool:
        """Layer ``layer`` uses the NoPE scheme."""
        if self.nope_layers is not None:
            return int(layer) in self.nope_layers
        return (int(layer) + 1) % self.every == 0

    def for_layer(self, layer: int) -> PositionalScheme:
        return self.nope if self.is_nope(layer) else self.rope

    def rotate(self, q, k, q_pos, k_pos):
        raise SchemeError("hybrid rotates per layer: call scheme.for_layer(layer).rotate(...) (attend and "
                          "GPT's blocks do)")

    def check_length(self, length: int) -> None:
        self.rope.check_length(length)
        self.nope.check_length(length)

    def constrain_(self) -> None:
        self.rope.constrain_()
        self.nope.constrain_()

    def options(self):
        return {"layers": self.layers, "every": self.every, "nope_layers": self.nope_layers, "rope": self.rope_name,
                "rope_params": self.rope_params, "nope": self.nope_name, "nope_params": self.nope_params,
                "rope_window": self.rope_window, **{k: v for k, v in self._sizes.items() if k != "layers"}}

"""RoPE/NoPE layer hybrids (Yang et al. 2025, "Rope to Nope and Back Again: A New Hybrid Attention
Strategy", arXiv 2501.18795, §4: RoPE in most layers, NoPE in every k-th, the RoPE layers optionally
with a sliding window, "RNoPE-SWA"; SmolLM3 and Llama 4's "iRoPE" use NoPE every 4th layer).

A preset of the layer types (positional/layout.py): the layout with two types, ``rope`` and ``nope``,
layer l of type ``nope`` when (l + 1) % every == 0, as Hugging Face's SmolLM3 and Llama 4
configurations build ``no_rope_layers`` from ``no_rope_layer_interval`` (layers 3, 7, 11, ... for
every = 4), or when l is in ``nope_layers``. Both are registered schemes, built with their own
options (``rope="rotary"``, ``rope_params``; ``nope="none"`` or e.g. ``"nope-headscale"``,
``nope_params``); ``rope_window`` w is the ``rope`` type's window (keys at distance < w, Sandwich paper
§3.3), which keeps those layers on the Toeplitz path; the NoPE layers stay global. The same model as
``model.layer_types=[rope, rope, rope, nope]`` with ``model.types`` naming those two schemes; the
state-dict keys (``scheme.rope.*``, ``scheme.rope.inner.*`` with a window, ``scheme.nope.*``) are the
ones this scheme had before it became a layout, so its checkpoints load as they are.
"""
from __future__ import annotations

from .base import SchemeError
from .layout import LayerType, Layout
from .registry import register


@register
class Hybrid(Layout):
    name = "hybrid"
    kind = "hybrid"
    paper = "Yang et al. 2025 (Rope to Nope and Back Again) §4; SmolLM3 / Llama 4 iRoPE: NoPE every k-th layer"
    summary = "RoPE in most layers, NoPE every k-th ((l+1) % every == 0), optional window on the RoPE layers"

    def __init__(self, num_heads: int, layers: int = 4, every: int = 4, nope_layers: list | None = None,
                 rope: str = "rotary", rope_params: dict | None = None, nope: str = "none",
                 nope_params: dict | None = None, rope_window: int | None = None, dim: int = 128,
                 head_dim: int = 32, init_std: float = 0.02) -> None:
        if int(layers) < 1 or int(every) < 1:
            raise SchemeError(f"hybrid needs layers >= 1 and every >= 1, got layers={layers}, every={every}")
        nl = None if nope_layers is None else sorted({int(x) for x in nope_layers})
        if nl is not None and any(not 0 <= x < int(layers) for x in nl):
            raise SchemeError(f"hybrid nope_layers must lie in 0..{int(layers) - 1}, got {nope_layers}")
        if rope_window is not None and int(rope_window) < 1:
            raise SchemeError(f"hybrid rope_window must be >= 1, got {rope_window}; e.g. rope_window=512")
        is_nope = [(l in nl) if nl is not None else (l + 1) % int(every) == 0 for l in range(int(layers))]
        types = {"rope": LayerType(str(rope), dict(rope_params or {}), window=int(rope_window or 0)),
                 "nope": LayerType(str(nope), dict(nope_params or {}))}
        sizes = {"dim": int(dim), "layers": int(layers), "head_dim": int(head_dim), "init_std": float(init_std)}
        super().__init__(num_heads, ["nope" if n else "rope" for n in is_nope], types, sizes=sizes,
                         build_unused=True)  # both types, used or not: the state dict the scheme always had
        self.layers, self.every, self.nope_layers = int(layers), int(every), nl
        self.rope_name, self.nope_name = str(rope), str(nope)
        self.rope_params, self.nope_params = dict(rope_params or {}), dict(nope_params or {})
        self.rope_window = None if rope_window is None else int(rope_window)

    def is_nope(self, layer: int) -> bool:
        """Layer ``layer`` uses the NoPE scheme."""
        return self.type_of(layer) == "nope"

    def options(self):
        return {"layers": self.layers, "every": self.every, "nope_layers": self.nope_layers, "rope": self.rope_name,
                "rope_params": self.rope_params, "nope": self.nope_name, "nope_params": self.nope_params,
                "rope_window": self.rope_window, **{k: v for k, v in self._sizes.items() if k != "layers"}}

"""NoPE with Llama 4's attention temperature tuning (Meta 2025, Llama 4's NoPE layers; transformers 5.23
``Llama4TextAttention.forward``, read for this file: "temperature tuning from arXiv 2501.19399", applied
when ``attn_temperature_tuning`` and the layer has no RoPE).

The query at position m is multiplied by

    s(m) = 1 + β · ln(1 + floor((m + 1) / c))        (β = ``attn_scale`` 0.1, c = ``floor_scale`` 8192)

before q·k, a step function of the position that is 1 for the first c - 1 tokens. On a NoPE layer
(no bias) that is exactly a per-query softmax temperature tau_m = 1 / s(m) dividing the whole logit,
so this scheme returns it from the ``temperature`` hook ([1, Lq]) and attention keeps the fused causal
kernel with q's rows divided (docs/attention.md, step 6). Positions are the token positions
(transformers: ``cache_position``), so a KV cache continues them. Llama 4 ties c to its chunk size
(8192 both); the ``irope`` layout (positional/layouts.py) sets c = its chunk at our sizes.
"""
from __future__ import annotations

import math

import torch

from .base import PositionalScheme, SchemeError
from .registry import register


def llama4_scale(positions: torch.Tensor, beta: float, floor: int) -> torch.Tensor:
    """s(m) = 1 + β·ln(1 + floor((m + 1) / c)) per position m, float64 [L] (module doc)."""
    m = positions.to(torch.float64)
    return 1.0 + beta * torch.log1p(torch.floor((m + 1.0) / floor))


@register
class NoPELlama4(PositionalScheme):
    name = "nope-llama4"
    kind = "none"
    relative = False  # the temperature depends on the query's absolute position
    paper = "Meta 2025 (Llama 4) NoPE layers: q·(1 + β·ln(1 + floor((m + 1)/c))), transformers Llama4TextAttention"
    summary = "NoPE with Llama 4's per-query temperature tuning, a step every c positions"

    def __init__(self, num_heads: int, beta: float = 0.1, floor: int = 8192) -> None:
        super().__init__(num_heads)
        if not (float(beta) >= 0 and math.isfinite(float(beta))):
            raise SchemeError(f"nope-llama4 beta must be a finite number >= 0, got {beta}; Llama 4 uses 0.1")
        if int(floor) < 1 or float(floor) != int(floor):
            raise SchemeError(f"nope-llama4 floor must be a whole number of tokens >= 1, got {floor}; Llama 4 uses 8192")
        self.beta, self.floor = float(beta), int(floor)

    def temperature(self, q_pos, layer=0):
        return (1.0 / llama4_scale(q_pos, self.beta, self.floor))[None]  # [1, Lq] tau_m = 1 / s(m)

    def options(self):
        return {"beta": self.beta, "floor": self.floor}

"""windowed attention (Sandwich paper §3.3; Longformer): bias 0 if k < w else -inf.

An R-layer model has theoretical receptive field w·R (Sandwich paper §5).
"""
from __future__ import annotations

import math

import torch

from .base import RelativeBias, SchemeError
from .registry import register


@register
class Windowed(RelativeBias):
    name = "windowed"
    paper = "Sandwich paper §3.3 (l_mn = q·k if n + w > m >= n else -inf)"
    summary = "hard window: attend to the w most recent keys (including the query itself)"
    mask_only = True  # 0 inside the window, -inf outside

    def __init__(self, num_heads: int, window: int = 64) -> None:
        super().__init__(num_heads)
        if int(window) < 1:
            raise SchemeError(f"window must be >= 1, got {window}; e.g. --set 'model.scheme_params={{window: 64}}'")
        self.window = int(window)

    def bias_from_distance(self, dist, layer=0):
        z = torch.zeros(dist.shape, dtype=torch.float64, device=dist.device)
        z = z.masked_fill(dist >= self.window, -math.inf)
        return z.unsqueeze(0).expand(self.num_heads, *dist.shape)  # [H, ...]

    def options(self):
        return {"window": self.window}

"""rotary (Su et al. 2021 RoFormer eq. 34; ALiBi §2.2).

Rotate each pair (2i, 2i+1) of q and k by angle m·theta_i, theta_i = base^(-2i/d_head).
cos/sin are cached per (length, device, dtype).
"""
from __future__ import annotations

import torch

from .base import PositionalScheme, SchemeError
from .registry import register


@register
class Rotary(PositionalScheme):
    name = "rotary"
    kind = "rotary"
    paper = "Su et al. 2021 (RoFormer) eq. 34"
    summary = "rotate q,k pairs by m·theta_i, theta_i = 10000^(-2i/d_head)"

    def __init__(self, num_heads: int, base: float = 10000.0) -> None:
        super().__init__(num_heads)
        if base <= 1:
            raise SchemeError(f"rotary base must be > 1, got {base}")
        self.base = float(base)
        self._cs: dict = {}

    def cos_sin(self, positions: torch.Tensor, d_head: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(positions.max()) + 1 if positions.numel() else 1
        key = (d_head, positions.device, dtype)
        cached = self._cs.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(n, 2 * (cached[0].shape[0] if cached else 0), 256)
            i = torch.arange(0, d_head, 2, dtype=torch.float64, device=positions.device)
            theta = self.base ** (-i / d_head)  # [d_head/2]
            ang = torch.arange(size, dtype=torch.float64, device=positions.device)[:, None] * theta
            cached = (torch.cos(ang).to(dtype), torch.sin(ang).to(dtype))  # [size, d_head/2] each
            self._cs[key] = cached
        return cached[0][positions], cached[1][positions]  # [L, d_head/2]

    def _rot(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        if d % 2:
            raise SchemeError(f"rotary needs an even head dimension, got {d}; change model.dim or heads")
        cos, sin = self.cos_sin(pos, d, x.dtype)  # [L, d/2]
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [..., L, d/2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [..., L, d/2, 2]
        return out.flatten(-2)  # [..., L, d]

    def rotate(self, q, k, q_pos, k_pos):
        return self._rot(q, q_pos), self._rot(k, k_pos)

    def options(self):
        return {"base": self.base}

    def _apply(self, fn, *a, **kw):
        self._cs.clear()
        return super()._apply(fn, *a, **kw)

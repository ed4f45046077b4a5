"""sinusoidal APE (Vaswani et al. 2017 §3.5; Sandwich paper eq. 5; ALiBi §2.2).

p[m, 2i] = sin(m / 10000^(2i/d)), p[m, 2i+1] = cos(m / 10000^(2i/d)), added to token embeddings.
``scale`` multiplies the table: the GPT sets it to sqrt(2)·init_std so that, with GPT-2-style
token embeddings (std 0.02), position and token signal start at the same scale (Vaswani et al.
instead scale token embeddings up by sqrt(d): ``model.embed_scale=0``).
"""
from __future__ import annotations

import torch

from .base import PositionalScheme, SchemeError
from .registry import register


def sinusoidal_table(positions: torch.Tensor, dim: int, base: float = 10000.0) -> torch.Tensor:
    """positions [L] -> [L, dim] interleaved sin/cos (eq. 5)."""
    i = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64)  # [dim/2] = 2i
    inv = base ** (-i / dim)  # [dim/2]
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [L, dim/2]
    out = torch.zeros(positions.numel(), dim, dtype=torch.float64, device=positions.device)
    out[:, 0::2] = torch.sin(ang)
    out[:, 1::2] = torch.cos(ang[:, : dim // 2])
    return out.float()  # [L, dim]


@register
class Sinusoidal(PositionalScheme):
    name = "sinusoidal"
    kind = "absolute"
    relative = False
    paper = "Vaswani et al. 2017 §3.5, Sandwich paper eq. 5"
    summary = "fixed sin/cos absolute embedding added to the token embeddings"

    def __init__(self, num_heads: int, base: float = 10000.0, scale: float = 1.0) -> None:
        super().__init__(num_heads)
        if base <= 1:
            raise SchemeError(f"sinusoidal base must be > 1, got {base}")
        if not scale > 0:
            raise SchemeError(f"sinusoidal scale must be > 0, got {scale}")
        self.base = float(base)
        self.scale = float(scale)

    def embed(self, positions, dim):
        return self.scale * sinusoidal_table(positions, dim, self.base)  # [L, dim]

    def options(self):
        return {"base": self.base, "scale": self.scale}

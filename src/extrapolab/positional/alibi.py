"""ALiBi (Press et al. 2022, eq. in §3; Sandwich paper eq. 3, §4.1-4.2).

bias = -slope_h · k. Default slopes follow the official ALiBi code: a geometric series
2^(-8/n)·(2^(-8/n))^i for a power of two n; for other n, the closest power of two c gives the
first c slopes and every other slope of the 2c series supplies the remaining n - c.
Options: ``shift`` Δ multiplies every slope by 2^-Δ (slope 1/2^(h+Δ), Sandwich §4.1);
``equal_exponent`` h0 gives every head slope 1/2^h0 (Sandwich §4.2). The bias has the ALiBi form
-slope_h·(m - n) at any positions (``alibi_slopes``), so positions with gaps stay on a fused path.
"""
from __future__ import annotations

import math

import torch

from .base import RelativeBias, SchemeError
from .registry import register


def official_alibi_slopes(n: int) -> list[float]:
    """Slopes exactly as in github.com/ofirpress/attention_with_linear_biases (get_slopes)."""

    def power_of_2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + official_alibi_slopes(2 * closest)[0::2][: n - closest]


@register
class ALiBi(RelativeBias):
    name = "alibi"
    paper = "Press et al. 2022 §3; Sandwich paper eq. 3, §4.1 (shift Δ), §4.2 (equal slopes)"
    summary = "linear bias -slope_h·k, official geometric slopes; shift Δ / equal-exponent options"

    def __init__(self, num_heads: int, shift: float = 0.0, equal_exponent: float | None = None) -> None:
        super().__init__(num_heads)
        self.shift = float(shift)
        self.equal_exponent = None if equal_exponent is None else float(equal_exponent)
        if self.equal_exponent is not None:
            slopes = [2.0 ** (-self.equal_exponent)] * self.num_heads
        else:
            slopes = [s * 2.0 ** (-self.shift) for s in official_alibi_slopes(self.num_heads)]
        if not all(math.isfinite(s) and s >= 0 for s in slopes):
            raise SchemeError(f"ALiBi slopes must be finite and >= 0; check shift={shift}")
        self.register_buffer("slopes", torch.tensor(slopes, dtype=torch.float64), persistent=False)

    def bias_from_distance(self, dist, layer=0):
        d = dist.to(torch.float64)
        return -self.slopes.to(d.device).reshape(-1, *([1] * d.dim())) * d  # [H, ...]

    def alibi_slopes(self, layer=0):
        """The ALiBi form itself: attention folds -slope_h·(m - n) into the fused kernel at any
        positions (model/folded.py), e.g. randomized positions with gaps."""
        return self.slopes  # [H] float64

    def options(self):
        return {"shift": self.shift, "equal_exponent": self.equal_exponent}

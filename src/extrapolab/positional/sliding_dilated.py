"""sliding-dilated attention bias of RegularGPT (thesis ch. 6, eq. 6.1).

At layer level l a query at position m sees key n iff (m - n) / C^l is an integer in [C]
(= {0, ..., C-1}); the bias there is the learned per-head scalar r_{(m-n)/C^l}, and -inf
everywhere else:

    M^(l)_mn = r_{(m-n)/C^l}   if C^l divides m-n and (m-n)/C^l < C,   -inf otherwise.

With weight sharing and thickness K (thesis §6.2.2) layer index ``layer`` = l·K + k runs at level
l = layer // K; an explicit ``level`` option pins every layer to one level instead.
Parameters: r, one row of C scalars per head (C·H in total), initialised to 0.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import RelativeBias, SchemeError
from .registry import register


def num_levels(length: int, C: int) -> int:
    """Levels ceil(log_C T) computed exactly in integers; at least 1 so every input passes a level
    (thesis §6.2.2: adaptive depth; T = 1 still runs one level)."""
    levels, reach = 0, 1
    while reach < int(length):
        reach *= C
        levels += 1
    return max(1, levels)


@register
class SlidingDilated(RelativeBias):
    name = "sliding-dilated"
    paper = "Chi 2024 thesis ch. 6 eq. 6.1 (RegularGPT sliding-dilated attention)"
    summary = "RegularGPT: level l sees keys at distances j·C^l, j < C, with learned r_j per head"
    layer_dependent = True

    def __init__(self, num_heads: int, C: int = 2, K: int = 1, level: int | None = None) -> None:
        super().__init__(num_heads)
        if isinstance(C, bool) or not isinstance(C, int) or C < 2:
            raise SchemeError(f"sliding-dilated chunk size C must be an integer >= 2, got {C!r}; e.g. C=2")
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise SchemeError(f"sliding-dilated thickness K must be an integer >= 1, got {K!r}; e.g. K=1")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
            raise SchemeError(f"sliding-dilated level must be None or an integer >= 0, got {level!r}")
        self.C, self.K, self.level = C, K, level
        self.r = nn.Parameter(torch.zeros(self.num_heads, C))  # [H, C]

    def level_of(self, layer: int) -> int:
        """Dilation level of layer index ``layer`` (thesis §6.2.2: layer = l·K + k)."""
        return self.level if self.level is not None else int(layer) // self.K

    def bias_from_distance(self, dist: torch.Tensor, layer: int = 0) -> torch.Tensor:
        # C^l capped below int64's range: a step beyond every distance leaves only d = 0 in reach
        # either way, and the cap needs no read-back of the largest distance (a device sync)
        step = min(self.C ** self.level_of(layer), 1 << 62)
        d = dist.to(torch.long)
        j = torch.div(d, step, rounding_mode="floor")
        ok = (d >= 0) & (d % step == 0) & (j < self.C)
        vals = self.r[:, j.clamp(0, self.C - 1)]  # [H, *dist.shape]
        return vals.masked_fill(~ok, -math.inf)

    def level_offsets(self, level: int, length: int) -> torch.Tensor:
        """Distances j·C^level of the keys a query sees at ``level`` (eq. 6.1), only for the
        j < C with j·C^level < length (farther ones fall before position 0 for every query): [C'].
        The bias at distance j·C^level is r_j at every level, i.e. ``self.r[:, :C']``."""
        step = self.C ** int(level)
        n = min(self.C, -(-int(length) // step))  # ceil(length / step), at least 1
        return torch.arange(n, device=self.r.device) * step

    def receptive_field(self, levels: int) -> int:
        """Tokens the last query can reach after ``levels`` levels (thickness 1): C^levels."""
        return self.C ** int(levels)

    def options(self):
        return {"C": self.C, "K": self.K, "level": self.level}

"""T5 relative bias (Raffel et al. 2020; thesis §3.4 bucket formula; ALiBi §2.2).

Causal log-bucketing identical to Hugging Face transformers'
``T5Attention._relative_position_bucket(bidirectional=False)``: distances < num_buckets/2 get
their own bucket, larger ones a log-spaced bucket up to ``max_distance``, and every distance
>= max_distance shares the last bucket. One learned scalar per (head, bucket), one table shared
by every layer (HF: only the first layer owns it). That last bucket makes the bias a per-head constant
from max_distance on (``constant_beyond``), which the near-far path of attention uses: plain flash
attention over the far keys, the table over a band of max_distance keys (docs/attention.md).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import RelativeBias, SchemeError
from .registry import register


def t5_causal_bucket(dist: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """dist = m - n >= 0 (long, any shape) -> bucket index (thesis §3.4 equation)."""
    d = dist.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = d < max_exact
    large = max_exact + (
        torch.log(d.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(is_small, d, large)


@register
class T5Bias(RelativeBias):
    name = "t5"
    paper = "Raffel et al. 2020; thesis §3.4 (bucket formula), HF _relative_position_bucket"
    summary = "learned scalar per head per log-spaced distance bucket (32 buckets, max distance 128)"

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__(num_heads)
        if int(num_buckets) < 2 or int(max_distance) <= int(num_buckets) // 2:
            raise SchemeError(
                f"T5 needs num_buckets >= 2 and max_distance > num_buckets/2, got {num_buckets}, {max_distance}; "
                "use the defaults num_buckets=32, max_distance=128"
            )
        self.num_buckets = int(num_buckets)
        self.max_distance = int(max_distance)
        self.table = nn.Parameter(torch.zeros(self.num_heads, self.num_buckets))  # [H, buckets]

    def bias_from_distance(self, dist, layer=0):
        return self.table[:, t5_causal_bucket(dist, self.num_buckets, self.max_distance)]  # [H, ...]

    def constant_beyond(self, layer=0):
        """max_distance: for d >= max_distance the log term is >= 1 (to fp32 rounding, 1 - 1 ulp at worst), so the
        bucket is num_buckets - 1 or clamped to it, whatever the rounding of the log."""
        return self.max_distance

    def options(self):
        return {"num_buckets": self.num_buckets, "max_distance": self.max_distance}

"""rotary-rerope-leaky: leaky ReRoPE (Su 2023, "Rectified Rotary Position Embeddings",
kexue.fm/archives/9708, github.com/bojone/rerope ``leaky_rerope_patch.py``).

Relative position m - n below w, w + (m - n - w)/k beyond: far queries at m/k + w - w/k, far keys
at n/k (the patch's position-interpolated rotary with scaling factor k, queries offset by
w(k - 1)). Two passes merged by the distance mask (:mod:`.rope_twopass`). A function of m - n
only. Options: ``w`` (default L_tr/8), ``k`` (default 16, the repository's), ``original_length``
L_tr (filled from model.train_length), ``logn`` (as the patch, off by default here), ``base``.
"""
from __future__ import annotations

from .registry import register
from .rotary import check_original_length
from .rope_twopass import MultiPassRotary, check_rule


@register
class RotaryReRoPELeaky(MultiPassRotary):
    name = "rotary-rerope-leaky"
    paper = "Su 2023 (leaky ReRoPE, github.com/bojone/rerope): w + (m - n - w)/k beyond w"
    summary = "RoPE within w, relative positions growing by 1/k per token beyond (two passes)"

    def __init__(self, num_heads: int, w: int | None = None, k: float = 16.0, original_length: int = 512,
                 logn: bool = False, base: float = 10000.0) -> None:
        original_length = check_original_length(self.name, original_length)
        w = max(1, original_length // 8) if w is None else w
        rule = check_rule("rerope-leaky", w, original_length, k=k, label=self.name)
        super().__init__(num_heads, rule, original_length, logn, base)

"""rotary-rerope: ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", kexue.fm/archives/9708,
github.com/bojone/rerope ``rerope_patch.py``).

Relative position min(m - n, w): keys nearer than w keep plain RoPE, farther keys are scored with
the query rotated to position w and the key unrotated (position 0), so every distance past w
reads as w. Two passes merged by the distance mask (:mod:`.rope_twopass`, attention's two-pass
path). A function of m - n only. Options: ``w`` (default L_tr/8, the repository's 512 of 4,096),
``original_length`` L_tr (filled from model.train_length), ``logn`` (the patch scales q by
max(1, log(m+1)/log L_tr); off by default here, so the two effects can be told apart), ``base``.
"""
from __future__ import annotations

from .registry import register
from .rotary import check_original_length
from .rope_twopass import MultiPassRotary, check_rule


@register
class RotaryReRoPE(MultiPassRotary):
    name = "rotary-rerope"
    paper = "Su 2023 (ReRoPE, github.com/bojone/rerope): relative position min(m - n, w)"
    summary = "RoPE with relative positions capped at w (two passes merged by the distance mask)"

    def __init__(self, num_heads: int, w: int | None = None, original_length: int = 512, logn: bool = False,
                 base: float = 10000.0) -> None:
        original_length = check_original_length(self.name, original_length)
        w = max(1, original_length // 8) if w is None else w
        rule = check_rule("rerope", w, original_length, label=self.name)
        super().__init__(num_heads, rule, original_length, logn, base)

"""rotary-selfextend: Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window
Without Tuning", arXiv 2401.01325, §3 and Algorithm 1; official code datamllab/LongLM).

Keys nearer than the neighbour window w (= w_n) keep plain RoPE; farther keys are scored with
grouped positions, floor(n/G) for keys and floor(m/G) + w - floor(w/G) for queries, merged with
the neighbour logits by the distance mask before one softmax (:mod:`.rope_twopass`, attention's
two-pass path). Up to length (L_tr - w)·G + w (:meth:`max_length`, the official README's rule)
every relative position is one seen in training. Not a function of m - n alone (floors), so
``relative`` is False. Options: ``G`` (group size), ``w`` (default L_tr/4, the README's 1,024 of
4,096), ``original_length`` L_tr (filled from model.train_length), ``logn`` (the official patch's
``scale_base``: log-n scaling of q), ``base``.
"""
from __future__ import annotations

from .registry import register
from .rotary import check_original_length
from .rope_twopass import MultiPassRotary, check_rule, selfextend_max_length


@register
class RotarySelfExtend(MultiPassRotary):
    name = "rotary-selfextend"
    paper = "Jin et al. 2024 (Self-Extend) §3, Algorithm 1: grouped positions floor(n/G), floor(m/G) + w - floor(w/G)"
    summary = "RoPE within w, grouped positions (group G) beyond; longest input (L_tr - w)·G + w"
    relative = False

    def __init__(self, num_heads: int, G: int = 4, w: int | None = None, original_length: int = 512,
                 logn: bool = False, base: float = 10000.0) -> None:
        original_length = check_original_length(self.name, original_length)
        w = max(1, original_length // 4) if w is None else w
        rule = check_rule("selfextend", w, original_length, group=G, label=self.name)
        super().__init__(num_heads, rule, original_length, logn, base)

    def max_length(self) -> int:
        """(L_tr - w)·G + w."""
        return selfextend_max_length(self.original_length, self.rule.window, self.rule.group)

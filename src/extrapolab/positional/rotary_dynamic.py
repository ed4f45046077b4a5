"""rotary-dynamic: dynamic NTK scaling (emozilla 2023, Reddit r/LocalLLaMA; Peng et al. 2023, "YaRN:
Efficient Context Window Extension of Large Language Models", §3.3 "Dynamic Scaling").

NTK-aware scaling (:mod:`.rotary_ntk`) whose s is chosen at run time from the current length L
(the largest position + 1 of the call): s = max(1, L/L_tr), so at L <= L_tr it *is* plain RoPE
and nothing trained is disturbed. With ``factor`` a != 1 it is Hugging Face's ``dynamic`` rope
type, s = a·L/L_tr - (a - 1) for L > L_tr (emozilla's original code); a = 1 gives s = L/L_tr.

KV cache: each call rotates its new keys with the s of its own length, and cached keys keep the
s they were rotated with (Hugging Face's cache behaves the same), so token-by-token decoding past
L_tr differs from one parallel forward over the same tokens, which uses one s for every position.
Options: ``original_length`` L_tr (filled from model.train_length), ``factor`` a, ``base``, ``logn``.
"""
from __future__ import annotations

from .registry import register
from .rotary import Rotary, check_factor, check_original_length, default_inv_freq
from .rotary_ntk import ntk_base


@register
class RotaryDynamicNTK(Rotary):
    name = "rotary-dynamic"
    paper = "emozilla 2023; Peng et al. 2023 (YaRN) §3.3, s = max(1, L/L_tr) in b' = b·s^(|D|/(|D|-2))"
    summary = "NTK-aware RoPE with s = max(1, L/L_tr) from the current length (= rotary up to L_tr)"
    length_dependent = True
    #: s depends on the absolute largest position, so shifting all positions changes the rotation
    relative = False

    def __init__(self, num_heads: int, original_length: int = 512, factor: float = 1.0,
                 base: float = 10000.0, logn: bool = False) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.original_length = check_original_length(self.name, original_length)
        self.factor = check_factor(self.name, factor)

    def scale(self, length: int) -> float:
        """s for a call whose largest position is ``length`` - 1."""
        L = max(int(length), self.original_length)
        return self.factor * L / self.original_length - (self.factor - 1.0)

    def scale_key(self, length):
        return self.scale(length)

    def inv_freq(self, d_head, length):
        return default_inv_freq(ntk_base(self.base, self.scale(length), d_head), d_head)

    def options(self):
        return {"original_length": self.original_length, "factor": self.factor, "base": self.base,
                **self.logn_options()}

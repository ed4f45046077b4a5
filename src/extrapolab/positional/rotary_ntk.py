"""rotary-ntk: NTK-aware scaled RoPE (bloc97 2023, Reddit r/LocalLLaMA; Peng, Quesnelle, Fan, Shippole
2023, "YaRN: Efficient Context Window Extension of Large Language Models", §3.1: b' = b·s^(|D|/(|D|-2))).

The base is raised so the lowest frequency is interpolated by exactly s while the highest
(theta_0 = 1) is untouched: theta_i' = (b·s^(d/(d-2)))^(-2i/d), i.e. theta_{d/2-1}' = theta_{d/2-1}/s.
High frequencies extrapolate, low ones interpolate, with no ramp in between. Options: ``factor``
s >= 1 and ``base`` b (the trained base), and the family's ``logn`` (rotary.py).
"""
from __future__ import annotations

from .registry import register
from .rotary import Rotary, check_factor, default_inv_freq


def ntk_base(base: float, factor: float, d_head: int) -> float:
    """b' = b·s^(d/(d-2)) (YaRN §3.1)."""
    return base * factor ** (d_head / (d_head - 2)) if d_head > 2 else base * factor


@register
class RotaryNTK(Rotary):
    name = "rotary-ntk"
    paper = "bloc97 2023; Peng et al. 2023 (YaRN) §3.1, b' = b·s^(|D|/(|D|-2))"
    summary = "RoPE with the NTK-aware base b·s^(d/(d-2)) (s = L_ex/L_tr, option factor)"

    def __init__(self, num_heads: int, factor: float = 4.0, base: float = 10000.0, logn: bool = False,
                 original_length: int = 512) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.factor = check_factor(self.name, factor)

    def inv_freq(self, d_head, length):
        return default_inv_freq(ntk_base(self.base, self.factor, d_head), d_head)

    def options(self):
        return {"factor": self.factor, "base": self.base, **self.logn_options()}

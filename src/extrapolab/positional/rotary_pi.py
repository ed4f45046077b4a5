"""rotary-pi: position interpolation (Chen, Wong, Chen, Tian 2023, "Extending Context Window of Large
Language Models via Positional Interpolation", §2.2: f'(x, m) = f(x, m·L/L')).

Positions are squeezed into the trained range, m -> m/s with s = L'/L = L_ex/L_tr, every frequency
theta_i unchanged. Since RoPE only ever uses the product m·theta_i, this is theta_i -> theta_i/s on
the rotary tables (as Hugging Face's ``linear`` rope type does). Option: ``factor`` s >= 1 (and the
family's ``logn``, see rotary.py).
"""
from __future__ import annotations

from .registry import register
from .rotary import Rotary, check_factor


@register
class RotaryPI(Rotary):
    name = "rotary-pi"
    paper = "Chen et al. 2023 (Position Interpolation) §2.2, f'(x, m) = f(x, mL/L')"
    summary = "RoPE with positions interpolated m -> m/s (s = L_ex/L_tr, option factor)"

    def __init__(self, num_heads: int, factor: float = 4.0, base: float = 10000.0, logn: bool = False,
                 original_length: int = 512) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.factor = check_factor(self.name, factor)

    def inv_freq(self, d_head, length):
        return super().inv_freq(d_head, length) / self.factor  # m·theta/s = (m/s)·theta

    def options(self):
        return {"factor": self.factor, "base": self.base, **self.logn_options()}

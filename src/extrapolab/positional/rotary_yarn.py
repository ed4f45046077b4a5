"""rotary-yarn: YaRN (Peng, Quesnelle, Fan, Shippole 2023, "YaRN: Efficient Context Window Extension of
Large Language Models", §3.2 "NTK-by-parts" ramp gamma and §3.4 attention temperature
sqrt(1/t) = 0.1·ln(s) + 1).

Frequencies: pair i with wavelength lambda_i = 2·pi/theta_i turns r_i = L_tr/lambda_i times over
the training length. Pairs that turn more than beta_fast = 32 times keep theta_i (extrapolation),
pairs that turn less than beta_slow = 1 time get theta_i/s (interpolation, as in PI), and a linear
ramp in between: theta_i' = (1 - gamma_i)·theta_i/s + gamma_i·theta_i. As in the authors' code
(jquesnelle/yarn, ``find_correction_range`` / ``linear_ramp_mask``) and Hugging Face's ``yarn``
rope type, gamma is linear in the pair index between the pair indices where r = beta_fast and
r = beta_slow (floored / ceiled), which the paper's gamma(r) (linear in r) approximates.

Temperature: softmax(q·k / (t·sqrt(d))) with sqrt(1/t) = 0.1·ln(s) + 1 (eq. in §3.4), applied like
the authors and Hugging Face do: q and k are both multiplied by f = 0.1·ln(s) + 1 inside the
rotation, so the logits are multiplied by f^2 = 1/t and attention itself is untouched. As a
softmax temperature (thesis ch. 5) this is tau = 1/f^2. Options: ``factor`` s, ``original_length``
L_tr (filled from model.train_length), ``beta_fast``, ``beta_slow``, ``attention_factor`` (f;
default the rule above, 1.0 switches the temperature off), ``base``, ``logn`` (rotary.py).
"""
from __future__ import annotations

import math

import torch

from .base import SchemeError
from .registry import register
from .rotary import Rotary, check_factor, check_original_length, default_inv_freq


def yarn_attention_factor(factor: float) -> float:
    """f = sqrt(1/t) = 0.1·ln(s) + 1 (YaRN §3.4); 1 for s <= 1."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def correction_dim(turns: float, d_head: int, base: float, original_length: int) -> float:
    """The (fractional) pair index i whose theta_i turns ``turns`` times over original_length positions."""
    return d_head * math.log(original_length / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp(d_head: int, base: float, original_length: int, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """gamma_i in [0, 1] per pair, float64 [d_head/2]: 1 keeps theta_i, 0 divides it by s."""
    low = max(math.floor(correction_dim(beta_fast, d_head, base, original_length)), 0)
    high = min(math.ceil(correction_dim(beta_slow, d_head, base, original_length)), d_head - 1)
    span = (high - low) or 0.001  # the authors' guard against a zero-width ramp
    ramp = ((torch.arange(d_head // 2, dtype=torch.float64) - low) / span).clamp(0, 1)  # [d/2]
    return 1.0 - ramp


@register
class RotaryYaRN(Rotary):
    name = "rotary-yarn"
    paper = "Peng et al. 2023 (YaRN) §3.2 ramp gamma, §3.4 sqrt(1/t) = 0.1 ln s + 1"
    summary = "RoPE with YaRN's per-frequency ramp (beta 32/1) and q,k scaled by 0.1 ln s + 1"

    def __init__(self, num_heads: int, factor: float = 4.0, original_length: int = 512, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, attention_factor: float | None = None, base: float = 10000.0,
                 logn: bool = False) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.factor = check_factor(self.name, factor)
        self.original_length = check_original_length(self.name, original_length)
        if not float(beta_fast) > float(beta_slow) > 0:
            raise SchemeError(f"rotary-yarn needs beta_fast > beta_slow > 0, got {beta_fast}, {beta_slow}; "
                              "the paper uses 32 and 1")
        self.beta_fast, self.beta_slow = float(beta_fast), float(beta_slow)
        f = yarn_attention_factor(self.factor) if attention_factor is None else float(attention_factor)
        if not f > 0:
            raise SchemeError(f"rotary-yarn attention_factor must be > 0, got {attention_factor}")
        self.attn_factor = f

    def inv_freq(self, d_head, length):
        theta = default_inv_freq(self.base, d_head)  # [d/2]
        keep = yarn_ramp(d_head, self.base, self.original_length, self.beta_fast, self.beta_slow)  # [d/2]
        return theta / self.factor * (1 - keep) + theta * keep

    def attention_factor(self, length):
        return self.attn_factor

    def options(self):
        return {"factor": self.factor, "original_length": self.original_length, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "attention_factor": self.attn_factor, "base": self.base,
                **self.logn_options()}

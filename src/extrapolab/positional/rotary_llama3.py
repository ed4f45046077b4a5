"""rotary-llama3: Llama 3.1's RoPE scaling (Meta 2024, "The Llama 3 Herd of Models", Dubey et al.,
arXiv 2407.21783; the scaling is ``apply_scaling`` in Meta's reference code, meta-llama/llama-models
``models/llama3/model.py``, with "values obtained from grid search": factor 8,
low_freq_factor 1, high_freq_factor 4, original context 8192; Hugging Face rope type ``llama3``).

Each pair i is judged by its *wavelength* lambda_i = 2·pi/theta_i against the original context L
(L = L_tr, ``original_length``):

    lambda_i <  L / high           theta_i' = theta_i                       (high frequencies: kept)
    lambda_i >  L / low            theta_i' = theta_i / s                   (low frequencies: as PI)
    otherwise                      theta_i' = (1 - g)·theta_i / s + g·theta_i,
                                   g = (L / lambda_i - low) / (high - low)  (smooth in between)

so g runs from 0 at lambda = L/low to 1 at lambda = L/high and the three pieces meet. Like YaRN's
NTK-by-parts ramp, but linear in the number of turns L/lambda_i rather than in the pair index,
and with no attention factor (q, k are not rescaled: the factor is 1, as in Hugging Face).
Options: ``factor`` s >= 1, ``low_freq_factor`` and ``high_freq_factor`` (0 < low < high),
``original_length`` L (filled from model.train_length), ``base`` (Llama 3: 500000), ``logn``.
"""
from __future__ import annotations

import math

import torch

from .base import SchemeError
from .registry import register
from .rotary import Rotary, check_factor, check_original_length, default_inv_freq


def llama3_inv_freq(theta: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """theta' per pair from theta [d/2] (float64), the piecewise rule of the module doc."""
    wavelen = 2 * math.pi / theta  # [d/2]
    g = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # [d/2]: 0 below L/low turns, 1 above L/high
    return (1 - g) * theta / factor + g * theta


@register
class RotaryLlama3(Rotary):
    name = "rotary-llama3"
    paper = "Dubey et al. 2024 (Llama 3.1), Meta's apply_scaling: wavelength bands L/high, L/low"
    summary = "RoPE with Llama 3.1's scaling: keep lambda < L/high, theta/s beyond L/low, smooth in between"

    def __init__(self, num_heads: int, factor: float = 8.0, low_freq_factor: float = 1.0,
                 high_freq_factor: float = 4.0, original_length: int = 512, base: float = 10000.0,
                 logn: bool = False) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.factor = check_factor(self.name, factor)
        self.original_length = check_original_length(self.name, original_length)
        low, high = float(low_freq_factor), float(high_freq_factor)
        if not (0 < low < high < math.inf):
            raise SchemeError(f"rotary-llama3 needs 0 < low_freq_factor < high_freq_factor, got {low_freq_factor}, "
                              f"{high_freq_factor}; Llama 3.1 uses low_freq_factor=1, high_freq_factor=4")
        self.low_freq_factor, self.high_freq_factor = low, high

    def inv_freq(self, d_head, length):
        return llama3_inv_freq(default_inv_freq(self.base, d_head), self.factor, self.low_freq_factor,
                               self.high_freq_factor, self.original_length)

    def options(self):
        return {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor, "original_length": self.original_length,
                "base": self.base, **self.logn_options()}

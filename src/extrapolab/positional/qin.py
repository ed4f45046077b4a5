"""Qin et al. 2024, "Exploring Transformer Extrapolation" (AAAI): RPEs defined by
b(k) = exp(RPE(k)), i.e. bias(k) = log b(k), added to the scaled logits (their eq. 7:
exp(q·k/sqrt(d))·exp(r_ij)). Theorem 0.4 (eq. 19): the model extrapolates if sum_{t>=0} b_t < inf.

Indexing: the paper writes b_n with n >= 1 for the nearest key (eq. 29: B_ij = sum_{i=0}^{j-1}
1/(i+1)^2), so distance k = m - n >= 0 maps to n = k + 1. Example 2's 1/(n ln n) is infinite at
n = 1, so it is shifted to n = k + 2 (its divergence proof sums from n = 3).

  qin-type1     b = 1/(k+1)^2            p-series, p = 2: converges, B = pi^2/6, TRF Θ(1/ε) (eq. 29)
  qin-type2     b = exp(-ln^2(k+1))      decays faster than any p-series: converges, smaller TRF
  qin-example1  b = 1/(k+1)              harmonic (p = 1): diverges like ln(k+1)   (does NOT extrapolate)
  qin-example2  b = 1/(n ln n), n = k+2  Bertrand series: diverges like ln ln n    (does NOT extrapolate)

The paper uses the same b for every head and layer (no per-head scaling), so do we. ``b(k)`` and
``log_b(k)`` are class methods in float64 for the theory tools (A2), both from ``formula(x)`` (pointwise, in
x's dtype), which is also the scheme's ``closed_form``: FlexAttention's score_mod computes log b(d) per score
instead of gathering it from the [H, n] table (docs/attention.md). The class attributes
``series``, ``series_p``, ``b_offset``, ``converges`` and ``series_sum`` name the closed-form
convergence family.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch

from .base import RelativeBias
from .registry import register


def _k64(k) -> torch.Tensor:
    return torch.as_tensor(k, dtype=torch.float64)


class _QinBias(RelativeBias):
    #: "p-series" (sum 1/n^p), "exp-log-squared" (sum exp(-ln^2 n)), "n-log-n" (sum 1/(n ln n))
    series: ClassVar[str] = ""
    #: the p of a p-series, else None
    series_p: ClassVar[float | None] = None
    #: n = k + b_offset in the paper's b_n
    b_offset: ClassVar[int] = 1
    #: does sum_{k>=0} b(k) converge (Qin Theorem 0.4)?
    converges: ClassVar[bool] = True
    #: closed-form sum_{k>=0} b(k) where known (inf when divergent), else None
    series_sum: ClassVar[float | None] = None

    @classmethod
    def formula(cls, x: torch.Tensor) -> torch.Tensor:
        """log b at float distances x, in x's dtype (head-independent)."""
        raise NotImplementedError

    @classmethod
    def log_b(cls, k, h: int = 0) -> torch.Tensor:
        """log b(k) in float64, same shape as k (head-independent)."""
        return cls.formula(_k64(k))

    def closed_form(self, layer=0, dtype=torch.float32, device=None):
        formula = type(self).formula
        return lambda h, d: formula(d)

    @classmethod
    def b(cls, k, h: int = 0) -> torch.Tensor:
        """b(k) = exp(bias(k)) in float64, same shape as k."""
        return torch.exp(cls.log_b(k, h))

    @classmethod
    def bias_fn(cls, k, h: int = 0) -> torch.Tensor:
        return cls.log_b(k, h)

    def bias_from_distance(self, dist, layer=0):
        lb = self.log_b(dist.to(torch.float64))  # [...]
        return lb.unsqueeze(0).expand(self.num_heads, *dist.shape)  # [H, ...]


@register
class QinType1(_QinBias):
    name = "qin-type1"
    paper = "Qin et al. 2024 'Two New RPEs' Type1: b_n = 1/n^2 = exp(-2 ln n), eq. 29, n = k+1"
    summary = "bias = log b(k), b = 1/(k+1)^2: convergent p-series (p = 2)"
    series, series_p, converges, series_sum = "p-series", 2.0, True, math.pi**2 / 6

    @classmethod
    def formula(cls, x):
        return -2.0 * torch.log1p(x)


@register
class QinType2(_QinBias):
    name = "qin-type2"
    paper = "Qin et al. 2024 'Two New RPEs' Type2: b_n = exp(-ln^2 n), n = k+1"
    summary = "bias = log b(k) = -ln^2(k+1): convergent, smaller TRF than Type1"
    series, series_p, converges, series_sum = "exp-log-squared", None, True, None

    @classmethod
    def formula(cls, x):
        return -torch.log1p(x) ** 2


@register
class QinExample1(_QinBias):
    name = "qin-example1"
    paper = "Qin et al. 2024 'Validating The Necessity' Example1: b_n = 1/n, n = k+1"
    summary = "bias = -log(k+1), b = 1/(k+1): harmonic series diverges, does NOT extrapolate"
    series, series_p, converges, series_sum = "p-series", 1.0, False, math.inf

    @classmethod
    def formula(cls, x):
        return -torch.log1p(x)


@register
class QinExample2(_QinBias):
    name = "qin-example2"
    paper = "Qin et al. 2024 'Validating The Necessity' Example2: b_n = 1/(n ln n), n = k+2"
    summary = "bias = -log(n ln n), n = k+2: Bertrand series diverges (ln ln n), does NOT extrapolate"
    series, series_p, b_offset, converges, series_sum = "n-log-n", None, 2, False, math.inf

    @classmethod
    def formula(cls, x):
        n = x + 2.0
        return -(torch.log(n) + torch.log(torch.log(n)))

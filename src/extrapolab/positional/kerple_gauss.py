"""KERPLE Gaussian-like kernels (thesis §3.7.3, Table 3.6; Fact 3.5 for the power limit).

Composite kernels plugged into the KERPLE framework (thesis eq. 3.2), parameters per head and
shared by every layer. Positivity and the power limit follow the official KERPLE code (see
``kerple.py``): every forward clamps r >= 0.01 and powers to (0, 2]; ``constrain_()`` also
projects the stored values after each optimizer step. Powers above 2 are not positive definite
(Fact 3.5, Schoenberg 1938), hence the cap.

  2-para-bias:  q·k + r1·exp(-r2·k^2)            r1, r2 > 0
  3-para-bias:  q·k + r1·exp(-r2·k^r3)           r1, r2 > 0, 0 < r3 <= 2
  1-para-wht:   q·k · exp(-r1·k^2)               r1 > 0       (multiplicative weight, no bias)
  2-para-wht:   q·k · exp(-r1·k^r2)              r1 > 0, 0 < r2 <= 2

The "wht" kinds set ``has_weight = True``: the attention module multiplies the scaled q·k by
``weight_from_distance`` (plain/blocked paths) and their additive bias is 0 (plus the causal mask).
Initialisation follows kerple.py: multipliers U(0, 1), powers U(0, 2).
"""
from __future__ import annotations

import torch

from .kerple import _Kerple
from .registry import register


def _gauss(k: torch.Tensor, scale: torch.Tensor, power: torch.Tensor | None) -> torch.Tensor:
    """exp(-scale·k^power) (power None means the fixed Gaussian power 2)."""
    kp = k * k if power is None else _Kerple._pow(k, power)
    return torch.exp(-scale * kp)


@register
class KerpleGauss2ParaBias(_Kerple):
    name = "kerple-gauss-2para-bias"
    paper = "thesis §3.7.3 (2-para-bias): q·k + r1·exp(-r2·|m-n|^2)"
    summary = "Gaussian bias r1·exp(-r2·k^2), r1, r2 > 0 learned per head"
    PARAMS = {"r1": (1.0, False), "r2": (1.0, False)}

    @classmethod
    def formula(cls, k, r1, r2):
        return r1 * _gauss(k, r2, None)


@register
class KerpleGauss3ParaBias(_Kerple):
    name = "kerple-gauss-3para-bias"
    paper = "thesis §3.7.3 (3-para-bias): q·k + r1·exp(-r2·|m-n|^r3)"
    summary = "Gaussian-like bias r1·exp(-r2·k^r3), r1, r2 > 0, 0 < r3 <= 2"
    PARAMS = {"r1": (1.0, False), "r2": (1.0, False), "r3": (2.0, True)}

    @classmethod
    def formula(cls, k, r1, r2, r3):
        return r1 * _gauss(k, r2, r3)


class _GaussWeight(_Kerple):
    """Weight-only kernels: zero additive bias, q·k multiplied by exp(-r1·k^power)."""

    has_weight = True

    def bias_from_distance(self, dist, layer=0):
        # zero bias that still depends on the parameters' dtype/device; [H, ...]
        return torch.zeros((self.num_heads, *dist.shape), dtype=self.r1.dtype, device=dist.device)


@register
class KerpleGauss1ParaWht(_GaussWeight):
    name = "kerple-gauss-1para-wht"
    paper = "thesis §3.7.3 (1-para-wht): q·k · exp(-r1·|m-n|^2)"
    summary = "Gaussian weight on q·k: exp(-r1·k^2), r1 > 0 learned per head"
    PARAMS = {"r1": (1.0, False)}

    def weight_from_distance(self, dist, layer=0):
        k = dist.to(self.r1.dtype)
        return _gauss(k, self._bc(self.p("r1"), k), None)  # [H, ...]


@register
class KerpleGauss2ParaWht(_GaussWeight):
    name = "kerple-gauss-2para-wht"
    paper = "thesis §3.7.3 (2-para-wht): q·k · exp(-r1·|m-n|^r2)"
    summary = "Gaussian-like weight on q·k: exp(-r1·k^r2), r1 > 0, 0 < r2 <= 2"
    PARAMS = {"r1": (1.0, False), "r2": (2.0, True)}

    def weight_from_distance(self, dist, layer=0):
        k = dist.to(self.r1.dtype)
        return _gauss(k, self._bc(self.p("r1"), k), self._bc(self.p("r2"), k))  # [H, ...]

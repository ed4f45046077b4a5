"""KERPLE kernels (Chi et al. 2022; thesis §3.4, §3.5.3).

All parameters are per head and shared by every layer (one module per model, as in the
official code). Positivity is enforced the official way: every forward clamps r >= eps = 0.01
and exponents to (0, 2]; ``constrain_()`` also projects the stored values after each optimizer step.

  log        (§3.4):   -r1 · log(1 + r2·k)                 r1, r2 > 0
  power      (§3.4):   -r1 · k^r2                          r1 > 0, 0 < r2 <= 2
  3-para-log (§3.5.3): -r1 · log(1 + r2·k^r3)              r1, r2 > 0, 0 < r3 <= 2
  bias+wht   (§3.5.3): q·k · exp(-r3·k^r4) - r1·k^r2       r1, r3 > 0, 0 < r2, r4 <= 2
Initialisation follows the official code: multipliers U(0,1), log-scales/powers U(0,2); any
parameter may instead be given an initial value (``r2=1.0`` or one per head), checked against
its constraint.

Each additive kernel is written once (``formula(k, *params)``, pointwise): the distance table applies it to
[H, 1, ...]-shaped parameters, ``closed_form`` to one head's scalars inside FlexAttention's score_mod (a
log1p or a power per score instead of a gather from the [H, n] table; docs/attention.md).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import RelativeBias, SchemeError
from .registry import register

EPS = 0.01


class _Kerple(RelativeBias):
    #: name -> (init high, is_power); powers are capped at 2
    PARAMS: dict[str, tuple[float, bool]] = {}

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        cls.EXTRA_OPTIONS = {pname: None for pname in cls.PARAMS}  # initial values; None = official init

    def __init__(self, num_heads: int, **init) -> None:
        super().__init__(num_heads)
        self._init = {}
        for pname, (high, power) in self.PARAMS.items():
            value = init.pop(pname, None)
            if value is None:
                t = torch.rand(self.num_heads) * high
            else:
                t = self._check_init(pname, value, power)
                self._init[pname] = value
            self.register_parameter(pname, nn.Parameter(t))
        if init:
            raise SchemeError(f"scheme {self.name!r} has no option {next(iter(init))!r}; "
                              f"valid options: {', '.join(self.PARAMS)}")
        self.constrain_()

    def _check_init(self, pname: str, value, power: bool) -> torch.Tensor:
        """An initial value (a number, or one per head) inside the kernel's constraint."""
        try:
            t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        except (TypeError, ValueError):
            t = None
        hi = 2.0 if power else float("inf")
        if t is None or t.numel() not in (1, self.num_heads) or not bool(((t > 0) & (t <= hi)).all()):
            rng = "(0, 2] (a power above 2 is not conditionally positive definite, thesis Fact 3.5)" if power \
                else "(0, inf)"
            raise SchemeError(f"{self.name} {pname} must be a number or {self.num_heads} numbers in {rng}, "
                              f"got {value!r}; e.g. {pname}=1.0 (or leave it out for the official random init)")
        return t.expand(self.num_heads).clone()  # [H]

    def p(self, pname: str) -> torch.Tensor:
        """The constrained value of a parameter, shape [H] (clamped as in the official forward)."""
        raw = getattr(self, pname)
        return raw.clamp(min=EPS, max=2.0) if self.PARAMS[pname][1] else raw.clamp(min=EPS)

    @torch.no_grad()
    def constrain_(self) -> None:
        for pname, (_, power) in self.PARAMS.items():
            getattr(self, pname).clamp_(min=EPS, max=2.0 if power else None)

    @staticmethod
    def _pow(k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """k^p with k >= 0 and a finite gradient w.r.t. p at k = 0 (0^p = 0 for p > 0)."""
        return torch.where(k > 0, k.clamp(min=1.0).pow(p), 0.0)

    @classmethod
    def formula(cls, k: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        """The additive kernel at distances k (float) with the constrained parameters in PARAMS order, each
        broadcastable against k."""
        raise NotImplementedError

    def bias_from_distance(self, dist, layer=0):
        k = dist.to(self.r1.dtype)
        return self.formula(k, *(self._bc(self.p(n), k) for n in self.PARAMS))  # [H, ...]

    def closed_form(self, layer=0, dtype=torch.float32, device=None):
        """f(h, d) = :meth:`formula` at one head's detached parameters ([H] tensors indexed by h: a scalar load)."""
        if self.has_weight or type(self).formula.__func__ is _Kerple.formula.__func__:  # a weight kernel: the table
            return None
        ps = [self.p(n).detach().to(device, dtype) for n in self.PARAMS]  # [H] each
        formula = self.formula
        return lambda h, d: formula(d, *(p[h] for p in ps))

    @staticmethod
    def _bc(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return v.reshape(-1, *([1] * like.dim()))  # [H, 1, ...]

    def options(self):
        return dict(self._init)


@register
class KerpleLog(_Kerple):
    name = "kerple-log"
    paper = "thesis §3.4 (logarithmic variant), Chi et al. 2022"
    summary = "-r1·log(1 + r2·k), r1, r2 > 0 learned per head"
    PARAMS = {"r1": (2.0, False), "r2": (1.0, False)}

    @classmethod
    def formula(cls, k, r1, r2):
        return -r1 * torch.log1p(r2 * k)


@register
class KerplePower(_Kerple):
    name = "kerple-power"
    paper = "thesis §3.4 (power variant), Chi et al. 2022"
    summary = "-r1·k^r2, r1 > 0, 0 < r2 <= 2 learned per head"
    PARAMS = {"r1": (1.0, False), "r2": (2.0, True)}

    @classmethod
    def formula(cls, k, r1, r2):
        return -r1 * cls._pow(k, r2)


@register
class Kerple3ParaLog(_Kerple):
    name = "kerple-3para-log"
    paper = "thesis §3.5.3 (3-para-log)"
    summary = "-r1·log(1 + r2·k^r3), r1, r2 > 0, 0 < r3 <= 2"
    PARAMS = {"r1": (2.0, False), "r2": (1.0, False), "r3": (2.0, True)}

    @classmethod
    def formula(cls, k, r1, r2, r3):
        return -r1 * torch.log1p(r2 * cls._pow(k, r3))


@register
class KerpleBiasWht(_Kerple):
    name = "kerple-bias-wht"
    has_weight = True
    paper = "thesis §3.5.3 (bias+wht)"
    summary = "q·k·exp(-r3·k^r4) - r1·k^r2 (weight and bias kernels)"
    PARAMS = {"r1": (1.0, False), "r2": (2.0, True), "r3": (1.0, False), "r4": (2.0, True)}

    def bias_from_distance(self, dist, layer=0):
        k = dist.to(self.r1.dtype)
        return -self._bc(self.p("r1"), k) * self._pow(k, self._bc(self.p("r2"), k))  # [H, ...]

    def weight_from_distance(self, dist, layer=0):
        k = dist.to(self.r3.dtype)
        return torch.exp(-self._bc(self.p("r3"), k) * self._pow(k, self._bc(self.p("r4"), k)))  # [H, ...]

"""Closed-form convergence verdicts for sum_t exp(bias_h(t)) (Qin et al. 2024, Thm. 0.4), per scheme.

Each entry of ``CLOSED_FORMS`` maps a registered scheme name to ``fn(scheme, head, layer)`` returning
``{"converges", "method", "B", "tail", "bound"}``: ``tail(j)`` = sum_{t>=j} b_t exactly where known
(geometric, p-series via the Hurwitz zeta, finite support), ``bound(N)`` >= sum_{t>=N} b_t (an
integral bound) where only that is known. Learnable schemes are read at their current parameters.
Schemes without an entry get the numeric test of ``theory.py`` alone.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from scipy.special import erfc, gammaincc, gammaln, zeta

NO_BIAS = "no additive positional bias: b_t = exp(0) = 1, the series diverges (outside Qin's RPE setting)"


def _additive(scheme) -> bool:
    return scheme.has_bias and hasattr(scheme, "bias_from_distance")


def _exact(converges, method, B=None, tail: Callable[[int], float] | None = None,
           bound: Callable[[int], float] | None = None) -> dict:
    """``tail(j)`` = sum_{t>=j} b_t exactly; ``bound(N)`` >= sum_{t>=N} b_t (an integral bound)."""
    return {"converges": converges, "method": method, "B": B, "tail": tail, "bound": bound}


def _np(x) -> np.ndarray:
    return x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def _alibi(s, h, layer):
    slope = float(s.slopes[h])
    if slope <= 0:
        return _exact(False, "geometric with ratio exp(-0) = 1: diverges")
    B = 1.0 / (-math.expm1(-slope))
    return _exact(True, f"geometric: b_t = exp(-{slope:.6g} t), B = 1/(1 - exp(-s))", B,
                  lambda j: B * math.exp(-slope * j))


def _windowed(s, h, layer):
    w = s.window
    return _exact(True, f"finite support: b_t = 1 for t < w = {w}, 0 after; B = w", float(w),
                  lambda j: float(max(w - j, 0)))


def _qin(s, h, layer):
    cls = type(s)
    if cls.series == "p-series":
        p, off = float(cls.series_p), int(cls.b_offset)
        if p <= 1:
            return _exact(False, f"p-series sum 1/n^{p:g} with p <= 1 (harmonic for p = 1): diverges")
        return _exact(True, f"p-series sum 1/n^{p:g}, p > 1: B = zeta({p:g}), tail = Hurwitz zeta({p:g}, j+{off})",
                      float(zeta(p, off)), lambda j: float(zeta(p, j + off)))
    if cls.series == "n-log-n":
        return _exact(False, "Bertrand series sum 1/(n ln n): diverges (integral test, ln ln n)")
    if cls.series == "exp-log-squared":
        # sum_{t>=N} exp(-ln^2(t+1)) <= int_N^inf exp(-ln^2 x) dx = e^(1/4) sqrt(pi)/2 erfc(ln N - 1/2)
        return _exact(True, "exp(-ln^2 n) <= 1/n^2 for n >= e^2: converges by comparison with a p-series",
                      bound=lambda N: float(math.exp(0.25) * math.sqrt(math.pi) / 2 * erfc(math.log(N) - 0.5)))
    return _exact(bool(cls.converges), f"declared by the scheme ({cls.series})")


def _kerple_log(s, h, layer):
    r1, r2 = float(_np(s.p("r1"))[h]), float(_np(s.p("r2"))[h])
    if r1 <= 1:
        return _exact(False, f"(1 + r2 t)^-r1 with r1 = {r1:.4g} <= 1: p-series with p <= 1, diverges")
    return _exact(True, f"(1 + r2 t)^-r1, r1 = {r1:.4g} > 1: B = r2^-r1 · zeta(r1, 1/r2)",
                  float(r2**-r1 * zeta(r1, 1.0 / r2)), lambda j: float(r2**-r1 * zeta(r1, j + 1.0 / r2)))


def _kerple_3para(s, h, layer):
    r1, r2, r3 = (float(_np(s.p(n))[h]) for n in ("r1", "r2", "r3"))
    p = r1 * r3
    ok = p > 1
    # (1 + r2 t^r3)^-r1 <= r2^-r1 t^-p, and sum_{t>=N} t^-p <= int_{N-1}^inf x^-p dx
    bound = (lambda N: r2**-r1 * (N - 1.0) ** (1.0 - p) / (p - 1.0)) if ok else None
    return _exact(ok, f"(1 + r2 t^r3)^-r1 ~ t^-(r1·r3), r1·r3 = {p:.4g} {'>' if ok else '<='} 1: "
                      f"{'converges' if ok else 'diverges'} (p-series comparison)", bound=bound)


def _stretched_bound(r1: float, r2: float) -> Callable[[int], float]:
    """sum_{t>=N} exp(-r1 t^r2) <= int_{N-1}^inf exp(-r1 x^r2) dx = Γ(1/r2, r1 (N-1)^r2) / (r2 r1^(1/r2))."""
    a = 1.0 / r2

    def bound(N: int) -> float:
        x = r1 * (N - 1.0) ** r2
        q = gammaincc(a, x)
        if q == 0.0:
            return 0.0
        return float(math.exp(gammaln(a) + math.log(q) - math.log(r2) - a * math.log(r1)))

    return bound


def _stretched(s, h, layer):
    r1, r2 = float(_np(s.p("r1"))[h]), float(_np(s.p("r2"))[h])
    return _exact(True, f"exp(-r1 t^r2), r1 = {r1:.4g}, r2 = {r2:.4g} > 0: stretched exponential, converges",
                  bound=_stretched_bound(r1, r2))


def _sliding_dilated(s, h, layer):
    step = s.C ** s.level_of(layer)
    w = np.exp(_np(s.r)[h])  # [C] b at distances j·C^l
    B = float(w.sum())
    return _exact(True, f"finite support {{j·{step} : j < {s.C}}} (level {s.level_of(layer)}): B = sum_j exp(r_j)",
                  B, lambda j0: float(w[np.arange(s.C) * step >= j0].sum()))


def _gauss_bias(s, h, layer):
    return _exact(False, "bias r1·exp(-r2 t^p) -> 0, so b_t -> 1: terms do not vanish, diverges")


def _t5(s, h, layer):
    return _exact(False, f"every t >= {s.max_distance} shares one bucket: b_t constant > 0, diverges")


def _sandwich(s, h, layer):
    c = float(s.ratios[h])
    return _exact(False, f"bias >= -dbar/c_h = {-s.dbar / c:.4g} (each cosine >= -1): "
                         "b_t stays >= exp(-dbar/c_h) > 0, terms do not vanish, diverges")


def _smoothed(s, h, layer):
    a, bb = (float(x) for x in s.coef[h])
    if a >= -1:
        return _exact(False, f"e^b (1 + t)^a with a = {a:.4g} >= -1: p-series with p <= 1, diverges")
    return _exact(True, f"e^b (1 + t)^a, a = {a:.4g} < -1: B = e^b zeta(-a, 1)",
                  float(math.exp(bb) * zeta(-a, 1.0)), lambda j: float(math.exp(bb) * zeta(-a, j + 1.0)))


CLOSED_FORMS: dict[str, Callable] = {
    "alibi": _alibi, "windowed": _windowed,
    "qin-type1": _qin, "qin-type2": _qin, "qin-example1": _qin, "qin-example2": _qin,
    "kerple-log": _kerple_log, "kerple-3para-log": _kerple_3para,
    "kerple-power": _stretched, "kerple-bias-wht": _stretched,  # bias+wht: only its bias enters b_t
    "kerple-gauss-2para-bias": _gauss_bias, "kerple-gauss-3para-bias": _gauss_bias,
    "t5": _t5, "sandwich": _sandwich, "smoothed-sandwich": _smoothed, "sliding-dilated": _sliding_dilated,
}


def _zero_bias(s, h, layer):
    return _exact(False, "weight-only kernel: additive bias 0, b_t = 1, diverges (the weight scales q·k, "
                         "outside Qin's additive-RPE setting)")


CLOSED_FORMS.update({"kerple-gauss-1para-wht": _zero_bias, "kerple-gauss-2para-wht": _zero_bias})


def exact_form(scheme, head: int, layer: int = 0) -> dict | None:
    """Closed-form verdict for this head, or None (numeric only)."""
    if getattr(scheme, "no_trf", ""):  # content-dependent bias (FoX, CoPE): no formula, say why
        return _exact(None, scheme.no_trf)
    if not _additive(scheme):
        return _exact(False, NO_BIAS)
    fn = CLOSED_FORMS.get(scheme.name)
    return None if fn is None else fn(scheme, head, layer)

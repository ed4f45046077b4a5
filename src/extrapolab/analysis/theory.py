"""A2: the theory side of Qin, Zhong, Deng 2024 ("Exploring Transformer Extrapolation").

* Theorem 0.4 (eq. 19): a relative positional encoding with b_t = exp(bias(t)), t = m - n >= 0,
  extrapolates if B = sum_{t>=0} b_t converges.
* TRF (eq. 22): n_the(eps) = inf_j (sum_{t>=j} b_t < B·eps), the fewest most recent keys that
  hold more than (1 - eps) of the series. For ALiBi (b_t = exp(-s·t)) the tail is
  B·exp(-s·j), so n_the = min{j : exp(-s·j) < eps} = floor(ln(1/eps)/s) + 1.

Everything here is computed from the scheme's formula alone (``bias_from_distance`` at its current
parameters, or a Qin scheme's own ``b(k)``), so it works for any registered scheme, including a
user callable registered with ``positional.register_callable``.

Two answers per head, both reported:

* ``numeric`` — dense b_t for t < N (default 2^20) and a ratio test on octave sums
  S_j = sum_{2^j <= t < 2^(j+1)} b_t over the last K octaves. Converges if every ratio is
  <= 1 - delta and the ratios do not drift up (a geometric octave decay, i.e. a power-law tail
  t^-p with p > 1 or faster); the stated tail bound sum_{t>=N} b_t <= S_last·r/(1-r) assumes that
  decay continues. Diverges if the octave sums stop shrinking (geometric-mean ratio >= 1 - delta).
  Otherwise (ratios < 1 but creeping towards 1, the 1/(n ln^p n) family) it is undetermined
  (``None``): no finite computation can settle those.
* ``exact`` — the verdict from the formula where a closed form exists (``CLOSED_FORMS``); it wins.

Schemes whose bias depends on the content (FoX's gates, CoPE's counted positions) have no formula:
they say why in ``no_trf`` and the verdict is undetermined (None) with that reason. A per-layer
hybrid is read at ``layer`` (its ``for_layer``).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from .. import positional
from ..io import UserError
from ..positional.base import PositionalScheme
from .closed_forms import CLOSED_FORMS, _additive, exact_form  # noqa: F401  (CLOSED_FORMS re-exported)

DEFAULT_N = 2**20


def as_scheme(scheme, num_heads: int = 8, **params) -> PositionalScheme:
    if isinstance(scheme, PositionalScheme):
        return scheme
    if isinstance(scheme, str):
        return positional.build(scheme, num_heads=num_heads, **params)
    raise UserError(f"expected a scheme name or PositionalScheme, got {type(scheme).__name__}")


def scheme_device(scheme) -> torch.device:
    for t in list(scheme.parameters()) + list(scheme.buffers()):
        return t.device
    return torch.device("cpu")


def b_values(scheme: PositionalScheme, dist, layer: int = 0) -> np.ndarray:
    """b_t = exp(bias(t)) in float64 for distances ``dist`` (1-D ints): [H, n]."""
    d = np.asarray(dist, dtype=np.int64)
    H = scheme.num_heads
    if not _additive(scheme):
        return np.ones((H, d.size))
    if callable(getattr(scheme, "b", None)):  # Qin schemes and user callables expose b(k, h) in float64
        k = torch.from_numpy(d.astype(np.float64))
        return np.stack([np.asarray(scheme.b(k, h), dtype=np.float64) for h in range(H)])
    if hasattr(scheme, "curve"):  # Sandwich: numpy closed form, no O(max distance) table
        return np.exp(np.asarray(scheme.curve(d), dtype=np.float64))
    with torch.no_grad():
        bias = scheme.bias_from_distance(torch.from_numpy(d).to(scheme_device(scheme)), layer)  # [H, n]
    return np.exp(bias.detach().double().cpu().numpy())


# ---- numeric test ------------------------------------------------------------------------------
def numeric_series(scheme, layer: int = 0, n: int = DEFAULT_N, octaves: int = 6,
                   delta: float = 1e-3, drift: float = 5e-3) -> list[dict]:
    """Per head: partial sum, octave-ratio verdict, stated tail bound, and the dense b (for TRF)."""
    scheme = as_scheme(scheme)
    J = int(math.log2(n))
    if 2**J != n or J < octaves + 2:
        raise UserError(f"n must be a power of two >= 2^{octaves + 2}, got {n}")
    b = b_values(scheme, np.arange(n), layer)  # [H, n]
    out = []
    for h in range(b.shape[0]):
        bh = b[h]
        if np.isnan(bh).any():
            t = int(np.nonzero(np.isnan(bh))[0][0])
            raise UserError(f"scheme {scheme.name!r} head {h}: exp(bias({t})) is NaN; fix the bias function")
        S = np.array([bh[2**j:2**(j + 1)].sum() for j in range(J)])  # octave sums
        last = S[-octaves - 1:]
        res = {"N": n, "partial_sum": float(bh.sum()), "octave_sums": last.tolist()}
        if not np.all(np.isfinite(bh)):
            res.update(converges=False, verdict="b_t is infinite", tail_bound=math.inf)
        elif last[-1] == 0.0:
            nz = np.nonzero(bh)[0]
            res.update(converges=True, tail_bound=0.0,
                       verdict=f"b_t = 0 (or underflows to 0) for {int(nz.max()) + 1 if nz.size else 0} <= t < N; "
                               "assumed to stay 0 beyond N")
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                r = last[1:] / last[:-1]
            r = np.where(np.isfinite(r), r, np.inf)
            g = (last[-1] / last[0]) ** (1.0 / octaves) if last[0] > 0 else np.inf
            res["octave_ratios"] = r.tolist()
            tail = float(last[-1] * r.max() / (1.0 - r.max())) if r.max() < 1 else math.inf
            if g >= 1.0 - delta:
                res.update(converges=False, tail_bound=math.inf,
                           verdict=f"octave sums do not shrink (geometric-mean ratio {g:.4f} >= {1 - delta})")
            elif r.max() <= 1.0 - delta and r[-1] - r[0] <= drift:
                res.update(converges=True, tail_bound=tail,
                           verdict=f"octave sums decay geometrically (ratio <= {r.max():.4f}); tail bound "
                                   "S_last·r/(1-r) assumes that decay continues beyond N")
            else:
                res.update(converges=None, tail_bound=tail,
                           verdict=f"undetermined: ratios < 1 but drifting up ({r[0]:.4f} -> {r[-1]:.4f}), "
                                   "the borderline 1/(n ln^p n) family; a finite sum cannot decide")
        res["_b"] = bh
        out.append(res)
    return out


# ---- public API ------------------------------------------------------------------------------------
def _one(scheme, h, layer, num) -> dict:
    ex = exact_form(scheme, h, layer)
    if ex is not None:
        conv, method = ex["converges"], ("exact: " if ex["converges"] is not None else "") + ex["method"]
        if ex["tail"] is not None:
            tail_bound = 0.0
        elif ex["bound"] is not None:  # closed-form bound on sum_{t>=N}: tighter and safer than numeric
            tail_bound = ex["bound"](num["N"])
            method += f"; B = dense sum to N + integral tail bound {tail_bound:.3g}"
        else:
            tail_bound = num["tail_bound"] if conv else math.inf
        B = ex["B"] if ex["B"] is not None else (num["partial_sum"] + tail_bound if conv else math.inf)
    else:
        conv, method = num["converges"], "numeric: " + num["verdict"]
        B = num["partial_sum"] + num["tail_bound"] if conv else math.inf
        tail_bound = num["tail_bound"]
    if conv is False:
        B = math.inf
    return {"head": h, "converges": conv, "B": B, "method": method, "tail_bound": tail_bound,
            "numeric": {k: v for k, v in num.items() if not k.startswith("_")}, "_tail": (ex or {}).get("tail"),
            "_b": num["_b"]}


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def convergence(scheme, head: int | None = None, *, layer: int = 0, n: int = DEFAULT_N,
                num_heads: int = 8, **params) -> dict | list[dict]:
    """Does sum_t exp(bias(t)) converge for ``head`` (or every head when None)? (Qin Thm. 0.4)

    Returns dict(head, converges (True/False/None = undetermined), B (inf when divergent), method,
    tail_bound (bound on the truncation error of a numeric B; 0 when a closed-form tail is used),
    numeric (the numeric test's own findings, kept as a cross-check)).
    A scheme name is built with ``num_heads`` and ``params``.
    """
    scheme = as_scheme(scheme, num_heads, **params).for_layer(layer)
    heads = range(scheme.num_heads) if head is None else [_check_head(scheme, head)]
    nums = numeric_series(scheme, layer, n)
    out = [_public(_one(scheme, h, layer, nums[h])) for h in heads]
    return out if head is None else out[0]


def _check_head(scheme, head: int) -> int:
    if not 0 <= int(head) < scheme.num_heads:
        raise UserError(f"head must lie in 0..{scheme.num_heads - 1}, got {head}")
    return int(head)


def _first_below(tail: Callable[[int], float], target: float) -> int | None:
    """Smallest j >= 0 with tail(j) < target, for a non-increasing tail (bisection); None when
    j > 2^62 (a barely convergent series, e.g. a p-series with p just above 1)."""
    if tail(0) < target:
        return 0
    hi = 1
    while tail(hi) >= target:
        hi *= 2
        if hi > 2**62:
            return None
    lo = hi // 2  # tail(lo) >= target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tail(mid) < target:
            hi = mid
        else:
            lo = mid
    return hi


def _trf_row(d: dict, eps: float, n: int) -> dict:
    row = {"head": d["head"], "converges": d["converges"], "B": d["B"], "eps": float(eps), "trf": None,
           "tail_bound": d["tail_bound"], "method": d["method"]}
    if not d["converges"]:
        return row
    if d["_tail"] is not None:
        row["trf"] = _first_below(d["_tail"], eps * d["B"])
        row["trf_method"] = "closed-form tail"
        if row["trf"] is None:
            row["trf_lower_bound"] = 2**62
            row["trf_method"] = "closed-form tail; TRF > 2^62 tokens (use a larger eps)"
        return row
    tails = np.cumsum(d["_b"][::-1])[::-1] + d["tail_bound"]  # [N] sum_{t>=j} b_t
    below = np.nonzero(tails < eps * d["B"])[0]
    if below.size:
        row["trf"] = int(below[0])
        row["trf_method"] = "numeric tails (dense sum + stated tail bound)"
    else:
        row["trf_lower_bound"] = n
        row["trf_method"] = f"TRF > N = {n}; raise n"
    return row


def _details(scheme, layer: int, n: int) -> list[dict]:
    scheme = scheme.for_layer(layer)  # per-layer hybrids: the scheme this layer attends with
    nums = numeric_series(scheme, layer, n)
    return [_one(scheme, h, layer, nums[h]) for h in range(scheme.num_heads)]


def _check_eps(eps) -> float:
    if not 0.0 < float(eps) < 1.0:
        raise UserError(f"eps must lie in (0, 1), got {eps}; e.g. --eps 0.01")
    return float(eps)


def trf(scheme, eps: float = 0.01, *, layer: int = 0, n: int = DEFAULT_N, num_heads: int = 8,
        **params) -> list[dict]:
    """Per head n_the(eps) of Qin eq. 22 (``trf`` None when the series diverges or is undetermined).

    Uses the closed-form tail where one exists (bisection, any size), else the dense numeric
    tails plus the stated tail bound (``trf_lower_bound = N`` when the TRF lies beyond N).
    """
    eps = _check_eps(eps)
    scheme = as_scheme(scheme, num_heads, **params)
    return [_trf_row(d, eps, n) for d in _details(scheme, layer, n)]


def trf_curve(scheme, eps_grid, *, layer: int = 0, n: int = DEFAULT_N, num_heads: int = 8) -> dict:
    """{eps: [trf per head]} for plotting Qin Fig. 6 (the series is evaluated once)."""
    scheme = as_scheme(scheme, num_heads)
    det = _details(scheme, layer, n)
    return {_check_eps(e): [_trf_row(d, e, n)["trf"] for d in det] for e in eps_grid}

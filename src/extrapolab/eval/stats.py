"""E7 multi-seed tables (Sandwich, Chi et al. 2023, Table 3; thesis Tables 3.2-3.5), and Student-t
intervals of a mean and of paired differences (:func:`t_interval`, :func:`paired_interval`).

Table 3 reports mean ± std over five seeds and its caption reads: "x† means sandwich is
statistically significantly *better* than x. x* means sandwich is statistically significantly
*worse* than x. The test used is paired two-sided t-test with α = 0.05." So with a lower-is-better
metric (perplexity) a cell gets † when the *reference* scheme is significantly better (the cell's
value is higher) and * when the reference is significantly worse.

Conventions: std is the sample standard deviation (ddof=1; reported only for n >= 2). Seeds are
paired by key when values are given as {seed: value}, else by order. Pairs with a missing or
non-finite value are dropped; fewer than 2 pairs -> no test and no mark. Zero variance of the
paired differences: all equal to zero -> p = 1 (identical, no mark); a constant non-zero
difference -> t = ±inf, p = 0 (what scipy.stats.ttest_rel returns in that case).
"""
from __future__ import annotations

import csv
import io
import math
from numbers import Real
from typing import Iterable, Mapping, Sequence

import numpy as np
from scipy import stats as sps

from ..io import UserError

ALPHA = 0.05
BETTER, WORSE = "†", "*"  # reference significantly better than x / significantly worse than x


def _finite(v) -> bool:
    return v is not None and isinstance(v, Real) and math.isfinite(float(v))


def _values(values) -> list:
    return list(values.values()) if isinstance(values, Mapping) else list(values)


def summary(values) -> dict:
    """Per-seed values (sequence or {seed: value}) -> {mean, std, n}; None values are skipped."""
    vals = [float(v) for v in _values(values) if v is not None]
    n = len(vals)
    if n == 0:
        return {"mean": None, "std": None, "n": 0}
    arr = np.asarray(vals, dtype=np.float64)
    std = float(np.std(arr, ddof=1)) if n >= 2 and np.all(np.isfinite(arr)) else None
    return {"mean": float(np.mean(arr)), "std": std, "n": n}


def _is_leaf(values) -> bool:
    items = _values(values)
    return all(v is None or isinstance(v, Real) for v in items)


def summarize(values_by_scheme_seed: Mapping) -> dict:
    """{scheme: per-seed values} -> {scheme: {mean, std, n}}; nests, e.g. {scheme: {L: values}}."""
    out = {}
    for key, vals in values_by_scheme_seed.items():
        out[key] = summary(vals) if _is_leaf(vals) else summarize(vals)
    return out


def paired(a, b) -> tuple[np.ndarray, np.ndarray]:
    """Align two per-seed collections (by key for mappings, by order otherwise), finite pairs only."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        keys = [k for k in a if k in b]
        pairs = [(a[k], b[k]) for k in keys]
    else:
        a, b = _values(a), _values(b)
        if len(a) != len(b):
            raise UserError(f"paired t-test needs one value per seed on both sides, got {len(a)} and "
                            f"{len(b)}; give values as {{seed: value}} to pair by seed")
        pairs = list(zip(a, b))
    pairs = [(float(x), float(y)) for x, y in pairs if _finite(x) and _finite(y)]
    xa = np.array([p[0] for p in pairs], dtype=np.float64)
    xb = np.array([p[1] for p in pairs], dtype=np.float64)
    return xa, xb


def paired_ttest(a, b) -> dict:
    """Two-sided paired t-test of a vs b (scipy.stats.ttest_rel) -> {t, p, n, mean_diff}.

    mean_diff = mean(a - b). n < 2 -> t = p = nan (no test).
    """
    xa, xb = paired(a, b)
    n = int(xa.size)
    if n < 2:
        return {"t": math.nan, "p": math.nan, "n": n, "mean_diff": float(np.mean(xa - xb)) if n else math.nan}
    d = xa - xb
    mean_diff = float(np.mean(d))
    if np.all(d == d[0]):  # zero variance of the differences
        if d[0] == 0:
            return {"t": 0.0, "p": 1.0, "n": n, "mean_diff": 0.0}
        return {"t": math.copysign(math.inf, d[0]), "p": 0.0, "n": n, "mean_diff": mean_diff}
    res = sps.ttest_rel(xa, xb)  # two-sided by default
    return {"t": float(res.statistic), "p": float(res.pvalue), "n": n, "mean_diff": mean_diff}


def t_interval(values, alpha: float = ALPHA) -> dict:
    """Mean of ``values`` (finite ones) with its two-sided 1 - ``alpha`` Student-t interval
    (scipy.stats.t): {mean, lo, hi, half, sd, n}. One value gives no interval (lo = -inf, hi = inf);
    values that are all equal give lo = hi = mean."""
    x = np.asarray([float(v) for v in _values(values) if _finite(v)], dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return {"mean": math.nan, "lo": -math.inf, "hi": math.inf, "half": math.inf, "sd": math.nan, "n": 0}
    mean = float(x.mean())
    if n < 2:
        return {"mean": mean, "lo": -math.inf, "hi": math.inf, "half": math.inf, "sd": math.nan, "n": 1}
    sd = float(x.std(ddof=1))
    half = float(sps.t.ppf(1 - alpha / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "half": half, "sd": sd, "n": n}


def paired_interval(a, b, alpha: float = ALPHA) -> dict:
    """:func:`t_interval` of the paired differences a - b (paired by key for mappings, by order
    otherwise, finite pairs only: :func:`paired`); its mean is ``paired_ttest``'s mean_diff."""
    xa, xb = paired(a, b)
    return t_interval(xa - xb, alpha)


def mark(reference, other, *, alpha: float = ALPHA, lower_is_better: bool = True) -> str:
    """'†' if ``reference`` is significantly better than ``other``, '*' if significantly worse, else ''."""
    res = paired_ttest(other, reference)
    if not (res["p"] < alpha):  # nan (no test) or not significant
        return ""
    other_higher = res["mean_diff"] > 0
    ref_better = other_higher if lower_is_better else not other_higher
    return BETTER if ref_better else WORSE


def _decimals(x: float) -> int:
    """Three significant digits, as in Sandwich Table 3 (23.5, 5.27, 2.88, 14168)."""
    if not math.isfinite(x) or x == 0:
        return 2
    return max(0, 2 - int(math.floor(math.log10(abs(x)))))


def format_cell(s: dict, m: str = "") -> str:
    if s["n"] == 0 or s["mean"] is None:
        return "—"
    if not math.isfinite(s["mean"]):
        return f"{s['mean']}{m}"
    d = _decimals(s["mean"])
    txt = f"{s['mean']:.{d}f}"
    if s["std"] is not None:
        txt += f" ± {s['std']:.{d}f}"
    return txt + m


def _lookup(per_length: Mapping, length):
    for key in (length, str(length)):
        if key in per_length:
            return per_length[key]
    try:
        return per_length.get(int(length))
    except (TypeError, ValueError):
        return None


def format_table(
    results: Mapping,
    reference: str,
    lengths: Iterable,
    *,
    alpha: float = ALPHA,
    lower_is_better: bool = True,
    metric: str = "ppl",
    schemes: Sequence[str] | None = None,
) -> tuple[str, str]:
    """{scheme: {length: per-seed values}} -> (markdown, csv) like Sandwich Table 3.

    Rows are lengths, columns schemes; every non-reference cell is marked against ``reference``.
    The CSV is long-format: length, scheme, mean, std, n, p_value, mark.
    """
    if reference not in results:
        raise UserError(f"reference scheme {reference!r} is not among the results {sorted(results)}; "
                        "pick one of them")
    schemes = list(schemes or results)
    lengths = list(lengths)
    head = "| L_ex | " + " | ".join(schemes) + " |"
    lines = [head, "|" + "---|" * (len(schemes) + 1)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["length", "scheme", f"{metric}_mean", f"{metric}_std", "n", "p_value", "mark"])
    n_max, tested = 0, False
    for L in lengths:
        ref_vals = _lookup(results[reference], L) or []
        cells = []
        for sc in schemes:
            vals = _lookup(results.get(sc, {}), L) or []
            s = summary(vals)
            n_max = max(n_max, s["n"])
            m, p = "", None
            if sc != reference and s["n"]:
                t = paired_ttest(vals, ref_vals)
                p = None if math.isnan(t["p"]) else t["p"]
                tested = tested or p is not None
                m = mark(ref_vals, vals, alpha=alpha, lower_is_better=lower_is_better)
            cells.append(format_cell(s, m))
            w.writerow([L, sc, "" if s["mean"] is None else repr(s["mean"]),
                        "" if s["std"] is None else repr(s["std"]), s["n"], "" if p is None else repr(p), m])
        lines.append(f"| {L} | " + " | ".join(cells) + " |")
    direction = f"{'lower' if lower_is_better else 'higher'} {metric} is better"
    lines.append("")
    lines.append(legend(reference, n_max, tested, alpha, direction, compared=len(schemes) > 1))
    return "\n".join(lines) + "\n", buf.getvalue()


def legend(reference: str, n_max: int, tested: bool, alpha: float = ALPHA, direction: str = "",
           compared: bool = True) -> str:
    """The line under an E7 table: the †/* key when some cell was t-tested, else why none was (one
    seed, no other scheme, or no scheme with >= 2 seeds paired with the reference), so no reader
    looks for marks that cannot be there."""
    tail = f"; {direction}" if direction else ""
    if tested:
        return (f"x{BETTER}: {reference} is significantly better than x; x{WORSE}: {reference} is "
                f"significantly worse than x (paired two-sided t-test over seeds, α = {alpha}; "
                f"mean ± sample std over up to {n_max} seeds{tail}).")
    why = ("one seed per scheme" if n_max < 2 else f"only {reference}, nothing to compare" if not compared
           else f"fewer than 2 seeds paired with {reference} in every cell")
    values = "values are single runs, without ± std" if n_max < 2 else \
        f"mean ± sample std over up to {n_max} seeds"
    return (f"No t-test was run ({why}; a paired t-test needs at least 2), so no cell is marked "
            f"{BETTER} or {WORSE}; {values}{tail}.")

"""The report's "see why" section from a sweep's database: A1 ERF overlay and A2 TRF table.

Sandwich paper §5 (Figs. 4-7, 11): a model extrapolates when the empirical receptive field
(ERF, the fewest most recent tokens holding 99% of the gradient of the last prediction) stays
inside L_tr. Qin et al. 2024 eq. 22: the theoretical receptive field n_the(eps) of the trained
bias exists only when sum_k exp(bias(k)) converges. Rows are written by sweeps with
``eval.erf_length > 0`` (protocols "erf" and "trf" in results.sqlite).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .. import positional  # noqa: E402
from ..eval.stats import format_cell, summary  # noqa: E402
from .db import ResultsDB  # noqa: E402
from .plots import plain_log_ticks, save, style  # noqa: E402


def erf_table(db: ResultsDB, labels: list[str], train_length: int) -> str:
    """Markdown: per scheme label, ERF tokens (mean ± std over seeds), inside L_tr?, theory TRF."""
    erf = defaultdict(list)
    length = {}
    for _, _, label, _, L, v in db.scalars("erf", "erf_tokens"):
        erf[label].append(v)
        length[label] = int(L)
    share = defaultdict(list)  # gradient share of the L_tr most recent inputs, c at distance L_tr
    for _, _, label, _, L, c in db.series("erf", "c"):
        n = len(c)
        share[label].append(float(c[n - train_length - 1]) if 0 < train_length < n else 1.0)
    theory: dict = defaultdict(lambda: defaultdict(list))
    for metric in ("converging_heads", "heads", "trf_mean", "trf_max"):
        for _, _, label, _, _, v in db.scalars("trf", metric):
            theory[label][metric].append(v)
    rows = ["| scheme | ERF measured at L | ERF tokens (mean ± std over runs) | runs with ERF ≤ L_tr | "
            "gradient share of the L_tr most recent inputs | "
            "heads with convergent Σexp(bias) | TRF n_the (mean over heads, mean over runs) |",
            "|---|---|---|---|---|---|---|"]
    no_formula = {r["label"]: _no_trf(r["scheme"]) for r in db.runs()}
    for label in [lb for lb in labels if lb in erf or lb in theory] or sorted(set(erf) | set(theory)):
        vals = erf.get(label, [])
        inside = f"{sum(v <= train_length for v in vals)}/{len(vals)}" if vals else "—"
        th = theory.get(label)
        if no_formula.get(label):  # a bias that is no fixed kernel of i - j: no verdict, its reason
            conv, trf = "no formula", no_formula[label].split(":")[0]
        elif th and th["heads"]:
            conv = f"{np.mean(th['converging_heads']):.0f}/{np.mean(th['heads']):.0f}"
            trf = f"{np.mean(th['trf_mean']):.0f}" if th["trf_mean"] else "none (diverges, or > 2^62)"
        else:
            conv, trf = "no bias", "—"
        sh = f"{100 * np.mean(share[label]):.0f}%" if share.get(label) else "—"
        rows.append(f"| {label} | {length.get(label, '—')} | {format_cell(summary(vals))} | {inside} | {sh} | {conv} | {trf} |")
    return "\n".join(rows) + "\n"


def _no_trf(scheme: str) -> str:
    """The registered scheme's reason for having no TRF formula ('' when it has one, or is unknown)."""
    cls = positional.REGISTRY.get(scheme)
    return cls.no_trf if cls is not None else ""  # a class attribute: no scheme to build


def plot_erf_overlay(db: ResultsDB, labels: list[str], train_length: int, stem: Path) -> Path | None:
    """Mean c_m over seeds per scheme (one line each), the L_tr most recent tokens shaded."""
    curves: dict = defaultdict(list)
    for _, _, label, _, L, c in db.series("erf", "c"):
        curves[label].append(np.asarray(c, dtype=float))
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    Lmax = 0
    for i, label in enumerate([lb for lb in labels if lb in curves] or sorted(curves)):
        cs = curves[label]
        n = min(len(c) for c in cs)
        c = np.mean([c[:n] for c in cs], axis=0)  # [n]
        dist = n - np.arange(1, n)  # [n-1] distance of input position m from the predicted token n
        ax.plot(dist, c[:-1], lw=1.2, label=label, **style(i))  # c_n = 0: the target itself is not an input
        Lmax = max(Lmax, n)
    if train_length:
        ax.axvspan(1, train_length, color="grey", alpha=0.12, label=f"L_tr = {train_length} most recent")
    ax.axhline(0.99, color="red", ls=":", lw=1, label="c = 0.99")
    ax.set_xscale("log")
    ax.set_xlim(1, Lmax)
    plain_log_ticks(ax)
    ax.set_xlabel("distance from the predicted token (log)")
    ax.set_ylabel("share of the gradient within this distance (c_m)")
    ax.set_title("A1 cumulative normalized gradient (Sandwich §5.1), mean over seeds")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, stem)

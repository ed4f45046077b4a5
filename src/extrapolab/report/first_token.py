"""The report's A6 section from a sweep's database: attention mass on the first token per layer
(analysis/first_token.py; rows written by sweeps with ``eval.first_token``), one figure per dataset at the
longest measured length, and a table of the mean over layers at L_tr and at that length."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .db import ResultsDB  # noqa: E402
from .plots import save, style  # noqa: E402


def first_token_curves(db: ResultsDB) -> dict:
    """{dataset: {L: {label: per-layer mass, mean over seeds}}}."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for _, ds, label, _, L, ys in db.series("first_token", "mass"):
        acc[ds][int(L)][label].append(np.asarray(ys, dtype=float))
    return {ds: {L: {lb: np.mean(v, axis=0).tolist() for lb, v in per.items()} for L, per in byL.items()}
            for ds, byL in acc.items()}


def first_token_means(db: ResultsDB) -> dict:
    """{dataset: {label: {L: mean over layers and seeds}}}: the claims' input (report/picture.py)."""
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for _, ds, label, _, L, v in db.scalars("first_token", "mass"):
        acc[ds][label][int(L)].append(float(v))
    return {ds: {lb: {L: float(np.mean(v)) for L, v in byL.items()} for lb, byL in per.items()} for ds, per in acc.items()}


def first_token_table(curves: dict, labels: list[str], train_length: int) -> str:
    """Markdown: per dataset and label, the mean mass over layers at each length and the per-layer values at
    the longest."""
    rows = ["| dataset | scheme | mean over layers at each L | per layer at the longest L |", "|---|---|---|---|"]
    for ds, byL in curves.items():
        Ls = sorted(byL)
        order = [lb for lb in labels if any(lb in byL[L] for L in Ls)] or sorted({lb for L in Ls for lb in byL[L]})
        for label in order:
            means = ", ".join(f"{L}: {np.mean(byL[L][label]):.3f}" for L in Ls if label in byL[L])
            last = byL[Ls[-1]].get(label)
            per = " ".join(f"{x:.3f}" for x in last) if last else "—"
            rows.append(f"| {ds} | {label} | {means} | {per} |")
    return "\n".join(rows) + "\n"


def plot_first_token(curves: dict, labels: list[str], stem: Path) -> list[Path]:
    """One figure per dataset: mass on token 0 by layer at the longest length, a line per label."""
    out = []
    for ds, byL in curves.items():
        L = max(byL)
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        per = byL[L]
        for i, label in enumerate([lb for lb in labels if lb in per] or sorted(per)):
            ys = per[label]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label=label, **style(i))
        ax.set_xlabel("layer")
        ax.set_ylabel("mean attention weight on token 0")
        ax.set_title(f"A6 attention on the first token ({ds}, L = {L}), mean over heads, queries and seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        out.append(save(fig, Path(f"{stem}_{ds}")))
    return out

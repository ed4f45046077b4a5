"""Figures of `extrapolab extend hf:PATH` (:mod:`.report`): E4 loss vs position, E1 vs
length, passkey heat maps, ERF curves; each written as PNG + SVG under ``<out>/figures``."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..analysis.common import new_figure, save_figure
from ..analysis.erf import plot_erf
from ..eval.positionwise import smooth
from ..report.plots import plot_ppl_vs_length
from .cells import METHODS
from ..tasks.retrieval import plot_heatmap


def label(m: str) -> str:
    return METHODS.get(m, m)


def distinct(results: dict, L: str, corpus: str) -> list[str]:
    """Methods measured at (L, corpus) whose cell was computed (not a copy of an identical one)."""
    return [m for m, byL in results["cells"].items()
            if corpus in byL.get(L, {}) and not byL[L][corpus].get("same_as")]


def plot_positionwise(results: dict, stem: Path) -> str | None:
    """E4: mean NLL vs position, one line per distinct method, one panel per (corpus, L > L_ctx)."""
    L_ctx = results["L_ctx"]
    panels = [(c, L) for L in sorted({L for byL in results["cells"].values() for L in byL}, key=int)
              if int(L) > L_ctx for c in results["spec"]["corpora"] if distinct(results, L, c)]
    if not panels:
        return None
    ncol = min(2, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = new_figure(6.0 * ncol, 3.8 * nrow, ncols=ncol, nrows=nrow)
    axes = np.atleast_1d(axes).ravel()
    for ax in axes[len(panels):]:
        ax.axis("off")
    for ax, (c, L) in zip(axes, panels):
        for m in distinct(results, L, c):
            cell = results["cells"][m][L][c]
            y = np.asarray(cell["e4_nll"], dtype=float)
            x = (np.arange(len(y)) + 0.5) * cell["e4_bin"]
            ax.plot(x, smooth(y, max(1, len(y) // 64)), lw=1.1, label=label(m))
        ax.axvline(L_ctx, color="grey", ls=":", lw=1, label=f"L_ctx = {L_ctx}")
        ax.set_title(f"{c}, L = {int(L):,} ({int(L) / L_ctx:g}x)", fontsize=9)
        ax.set_xlabel("position (tokens seen - 1)")
        ax.set_ylabel("mean NLL (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, stem)[0]


def plot_e1(results: dict, corpus: str, stem: Path) -> str:
    means = {}
    for m in results["cells"]:
        pts = {int(L): {"mean": byc[corpus]["e1"], "std": None}
               for L, byc in results["cells"][m].items() if corpus in byc}
        if pts and not all(results["cells"][m][str(L)][corpus].get("same_as") for L in pts if L > results["L_ctx"]):
            means[label(m)] = pts
    return str(plot_ppl_vs_length(means, results["L_ctx"], stem, title=f"E1 vs L, {corpus} (same weights)"))


def plot_passkey(results: dict, stem: Path) -> str | None:
    records = [{**r, "correct": r.get("retrieved", r["correct"]), "rule": label(m), "length": int(L)}
               for m, byL in results.get("tasks", {}).get("passkey", {}).items() for L, recs in byL.items()
               for r in recs if not r.get("same_as")]
    if not records:
        return None
    return plot_heatmap(records, stem, title="passkey, the value retrieved")[0]


def plot_erf_curves(results: dict, stem: Path) -> str | None:
    curves = {label(m): r["c"] for m, r in results["erf"].items()}
    if not curves:
        return None
    L = len(next(iter(curves.values())))
    return plot_erf(curves, stem, train_length=results["L_ctx"] if L > results["L_ctx"] else None,
                    title=f"cumulative normalized gradient of the last token, L = {L - 1:,} inputs")[0]

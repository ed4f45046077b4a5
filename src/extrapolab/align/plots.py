"""Alignment output: the tau table (thesis Tables 5.8-5.11 and 5.1) and the temperature-curve
figure (thesis Figs. 5.3-5.4) from a result of :func:`extrapolab.align.algorithm.align`."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..analysis.common import save_figure
from .rules import length_rule

RULE_NAMES = {"pmax": "w/ P_max", "entropy": "w/ H", "length": "w/ log_{L_ex} L_tr",
              "prop51": "Prop. 5.1 (layer 0)", "prop52": "Prop. 5.2 (layer 0)"}


def align_table(res: dict) -> str:
    """Markdown like thesis Tables 5.8-5.11 (tau per L_ex) plus Table 5.1-style sharpness at tau=1."""
    Ls = [str(L) for L in res["lengths"]]
    lines = [f"Temperatures (L_tr = {res['train_length']}; grid {res['grid'][0]}..{res['grid'][-1]})", "",
             "| rule | " + " | ".join(Ls) + " |", "|---" * (len(Ls) + 1) + "|"]
    for rule, row in res["tau"].items():
        cells = [f"{row[L]:.2f}" if L in row and math.isfinite(row[L]) else "n/a" for L in Ls]
        lines.append(f"| {RULE_NAMES.get(rule, rule)} | " + " | ".join(cells) + " |")
    grid = res["grid"]
    i1 = grid.index(1.0) if 1.0 in grid else None
    if i1 is not None:
        tr = res["stats"]["train"]
        lines += ["", "Attention sharpness at tau=1 (thesis Table 5.1)", "",
                  f"| stat | L_tr={res['train_length']} | " + " | ".join(Ls) + " |", "|---" * (len(Ls) + 2) + "|"]
        for m, label in (("pmax", "avg P_max"), ("entropy", "avg H")):
            vals = [res["stats"]["ex"][L][m][i1] for L in Ls]  # None: tau = 1 not evaluated (bisection)
            cells = [f"{v:.3f}" if v is not None else "n/a" for v in vals]
            lines.append(f"| {label} | {tr[m]:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_temperature_curves(res: dict, stem: str | Path, title: str = "") -> list[Path]:
    """Thesis Figs. 5.3-5.4: Prop. 5.1/5.2 curves, Algorithm 1 dots (P_max) and crosses (H), log rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..report.plots import plain_log_ticks  # here: importing extrapolab.align loads no matplotlib

    Ls = res["lengths"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs = np.geomspace(max(res["train_length"] + 1, min(Ls)), max(Ls), 100)
    ax.plot(xs, [length_rule(res["train_length"], x) for x in xs], "k:", label=r"$\log_{L_{ex}} L_{tr}$")
    for rule, style, label in (("prop51", "-", "Prop. 5.1 (P_max)"), ("prop52", "--", "Prop. 5.2 (H)")):
        ys = [res["tau"][rule].get(str(L), float("nan")) for L in Ls]
        ax.plot(Ls, ys, style, label=label)
    for rule, marker, label in (("pmax", "o", "Alg. 1 P_max"), ("entropy", "x", "Alg. 1 H")):
        if rule in res["tau"]:
            ax.plot(Ls, [res["tau"][rule][str(L)] for L in Ls], marker, ls="none", ms=7, label=label)
    ax.set_xscale("log", base=2)
    plain_log_ticks(ax)
    ax.set_xlabel(r"$L_{ex}$")
    ax.set_ylabel(r"temperature $\tau$")
    ax.set_title(title or f"Temperature alignment (L_tr = {res['train_length']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    try:
        return save_figure(fig, stem)
    finally:
        plt.close(fig)

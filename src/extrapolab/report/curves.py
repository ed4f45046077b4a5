"""Training curves of a sweep: train and validation loss against optimizer step and tokens seen.

One line per scheme (the mean over seeds at each step), a band from the minimum to the maximum
over seeds, one figure per dataset. The numbers are the runs' own records (``metrics.jsonl``,
train/records.py): train loss = mean over each ``log_every`` interval, validation loss = the
fixed validation windows at each ``eval_every``. A sweep stores them in results.sqlite (protocol
``train``, written by sweep/sweep.py); runs recorded before that are read from their
``metrics.jsonl`` when it is still on disk, so ``extrapolab report DIR`` redraws them either way.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..train.records import CURVES, curves, read_rows
from .db import ResultsDB
from .plots import plt, save, style

PROTOCOL = "train"  # results.sqlite series: (run_id, "train", 0, name, values), see sweep/job.py


def load_curves(db: ResultsDB) -> tuple[dict, list[str]]:
    """{dataset: {label: {seed: {name: np.ndarray}}}} for every finished run, and the run ids whose
    curves came from their metrics.jsonl (recorded before curves were stored) rather than the DB."""
    stored: dict = defaultdict(dict)
    for name in CURVES:
        for run_id, _, _, _, _, data in db.series(PROTOCOL, name):
            stored[run_id][name] = data
    out: dict = defaultdict(lambda: defaultdict(dict))
    from_files = []
    for r in db.runs():
        c = stored.get(r["run_id"])
        if not c and r.get("run_dir") and (Path(r["run_dir"]) / "metrics.jsonl").is_file():
            c = curves(read_rows(Path(r["run_dir"])), (r.get("summary") or {}).get("tokens_per_step"))
            from_files.append(r["run_id"])
        if c and (c.get("train_step") or c.get("valid_step")):
            out[r["dataset"]][r["label"]][int(r["seed"])] = {k: np.asarray(v, dtype=np.float64) for k, v in c.items()}
    return out, from_files


def _band(per_seed: dict, x: str, y: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(x, mean, min, max) over seeds at the x values every seed has."""
    runs = [c for c in per_seed.values() if len(c.get(x, ())) and len(c.get(y, ())) == len(c[x])]
    if not runs:
        return None
    common = sorted(set.intersection(*(set(c[x].tolist()) for c in runs)))
    if not common:
        return None
    maps = [dict(zip(c[x].tolist(), c[y].tolist())) for c in runs]
    ys = np.array([[m[v] for v in common] for m in maps], dtype=np.float64)  # [seeds, n]
    return np.asarray(common), ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def _tokens_per_step(per_label: dict) -> float | None:
    """The one tokens-per-step ratio of every run in the figure, or None when runs differ."""
    ratios = set()
    for per_seed in per_label.values():
        for c in per_seed.values():
            for pre in ("train", "valid"):
                s, t = c.get(f"{pre}_step", ()), c.get(f"{pre}_tokens", ())
                ratios.update(round(float(b) / float(a), 6) for a, b in zip(s, t) if a > 0 and math.isfinite(b))
    return ratios.pop() if len(ratios) == 1 else None


def plot_training_curves(per_label: dict, labels: list[str], stem: Path, title: str = "") -> Path:
    """Two panels (train loss, validation loss) against step; tokens seen on a top axis when every
    run has the same tokens per step, else a second row of panels against tokens."""
    order = [lb for lb in labels if lb in per_label] + sorted(set(per_label) - set(labels))
    tps = _tokens_per_step(per_label)
    xs = ["step"] if tps else ["step", "tokens"]
    fig, axes = plt.subplots(len(xs), 2, figsize=(11, 3.8 * len(xs)), squeeze=False)
    for row, x in enumerate(xs):
        for col, (pre, what) in enumerate((("train", "train loss (mean over each log interval)"),
                                           ("valid", "validation loss (fixed windows)"))):
            ax = axes[row][col]
            for i, label in enumerate(order):
                band = _band(per_label[label], f"{pre}_{x}", f"{pre}_loss")
                if band is None:
                    continue
                xv, mean, lo, hi = band
                n = len(per_label[label])
                st = style(i)
                color = st["color"]
                ax.plot(xv, mean, lw=1.3, color=color, ls=st["ls"], marker="o" if len(xv) < 4 else None, ms=3,
                        label=f"{label} ({n} seed{'s' if n != 1 else ''})")
                if n > 1:
                    ax.fill_between(xv, lo, hi, color=color, alpha=0.2, lw=0)
            ax.set_xlabel("optimizer step" if x == "step" else "tokens seen")
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            if tps and x == "step":
                top = ax.secondary_xaxis("top", functions=(lambda s: s * tps, lambda t: t / tps))
                top.set_xlabel("tokens seen")
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(title or "training curves: mean over seeds, band = min-max over seeds")
    fig.tight_layout()
    return save(fig, stem)


def curves_section(db: ResultsDB, labels: list[str], figs: Path, out: Path) -> list[tuple[str, Path, str]]:
    """[(title, png, caption)] per dataset for the report; empty when no run has records."""
    curves, from_files = load_curves(db)
    sections = []
    for ds, per_label in curves.items():
        png = plot_training_curves(per_label, labels, figs / f"training_curves_{ds}",
                                   title=f"training curves ({ds}): mean over seeds, band = min-max over seeds")
        seeds = sorted({len(s) for s in per_label.values()})
        caption = ("Line: the mean over seeds at each logged step; shaded band: the minimum to the maximum over "
                   f"seeds ({'/'.join(map(str, seeds))} seeds per scheme; no band for one seed). Train loss is "
                   "the mean over each log interval; validation loss is measured on the same fixed windows "
                   "every time.")
        if from_files:
            caption += (f" {len(from_files)} run(s) recorded before curves were stored in results.sqlite were "
                        "read from their metrics.jsonl.")
        sections.append((f"Training curves — {ds}", png, caption))
    return sections

"""Report figures (matplotlib, Agg): perplexity vs L_ex (log x) and position-wise curves."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402


class PlainLogFormatter(LogFormatter):
    """matplotlib's log-axis labelling (which ticks get a label: decades, then 2-3-6, then all, as the
    span narrows) with the label a plain number: 140 and 2048, not 1.4 x 10^2 and 2^11."""

    def _num_to_string(self, x, vmin, vmax):
        return np.format_float_positional(float(f"{x:.4g}"), trim="-")


def plain_log_ticks(ax) -> None:
    """Label the ticks of each log-scaled axis of ``ax`` as plain numbers, major and minor (call after
    set_xscale / set_yscale, which reset the formatters). A narrow perplexity range (93-145) gets its
    minor ticks labelled 100, 110, ..., 140 instead of 1.4 x 10^2."""
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            base = axis.get_transform().base
            axis.set_major_formatter(PlainLogFormatter(base))
            axis.set_minor_formatter(PlainLogFormatter(base))  # as matplotlib's default (subs=None)


def save(fig, stem: Path) -> Path:
    """Write stem.png and stem.svg (atomically) and return the PNG path."""
    from ..io import atomic_path

    stem = Path(stem)
    for ext in ("png", "svg"):
        with atomic_path(stem.with_suffix(f".{ext}")) as tmp:
            fig.savefig(tmp, format=ext, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return stem.with_suffix(".png")


def style(i: int) -> dict:
    """Line style of the i-th curve: the colour cycle first, then the same colours dashed, dotted, ...,
    so that more curves than colours (a 16-scheme sweep) stay distinguishable in one legend."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {"color": colors[i % len(colors)], "ls": ("-", "--", ":", "-.")[(i // len(colors)) % 4]}


def plot_ppl_vs_length(means: dict, train_length: int, stem: Path, title: str = "") -> Path:
    """means: {label: {L: {mean, std, n}}} -> log-x plot with ±std bars and L_tr marked."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (label, byL) in enumerate(means.items()):
        Ls = [L for L in sorted(byL) if byL[L]["mean"] is not None]
        if not Ls:
            continue
        m = np.array([byL[L]["mean"] for L in Ls])
        s = np.array([byL[L]["std"] or 0.0 for L in Ls])
        if s.any():
            ax.errorbar(Ls, m, yerr=s, marker="o", ms=3, capsize=2, label=label, **style(i))
        else:  # one seed: a plain line (its legend entry shows the dash pattern)
            ax.plot(Ls, m, marker="o", ms=3, label=label, **style(i))
    if train_length:
        ax.axvline(train_length, color="grey", ls=":", lw=1, label=f"L_tr = {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length L_ex")
    ax.set_ylabel("perplexity (log scale)")
    plain_log_ticks(ax)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, stem)


def _mean_curves(rows) -> dict:
    acc: dict = defaultdict(list)
    for _, _, label, _, _, data in rows:
        acc[label].append(np.asarray(data, dtype=np.float64))
    return {k: np.nanmean(np.stack(v), axis=0) for k, v in acc.items()}


def _smooth(x: np.ndarray, width: int) -> np.ndarray:
    from ..eval.positionwise import smooth

    return smooth(x, width)


def plot_positionwise(rows, ref_rows, train_length: int, stem: Path) -> Path:
    """rows: [(run_id, ds, label, seed, L, ppl list)] -> one panel per scheme, each with its
    windowed@L_tr reference (thesis Fig. 3.5), curves averaged over seeds and smoothed."""
    curves, refs = _mean_curves(rows), _mean_curves(ref_rows)
    n = len(curves)
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), sharey=True, squeeze=False)
    for ax, (label, c) in zip(axes.flat, curves.items()):
        w = max(1, len(c) // 32)
        x = np.arange(1, len(c) + 1)
        ax.plot(x, _smooth(c, w), lw=1.2, label=label)
        if label in refs:
            ax.plot(x, _smooth(refs[label], w), lw=1.0, ls="--", color="k", alpha=0.6, label=f"windowed@{train_length}")
        if train_length:
            ax.axvline(train_length, color="grey", ls=":", lw=1)
        ax.set_yscale("log")
        plain_log_ticks(ax)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("position in the sequence")
    fig.supylabel("perplexity at that position")
    fig.suptitle(f"position-wise perplexity (dashed: same model restricted to the last {train_length} keys)")
    fig.tight_layout()
    return save(fig, stem)

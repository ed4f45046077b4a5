"""Log-scale axes of the report's figures label their ticks as plain numbers (140, 2048), not
matplotlib's default 1.4 x 10^2 / 2^11 (report/plots.py ``plain_log_ticks``): each figure is drawn by
the function the report calls, its tick labels read back after a real draw."""
import re

import numpy as np
import pytest

from extrapolab.report import analysis_section, plots
from extrapolab.report.db import ResultsDB

PLAIN = re.compile(r"^\d+(\.\d+)?$")


def _labels(axis) -> dict[float, str]:
    """{tick location: label text} of the non-empty major and minor labels inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    out = {}
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        text = tick.label1.get_text()
        if text and tick.get_visible() and lo <= tick.get_loc() <= hi:
            out[tick.get_loc()] = text
    return out


def _check_plain(axis) -> dict[float, str]:
    labels = _labels(axis)
    assert labels, "no tick label drawn"
    for loc, text in labels.items():
        assert PLAIN.match(text), f"tick at {loc} labelled {text!r}, not a plain number"
        assert float(text) == pytest.approx(loc, rel=1e-3)  # the label says where the tick is
    return labels


@pytest.fixture
def captured(monkeypatch):
    """The figures the report's plot functions would save, kept open (drawn) instead of written."""
    figs = []

    def keep(fig, stem):
        fig.canvas.draw()
        figs.append(fig)
        return stem

    monkeypatch.setattr(plots, "save", keep)
    monkeypatch.setattr(analysis_section, "save", keep)
    yield figs
    for fig in figs:
        plots.plt.close(fig)


def test_ppl_vs_length_narrow_range_reads_plain(captured, tmp_path):
    """The demo's E1 figure: perplexity 93-145 (less than a decade: matplotlib labels minor ticks
    only, each as a x 10^2 by default) over L_ex 64 ... 1024 on a base-2 axis (2^6 ... 2^10)."""
    Ls = [64, 128, 256, 512, 1024]
    means = {"sinusoidal": {L: {"mean": v, "std": None, "n": 1} for L, v in zip(Ls, (126, 129, 137, 142, 145))},
             "kerple-log": {L: {"mean": v, "std": None, "n": 1} for L, v in zip(Ls, (95.2, 93.9, 93.5, 93.5, 93.6))}}
    plots.plot_ppl_vs_length(means, 64, tmp_path / "e1")
    ax = captured[0].axes[0]
    y = _check_plain(ax.yaxis)
    assert {"100", "140"} <= set(y.values())
    x = _check_plain(ax.xaxis)
    assert set(x.values()) >= {"64", "128", "256", "512", "1024"}


def test_ppl_vs_length_over_decades_keeps_few_labels(captured, tmp_path):
    """Over four decades matplotlib labels only the decades: still so, each plainly."""
    Ls = [2 ** k for k in range(6, 15)]
    means = {"none": {L: {"mean": 10.0 * 2.8 ** i, "std": 0.1, "n": 2} for i, L in enumerate(Ls)}}
    plots.plot_ppl_vs_length(means, 64, tmp_path / "e1")
    y = _check_plain(captured[0].axes[0].yaxis)
    assert set(y.values()) <= {"1", "10", "100", "1000", "10000", "100000", "1000000"}
    assert {"100", "1000", "10000"} <= set(y.values())


def test_positionwise_and_erf_read_plain(captured, tmp_path):
    rng = np.random.default_rng(0)
    curve = list(120 + 20 * rng.random(256))
    rows = [("r1", "stdlib", "alibi", 0, 256, curve), ("r2", "stdlib", "none", 0, 256, [c * 1.3 for c in curve])]
    plots.plot_positionwise(rows, [], 64, tmp_path / "pw")
    for ax in captured[0].axes:
        if ax.get_visible() and ax.get_yscale() == "log":
            _check_plain(ax.yaxis)
    db = ResultsDB(tmp_path / "results.sqlite")
    db.set_meta(name="t", schemes=["alibi"], train_length=64)
    db.mark("r1", dataset="stdlib", scheme="alibi", label="alibi", seed=0, status="done", run_dir=str(tmp_path))
    c = np.cumsum(rng.random(512))
    db.record("r1", {}, [], [("erf", 512, "c", list(c / c[-1]))])
    analysis_section.plot_erf_overlay(db, ["alibi"], 64, tmp_path / "erf")
    db.close()
    x = _check_plain(captured[1].axes[0].xaxis)
    assert {"1", "10", "100"} <= set(x.values())


def test_temperature_curves_read_plain(tmp_path, monkeypatch):
    """The alignment study's τ vs L_ex figure (align/plots.py), base-2 x axis."""
    from extrapolab.align import plots as align_plots

    figs = []
    monkeypatch.setattr(align_plots, "save_figure", lambda fig, stem: (fig.canvas.draw(), figs.append(fig))[1])
    Ls = [512, 1024, 2048]
    res = {"lengths": Ls, "train_length": 256,
           "tau": {"prop51": {str(L): 0.8 for L in Ls}, "prop52": {str(L): 0.6 for L in Ls},
                   "pmax": {str(L): 0.9 for L in Ls}}}
    align_plots.plot_temperature_curves(res, tmp_path / "tau")
    x = _check_plain(figs[0].axes[0].xaxis)
    assert {"512", "1024", "2048"} <= set(x.values())
    plots.plt.close(figs[0])

"""Training curves in the sweep report (report/curves.py), from stored records only."""
import json

import numpy as np
import pytest

from extrapolab.report.curves import _band, load_curves
from extrapolab.report.db import ResultsDB
from extrapolab.sweep.record import curve_series
from extrapolab.sweep.sweep import rebuild_report
from extrapolab.train.records import curves

TPS = 4 * 32  # tokens per optimizer step of the fake runs


def _rows(seed: int, shift: float) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(2, 21, 2):
        rows.append({"step": step, "loss": 5.0 / step ** 0.3 + shift + 0.05 * rng.random(), "lr": 1e-3,
                     "tokens": step * TPS, "sec_per_step": 0.1, "tokens_per_s": 1000.0})
        if step % 10 == 0:
            rows.append({"step": step, "valid_loss": 4.5 / step ** 0.3 + shift + 0.05 * rng.random(),
                         "valid_ppl": 1.0})
    return rows


def _write_run(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def sweep_dir(tmp_path):
    """A results.sqlite of 2 schemes x 2 seeds recorded with curves, and one older run (no stored
    curves, only its metrics.jsonl) of a third scheme."""
    db = ResultsDB(tmp_path / "results.sqlite")
    db.set_meta(name="fake", schemes=["alibi", "rotary", "none"], reference="alibi", train_length=32,
                protocols=[], seeds=[0, 1], datasets=["stdlib"])
    rows = {}
    for label, shift in (("alibi", 0.0), ("rotary", 0.3), ("none", 0.6)):
        for seed in (0, 1) if label != "none" else (0,):
            rid = f"stdlib--{label}--s{seed}"
            run_dir = tmp_path / "runs" / rid
            rows[rid] = _rows(seed, shift)
            _write_run(run_dir, rows[rid])
            db.mark(rid, dataset="stdlib", scheme=label, label=label, seed=seed, status="queued",
                    run_dir=str(run_dir))
            summary = {"tokens_per_step": TPS}
            series = curve_series(run_dir, summary) if label != "none" else []
            db.record(rid, summary, [], series)
    db.close()
    return tmp_path, rows


def test_curves_follow_the_records():
    rows = _rows(0, 0.0)
    c = curves(rows)  # tokens per step recovered from the train rows
    assert c["train_step"] == [r["step"] for r in rows if "loss" in r]
    assert c["train_loss"] == [r["loss"] for r in rows if "loss" in r]
    assert c["valid_step"] == [10.0, 20.0]
    assert c["valid_tokens"] == [10.0 * TPS, 20.0 * TPS]
    assert c["valid_loss"] == [r["valid_loss"] for r in rows if "valid_loss" in r]


def test_stored_and_file_curves_and_seed_bands(sweep_dir):
    out, rows = sweep_dir
    db = ResultsDB(out / "results.sqlite")
    got, from_files = load_curves(db)
    db.close()
    assert from_files == ["stdlib--none--s0"]  # the run without stored curves came from its metrics.jsonl
    assert set(got["stdlib"]) == {"alibi", "rotary", "none"} and set(got["stdlib"]["alibi"]) == {0, 1}
    x, mean, lo, hi = _band(got["stdlib"]["rotary"], "train_step", "train_loss")
    losses = np.array([[r["loss"] for r in rows[f"stdlib--rotary--s{s}"] if "loss" in r] for s in (0, 1)])
    np.testing.assert_allclose(x, np.arange(2, 21, 2))
    np.testing.assert_allclose(mean, losses.mean(0))
    np.testing.assert_allclose(lo, losses.min(0))
    np.testing.assert_allclose(hi, losses.max(0))
    x, mean, lo, hi = _band(got["stdlib"]["none"], "valid_tokens", "valid_loss")  # one seed: no spread
    np.testing.assert_allclose(x, [10 * TPS, 20 * TPS])
    np.testing.assert_array_equal(lo, hi)


def test_report_draws_the_curves_and_regenerates_them(sweep_dir):
    out, _ = sweep_dir
    rebuild_report(out)
    for ext in ("png", "svg"):
        assert (out / "figures" / f"training_curves_stdlib.{ext}").stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert "## Training curves — stdlib" in md and "figures/training_curves_stdlib.png" in md
    assert "minimum to the maximum over seeds" in md and "read from their metrics.jsonl" in md
    assert "Training curves — stdlib" in (out / "report.html").read_text()
    for p in (out / "figures").iterdir():
        p.unlink()
    (out / "report.md").unlink()
    rebuild_report(out)  # from results.sqlite (and the old run's records) alone
    assert (out / "figures" / "training_curves_stdlib.png").is_file()


def test_tokens_axis_only_when_every_run_has_the_same_tokens_per_step():
    from extrapolab.report.curves import _tokens_per_step

    a = {k: np.asarray(v, dtype=float) for k, v in curves(_rows(0, 0.0)).items()}
    b = {**a, "train_tokens": a["train_tokens"] * 2, "valid_tokens": a["valid_tokens"] * 2}
    assert _tokens_per_step({"alibi": {0: a}, "rotary": {0: a}}) == TPS
    assert _tokens_per_step({"alibi": {0: a}, "rotary": {0: b}}) is None  # -> a second row against tokens

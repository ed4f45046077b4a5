"""`regular table` budgets (quick | thesis), the measured/projected wall time, re-evaluation."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.regular import table as table_mod
from extrapolab.regular.table import BUDGETS, budget_options, run_config, wall_time
from extrapolab.regular.tasks import BHATTACHARYA, DELETANG
from extrapolab.regular.train import RegularRunConfig, load_run, reevaluate, run

TINY = dict(steps=2, eval_every=1, val_samples=4, test_samples=4, test_max=44, train_max=6)


def test_quick_budget_is_the_cpu_default_and_strides_only_the_long_transformer_tests():
    par = run_config("parity", "transformer", 0, "quick").resolved()
    assert (par.steps, par.lr, par.test_stride, par.test_samples, par.val_lengths) == (2000, 3e-4, 5, 64, [80])
    assert par.model_options == {"scheme": "t5", "layers": 4}
    d2 = run_config("d2", "transformer", 0, "quick").resolved()
    assert (d2.test_stride, d2.test_samples, d2.val_lengths) == (1, 64, [80])  # 51..100 is cheap
    g = run_config("modular_arithmetic", "regulargpt-C2", 1, "quick")
    assert g == run_config("modular_arithmetic", "regulargpt-C2", 1)  # quick adds nothing for RegularGPT
    assert (g.steps, g.lr, g.model_options, g.seed) == (3000, 1e-3, {"C": 2}, 1)


def test_every_budget_gives_a_valid_config_for_every_cell():
    """Regression: the quick transformer preset validated at 80, which Modular Arithmetic (odd
    lengths only) rejects; a preset validation length now moves to the next valid length."""
    for budget in BUDGETS:
        for task in DELETANG + BHATTACHARYA:
            for column in table_mod.MODEL_SPECS:
                run_config(task, column, 0, budget).resolved()
    assert run_config("modular_arithmetic", "transformer", 0, "quick").resolved().val_lengths == [81]
    assert run_config("tomita5", "transformer", 0, "quick").resolved().val_lengths == [80]
    with pytest.raises(UserError, match="valid length"):  # an explicit user value is not moved
        run_config("modular_arithmetic", "transformer", 0, "quick", val_lengths=[80]).resolved()


def test_thesis_budget_follows_table_6_5_and_overrides_win():
    c = run_config("parity", "regulargpt-C3", 2, "thesis")
    assert c.steps == 100_000 and c.lr == 3e-4 and c.batch_size == 128
    assert c.model_options == {"C": 3, "dim": 256, "heads": 8}  # merged, C kept
    assert run_config("d4", "lstm", 0, "thesis").model_options == {"hidden": 256}
    o = run_config("parity", "regulargpt-C2", 0, "thesis", steps=50, model_options={"K": 2}, lr=None)
    assert o.steps == 50 and o.lr == 3e-4 and o.model_options == {"C": 2, "dim": 256, "heads": 8, "K": 2}
    assert budget_options("quick", "tomita3", "rnn") == {}
    with pytest.raises(UserError, match="unknown budget"):
        budget_options("huge", "parity", "rnn")
    assert set(BUDGETS) == {"quick", "thesis"}


def _fake_run(path, cfg: RegularRunConfig, seconds: float):
    path.mkdir(parents=True)
    res = {"config": json.loads(json.dumps(cfg.resolved().__dict__)), "train_seconds": seconds - 1.0,
           "eval_seconds": 1.0, "mean_test": 0.5}
    (path / "result.json").write_text(json.dumps(res))


def test_wall_time_sums_finished_runs_and_estimates_missing_ones(tmp_path):
    runs = tmp_path / "runs"
    _fake_run(runs / "parity/rnn/seed0", run_config("parity", "rnn", 0, "quick"), 10.0)
    _fake_run(runs / "parity/rnn/seed1", run_config("parity", "rnn", 1, "quick"), 30.0)
    _fake_run(runs / "d2/rnn/seed0", run_config("d2", "rnn", 0, "quick"), 4.0)
    _fake_run(runs / "d3/rnn/seed0", run_config("d3", "rnn", 0, "quick", steps=7), 999.0)  # other config
    wt = wall_time(tmp_path, "parity,even_pairs,d2,d3", "rnn,lstm", seeds=2)
    assert (wt["runs"], wt["done"], wt["missing"]) == (16, 3, 13)
    assert wt["measured_s"] == pytest.approx(44.0)
    # parity seed... none missing for rnn on parity; even_pairs x2 <- Deletang mean 20; d2 seed1 <- d2 mean 4;
    # d3 x2 <- Bhattacharya mean 4; lstm has no finished run -> unknown
    assert wt["estimated_missing_s"] == pytest.approx(2 * 20 + 4 + 2 * 4)
    assert wt["projected_total_s"] == pytest.approx(44 + 52)
    assert len(wt["unknown"]) == 8 and wt["per_column"]["rnn"] == {
        "done": 3, "measured_s": 44.0, "missing": 5, "estimated_s": 52.0}


def test_table_reports_budget_lengths_in_distribution_and_wall_time(tmp_path, monkeypatch):
    monkeypatch.setitem(table_mod.MODEL_SPECS, "rnn", {"model": "rnn", "model_options": {"hidden": 8}})
    t = table_mod.regular_table(tmp_path, "parity", "rnn", seeds=2, progress=False, **TINY)
    assert t["budget"] == "quick" and t["wall_time"]["done"] == 2 and t["wall_time"]["missing"] == 0
    secs = sum(r + e for r, e in zip(t["tasks"]["parity"]["rnn"]["train_seconds"],
                                     t["tasks"]["parity"]["rnn"]["eval_seconds"]))
    assert t["wall_time"]["measured_s"] == pytest.approx(secs)
    md = (tmp_path / "table.md").read_text()
    assert "## In-distribution accuracy" in md and "## Wall time" in md
    assert "- parity (rnn): 4 lengths (41, 42, 43, ..., 44), 4 strings each" in md
    r = CliRunner().invoke(app, ["table", "--out", str(tmp_path), "--tasks", "parity,d2", "--models", "rnn",
                                 "--seeds", "2", "--plan", "--steps", "2"])
    assert r.exit_code == 0 and "runs finished" in r.output and "projected full table" in r.output
    r = CliRunner().invoke(app, ["table", "--out", str(tmp_path), "--budget", "nope", "--plan"])
    assert r.exit_code == 2 and "unknown budget" in r.output


def test_reevaluate_equals_a_fresh_run_with_the_new_test_options(tmp_path):
    base = dict(task="cycle_navigation", model="rnn", model_options={"hidden": 8}, steps=3, eval_every=1,
                val_samples=4, train_max=6, val_lengths=[12], test_min=41, test_max=60, test_samples=4)
    run(RegularRunConfig.from_dict({**base, "test_stride": 5}), tmp_path / "a", progress=False)
    old = json.loads((tmp_path / "a" / "result.json").read_text())
    new = reevaluate(tmp_path / "a", test_stride=2, test_samples=6)
    fresh = run(RegularRunConfig.from_dict({**base, "test_stride": 2, "test_samples": 6}), None, progress=False)
    assert new["per_length"] == fresh["per_length"] and len(new["per_length"]) == 10
    assert new["mean_test"] == pytest.approx(np.mean(list(fresh["per_length"].values())))
    assert new["history"] == old["history"] and new["train_seconds"] == old["train_seconds"]
    _, cfg, saved = load_run(tmp_path / "a")
    assert (cfg.test_stride, cfg.test_samples) == (2, 6) and saved["config"] == fresh["config"]
    with pytest.raises(UserError, match="reevaluate changes only"):
        reevaluate(tmp_path / "a", steps=9)

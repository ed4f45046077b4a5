"""regular train/eval/table on a chosen device and autocast, the --only cell filter and the --plan probe
(CPU here; the CUDA versions are in test_device_gpu.py)."""
import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.regular.plan import plan, probe_run
from extrapolab.regular.table import THESIS_GAPS, parse_cells, run_config, wall_time
from extrapolab.regular.train import RegularRunConfig, load_run, run

TINY = dict(steps=3, eval_every=1, val_samples=4, test_samples=4, test_max=44, train_max=6)
runner = CliRunner()


def test_explicit_cpu_fp32_is_the_default_path_and_bf16_autocast_runs():
    cfg = RegularRunConfig(task="parity", model="regulargpt", model_options={"dim": 16, "heads": 2}, **TINY)
    a = run(cfg, progress=False)
    b = run(replace(cfg, device="cpu", precision="fp32"), progress=False)
    assert a["per_length"] == b["per_length"] and a["history"] == [
        dict(h, seconds=a["history"][i]["seconds"]) for i, h in enumerate(b["history"])]
    c = run(replace(cfg, device="cpu", precision="bf16"), progress=False)
    assert c["placement"] == {"device": "cpu", "precision": "bf16"} == c["eval_placement"]
    assert c["history"][0]["loss"] != a["history"][0]["loss"]  # the forward really ran in bf16
    assert all(p.dtype == torch.float32 for p in c["model"].parameters())  # weights stay fp32


def test_only_cells_validate_and_gaps_are_the_three_thesis_cells():
    assert parse_cells(THESIS_GAPS) == [("modular_arithmetic", "regulargpt-C2"),
                                        ("cycle_navigation", "regulargpt-C3"), ("tomita6", "regulargpt-C3")]
    for bad, match in (("parity", "TASK:COLUMN"), ("nope:rnn", "unknown regular-language task"), ("parity:gpt", "unknown table column"),
                       (",", "at least one")):
        with pytest.raises(UserError, match=match):
            parse_cells(bad)


def test_table_only_trains_the_chosen_cells_and_reuses_them_on_another_placement(tmp_path):
    base = ["--out", str(tmp_path), "--seeds", "1", "--steps", "3", "--test-stride", "200", "--test-samples", "4",
            "--run-opt", "rnn:model_options={hidden: 8}", "--run-opt", "regulargpt-C2:val_samples=4",
            "--run-opt", "rnn:val_samples=4", "--no-progress"]
    res = runner.invoke(app, ["table", "--only", "parity:regulargpt-C2,even_pairs:rnn", "--device", "cpu",
                              "--dtype", "bf16", *base])
    assert res.exit_code == 0, res.output
    runs = sorted(str(p.relative_to(tmp_path / "runs")) for p in (tmp_path / "runs").glob("*/*/seed0"))
    assert runs == ["even_pairs/rnn/seed0", "parity/regulargpt-C2/seed0"]
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["only"] == ["even_pairs:rnn", "parity:regulargpt-C2"] and table["invocation"]["trained"] == 2
    assert set(table["tasks"]) == {"parity", "even_pairs"} and set(table["tasks"]["parity"]) == {"regulargpt-C2", "_plots"}
    _, _, result = load_run(tmp_path / "runs" / "parity" / "regulargpt-C2" / "seed0")
    assert result["placement"] == {"device": "cpu", "precision": "bf16"}
    res = runner.invoke(app, ["table", "--only", "parity:regulargpt-C2", "--dtype", "fp32", *base])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "table.json").read_text())["invocation"]["trained"] == 0  # placement is not identity
    res = runner.invoke(app, ["table", "--only", "parity:gpt", *base])
    assert res.exit_code == 2 and "unknown table column 'gpt'" in res.output
    res = runner.invoke(app, ["train", "--task", "parity", "--out", str(tmp_path / "x"), "--dtype", "fp16",
                              "--device", "cpu", "--steps", "1"])
    assert res.exit_code == 2 and "--dtype fp16 needs a CUDA device" in res.output


def test_plan_probes_columns_without_a_finished_run(tmp_path):
    over = dict(steps=1000, test_stride=150, test_samples=2, device="cpu", precision="fp32")
    cfg = run_config("parity", "regulargpt-C2", 0, "thesis", **over)
    assert (cfg.steps, cfg.model_options["dim"], cfg.lr) == (1000, 256, 3e-4)  # the thesis sizes
    cfg = replace(cfg, val_samples=2, model_options={**cfg.model_options, "dim": 32})
    p = probe_run(cfg, steps=2, warmup=1)
    assert p["projected_s"] == pytest.approx(1000 * p["step_s"] + 10 * p["validation_round_s"] + p["scoring_s"])
    assert p["device"] == "cpu" and p["validation_rounds"] == 10
    per = {"regulargpt-C2": {"model_options": {"dim": 16, "heads": 2}, "val_samples": 2}}
    wt = plan(tmp_path, seeds=2, budget="thesis", per_model=per, only="parity:regulargpt-C2", probe_steps=2, **over)
    assert wt["runs"] == 2 and wt["unknown"] == [] and list(wt["probes"]) == ["regulargpt-C2@deletang"]
    assert wt["estimated_missing_s"] == pytest.approx(2 * wt["probes"]["regulargpt-C2@deletang"]["projected_s"])
    assert wall_time(tmp_path, seeds=2, budget="thesis", per_model=per, only="parity:regulargpt-C2",
                     **over)["unknown"] == ["parity/regulargpt-C2/seed0", "parity/regulargpt-C2/seed1"]
    res = runner.invoke(app, ["table", "--plan", "--budget", "thesis", "--only", "gaps", "--probe-steps", "0",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0 and "0/9 runs finished" in res.output and "9 runs with no estimate" in res.output

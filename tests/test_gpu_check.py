"""scripts/gpu-check.sh, the one command that proves the CUDA paths on a GPU machine, run here with --dry-run: the
same stages at toy sizes on the CPU (pytest -m gpu skips, bench rows with their paths, a demo slice with its
E1 table, a one-process torchrun on gloo), and the report it writes."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_stage_and_writes_its_report(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out"), "--dry-run"],
                          capture_output=True, text=True, timeout=1800)
    out = tmp_path / "out"
    report = (out / "gpu-check.md").read_text()
    assert proc.returncode == 0, report
    for stage in ("pytest", "bench-train-a1", "bench-train-a2", "bench-train-b1", "bench-train-b2",
                  "bench-long-a", "bench-long-b", "bench-long-c", "demo", "profile", "torchrun"):
        assert f"| {stage} | 0 |" in report, stage
    profiled = report.split("## profile: where one train step's time goes")
    assert len(profiled) == 2 and "| rotary | " in profiled[1]
    assert "### SDPA layouts, L = 64" in profiled[1] and "| qk-own | " in profiled[1]  # SDPA alone, per layout
    train = json.loads((out / "bench-train-a1.json").read_text())["train"]["64"]
    assert "| fox |" in report and "| qin-type1 |" in report  # the chunks' rows merged into one table
    assert train["alibi"]["paths"] and train["none"]["paths"] == {"causal": train["none"]["paths"]["causal"]}
    assert "| alibi | toeplitz |" in report and "backend gloo, world size 1" in report
    assert "nonoverlapping" in report or "E1" in report
    assert "| bench-compile |" not in report and "| bench-train-c |" not in report  # opt-in: named exactly
    # a check split into two commands (a GPU machine whose commands stop at 10 minutes): the second reruns one
    # stage and its report still covers every stage recorded in OUT
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(out), "--dry-run",
                            "--stages", "torchrun,bench-train-c"], capture_output=True, text=True, timeout=600)
    report2 = (out / "gpu-check.md").read_text()
    assert again.returncode == 0 and "| bench-long-b | 0 |" in report2 and "| torchrun | 0 |" in report2
    assert again.stdout.count("[gpu-check] torchrun: rc") == 1 and "[gpu-check] pytest: rc" not in again.stdout
    assert "| bench-train-c | 0 |" in report2  # an opt-in stage runs when named


def test_a_budget_starts_no_stage_that_would_end_past_it(tmp_path):
    """``--budget``: under a GPU machine's per-command limit the check starts no stage whose time limit would end
    past the budget, and says which stages to run next (none of them ran, none is recorded as failed)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out"), "--dry-run",
                           "--budget", "1", "--stages", "demo,torchrun"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "not started within --budget 1 s: demo, torchrun; run them with --stages demo,torchrun" in proc.stdout
    assert "torchrun: rc" not in proc.stdout and not (tmp_path / "out" / "stages.json").exists()


def test_gpu_check_unknown_stage_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "out"), "--dry-run",
                           "--stages", "bench-wide"], capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.startswith("gpu_check.py: error")]
    assert proc.returncode == 2 and len(err) == 1 and "unknown stage(s) bench-wide; choose from pytest" in err[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "stages.json").exists()


def test_report_only_rewrites_the_report_from_a_folder_copied_off_the_gpu_machine(tmp_path):
    """--report-only runs nothing: the report comes from OUT's stages.json and env.json (the machine that ran them),
    so a check run in several commands on a GPU machine is reported here; an empty folder is a one-line error."""
    out = tmp_path / "gc"
    out.mkdir()
    (out / "stages.json").write_text(json.dumps({"torchrun": {"rc": 0, "seconds": 20.2, "limit_s": 30,
                                                              "command": "torchrun ..."}}))
    (out / "env.json").write_text(json.dumps({"torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3",
                                              "gpu": "NVIDIA H100 80GB HBM3", "triton": "3.6.0", "commit": "abc1234",
                                              "date": "2026-11-27", "wall_s": 90.7}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(out), "--dry-run",
                           "--report-only"], capture_output=True, text=True, timeout=300)
    report = (out / "gpu-check.md").read_text()
    assert proc.returncode == 0 and "GPU check on NVIDIA H100 80GB HBM3" in report and "triton 3.6.0" in report
    assert "| torchrun | 0 | 20.2 (30) |" in report and "wall time 91 s" in report
    empty = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path / "none"),
                            "--report-only"], capture_output=True, text=True, timeout=300)
    err = [line for line in empty.stderr.splitlines() if line.startswith("gpu_check.py: error")]
    assert empty.returncode == 2 and len(err) == 1 and "no stages.json" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_without_cuda_stops_at_once_and_writes_nothing(tmp_path):
    """Without a CUDA device the check says so in one line before any stage (it used to run every stage for about
    ten minutes, pytest skipping and each bench stage exiting 2 in turn), through the shell script users run."""
    out = tmp_path / "out"
    t = time.time()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable})
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "needs a CUDA GPU and none is visible" in err[0], proc.stderr
    assert "--dry-run" in err[0] and not out.exists() and time.time() - t < 60

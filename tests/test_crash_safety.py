"""Crash safety (docs/reliability.md): SIGKILL a training process, or a sweep, at seeded random points.

Training: every kill leaves readable checkpoints; each relaunch continues from the last one (it
never restarts from scratch); after the last relaunch the weights and every logged loss, lr and
valid loss equal an uninterrupted run's bit for bit (CPU, one thread).
Sweep: runs recorded 'done' before a kill are not redone; the final results table has exactly
the rows, with exactly the values, of an uninterrupted sweep (none lost, none duplicated).
The default run kills training twice and the sweep once; ``-m slow`` runs many-kill versions:
``.venv/bin/python -m pytest -q -m slow tests/test_crash_safety.py``.
"""
from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from extrapolab import config as C
from extrapolab.data import prepare
from extrapolab.sweep.sweep import run_sweep
from extrapolab.train import load_checkpoint, load_model, train
from extrapolab.train.checkpoint import checkpoint_path
from extrapolab.train.records import read_rows

PY = sys.executable
TIMING = ("sec_per_step", "tokens_per_s")
STEPS = 30


def _corpus(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for j in range(60):
        (folder / f"m{j:02d}.py").write_text("".join(f"def g{i}_{j}(x):\n    return x + {i * j % 97}\n" for i in range(50)))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    preset = {
        "name": "crash", "out_dir": str(root),
        "model": {"layers": 2, "heads": 2, "dim": 32, "train_length": 16, "scheme": "kerple-log", "dropout": 0.1},
        "data": {"corpus": f"path:{_corpus(root / 'corpus')}", "tokenizer": "bytes", "cache_dir": str(root / "cache")},
        "train": {"steps": STEPS, "batch_size": 4, "grad_accum": 2, "warmup_steps": 3, "lr": 3e-3, "eval_every": 5,
                  "eval_batches": 2, "checkpoint_every": 3, "log_every": 1, "precision": "fp32", "threads": 1},
    }
    (root / "crash.yaml").write_text(yaml.safe_dump(preset))
    cfg = C.resolve(str(root / "crash.yaml"))
    data = prepare(cfg.data, progress=False)  # the subprocesses reuse this cache
    train(cfg, root / "reference", data=data, progress=False)
    return root, cfg


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_rows(run)]


def _wait(cond, proc, timeout=180.0) -> bool:
    """Poll ``cond()`` every 2 ms until true (True) or the process ends / time runs out (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise AssertionError("timed out waiting for the child process")


def _max_step(run: Path) -> int:
    return max((r["step"] for r in read_rows(run)), default=0)


def _readable_checkpoints(run: Path) -> int:
    """load_checkpoint every checkpoint present (manifest + sha256 + config); the last one's step."""
    step = 0
    for which in ("best", "last"):
        path = checkpoint_path(run, which)
        if path is not None:
            ck = load_checkpoint(path)
            if which == "last":
                step = ck.step
    return step


def kill_and_resume_training(root: Path, cfg, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    run = root / f"killed-{seed}"
    cmd = [PY, "-m", "extrapolab.train", "--preset", str(root / "crash.yaml"), "--run-dir", str(run), "--no-progress"]
    last = 0
    started_from = None  # checkpoint step the launch that finished the run resumed from (if one did)
    for left in range(kills, 0, -1):
        prev = _max_step(run)  # stale rows until the relaunch truncates them to its checkpoint
        if prev >= STEPS - 1:
            break
        # a step only this launch can log (> prev), spread so the kills cover the whole run
        target = prev + 1 + rng.randrange(max(1, (STEPS - 1 - prev) // left))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        reached = _wait(lambda: _max_step(run) >= target, proc)
        time.sleep(rng.uniform(0.0, 0.04))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert reached and proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        mid_write = bool(list((run / "checkpoints").glob(".*.tmp"))) if (run / "checkpoints").is_dir() else False
        step = _readable_checkpoints(run)
        print(f"killed after step {_max_step(run)}; last checkpoint {step}; mid-write {mid_write}")
        assert step >= last  # a relaunch continued from the last checkpoint, never from scratch
        if (run / "summary.json").exists():  # the kill landed after this launch wrote its summary
            started_from = last
        last = step
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    # the summary is written by the launch that finished the run: usually the final relaunch
    # (from the last checkpoint), or a killed one if the kill came after its summary write
    expected = last if started_from is None else started_from
    assert summary["resumed_from"] == (expected or None) and summary["steps"] == STEPS
    ref = root / "reference"
    assert _rows(run) == _rows(ref)  # losses, lr, valid losses: identical floats, each step once
    a, b = load_model(ref, "last")[0].state_dict(), load_model(run, "last")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(run, "best")[1].train.steps == STEPS


def test_killed_training_resumes_bit_exact(setup):
    kill_and_resume_training(*setup, kills=2, seed=1)


@pytest.mark.slow
def test_killed_training_many_times(setup):
    for seed in (2, 3):
        kill_and_resume_training(*setup, kills=6, seed=seed)


# ---- sweeps --------------------------------------------------------------------------------------
def _done(db: Path) -> dict[str, float]:
    """{run_id: updated} of finished runs, read without taking a write lock."""
    if not db.is_file():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return dict(con.execute("SELECT run_id, updated FROM runs WHERE status='done'").fetchall())
    except sqlite3.OperationalError:  # the schema is not there yet
        return {}
    finally:
        con.close()


def _results(db: Path) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return sorted(con.execute("SELECT run_id, protocol, length, metric, value FROM results").fetchall())
    finally:
        con.close()


def kill_and_resume_sweep(root: Path, kills: list[int], seed: int, grid: list[str]) -> None:
    rng = random.Random(seed)
    over = [f"data.cache_dir={root / 'cache'}", "train.threads=1", *grid]
    ref = run_sweep("demo-smoke", out=root / f"sweep-ref-{seed}", overrides=over, progress=False)["out"]
    out = root / f"sweep-killed-{seed}"
    cmd = [PY, "-m", "extrapolab.cli.main", "sweep", "demo-smoke", "--out", str(out)]
    cmd += [a for o in over for a in ("--set", o)]
    db = out / "results.sqlite"
    seen: dict[str, float] = {}
    for n_done in kills:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        reached = _wait(lambda: len(_done(db)) >= n_done, proc)
        time.sleep(rng.uniform(0.0, 0.3))  # lands in the next run's training or evaluation
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert reached and proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        done = _done(db)
        assert all(done[r] == t for r, t in seen.items())  # finished runs were not redone
        seen = done
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    final = _done(db)
    assert all(final[r] == t for r, t in seen.items())
    assert set(final) == set(_done(ref / "results.sqlite"))
    assert _results(db) == _results(ref / "results.sqlite")  # no row lost or duplicated; same values
    assert (out / "report.html").is_file()


def test_killed_sweep_keeps_finished_runs(setup):
    kill_and_resume_sweep(setup[0], kills=[1], seed=5, grid=["sweep.seeds=[0]", "sweep.schemes=[none,alibi]"])


def test_killed_sweep_with_parallel_workers_keeps_finished_runs(setup):
    """The same with two worker processes: they end with the killed driver, which alone records their rows."""
    kill_and_resume_sweep(setup[0], kills=[1], seed=7, grid=["sweep.seeds=[0]", "sweep.schemes=[none,alibi]",
                                                             "sweep.workers=2", "sweep.cost_rounds=1"])


@pytest.mark.slow
def test_killed_sweep_many_times(setup):
    kill_and_resume_sweep(setup[0], kills=[1, 1, 2, 3, 4, 5], seed=6, grid=["sweep.seeds=[0,1]"])

"""One sweep run, in whatever process the executor gives it (the driver, a local worker, a Ray task on any
node): train it (resuming from its last checkpoint) or derive it, evaluate it, and hand its rows back.

The driver records them: it is the only writer of results.sqlite, so no node ever opens the database
(SQLite on a network file system is not safe) and a run retried elsewhere cannot leave a half-recorded
row. Everything a run writes is in its run folder, atomically, under the run folder's lock; each attempt
is noted in ``placement.json`` (node, process), so where a run ran, and where it resumed, is on disk.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .. import config as C
from ..executor import worker
from ..io import LockBusy, atomic_write_json, run_lock
from .record import curve_series, evaluate_run_dir


def run_job(out: str, rid: str, cfg_dict: dict, tag: str, derive: dict | None = None, procs: int = 1) -> dict:
    """-> {"status": "done", "summary", "scalars", "series", "message"} or {"status": "skipped", "message"}.
    ``derive``: {"source": run id, "step": {...}} of a derived entry (sweep/derived.py); ``procs`` > 1:
    train as that many processes (torchrun) in this one placement."""
    from ..data import prepare
    from ..train import train

    cfg = C.from_dict(C.RunConfig, cfg_dict)
    cfg.train.device = worker.device(cfg.train.device)  # a GPU slot's worker sees only its GPUs
    run_dir = Path(out) / "runs" / rid
    try:
        if procs > 1 and not derive:  # the trainer's rank 0 holds the run lock while the processes train
            _train_processes(cfg, run_dir, procs, f"sweep {out}: {rid}")
        with run_lock(run_dir, owner=f"sweep {out}: {rid}", wait=worker.lock_wait_s()):
            note_attempt(run_dir)
            data = prepare(cfg.data, progress=False)
            if derive:
                from .derived import derive_run

                worker.report("deriving")
                model_dir, summary = derive_run(Path(out), derive, run_dir, cfg, data)
            else:
                worker.report("training")
                model_dir, summary = run_dir, train(cfg, run_dir, data=data, progress=False)
            worker.report("evaluating")
            scalars, series, extra = evaluate_run_dir(run_dir, cfg, data, model_dir=model_dir)
            if not derive:
                series += curve_series(run_dir, summary)  # the report's training curves
    except LockBusy as e:
        return {"status": "skipped", "message": f"{tag}: skipped, another process is on it ({e.holder or 'pid unknown'}); "
                                                "re-run this sweep later for its results"}
    ppl = next((v for p, L, m, v in scalars if p == "nonoverlapping" and L == cfg.model.train_length
                and m == "ppl"), None)
    return {"status": "done", "summary": {**summary, **extra, "node": worker.node()}, "scalars": scalars,
            "series": series, "message": f"{tag}: done" + (f" (ppl at L_tr {ppl:.2f})" if ppl else "")}


def note_attempt(run_dir: Path) -> None:
    """Append this attempt (node, process, time) to the run folder's placement.json (under its lock)."""
    import os

    path = Path(run_dir) / "placement.json"
    try:
        attempts = json.loads(path.read_text())["attempts"]
    except (OSError, ValueError, KeyError, TypeError):
        attempts = []
    attempts.append({"node": worker.node(), "pid": os.getpid(), "time": time.time()})
    atomic_write_json(path, {"attempts": attempts})


def _train_processes(cfg: C.RunConfig, run_dir: Path, procs: int, owner: str) -> None:
    """Train as ``procs`` processes (DDP/FSDP by train.strategy) through torchrun, resuming like any run;
    the caller then finds the run finished (train() returns its summary) and evaluates it here."""
    from ..executor.torchrun import torchrun

    with run_lock(run_dir, owner=owner, wait=worker.lock_wait_s()):  # another process on it: skip (LockBusy)
        pass
    worker.report("training")
    launch = Path(run_dir).parent / f".{Path(run_dir).name}.launch.yaml"  # the run's config for every process
    cfg.train.threads = max(1, cfg.train.threads // procs) if cfg.train.threads else 0
    C.save(cfg, launch)
    try:
        torchrun("extrapolab.train", ["--preset", str(launch), "--run-dir", str(run_dir), "--no-progress"], procs,
                 threads=cfg.train.threads)
    finally:
        launch.unlink(missing_ok=True)

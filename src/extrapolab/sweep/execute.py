"""The driver's side of a sweep's runs (docs/scale-out.md): hand them to the executor, record what comes back.

The sweep process is the only writer of results.sqlite: it marks each run queued, turns the phases its
runs report (training, deriving, evaluating) into their status, which the live progress line reads, and
records a finished run's rows in one transaction. Trained runs go first; the derived entries then, each
once its source run is done. ``sweep.time_budget_s`` stops handing out runs when the next would end past
it (a run's length: the longest finished run's); every invocation starts at least one run.
"""
from __future__ import annotations

import time

from ..executor import Executor, Job
from ..report.db import ResultsDB


def run_seconds(db: ResultsDB) -> list[float]:
    """Wall seconds (training + evaluation + analysis) of the finished runs recorded in ``db``."""
    return [s for s in (_run_wall(r["summary"]) for r in db.runs(status="done")) if s > 0]


def _run_wall(summary: dict) -> float:
    return sum(float(summary.get(k) or 0) for k in ("wall_seconds", "eval_wall_s", "analysis_wall_s"))


def run_all(ex: Executor, db: ResultsDB, trains: list[Job], derived: list[tuple[Job, str]], budget_s: float,
            t0: float, say) -> int:
    """Run ``trains``, then each derived job whose source run (the str beside it) is done; -> the runs the
    time budget left for the next invocation."""
    took = run_seconds(db)  # what one run took here before: the budget's estimate of the next
    started = [0]

    def may_start(_n: int) -> bool:
        ok = not started[0] or not budget_s or time.time() - t0 + max(took, default=0.0) <= budget_s
        started[0] += ok
        return ok

    def on_event(job: Job, ev: dict) -> None:
        if ev["phase"] in ("training", "deriving", "evaluating"):
            db.set_status(job.key, ev["phase"])

    def on_result(job: Job, res: dict) -> None:
        if res["status"] == "done":
            if db.status(job.key) == "done":  # finished by another sweep since this one listed it
                res = {**res, "message": f"{job.tag}: done by another process"}
            else:
                db.record(job.key, res["summary"], res["scalars"], res["series"])
                took.append(_run_wall(res["summary"]))
        say(res["message"])

    left = ex.run(trains, may_start=may_start, on_event=on_event, on_result=on_result)
    if left:
        return len(left) + len(derived)
    ready = []
    for job, source in derived:
        if db.status(source) == "done":
            ready.append(job)
        else:
            say(f"{job.tag}: skipped, its source run {source} is not done; re-run this sweep after it")
    return len(ex.run(ready, may_start=may_start, on_event=on_event, on_result=on_result))

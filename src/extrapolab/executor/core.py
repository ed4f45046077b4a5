"""The one loop every backend runs: hand runs to free slots, pass their phases and results to the driver.

Runs are handed out lazily, never more than the backend can start at once (``capacity``), so a run
that is handed out is a run that is starting: the driver knows which runs are running and which are
queued, can stop starting runs when its time budget would be overrun (``may_start``), and after a
failing run starts no other (runs already going finish and are recorded; the error is raised after).
Results come back to the driver (``on_result``), which is the only writer of what the job records.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Job:
    """One run: ``fn(*args)`` (a module-level function, so it can be sent to another process or node)."""

    key: str
    fn: Callable
    args: tuple = ()
    tag: str = ""  # how messages name it, e.g. "[3/8] stdlib--alibi--s0"
    threads: int = 0  # torch threads of its worker (0: leave them)


class Executor:
    """A backend: ``with`` it, ``run(jobs)`` any number of times, ``where`` says which node runs what."""

    kind = "local"
    in_process = False  # runs in the driver itself (one slot on the CPU): progress bars may be shown

    def __init__(self) -> None:
        self.slots = 1  # runs at once (local: workers or GPU slots; ray: what the cluster fits)
        self.gpu = False  # the runs train on GPUs
        self.cpus_per_run, self.gpus_per_run = 1, 0  # what one run holds (ray's task resources)
        self.where: dict[str, str] = {}  # running run -> node (the live line shows it)
        self.timings: dict[str, dict] = {}  # run -> submitted, received (driver clock), task_s, node, pid
        self._live: set[str] = set()
        self._jobs: dict[str, Job] = {}
        self._on_event = None

    # ---- what a backend provides --------------------------------------------------------------
    def capacity(self) -> int:
        return self.slots

    def describe(self, runs: int) -> str:
        """How ``runs`` runs at once are executed, for the sweep's first line."""
        return f"{runs} worker{'s' if runs > 1 else ''}"

    def run_threads(self, share: int) -> int:
        """Torch threads of a run when ``share`` runs at once share this machine's cores."""
        return max(1, cpu_count() // max(1, share))

    def _submit(self, job: Job):  # -> a handle
        raise NotImplementedError

    def _wait(self, handles: list, timeout: float) -> list:  # -> the handles that finished
        raise NotImplementedError

    def _result(self, handle, job: Job) -> tuple:  # -> (result, meta) or raises the run's error
        raise NotImplementedError

    def _events(self) -> list[dict]:  # phases the runs reported since the last call
        return []

    def _cancel(self, handles: list) -> None:
        pass

    def close(self, abort: bool = False) -> None:  # abort: the driver is stopping on an error
        pass

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(abort=exc_type is not None)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, jobs: list[Job], *, may_start: Callable[[int], bool] | None = None,
            on_event: Callable[[Job, dict], None] | None = None,
            on_result: Callable[[Job, object], None] | None = None) -> list[Job]:
        """Run ``jobs`` in order, at most ``capacity()`` at once; returns those never started because
        ``may_start(n_started)`` said no. A failing run's error is raised once the runs going have finished."""
        pending, inflight = list(jobs), {}
        self._jobs.update({j.key: j for j in jobs})
        self._on_event = on_event
        error, stopped, started = None, False, 0
        try:
            while True:
                while pending and not stopped and error is None and len(inflight) < max(1, self.capacity()):
                    if may_start is not None and not may_start(started):
                        stopped = True
                        break
                    job = pending.pop(0)
                    self._live.add(job.key)
                    self.timings[job.key] = {"submitted": time.time()}
                    inflight[self._submit(job)] = job
                    started += 1
                if not inflight:
                    break
                done = self._wait(list(inflight), 0.5)
                self.drain()
                for handle in done:
                    job = inflight.pop(handle)
                    try:
                        res, meta = self._result(handle, job)
                    except Exception as e:  # the run failed: start no other, raise it after the rest
                        error = error or e
                        continue
                    finally:
                        self._live.discard(job.key)
                        self.where.pop(job.key, None)
                    self.timings[job.key].update(received=time.time(), **meta)
                    if on_result is not None:
                        on_result(job, res)
        except BaseException:
            self._cancel(list(inflight))
            raise
        if error is not None:
            raise error
        return pending

    def drain(self) -> None:
        for ev in self._events():
            self._event(ev)

    def _event(self, ev: dict) -> None:
        """A run's phase, in the driver: late events of finished runs are dropped."""
        key = ev.get("key")
        if key not in self._live:
            return
        if ev.get("node"):
            self.where[key] = ev["node"]
        if self._on_event is not None:
            self._on_event(self._jobs[key], ev)

    def overhead(self) -> dict:
        """Per finished run: seconds between handing it out and getting its result, minus its own time in
        the worker (spawning or scheduling, start-up, transfers); mean and max over the runs."""
        gaps = [t["received"] - t["submitted"] - t["task_s"] for t in self.timings.values() if "received" in t]
        return {"runs": len(gaps), "mean_s": sum(gaps) / len(gaps) if gaps else None, "max_s": max(gaps, default=None),
                "task_s": sum(t["task_s"] for t in self.timings.values() if "received" in t)}


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

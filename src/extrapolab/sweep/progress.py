"""One live progress line for a sweep: runs finished / running / queued, each running run's step,
and an ETA from the step times the runs measure.

The line is built by polling the runs' status in results.sqlite (the driver writes it from the phases
the runs report), the last row of each run's ``metrics.jsonl`` and where the executor placed each run
(a Ray node, a GPU: shown when it is not simply this machine), so it works the same for runs in this
process, in pool workers and on a cluster. On a terminal it is one rich live line; otherwise (a log file, CI) the same line is
printed every ``every`` seconds when it changed.
"""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.text import Text

from ..report.db import ResultsDB

EVAL_SHARE_GUESS = 0.35  # eval + ERF time as a share of training time, until a finished run measures it


def _last_step(run_dir: Path) -> tuple[int, float | None]:
    """(step, sec/step) of the last logged row of a run's metrics.jsonl ((0, None) before one)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="ignore").splitlines()
    except OSError:
        return 0, None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "sec_per_step" in row:
            return int(row["step"]), float(row["sec_per_step"])
    return 0, None


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)} min {int(s % 60):02d} s" if s >= 60 else f"{s:.0f} s"


class Monitor:
    """``with Monitor(out, run_ids, steps, workers) as mon:`` ... ``mon.say(msg)`` prints above the line."""

    def __init__(self, out: Path, run_ids: list[str], steps: int, workers: int, enabled: bool = True,
                 every: float = 30.0, where: dict | None = None) -> None:
        self.out, self.run_ids, self.steps, self.workers = Path(out), list(run_ids), int(steps), max(1, workers)
        self.where = where if where is not None else {}  # run -> node, kept by the executor (shown when not here)
        self.progress, self.enabled, self.every = enabled, enabled and bool(run_ids), every
        self.console = Console(stderr=True, soft_wrap=True)
        self._stop, self._thread, self._live, self.t0 = threading.Event(), None, None, time.time()
        self.phase = ""  # shown once every run is done, e.g. the cost bench pass

    def say(self, msg: str) -> None:
        if self.progress:
            self.console.print(f"[bold cyan]extrapolab[/] {msg}")

    def line(self, db: ResultsDB) -> str:
        every = db.runs(status=None)  # finished runs of earlier sessions also tell step and eval times
        status = {r["run_id"]: r for r in every if r["run_id"] in set(self.run_ids)}
        finished = [r for r in every if r["status"] == "done"]
        done = [status[r] for r in self.run_ids if status.get(r, {}).get("status") == "done"]
        running = [r for r in self.run_ids if status.get(r, {}).get("status") in ("training", "evaluating")]
        queued = len(self.run_ids) - len(done) - len(running)
        steps = {r: _last_step(self.out / "runs" / r) for r in running}
        rates = [s for _, s in steps.values() if s] + [r["summary"].get("median_sec_per_step") for r in finished
                                                        if r["summary"].get("median_sec_per_step")]
        evals = [(r["summary"].get("eval_wall_s") or 0) + (r["summary"].get("analysis_wall_s") or 0) for r in finished]
        parts = [f"runs {len(done)} done / {len(running)} running / {queued} queued"]
        for r in running:
            st = status[r]["status"]
            node = self.where.get(r)
            parts.append(f"{r}: " + ("evaluating" if st == "evaluating" else f"step {steps[r][0]}/{self.steps}")
                         + (f" on {node}" if node and node != socket.gethostname() else ""))
        if self.phase and not running and not queued:
            parts.append(self.phase)
        elif rates:
            sps = statistics.median(rates)
            ev = statistics.median(evals) if evals else EVAL_SHARE_GUESS * self.steps * sps
            left = sum((self.steps - steps[r][0]) * sps + ev if status[r]["status"] == "training" else ev / 2
                       for r in running) + queued * (self.steps * sps + ev)
            parts.append(f"ETA {_fmt_s(left / self.workers)} ({sps:.2f} s/step{'' if evals else ', eval time guessed'})")
        parts.append(f"{_fmt_s(time.time() - self.t0)} elapsed")
        return " | ".join(parts)

    def _loop(self) -> None:
        db, last_print, last = ResultsDB(self.out / "results.sqlite"), 0.0, ""
        try:
            while not self._stop.wait(1.0):
                try:
                    text = self.line(db)
                except Exception as e:  # a torn read must not kill the sweep; show it and go on
                    text = f"progress unavailable ({type(e).__name__})"
                if self._live is not None:
                    self._live.update(Text(text))
                elif text != last and time.time() - last_print >= self.every:
                    self.console.print(text)
                    last_print, last = time.time(), text
        finally:
            db.close()

    def __enter__(self) -> "Monitor":
        if self.enabled:
            if self.console.is_terminal:
                self._live = Live(Text("starting runs ..."), console=self.console, refresh_per_second=2,
                                  transient=False)
                self._live.start()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._live is not None:
            self._live.stop()

"""Many independent regular-benchmark runs at once (``regular table --workers N``, ``--engine ray``), through
the one executor of every many-run job (executor/, docs/scale-out.md).

Each (task, model, seed) run is single-process and small, so a many-core CPU is used best by N
worker processes of ``threads`` torch threads each rather than one process with many threads; on a GPU
node each worker gets its GPU (``--devices``, ``--runs-per-device``), on a Ray cluster each run is a task.
Every run writes its own folder atomically, so a killed table keeps every finished run and resumes
from there (a run cut short starts over: these runs are minutes long and keep no checkpoint).
Jobs start longest-first (a static cost guess, ``job_cost``) so the last worker is not left alone
with the slowest run.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from ..executor import Executor, Job
from ..executor.core import cpu_count  # noqa: F401 - table.json records the CPUs

#: relative cost of one run by model column (measured on the quick budget: the O(T^2) transformer
#: is the slowest, the RNN the fastest); tasks tested up to 500 (Deletang) cost about twice more
COLUMN_COST = {"transformer": 4.0, "regulargpt-C2": 3.0, "regulargpt-C3": 2.0, "lstm": 1.5, "rnn": 0.5,
               # not measured: ALiBi at positions with gaps takes the dense-mask fallback path
               "transformer-rope-random": 4.0, "transformer-alibi-random": 5.0}


def job_cost(model: str, family: str) -> float:
    return COLUMN_COST.get(model, 1.0) * (2.0 if family == "deletang" else 1.0)


def _describe(key) -> str:
    return "/".join(str(k) if not isinstance(k, int) else f"seed{k}" for k in key)


def run_jobs(jobs: dict, fn, ex: Executor, threads: int = 1, progress: bool = True) -> dict:
    """``jobs``: key -> (cfg, run_dir, cost); ``fn(cfg, run_dir, progress, train)`` trains one run and
    returns its result (a picklable, module-level function). Returns key -> result.

    In the driver (one CPU slot) the runs go in the given order, with per-run progress bars. Otherwise
    the executor's workers (or Ray tasks) take them longest-first, ``threads`` torch threads each; a
    failing run stops handing out runs (finished ones stay on disk) and its error is raised here.
    """
    order = list(jobs) if ex.in_process else sorted(jobs, key=lambda k: -jobs[k][2])
    keys = {_describe(k): k for k in order}
    out: dict = {}
    bar = tqdm(total=len(order), desc=f"runs ({ex.describe(min(ex.slots, len(order)))})", unit="run",
               disable=not progress or ex.in_process or not order)

    def done(job: Job, res) -> None:
        out[keys[job.key]] = res
        bar.update(1)
        bar.set_postfix_str(job.key)

    runs = [Job(_describe(k), fn, (jobs[k][0], jobs[k][1], progress and ex.in_process, True), tag=_describe(k),
                threads=0 if ex.in_process else threads) for k in order]
    try:
        ex.run(runs, on_result=done)
    finally:
        bar.close()
    return out

"""Run many independent regular-benchmark runs at once (``regular table --workers N``).

Each (task, model, seed) run is single-process and small, so a many-core CPU is used best by N
worker processes of ``threads`` torch threads each rather than one process with many threads.
Workers are spawned (not forked: a forked torch thread pool can deadlock) and every run writes its
own folder atomically, so a killed table keeps every finished run and resumes from there.
Jobs start longest-first (a static cost guess, ``job_cost``) so the last worker is not left alone
with the slowest run.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from tqdm.auto import tqdm

#: relative cost of one run by model column (measured on the quick budget: the O(T^2) transformer
#: is the slowest, the RNN the fastest); tasks tested up to 500 (Deletang) cost about twice more
COLUMN_COST = {"transformer": 4.0, "regulargpt-C2": 3.0, "regulargpt-C3": 2.0, "lstm": 1.5, "rnn": 0.5,
               # not measured: ALiBi at positions with gaps takes the dense-mask fallback path
               "transformer-rope-random": 4.0, "transformer-alibi-random": 5.0}


def job_cost(model: str, family: str) -> float:
    return COLUMN_COST.get(model, 1.0) * (2.0 if family == "deletang" else 1.0)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(max(1, int(threads)))


def _describe(key) -> str:
    return "/".join(str(k) if not isinstance(k, int) else f"seed{k}" for k in key)


def run_jobs(jobs: dict, fn, workers: int = 1, threads: int = 1, progress: bool = True) -> dict:
    """``jobs``: key -> (cfg, run_dir, cost); ``fn(cfg, run_dir, progress, train)`` trains one
    run and returns its result (a picklable, module-level function). Returns key -> result.

    workers <= 1 runs in this process, in the given order, with per-run progress bars. Otherwise
    ``workers`` spawned processes take the jobs longest-first; a failing run stops the pool
    (queued runs are cancelled, finished ones stay on disk) and its error is raised here.
    """
    if workers <= 1 or not jobs:  # one job with workers > 1 still gets its own `threads`
        return {k: fn(cfg, run_dir, progress, True) for k, (cfg, run_dir, _) in jobs.items()}
    order = sorted(jobs, key=lambda k: -jobs[k][2])
    out: dict = {}
    workers = min(int(workers), len(order))
    bar = tqdm(total=len(order), desc=f"runs ({workers} workers)", disable=not progress, unit="run")
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(threads,)) as pool:
        pending = {pool.submit(fn, jobs[k][0], jobs[k][1], False, True): k for k in order}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    key = pending.pop(fut)
                    out[key] = fut.result()  # re-raises a worker's error
                    bar.update(1)
                    bar.set_postfix_str(_describe(key))
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
        finally:
            bar.close()
    return out


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

"""The local engine: this machine's cores or GPUs.

One slot and no GPU to hand out: the runs run in the driver process itself, one after another. Else
a pool of spawned worker processes (spawned, not forked: a forked torch thread pool can deadlock),
one per slot; a worker takes its slot when it starts and keeps it, so a GPU slot's worker sees only
its devices (``CUDA_VISIBLE_DEVICES``, set before anything in it touches CUDA, so the run's ``cuda``
is its GPU). Workers end with the driver (:func:`exit_with_parent`), runs report their phases over
a queue, and a run that fails is raised in the driver after the runs going have finished.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from queue import Empty

from . import worker
from .core import Executor, Job
from .devices import cuda_visible, runs_per_gpu

_SLOT: dict = {}  # in a pool worker: node (this machine and its GPUs), gpus, channel


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """End this worker when the driver is gone (killed by SIGTERM/SIGKILL, which a process pool does not
    pass on), so no orphan keeps training and holding a run lock. The run resumes from its last checkpoint
    when the same command is run again."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(143)  # like SIGTERM: the parent went away

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_worker(parent_pid: int, events, slots) -> None:
    """Pool worker start: die with the driver, take a slot (its GPUs: the only ones this process sees)."""
    exit_with_parent(parent_pid)
    slot = slots.get()
    if slot:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible(slot)
    _SLOT.update(node=worker.host() + (f"/gpu{','.join(map(str, slot))}" if slot else ""), gpus=len(slot or ()),
                 channel=events.put)


def _pool_call(key: str, fn, args: tuple, threads: int):
    return worker.call(key, fn, args, _SLOT["channel"], node=_SLOT["node"], gpus=_SLOT["gpus"], threads=threads)


class LocalExecutor(Executor):
    """``slots``: one entry per worker, None (a CPU worker) or the tuple of GPU ids it owns; ``in_process``:
    one slot whose runs run in the driver itself (a CPU, or the machine's only GPU)."""

    def __init__(self, slots: list[tuple[int, ...] | None], in_process: bool | None = None) -> None:
        super().__init__()
        self._slots = list(slots) or [None]
        self.slots = len(self._slots)
        self.gpu = any(self._slots)
        self.gpus_per_run = len(self._slots[0] or ())
        self.in_process = self._slots == [None] if in_process is None else bool(in_process and self.slots == 1)
        self._pool = self._events_q = None

    def describe(self, runs: int) -> str:
        if not self.gpu:
            return super().describe(runs)
        per = runs_per_gpu(self._slots)
        return (f"{runs} worker{'s' if runs > 1 else ''} on GPU{'s' if len(per) > 1 else ''} "
                f"{','.join(map(str, per))} (at most {max(per.values())} run{'s' if max(per.values()) > 1 else ''} "
                "per GPU)")

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._events_q, slots_q = ctx.Queue(), ctx.Queue()
        for s in self._slots:
            slots_q.put(s)
        self._pool = ProcessPoolExecutor(self.slots, mp_context=ctx, initializer=_init_worker,
                                         initargs=(os.getpid(), self._events_q, slots_q))

    def _submit(self, job: Job):
        if self.in_process:
            fut: Future = Future()
            try:
                fut.set_result(worker.call(job.key, job.fn, job.args, self._event, gpus=self.gpus_per_run,
                                           threads=job.threads))
            except Exception as e:
                fut.set_exception(e)
            return fut
        if self._pool is None:
            self._start()
        return self._pool.submit(_pool_call, job.key, job.fn, job.args, job.threads)

    def _wait(self, handles: list, timeout: float) -> list:
        return list(wait(handles, timeout=timeout, return_when=FIRST_COMPLETED).done)

    def _result(self, handle, job: Job) -> tuple:
        try:
            return handle.result()
        except BrokenProcessPool:
            raise RuntimeError(f"the worker process running {job.key} died (killed, or out of memory?); re-run the "
                               "same command: finished runs are kept and this one resumes from its last "
                               "checkpoint") from None

    def _events(self) -> list[dict]:
        out = []
        while self._events_q is not None:
            try:
                out.append(self._events_q.get_nowait())
            except (Empty, OSError, ValueError):
                break
        return out

    def _cancel(self, handles: list) -> None:
        for h in handles:
            h.cancel()

    def close(self, abort: bool = False) -> None:
        """Stop the pool; on ``abort`` (the driver stops on an error) runs still going stop with their workers."""
        if self._pool is not None:
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=not abort, cancel_futures=True)
            for p in procs if abort else ():
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
            self._pool = None
        if self._events_q is not None:
            self._events_q.close()
            self._events_q = None

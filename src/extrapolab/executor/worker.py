"""What a run sees of the executor from inside its worker: where it runs, its device, and a way to tell
the driver its phase (``report("evaluating")``), which the driver turns into the live progress line and
the run's status (the driver is the only writer of a sweep's results; docs/scale-out.md).

The state below is set by :func:`call` for the duration of one run, in whatever process runs it (the
driver itself, a spawned local worker, a Ray worker); importing this module changes nothing.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable

_RUN: dict = {}  # key, channel (event -> None), node (label), gpus (GPUs given to this run), lock_wait_s


def call(key: str, fn: Callable, args: tuple, channel: Callable[[dict], None] | None, *, node: str = "",
         gpus: int = 0, threads: int = 0, lock_wait_s: float = 0.0) -> tuple:
    """Run ``fn(*args)`` as run ``key``: announce its start, set its torch threads; returns (result, meta)
    where meta says where it ran and how long it took inside the worker (the executor's overhead is the rest)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    before = dict(_RUN)
    _RUN.update(key=key, channel=channel, node=node or host(), gpus=int(gpus), lock_wait_s=float(lock_wait_s))
    t = time.perf_counter()
    try:
        report("start")
        result = fn(*args)
    finally:
        _RUN.clear()
        _RUN.update(before)
    return result, {"node": node or host(), "pid": os.getpid(), "task_s": time.perf_counter() - t}


def report(phase: str, **extra) -> None:
    """Tell the driver this run's phase (start, training, deriving, evaluating); a no-op outside a run."""
    channel = _RUN.get("channel")
    if channel is not None:
        channel({"key": _RUN["key"], "phase": phase, "node": _RUN.get("node", ""), "pid": os.getpid(),
                 "time": time.time(), **extra})


def node() -> str:
    """Where this run runs: a Ray node (``ip/node-id``), else this machine's name (``/gpuN``: its GPUs)."""
    return _RUN.get("node") or host()


def host() -> str:
    return socket.gethostname()


def device(requested: str) -> str:
    """The device a run asked for, inside the slot the executor gave it: a slot with GPUs sees only them,
    as cuda:0.., so ``auto`` / ``cuda`` / ``cuda:N`` all become ``cuda`` there; elsewhere it is unchanged."""
    if _RUN.get("gpus") and (requested or "auto") != "cpu":
        return "cuda"
    return requested


def lock_wait_s() -> float:
    """Seconds a run waits for its run folder's lock: on a cluster a retried run may land while the killed
    attempt's process is still going away (0 elsewhere: another process on it means skip it)."""
    return float(_RUN.get("lock_wait_s") or 0.0)

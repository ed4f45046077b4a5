"""A run of several processes (DDP / FSDP, train/dist.py) as one placement: ``torchrun --standalone`` on the
node that holds the run's slot (local) or task (Ray: the task holds all its GPUs / CPUs), so the run's
processes are scheduled, retried and killed together. The children die with the process that launched them
(``PR_SET_PDEATHSIG``), so a killed worker or node leaves no training process behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from ..io import UserError


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the launching process dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def torchrun(module: str, args: list[str], nproc: int, threads: int = 0) -> None:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGS`` here; a child's
    one-line ``error:`` becomes a UserError, any other failure a RuntimeError with the end of its log."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}",
           "-m", module, *args]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    if proc.returncode:
        errors = [ln[len("error: "):] for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
        if errors:
            raise UserError(errors[0])
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"torchrun ({nproc} processes) of {module} exited with {proc.returncode}: {tail}")

"""One executor for every job made of many independent runs (``sweep``, ``demo``, ``regular table``):
the local engine (this machine's cores or GPUs) or a Ray cluster (docs/scale-out.md).

It sits after the stages and before the studies that use it; it knows nothing of what a run does
(a module-level function and its arguments) and imports Ray only when the Ray engine is chosen.
"""
from __future__ import annotations

from pathlib import Path

from ..io import UserError
from .core import Executor, Job
from .devices import device_slots, resolve_devices, visible_gpus
from .local import LocalExecutor, exit_with_parent
from .spec import ENGINES, KEYS, EngineSpec, parse_devices

__all__ = ["ENGINES", "KEYS", "EngineSpec", "Executor", "Job", "LocalExecutor", "exit_with_parent",
           "local_executor", "open_executor", "parse_devices"]


def open_executor(spec: EngineSpec, *, device: str = "auto", threads: int = 0, out: Path | None = None,
                  device_what: str = "train.device") -> Executor:
    """The executor ``spec`` asks for, for runs that ask for ``device`` and ``threads`` torch threads each
    (``out``: the job's folder, which a Ray cluster's nodes must all see). Checks everything it can before
    the caller writes anything: devices, the cluster's address, resources and storage."""
    if spec.engine == "ray":
        from .cluster import RayExecutor

        return RayExecutor(spec, device=device, threads=threads, out=out, device_what=device_what)
    return local_executor(spec, device, device_what)


def local_executor(spec: EngineSpec, device: str = "auto", device_what: str = "train.device") -> LocalExecutor:
    """CPU runs: ``workers`` slots. GPU runs: ``runs_per_device`` slots on each of ``devices`` (a run of
    ``procs_per_run`` processes: that many GPUs per slot); one slot holding the only GPU runs in the driver."""
    device = (device or "auto").strip()
    visible = visible_gpus() if device != "cpu" or spec.devices != "auto" else 0
    on_gpu = device.startswith("cuda") or (device == "auto" and visible > 0)
    if spec.devices != "auto" or on_gpu:
        devices = spec.devices
        if devices == "auto" and device.startswith("cuda:"):  # train.device=cuda:N: that GPU only
            devices = [int(device.split(":", 1)[1])] if device.split(":", 1)[1].isdigit() else "auto"
        devices = resolve_devices(devices, visible, spec.key("devices"))
        if on_gpu and not devices:
            raise UserError(f"{device_what}={device} but no CUDA device is visible; use {device_what}=cpu")
    if not on_gpu:  # a device list on CPU runs (train.device=cpu) names nothing they use
        return LocalExecutor([None] * spec.workers)
    slots = device_slots(devices, spec.runs_per_device, spec.procs_per_run, spec.key("procs_per_run"))
    return LocalExecutor(slots, in_process=len(slots) == 1 and list(slots[0]) == list(range(visible)))

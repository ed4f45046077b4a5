"""Which run gets which GPU on one machine: pure functions of the device list and the visible count.

Every worker process of the local engine owns one slot for its whole life: a tuple of GPU ids it sees
as ``cuda:0..`` (``CUDA_VISIBLE_DEVICES``, set in the spawned worker before CUDA starts). A device
carries ``runs_per_device`` slots, so no more runs than that are ever on one GPU at once; slots are
dealt device by device (0, 1, 2, 0, 1, 2, ...) so that fewer runs than slots spread over the GPUs
first. A run of ``procs_per_run`` processes gets that many whole GPUs.
"""
from __future__ import annotations

import os

from ..io import UserError


def visible_gpus() -> int:
    """CUDA devices this process sees (0 on a CPU-only machine or torch build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(devices, visible: int, what: str = "sweep.devices") -> list[int]:
    """``auto`` -> every visible GPU; a list -> checked against the ``visible`` count (ids 0..visible-1)."""
    if devices == "auto":
        return list(range(visible))
    if not visible:
        raise UserError(f"{what}={list(devices)} names GPUs but no CUDA device is visible here; drop {what} "
                        "(the runs train on the CPU) or run on a GPU machine")
    bad = [d for d in devices if not 0 <= int(d) < visible]
    if bad:
        raise UserError(f"{what}={list(devices)} names GPU {bad[0]} but only {visible} CUDA device(s) are visible "
                        f"(ids 0..{visible - 1}); use {what}=auto or ids from that range")
    return [int(d) for d in devices]


def device_slots(devices: list[int], runs_per_device: int = 1, procs_per_run: int = 1,
                 what: str = "sweep.procs_per_run") -> list[tuple[int, ...]]:
    """The GPUs of each worker process: ``runs_per_device`` slots per device, dealt device by device; with
    ``procs_per_run`` > 1, consecutive groups of that many devices (GPUs left over stay idle)."""
    if runs_per_device < 1:
        raise ValueError("runs_per_device must be >= 1")
    if procs_per_run > 1:
        if len(devices) < procs_per_run:
            raise UserError(f"{what}={procs_per_run} needs {procs_per_run} GPUs per run; only {len(devices)} "
                            "are used here (sweep.devices)")
        return [tuple(devices[i:i + procs_per_run]) for i in range(0, len(devices) - procs_per_run + 1, procs_per_run)]
    return [(d,) for _ in range(runs_per_device) for d in devices]


def runs_per_gpu(slots: list[tuple[int, ...]]) -> dict[int, int]:
    """{device: slots on it}: how many runs can be on each GPU at once (at most runs_per_device)."""
    out: dict[int, int] = {}
    for slot in slots:
        for d in slot:
            out[d] = out.get(d, 0) + 1
    return out


def cuda_visible(slot: tuple[int, ...], parent: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker of ``slot``: ids as this process numbers them, mapped through the
    parent's own ``CUDA_VISIBLE_DEVICES`` when it has one (ids there may be UUIDs)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    names = [p.strip() for p in parent.split(",") if p.strip()] if parent else None
    return ",".join(names[d] if names else str(d) for d in slot)

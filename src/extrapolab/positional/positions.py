"""Position tensors whose layout is known on the host.

A forward asks of its positions the largest (the scheme's length check, a rotary table's size), the first, and
whether they are contiguous and increasing (the Toeplitz, folded and rotary fast paths). Read from a CUDA tensor,
each answer is a host sync: the host waits for every kernel queued before it, and a training step whose host
runs ahead of the GPU (GPT-2 small at 16 x 512 on an H100: 37.8 ms a step with 26.7 ms of kernels,
docs/results/gpu-h100-2026-11-27.md) loses that lead at every read. Positions made by :func:`arange_positions`
carry their start on the host, so those questions cost nothing; any other tensor is read as before. The other
way round, a tensor made on the host reaches CUDA through :func:`to_device` without making the host wait.
"""
from __future__ import annotations

import torch


def version(t: torch.Tensor) -> int | None:
    """A tensor's in-place version, for memos keyed on a tensor (None: do not memoise): None for inference tensors,
    which have none, and in code that torch.compile traces, where asking is a graph break (positions made inside the
    traced forward are not changed in place)."""
    return None if inference_tensor(t) or torch.compiler.is_compiling() else t._version


def inference_mode() -> bool:
    """``torch.is_inference_mode_enabled()``; False in code torch.compile traces (``train.compile``), where the
    question is a graph break and inference mode is not used."""
    return not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()


def inference_tensor(t: torch.Tensor) -> bool:
    """``t.is_inference()``; False in traced code (as :func:`inference_mode`)."""
    return not torch.compiler.is_compiling() and t.is_inference()


def arange_positions(start: int, n: int, device) -> torch.Tensor:
    """start .. start + n - 1 [n] (int64) on ``device``, its start kept on the host for :func:`known_start`."""
    pos = torch.arange(start, start + n, device=device)  # [n]
    pos._arange_start = (int(start), version(pos))
    return pos


def known_start(pos: torch.Tensor) -> int | None:
    """The start of positions made by :func:`arange_positions` and not changed in place since, else None (then the
    caller reads the device). Views, slices and copies carry no start."""
    tag = getattr(pos, "_arange_start", None)
    if tag is None or tag[1] != version(pos) or pos.dim() != 1:
        return None
    return tag[0]


def span(pos: torch.Tensor) -> tuple[int, int | None]:
    """(max(pos) + 1, p0 where 1-D ``pos == p0 + arange(len(pos))`` else None); (0, None) for no positions: the
    rows a rotary table needs, and whether they are one slice of it. From the host where the start is known, else
    one read of the device for one position and two or three for more (the largest, the first, and whether they
    increase when the two allow a range: integers that increase strictly from p0 to p0 + len - 1 are that range)."""
    n = pos.numel()
    if n == 0:
        return 0, None
    p0 = known_start(pos)
    if p0 is not None:
        return p0 + n, p0
    if n == 1:
        p0 = int(pos.reshape(-1)[0])
        return p0 + 1, (p0 if pos.dim() == 1 else None)
    hi, p0 = int(pos.max()) + 1, int(pos.reshape(-1)[0])
    return hi, (p0 if pos.dim() == 1 and hi - p0 == n and bool(torch.all(pos[1:] > pos[:-1])) else None)


def top(pos: torch.Tensor) -> int:
    """max(pos) + 1 (0 for no positions), from the host where the start is known."""
    if not pos.numel():
        return 0
    p0 = known_start(pos)
    return p0 + pos.numel() if p0 is not None else int(pos.max()) + 1


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (positions drawn on the host, a training batch) on ``device``: to CUDA through pinned memory
    without blocking -- a copy from pageable memory makes the host wait for every queued kernel, once a step."""
    if device is not None and torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)

"""Where a model runs and in which precision: the ``--device`` / ``--dtype`` of every verb that runs one.

Training reads ``train.device`` / ``train.precision``; ``eval``, ``analyze``, ``align`` and ``regular``
take ``--device`` / ``--dtype`` and resolve them with the same two functions
(:func:`dist.resolve_device`, :func:`step.resolve_precision`), so the rules are one: ``auto`` device =
CUDA when visible, else CPU; ``auto`` precision = bf16 autocast on a GPU that supports it (fp16
otherwise), fp32 on a CPU. Weights stay fp32; autocast runs the matmuls in the lower precision and
every loss / log-softmax in this package upcasts logits to fp32 first (``logits.float()``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .dist import resolve_device
from .step import autocast, resolve_precision


@dataclass(frozen=True)
class Placement:
    device: torch.device
    precision: str  # fp32 | bf16 | fp16

    def put(self, module):
        """``module`` moved to the device (in place for an nn.Module, as ``.to`` does); returns it."""
        return module.to(self.device)

    def autocast(self):
        """The autocast context of this precision on this device (a no-op for fp32)."""
        return autocast(self.precision, self.device)

    @contextmanager
    def running(self, module):
        """``module`` on the device, under autocast, for the duration (the model stays there after)."""
        self.put(module)
        with self.autocast():
            yield module

    def describe(self) -> dict:
        return {"device": str(self.device), "precision": self.precision}


def placement(device: str = "auto", dtype: str = "auto", *, device_what: str = "--device",
              dtype_what: str = "--dtype") -> Placement:
    """``--device`` / ``--dtype`` values -> a Placement; one-line UserError naming the option on bad input."""
    dev = resolve_device(device, what=device_what)
    return Placement(dev, resolve_precision(dtype, dev, what=dtype_what))


def run_placement(train_cfg) -> Placement:
    """The placement a run's ``train.device`` / ``train.precision`` ask for (sweeps evaluate there too)."""
    return placement(train_cfg.device, train_cfg.precision, device_what="train.device",
                     dtype_what="train.precision")


def placement_overrides(device: str = "auto", dtype: str = "auto") -> list[str]:
    """``--device`` / ``--dtype`` of a verb that trains (sweep, demo, align experiment) as ``--set``
    overrides of ``train.device`` / ``train.precision``; ``auto`` adds nothing, so a preset's own value stands."""
    out = [f"train.device={device}"] if device and device != "auto" else []
    return out + ([f"train.precision={dtype}"] if dtype and dtype != "auto" else [])

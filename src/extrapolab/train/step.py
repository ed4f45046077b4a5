"""One optimizer step's pieces: precision/autocast, accumulated forward-backward, host RNG state.

``forward_backward`` accumulates the gradient of the *mean* next-token loss over micro-batches
(each micro-batch loss divided by their number), so ``grad_accum × batch`` equals one batch of the
same windows; the gradient all-reduce (DDP/FSDP) runs only on the last micro-batch.
"""
from __future__ import annotations

import json
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from ..io import UserError
from . import dist as D


def resolve_precision(precision: str, device: torch.device, what: str = "train.precision") -> str:
    """auto | fp32 | bf16 | fp16 -> the autocast precision (``what`` names the setting in errors)."""
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if precision not in ("fp32", "bf16", "fp16"):
        raise UserError(f"unknown {what} {precision!r}; use auto, fp32, bf16 or fp16")
    if precision == "fp16" and device.type != "cuda":
        flag = what.startswith("--")  # a CLI option (--dtype fp16) or a config key (train.precision=fp16)
        fix = f"{what} bf16 or fp32" if flag else f"--set {what}=bf16 or fp32"
        raise UserError(f"{what}{' ' if flag else '='}fp16 needs a CUDA device; use {fix} on CPU")
    return precision


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def forward_backward(model, micro_batches, precision="fp32", device=torch.device("cpu"), scaler=None,
                     positions=None, opts=None) -> torch.Tensor:
    """Accumulate gradients of the mean next-token loss over ``micro_batches`` (each [b, L+1]).

    ``positions``: None (0..L-1) or one [L] tensor per micro-batch (randomized positions); ``opts``: the
    attention options of the forward (``train.attention``), None for the model's default.
    Returns the detached mean loss. Gradient sync (DDP/FSDP) only on the last micro-batch.
    """
    n = len(micro_batches)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, x in enumerate(micro_batches):
        with D.sync_context(model, i == n - 1):
            with autocast(precision, device):
                kw = {} if opts is None else {"opts": opts}
                logits = model(x[:, :-1], None if positions is None else positions[i], **kw)  # [b, L, V]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            (scaler.scale(loss / n) if scaler is not None else loss / n).backward()
        total += loss.detach().double()
    return total / n


def host_rng() -> str:
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()
    return json.dumps({"python": random.getstate(), "numpy": np_state})


def set_host_rng(text: str) -> None:
    s = json.loads(text)
    version, internal, gauss = s["python"]
    random.setstate((version, tuple(internal), gauss))
    s["numpy"]["state"]["key"] = np.asarray(s["numpy"]["state"]["key"], dtype=np.uint32)
    np.random.set_state(s["numpy"])

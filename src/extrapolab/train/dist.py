"""Multi-process data parallel training under ``torchrun`` (docs/architecture.md, "Beyond one machine").

``torchrun --nproc-per-node N -m extrapolab.train ...`` sets RANK / WORLD_SIZE / LOCAL_RANK; we
initialise the default process group from them (gloo on CPU, nccl on CUDA) and wrap the model in
DistributedDataParallel (``train.strategy=ddp``) or FSDP2 ``fully_shard`` per block + root
(``train.strategy=fsdp``). Checkpoint state goes through ``torch.distributed.checkpoint``'s
full-state-dict API, which is the same call for a plain, DDP or FSDP model (so a run can resume
under another strategy or process count). Only rank 0 writes files.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from ..io import UserError

STRATEGIES = ("ddp", "fsdp")


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False
    joined: bool = False  # in a process group (torchrun, at any world size, world size 1 included)

    @property
    def enabled(self) -> bool:
        return self.world > 1 or self.joined

    @property
    def backend(self) -> str | None:
        """The process group's backend (nccl on CUDA, gloo on the CPU), None outside one."""
        return dist.get_backend() if self.joined and dist.is_initialized() else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few floats over all ranks (one collective)."""
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # [n]
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_gather(self, obj) -> list:
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self, synchronize: bool = True) -> None:
        if self.owns_group and dist.is_initialized():
            if synchronize:  # after a normal finish: no rank tears gloo down mid-collective
                dist.barrier()
            dist.destroy_process_group()


def resolve_device(spec: str, local_rank: int = 0, what: str = "train.device") -> torch.device:
    """auto | cpu | cuda | cuda:N -> a torch.device (``what`` names the setting in errors, e.g. --device)."""
    spec = (spec or "auto").strip()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    flag = what.startswith("--")  # a CLI option (--device cuda) or a config key (train.device=cuda)
    fix = f"{what} cpu" if flag else f"--set {what}=cpu"
    shown = f"{what} {spec}" if flag else f"{what}={spec}"
    if spec == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"{shown} but no CUDA device is visible; use {fix}")
        try:
            dev = torch.device("cuda", local_rank) if spec == "cuda" else torch.device(spec)
        except RuntimeError:
            raise UserError(f"unknown {what} {spec!r}; use auto, cpu, cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"{shown} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                            f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return dev
    raise UserError(f"unknown {what} {spec!r}; use auto, cpu, cuda or cuda:N")


def setup(device_spec: str) -> DistEnv:
    """Join the torchrun process group when launched by torchrun -- at any world size, so that one process runs
    the multi-GPU path's code (DDP, collectives on NCCL or gloo) -- or reuse an initialised one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "TORCHELASTIC_RUN_ID" in os.environ or world > 1
    if not launched and not dist.is_initialized():
        return DistEnv(device=resolve_device(device_spec))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local)
    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        owns = True
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, device, owns, joined=True)


def wrap(model: nn.Module, strategy: str, env: DistEnv) -> nn.Module:
    """DDP or FSDP2 around ``model`` (returned unchanged for a single process)."""
    if strategy not in STRATEGIES:
        raise UserError(f"unknown train.strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if not env.enabled:
        return model
    if strategy == "ddp":
        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def sync_context(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on accumulation micro-steps that are not the last one."""
    if isinstance(model, DDP):
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on CPU; collective under FSDP."""
    return get_state_dict(model, optimizer, options=_FULL)


def restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def model_state(model: nn.Module) -> dict:
    """Full model state dict on CPU (collective under FSDP)."""
    return get_model_state_dict(model, options=_FULL)

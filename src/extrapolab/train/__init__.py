"""Train short (docs/architecture.md): the training loop, checkpoints, resume and torchrun data parallel.

Public API::

    train(cfg, run_dir=None, *, data=None, resume=True, progress=True, stop_after=None) -> dict
    load_model(run_dir, which="best", device="cpu") -> (GPT, RunConfig)
    load_checkpoint(path, cfg=None, *, with_state=True) -> Checkpoint
    lr_at(step, train_cfg) -> float
    placement(device="auto", dtype="auto") -> Placement   # --device / --dtype of every verb; .put / .autocast
    run_placement(train_cfg) -> Placement
"""
from .checkpoint import Checkpoint, checkpoint_path, load_checkpoint, load_model
from .loop import train
from .step import forward_backward
from .optim import build_optimizer, lr_at, param_groups
from .placement import Placement, placement, placement_overrides, run_placement

__all__ = [
    "Checkpoint", "build_optimizer", "checkpoint_path", "forward_backward", "load_checkpoint",
    "Placement", "load_model", "lr_at", "param_groups", "placement", "placement_overrides",
    "run_placement", "train",
]

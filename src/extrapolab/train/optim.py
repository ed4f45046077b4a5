"""AdamW parameter groups and the warmup + cosine learning-rate schedule (docs/architecture.md, "Train short").

Schedule (GPT-2/nanoGPT style, as used by the ALiBi/KERPLE/Sandwich training recipes): for the
0-based optimizer step ``s`` of ``S = train.steps``,

* linear warmup:  lr(s) = lr · (s + 1) / W                      for s < W = warmup_steps
* cosine decay:   lr(s) = m + ½ (1 + cos(π · (s − W) / (S − W))) · (lr − m),   m = min_lr_ratio · lr

so the first step already has a non-zero rate, the peak is reached at s = W − 1 / W, and the last
step ends just above ``m``. Weight decay applies only to 2-D weight matrices of linear layers;
biases, LayerNorm parameters, embeddings (the tied output matrix included) and every parameter of
the positional scheme (T5 buckets, KERPLE r1/r2, learned APE) are not decayed.
``train.pos_lr_scale`` multiplies the learning rate of a relative-bias scheme's few parameters
(T5 buckets, KERPLE kernels; 1 = same rate) so that short CPU budgets let a zero-initialised T5
table move as far as a long run would. Learned APE is an embedding table and keeps the model's
rate (at 20x its ppl at L_tr went from 95 to 160-173 in the quick demo, measured).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig
from ..io import UserError


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based optimizer step ``step``."""
    warm = max(0, int(cfg.warmup_steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    floor = cfg.min_lr_ratio * cfg.lr
    span = max(1, cfg.steps - warm)
    progress = min(1.0, (step - warm) / span)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - floor)


def param_groups(model: nn.Module, weight_decay: float, pos_lr_scale: float = 1.0) -> list[dict]:
    """AdamW groups: decayed linear weights, and everything else (see module docstring); with
    ``pos_lr_scale`` != 1 a relative-bias scheme's parameters get their own group whose learning rate
    is that multiple of the schedule's (``lr_scale``, applied by :func:`set_lr`)."""
    decay, no_decay, pos, seen = [], [], [], set()
    bias_scheme = bool(getattr(getattr(model, "scheme", None), "has_bias", False))  # not learned APE
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            skip = (
                full.startswith("scheme.")
                or isinstance(module, (nn.LayerNorm, nn.Embedding))
                or p_name.endswith("bias")
                or p.ndim < 2
            )
            if full.startswith("scheme.") and bias_scheme and pos_lr_scale != 1.0:
                pos.append(p)
            else:
                (no_decay if skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if pos:
        groups.append({"params": pos, "weight_decay": 0.0, "lr_scale": float(pos_lr_scale)})
    return groups


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    if cfg.lr <= 0:
        raise UserError(f"train.lr must be > 0, got {cfg.lr}; e.g. --set train.lr=1e-3")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UserError(f"train.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    betas = tuple(float(b) for b in cfg.betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"train.betas must be two numbers in [0, 1), got {cfg.betas}; e.g. --set train.betas=[0.9,0.95]")
    if cfg.pos_lr_scale <= 0:
        raise UserError(f"train.pos_lr_scale must be > 0, got {cfg.pos_lr_scale}; 1 = the same rate as the model")
    groups = param_groups(model, cfg.weight_decay, cfg.pos_lr_scale)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)

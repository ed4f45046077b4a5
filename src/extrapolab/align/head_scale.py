"""Head scale for NoPE, found by a search then tuned alone at the target length (Wang et al., ACL 2024,
"Length Generalization of Causal Transformers without Position Encoding", arXiv 2404.12224; official
code github.com/AntNLP/nope_head_scale: ``scripts/run_hs.sh``, ``utils/callbacks.py``).

The step next to Algorithm 1 (:mod:`.algorithm`) for NoPE models: where Algorithm 1 matches one
temperature per layer to a statistic of the training length, the head scale fits λ_h per layer and
head, the attention becoming softmax(λ_h · q·k / sqrt(d)) (tau_h = 1/λ_h, the ``temperature`` hook
of ``positional/headscale.py``):

1. :func:`with_head_scale` turns a NoPE model into the same model with scheme ``nope-headscale``
   (λ = 1: identical outputs).
2. :func:`uniform_scale_search` evaluates one λ shared by every head on a grid at the target length
   and picks the lowest loss (the paper's uniform scale, its initial value for step 3).
3. :func:`tune_head_scale` freezes every other weight and fits the λ alone with the LM loss on
   segments of the target length (the official run: AdamW, lr 0.1, 200 steps, no weight decay),
   clamping λ >= ``min_scale`` = 1 after each step (the "focus" constraint, ``--scale_lb 1``).

A CLI verb (e.g. ``extrapolab align head-scale RUN --length 8192``) would load a NoPE run, call the
three in order on its training split, and save the tuned model as a run of scheme ``nope-headscale``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import positional
from ..io import UserError

#: the uniform scales searched by default (the paper's runs start from 1.6 at 8k tokens)
SCALE_GRID = tuple(round(1.0 + 0.1 * i, 2) for i in range(11))  # 1.0 .. 2.0


def with_head_scale(model, scale: float = 1.0, min_scale: float | None = 1.0):
    """A copy of ``model`` (our GPT with scheme ``none`` or ``nope-headscale``) whose scheme is
    ``nope-headscale`` with every λ = ``scale``; the other weights are copied unchanged."""
    name = model.cfg.scheme
    if name not in ("none", "nope-headscale") or getattr(model.cfg, "arch", "gpt") != "gpt":
        raise UserError(f"the head scale applies to NoPE models (scheme none), got scheme {name!r}")
    out = copy.deepcopy(model)
    params = {"scale": float(scale), "min_scale": min_scale, "layers": model.cfg.layers}
    out.cfg = replace(model.cfg, scheme="nope-headscale", scheme_params={k: v for k, v in params.items() if k != "layers"})
    dev = next(model.parameters()).device
    out.scheme = positional.build("nope-headscale", num_heads=model.cfg.heads, **params).to(dev)
    return out


def _segments(tokens, length: int, n: int, seed: int) -> torch.Tensor:
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size < length + 1:
        raise UserError(f"only {tokens.size} tokens but the target length is {length}; pass a bigger split")
    starts = np.random.default_rng(seed).integers(0, tokens.size - length, size=int(n))
    return torch.as_tensor(np.stack([tokens[s:s + length + 1] for s in starts]).astype(np.int64))  # [n, L+1]


def _loss(model, seg: torch.Tensor) -> torch.Tensor:
    logits = model(seg[:, :-1])  # [b, L, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), seg[:, 1:].reshape(-1))


def uniform_scale_search(model, tokens, length: int, grid: Sequence[float] = SCALE_GRID, *, segments: int = 4,
                         batch_size: int = 1, seed: int = 0) -> dict:
    """LM loss at ``length`` for one λ shared by every head, for each λ in ``grid`` (a nope-headscale
    model, e.g. from :func:`with_head_scale`; its λ are restored after). Returns {"grid", "loss", "best"}."""
    scheme = model.scheme
    if scheme.name != "nope-headscale":
        raise UserError("uniform_scale_search needs a nope-headscale model; call with_head_scale(model) first")
    seg = _segments(tokens, int(length), segments, seed).to(next(model.parameters()).device)
    saved = scheme.scale.detach().clone()
    losses = []
    try:
        with torch.no_grad():
            for lam in grid:
                scheme.scale.fill_(float(lam))
                losses.append(float(np.mean([_loss(model, seg[i:i + batch_size]).item()
                                             for i in range(0, seg.shape[0], batch_size)])))
    finally:
        with torch.no_grad():
            scheme.scale.copy_(saved)
    best = float(grid[int(np.argmin(losses))])
    return {"grid": [float(g) for g in grid], "loss": losses, "best": best, "length": int(length)}


def tune_head_scale(model, tokens, length: int, *, steps: int = 200, lr: float = 0.1, init: float | None = None,
                    min_scale: float | None = 1.0, batch_size: int = 1, seed: int = 0) -> dict:
    """Fit the λ of a nope-headscale model alone at ``length`` (every other weight frozen, restored
    after): AdamW(lr, no weight decay) on the LM loss of segments of ``length`` tokens, λ clamped to
    >= ``min_scale`` after each step. ``init``: start every λ there (the uniform search's best).
    Returns {"scale": [[λ per head] per layer], "loss_before", "loss_after", "steps"}."""
    scheme = model.scheme
    if scheme.name != "nope-headscale":
        raise UserError("tune_head_scale needs a nope-headscale model; call with_head_scale(model) first")
    if int(steps) < 1 or not lr > 0:
        raise UserError(f"tune_head_scale needs steps >= 1 and lr > 0, got steps={steps}, lr={lr}")
    dev = next(model.parameters()).device
    seg = _segments(tokens, int(length), int(steps) * int(batch_size), seed).to(dev)
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(p is scheme.scale)
    with torch.no_grad():
        if init is not None:
            scheme.scale.fill_(float(init))
    opt = torch.optim.AdamW([scheme.scale], lr=float(lr), weight_decay=0.0)
    was_training = model.training
    model.train()
    losses = []
    try:
        for i in range(int(steps)):
            loss = _loss(model, seg[i * batch_size:(i + 1) * batch_size])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():  # the focus constraint (ParamClampCallback: clamp_min_(scale_lb))
                scheme.scale.clamp_(min=min_scale if min_scale is not None else 1e-4)
            losses.append(float(loss.item()))
    finally:
        for p, req in frozen:
            p.requires_grad_(req)
        model.train(was_training)
    k = max(1, min(10, len(losses) // 4))
    return {"scale": scheme.scale.detach().cpu().tolist(), "loss_before": float(np.mean(losses[:k])),
            "loss_after": float(np.mean(losses[-k:])), "steps": int(steps), "length": int(length),
            "lr": float(lr), "min_scale": min_scale, "ppl_after": math.exp(float(np.mean(losses[-k:])))}

"""Attention probabilities for chosen query rows, without ever materialising L x L.

One forward pass (any attention path) records each layer's fused q/k/v projection with a
forward hook on ``Block.qkv``. Rows of the attention matrix are then recomputed for chosen
queries by the model's own reference logits (``model.reference.logits``: rotate -> scale ->
KERPLE weight -> scheme bias + causal/window mask; then / tau and softmax, docs/attention.md),
so memory is O(H · rows · L) per step and there is no second copy of the logit computation.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..model.attention import AttnOptions
from ..model.reference import logits


@contextmanager
def recording(model, modules: str = "qkv") -> Iterator[list]:
    """Record the output of ``blk.<modules>`` for every block during the next forward passes."""
    store: list = [None] * len(model.blocks)
    hooks = []
    for i, blk in enumerate(model.blocks):
        def hook(_m, _inp, out, i=i):
            store[i] = out.detach()

        hooks.append(getattr(blk, modules).register_forward_hook(hook))
    try:
        yield store
    finally:
        for h in hooks:
            h.remove()


def capture_qkv(model, idx: torch.Tensor, opts: AttnOptions | None = None, positions=None,
                inputs_embeds: torch.Tensor | None = None) -> list:
    """Run ``model`` on idx [B, L] (or inputs_embeds [B, L, C]) and return each layer's qkv [B, L, 3C]."""
    opts = opts or AttnOptions(impl="auto")
    if opts.need_probs:  # recomputed row by row here; never ask the model for L x L probabilities
        opts = AttnOptions(**{**opts.__dict__, "need_probs": False})
    with torch.no_grad(), recording(model, "qkv") as store:
        model(idx, positions, inputs_embeds=inputs_embeds, opts=opts)
    return list(store)


def attention_rows(
    model,
    qkv: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    opts: AttnOptions | None = None,
) -> torch.Tensor:
    """Probabilities of query rows ``rows`` (indices into the sequence) at ``layer``: [B, H, n, L]."""
    opts = opts or AttnOptions()
    B, L, C3 = qkv.shape
    H = model.cfg.heads
    D = C3 // 3 // H
    q, k, _ = qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
    q = q[:, :, rows]  # [B, H, n, D]
    qpos = positions[rows]
    q, k = model.scheme.rotate(q, k, qpos, positions)
    lg = logits(q, k, qpos, positions, model.scheme, layer, opts.window)  # [B, H, n, L]
    return torch.softmax(lg.float() / opts.tau(layer), dim=-1)  # [B, H, n, L]


def iter_row_blocks(L: int, rows: torch.Tensor | None = None, block: int = 256):
    """Query-row index blocks covering ``rows`` (default all L rows)."""
    rows = torch.arange(L) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    for s in range(0, rows.numel(), max(1, int(block))):
        yield rows[s:s + block]

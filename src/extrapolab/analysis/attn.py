"""Attention probabilities for chosen query rows, without ever materialising L x L.

One forward pass (any attention path) records each layer's fused q/k/v projection with a
forward hook on ``Block.qkv`` (and the layer's attention input, ``Block.ln1``, where a layer's
scheme computes positions from it: FoX). Rows of the attention matrix are then recomputed for
chosen queries by the model's own reference computation (``model.reference.probabilities``: the
layer's QK-norm, scheme, rotate -> scale -> kernel -> bias -> positions from content -> mask -> score hook
-> selection -> temperatures (SSMax's too) -> softmax with the layer's attention sinks or the scheme's
normalisation, docs/attention.md), so memory is O(H · rows · L) per step and there is no second copy of the
logit computation. A scheme that accumulates a selection (selective attention) streams every query up to the
last row, 64 at a time.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from ..io import UserError
from ..model.attention import AttnOptions
from ..model.reference import probabilities


@dataclass
class LayerCapture:
    """A layer's qkv [B, L, 3C] and its attention input [B, L, C] (for positions from content)."""

    qkv: torch.Tensor
    hidden: torch.Tensor


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
    """Run ``model`` on idx [B, L] (or inputs_embeds [B, L, C]) and return each layer's qkv [B, L, 3C]
    (a :class:`LayerCapture` with the layer input too where the layer's scheme needs it)."""
    opts = opts or AttnOptions(impl="auto")
    if opts.need_probs:  # recomputed row by row here; never ask the model for L x L probabilities
        opts = AttnOptions(**{**opts.__dict__, "need_probs": False})
    content = [model.scheme.for_layer(i).has_content for i in range(len(model.blocks))]
    with torch.no_grad(), recording(model, "qkv") as store, recording(model, "ln1") as hidden:
        model(idx, positions, inputs_embeds=inputs_embeds, opts=opts)
    return [LayerCapture(x, h) if c else x for x, h, c in zip(store, hidden, content)]


def attention_rows(
    model,
    qkv: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    opts: AttnOptions | None = None,
) -> torch.Tensor:
    """Probabilities of query rows ``rows`` (indices into the sequence) at ``layer``: [B, H, n, L].
    ``qkv``: what :func:`capture_qkv` returned for that layer."""
    opts = opts or AttnOptions()
    hidden = None
    if isinstance(qkv, LayerCapture):
        qkv, hidden = qkv.qkv, qkv.hidden
    scheme = model.scheme.for_layer(layer)
    B, L, C3 = qkv.shape
    H = model.cfg.heads
    D = C3 // 3 // H
    q, k, _ = qkv.view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
    blocks = getattr(model, "blocks", None)
    extras = None if blocks is None else getattr(blocks[layer], "extras", None)  # attention options (model/attn_extras.py)
    kw = {} if extras is None else extras.attend_kwargs()  # sinks, SSMax
    if extras is not None:
        q, k = extras.normalize(q, k)  # QK-norm, before the rotation as in the block
    every = scheme.accumulates  # selective attention: each row needs the queries before it
    if not every:
        q = q[:, :, rows]  # [B, H, n, D]
    qpos = positions if every else positions[rows]
    q, k = scheme.rotate(q, k, qpos, positions)
    content = None
    if scheme.has_content:
        if hidden is None:
            raise UserError(f"layer {layer}'s scheme {scheme.name!r} computes positions from its input; "
                            "pass what capture_qkv returned (it records that input)")
        p = scheme.content_positions(hidden, layer)  # [B, H, L]
        content = (p, p) if every else (p[..., rows], p)
    return probabilities(q, k, qpos, positions, scheme, layer, opts.window, opts.tau(layer), content=content,
                         rows=rows if every else None, **kw).float()  # [B, H, n, L]


def iter_row_blocks(L: int, rows: torch.Tensor | None = None, block: int = 256):
    """Query-row index blocks covering ``rows`` (default all L rows)."""
    rows = torch.arange(L) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    for s in range(0, rows.numel(), max(1, int(block))):
        yield rows[s:s + block]

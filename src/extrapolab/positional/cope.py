"""CoPE, contextual position encoding (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position
Encoding: Learning to Count What's Important", arXiv 2405.18719, §3 eqs. 3-5).

Positions count the keys a query finds relevant, through gates on its own logit row:

    g_ij = σ(q_i·k_j / sqrt(d))                          gates (eq. 3; masked keys: 0)
    p_ij = Σ_{t=j..i} g_it                               reverse cumulative sum (eq. 4), clipped at npos_max - 1
    e[p] = (p - ⌊p⌋)·e[⌈p⌉] + (1 - (p - ⌊p⌋))·e[⌊p⌋]     interpolated position embeddings (eq. 5)
    l_ij = (q_i·k_j + q_i·e[p_ij]) / sqrt(d)

exactly as the official code (github.com/facebookresearch/RAM, ``projects/cope/src/cope/
context_position.py``, ``ContextPosSelfAttn.forward``, default options, read for this file): one
embedding table ``pos_emb`` [head_dim, npos] per layer shared by the heads, initialised to zeros;
npos = block_size + 1 unless ``--cope-npos`` (here ``npos_max``, default L_tr + 1); q·e[p] is
added before the division by sqrt(d); the interpolation weight p - ⌊p⌋ carries the gradient.

p_ij depends on every gate between key j and query i, so CoPE runs through the score-level hook
``scores`` on the reference path (query blocks, never L x L beyond one block): no fused kernel can
compute it (``reference_only``). The KV cache keeps k; p is recomputed from each query's row.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import PositionalScheme, ScoreBlock, SchemeError
from .registry import register


@register
class CoPE(PositionalScheme):
    name = "cope"
    kind = "score"
    relative = True  # positions count gated keys between n and m: no absolute position enters
    paper = "Golovneva et al. 2024 (CoPE) §3 eqs. 3-5: p_ij = Σ_{t=j..i} σ(q_i·k_t), interpolated e[p]"
    summary = "contextual positions: counts of σ(q·k) gates along each row, interpolated embeddings"
    reference_only = ("CoPE's position p_ij sums the gates σ(q_i·k_t) of every key between j and i, so each "
                      "logit depends on its whole row: reference path (query blocks)")
    no_trf = "CoPE's positions are counts of content gates, not distances: no formula for the TRF"

    def __init__(self, num_heads: int, layers: int = 4, head_dim: int = 32, npos_max: int | None = None,
                 original_length: int = 512) -> None:
        super().__init__(num_heads)
        if int(layers) < 1 or int(head_dim) < 1:
            raise SchemeError(f"cope needs layers >= 1 and head_dim >= 1, got layers={layers}, head_dim={head_dim}")
        npos = int(original_length) + 1 if npos_max is None else int(npos_max)
        if npos < 2:
            raise SchemeError(f"cope npos_max must be >= 2, got {npos_max}; e.g. npos_max=64")
        self.layers, self.head_dim, self.npos = int(layers), int(head_dim), npos
        self.npos_max, self.original_length = npos_max, int(original_length)
        self.emb = nn.Parameter(torch.zeros(self.layers, self.head_dim, self.npos))  # [layers, D, npos]

    def positions(self, block: ScoreBlock) -> torch.Tensor:
        """p [B, H, bq, bk]: p_ij = Σ_{t >= j} g_it over visible keys, clipped at npos - 1 (eq. 4)."""
        gates = torch.sigmoid(block.qk) * block.visible  # [B, H, bq, bk]; masked keys count 0
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos - 1)

    def scores(self, logits, block):
        if block.q.shape[-1] != self.head_dim:
            raise SchemeError(f"cope was built for head_dim={self.head_dim} but attention has {block.q.shape[-1]}")
        if not 0 <= block.layer < self.layers:
            raise SchemeError(f"cope has embeddings for {self.layers} layers but layer {block.layer} attends; "
                              "build it with layers = the model's depth (GPT passes model.layers)")
        p = self.positions(block)  # [B, H, bq, bk]
        fl = p.detach().floor()
        idx = fl.long()  # [B, H, bq, bk]
        up = (idx + 1).clamp(max=self.npos - 1)  # ⌈p⌉ (its weight is 0 when p is an integer)
        e = torch.matmul(block.q, self.emb[block.layer].to(block.q.dtype))  # [B, H, bq, npos] q·e[n]
        w = p - fl  # the interpolation weight carries the gradient
        pos_logits = torch.lerp(e.gather(-1, idx), e.gather(-1, up), w.to(e.dtype))  # [B, H, bq, bk]
        return logits + pos_logits.to(logits.dtype) / math.sqrt(block.q.shape[-1])

    def options(self):
        return {"layers": self.layers, "head_dim": self.head_dim, "npos_max": self.npos_max,
                "original_length": self.original_length}

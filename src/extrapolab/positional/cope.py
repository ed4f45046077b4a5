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

    def scores(self, logits, block):
        if block.q.shape[-1] != self.head_dim:
            raise SchemeError(f"cope was built for head_dim={self.head_dim} but attention has {block.q.shape[-1]}")
        if not 0 <= block.layer < self.layers:
            raise SchemeError(f"cope has embeddings for {self.layers} layers but layer {block.layer} attends; "
                              "build it with layers = the model's depth (GPT passes model.layers)")
        # gates σ(q·k/√d), 0 for masked keys: σ(-inf) = 0 (logits are q·k/√d, -inf where masked, without a bias)
        gate_logits = logits if block.bias is None else block.qk.masked_fill(~block.visible, -math.inf)
        # p <= the number of keys, so a block of bk keys reads e[0 .. min(npos - 1, bk)] only
        emb = self.emb[block.layer, :, :min(self.npos, logits.shape[-1] + 1)].to(block.q.dtype)  # [D, n]
        e = torch.matmul(block.q, emb) / math.sqrt(self.head_dim)  # [B, H, bq, n]
        return logits + CoPELogits.apply(gate_logits, e, self.npos).to(logits.dtype)  # [B, H, bq, bk]


class CoPELogits(torch.autograd.Function):
    """q·e[p_ij]/√d of eqs. 4-5 from the gate logits l [B, H, bq, bk] and e = q·emb/√d [B, H, bq, npos],
    with a hand-written backward: the same gradients as autograd through the official forward (tests/
    test_cope.py), without its full-size temporaries (flips, slice and gather backward buffers).

    p = clip(Σ_{t>=j} σ(l_t), npos - 1); out = e[⌊p⌋] + (p - ⌊p⌋)·(e[⌊p⌋+1] - e[⌊p⌋]).
    Backward: de scatters g·(1-w), g·w at ⌊p⌋, ⌊p⌋+1; dp = g·(e[⌊p⌋+1] - e[⌊p⌋]) where p is not
    clipped; dσ_t = Σ_{j<=t} dp_j (the transpose of the reverse sum); dl = dσ·σ(1 - σ).
    """

    @staticmethod
    def forward(ctx, logits, e, npos: int):
        g, p = positions(logits, npos)  # [B, H, bq, bk] gates and positions, fp32 at least
        ew = e.to(p.dtype)  # [B, H, bq, npos]
        idx = p.long()  # ⌊p⌋ (p >= 0)
        up = torch.cat([ew[..., 1:], ew[..., -1:]], -1)  # e[⌊p⌋ + 1], the last one repeated
        e0 = ew.gather(-1, idx)
        out = up.gather(-1, idx).sub_(e0)  # e[⌊p⌋+1] - e[⌊p⌋]
        ctx.save_for_backward(g, p, e)
        ctx.npos, ctx.dtype = npos, logits.dtype
        return out.mul_(p - idx).add_(e0)

    @staticmethod
    def backward(ctx, grad):
        g, p, e = ctx.saved_tensors
        npos = ctx.npos
        ew, grad = e.to(p.dtype), grad.to(p.dtype)
        idx = p.long()
        w = p - idx
        up = torch.cat([ew[..., 1:], ew[..., -1:]], -1)
        de = torch.zeros_like(ew).scatter_add_(-1, idx, grad * (1 - w))  # [B, H, bq, npos]
        dup = torch.zeros_like(ew).scatter_add_(-1, idx, grad * w)
        de[..., 1:] += dup[..., :-1]
        de[..., -1] += dup[..., -1]  # the repeated last entry
        dp = up.gather(-1, idx).sub_(ew.gather(-1, idx)).mul_(grad)  # [B, H, bq, bk]
        dp = dp.masked_fill_(p >= npos - 1, 0.0)  # clipped positions pass no gradient
        dlogits = dp.cumsum(-1).mul_(g).mul_(1 - g)  # Σ_{j <= t} dp_j · σ'(l_t)
        return dlogits.to(ctx.dtype), de.to(e.dtype), None


def positions(logits: torch.Tensor, npos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, p): gates σ(l) and CoPE's positions p_j = min(Σ_{t >= j} g_t, npos - 1) of eq. 4, both [B, H, bq, bk],
    in fp32 where the logits are 16-bit (fp64 stays fp64). The reverse cumulative sum is computed directly
    (flip, cumsum, flip, as the official code does): the difference of two running sums, total - prefix + g,
    loses the small positions to cancellation -- in bf16 up to 2.0 positions at 600 keys and 5.5 at 2,048
    (CPU autocast keeps cumsum in bf16), which tests/test_cope.py checks against fp64."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    g = torch.sigmoid(work)  # [B, H, bq, bk]
    p = g.flip(-1).cumsum(-1).flip(-1).clamp_(max=npos - 1)  # Σ_{t >= j} g_t
    return g, p

    def options(self):
        return {"layers": self.layers, "head_dim": self.head_dim, "npos_max": self.npos_max,
                "original_length": self.original_length}

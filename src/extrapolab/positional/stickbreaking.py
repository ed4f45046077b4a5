"""Stick-breaking attention (Tan, Shen, Yang, Courville, Panda, ICLR 2025, "Scaling Stick-Breaking
Attention: An Efficient Implementation and In-depth Study", arXiv 2410.17980, §2, the stick-breaking
process that replaces softmax):

    β_ij = σ(z_ij),   z_ij = q_i·k_j / sqrt(d)
    A_ij = β_ij · Π_{j<k<i} (1 − β_ik)            for keys j < i (the nearest key breaks the stick first)
    o_i  = Σ_j A_ij v_j + (1 − Σ_j A_ij) · v_i     the remainder goes to the current token

No positional encoding: recency comes from the product (a key's weight shrinks with every key between
it and the query). Exactly as the reference of the official code (github.com/shawntan/stickbreaking-
attention, ``stickbreaking_attention/sb_ref.py`` ``stickbreaking`` and ``tests/test_attn.py``
``ref_fwd``, read for this file): logits in fp32, log β = logsigmoid(z), log(1 − β) = logsigmoid(−z)
= −softplus(z), A = exp(log β + Σ_{j<k<i} log(1 − β_ik)); with ``attend_current=False`` (their
default) the diagonal is masked out of the stick (mask = triu(0)) and the remainder 1 − Σ_j A_ij is
added to v_i (``o = o + rem[..., None] * v``); ``attend_current=True`` lets the current token take
part (mask = triu(1), product over j < k <= i) and still adds the remainder to v_i.

Here the weights come from the ``normalize`` hook on the reference path (query blocks, never L x L
beyond one block; ``reference_only`` says why no fused kernel runs it): the remainder is put on the
query's own column, so p·v is the formula above; every step is in log space (the sum over k is a
reverse cumulative sum along the row), so no product underflows before the final exp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import PositionalScheme
from .registry import register


@register
class StickBreaking(PositionalScheme):
    name = "stick-breaking"
    kind = "score"
    relative = True  # no positions at all: only the order of the keys enters, through the product
    paper = "Tan et al. 2025 (Scaling Stick-Breaking Attention, ICLR) §2: A_ij = σ(z_ij) Π_{j<k<i} (1 − σ(z_ik))"
    summary = "stick-breaking weights σ(q·k) Π (1 − σ) instead of softmax, remainder to the current token"
    reference_only = ("stick-breaking replaces softmax by a product over every key between key and query (a reverse "
                      "cumulative sum along the row), which no fused softmax kernel computes: reference path")
    replaces_softmax = "stick-breaking weights σ(z) Π (1 − σ)"
    no_trf = "stick-breaking has no positional bias: recency comes from its product of content gates, no TRF formula"

    def __init__(self, num_heads: int, attend_current: bool = False) -> None:
        super().__init__(num_heads)
        self.attend_current = bool(attend_current)

    def normalize(self, logits, block):
        """Weights [B, H, bq, bk] from the logits z (after the temperature); masked keys get 0."""
        z = logits if logits.dtype == torch.float64 else logits.float()
        stick = block.visible & (block.k_pos[None] <= block.q_pos[:, None] - (0 if self.attend_current else 1))
        zf = z.masked_fill(~stick, 0.0)  # finite everywhere: masked entries are dropped below
        log_beta = F.logsigmoid(zf).masked_fill(~stick, -torch.inf)  # [B, H, bq, bk] log β
        log_rest = F.logsigmoid(-zf).masked_fill(~stick, 0.0)  # log(1 − β), 0 off the stick
        suffix = log_rest.flip(-1).cumsum(-1).flip(-1)  # Σ_{k >= j} log(1 − β_ik)
        later = F.pad(suffix[..., 1:], (0, 1))  # Σ_{k > j}: keys between j and the query (none are later)
        A = (log_beta + later).exp()  # [B, H, bq, bk]
        own = (block.q_pos[:, None] == block.k_pos[None]).to(A.dtype)  # [bq, bk] the query's own column
        return A + (1.0 - A.sum(-1, keepdim=True)) * own

    def options(self):
        return {"attend_current": self.attend_current}

"""Blockwise causal attention at test time (Sun et al., ACL 2023, "A Length-Extrapolatable
Transformer", arXiv 2212.10554, §3.3), an evaluation option for every scheme (``eval.bca``).

§3.3: with pre-training length l, the queries are divided into blocks of l/2 tokens and each query
attends to the keys of its own block (causally) and of the previous block, so it sees between l/2
and l keys, never more than in training; the keys and values of the previous block are reused, which
is how context reaches further than one window. The paper uses it with xPos; nothing in it is
specific to one scheme, so here it wraps any trained GPT.

:class:`BlockwiseCausal` runs one block at a time at its absolute positions with a KV cache
(``model.gpt.KVCache``) seeded with the previous block's cached keys/values of every layer. Those were
computed when the previous block was processed (under the same rule), so the result equals a
parallel forward whose every layer masks the logits with the BCA pattern (tested against that dense
mask on the reference path). For L <= 2 x block the pattern is plain causal attention, so lengths up
to L_tr run as one forward. Cost O(L x block) instead of O(L^2).
"""
from __future__ import annotations

import torch
from torch import nn

from ..io import UserError
from ..model.attention import AttnOptions
from ..model.gpt import KVCache


def block_size(block: int, train_length: int) -> int:
    """``eval.bca_block`` (0 = L_tr / 2, the paper's choice) -> block size >= 1, or a UserError."""
    b = int(block) or int(train_length) // 2
    if b < 1:
        raise UserError(f"eval.bca_block must be >= 1 (0 = L_tr / 2), got {block} with L_tr = {train_length}")
    return b


def bca_mask(positions: torch.Tensor, block: int) -> torch.Tensor:
    """[L, L] bool, True where query i may attend key j: j <= i and block(j) >= block(i) - 1, blocks of
    ``block`` consecutive entries counted from the first (the dense form of :class:`BlockwiseCausal`)."""
    idx = torch.arange(positions.numel(), device=positions.device)
    blk = idx // block
    causal = positions[:, None] >= positions[None, :]  # [L, L]
    return causal & (blk[:, None] - blk[None, :] <= 1)


class BlockwiseCausal(nn.Module):
    """``model`` evaluated with blockwise causal attention of ``block``-token blocks (xPos §3.3).

    Called like the GPT (``idx [B, L]``, optional ``positions [L]``, ``opts``) -> logits [B, L, V];
    what the protocols read besides (``cfg``, ``check_opts``, parameters) is the wrapped model's.
    """

    def __init__(self, model: nn.Module, block: int) -> None:
        super().__init__()
        if not hasattr(model, "blocks"):
            raise UserError(f"eval.bca needs an extrapolab GPT (per-layer KV cache); got {type(model).__name__}")
        self.model, self.block = model, int(block)
        self.cfg = getattr(model, "cfg", None)

    def check_opts(self, opts: AttnOptions) -> None:
        self.model.check_opts(opts)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None, *,
                opts: AttnOptions | None = None, **kw) -> torch.Tensor:
        if kw:
            raise UserError(f"blockwise causal evaluation returns logits only, not {sorted(kw)}; "
                            "run that analysis without eval.bca")
        L = idx.shape[1]
        if positions is None:
            positions = torch.arange(L, device=idx.device)
        if any(self.model.scheme.for_layer(i).accumulates for i in range(len(self.model.blocks))):
            raise UserError("eval.bca restarts the keys at every block, but selective attention's selection spares "
                            "the first key it sees (the sequence's first token); evaluate it without eval.bca")
        if L <= 2 * self.block:  # every key a query may see is in its own or the previous block
            return self.model(idx, positions=positions, opts=opts)
        layers, prev, outs = len(self.model.blocks), None, []
        for s in range(0, L, self.block):
            e = min(L, s + self.block)
            cache = KVCache(layers)
            if prev is not None:  # the previous block's keys/values (and positions from content: FoX), as computed
                for layer, (k, v, p, c) in enumerate(prev):  # when it was processed
                    cache.extend(layer, k, v, p, c)
            outs.append(self.model(idx[:, s:e], positions=positions[s:e], opts=opts, cache=cache))  # [B, e-s, V]
            n = e - s
            prev = [(cache.k[i][:, :, -n:], cache.v[i][:, :, -n:], cache.pos[i][-n:],
                     None if cache.content[i] is None else cache.content[i][..., -n:]) for i in range(layers)]
        return torch.cat(outs, dim=1)  # [B, L, V]

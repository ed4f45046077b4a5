"""Selective attention (Leviathan, Kalman, Matias, ICLR 2025, "Selective Attention Improves Transformer", arXiv
2410.02703, §3, the listing of §3.2): a token may mask an earlier token for every later query, with no new
parameters. From the logits l⁰ of one head (head 0), after the causal mask:

    S = ReLU(l⁰)                      only positive selection
    S[:, first] = 0                   the first token (<BOS>) is never masked
    S[i, i] = 0                       a token does not mask itself
    F[i, j] = Σ_{k<i} S[k, j]         accumulated, strictly from the next token on ("roll" then "cumsum")
    l_h ← l_h − F  for every head h,  then softmax

checked against x-transformers' ``selective_attn`` (``x_transformers/attend.py``, read for this file: ReLU of
the first head's masked logits, the first column zeroed, the diagonal zeroed, rows shifted down by one, cumsum
over queries, subtracted from every head before the attention sink and the softmax; it refuses a KV cache).

F needs every earlier query's row of l⁰, so no fused kernel computes it: the scheme runs on the reference
path (``reference_only``), in query blocks, through the ``accumulate`` hook: it returns S of a block and the
reference path keeps F per key across blocks, in order, and across calls in the KV cache (``has_content``:
each key's F sits where FoX keeps its positions; a new token's is 0), which is the paper's own inference
algorithm (§4, F kept per token in the context buffer; we do not prune it). So cached decoding equals the
parallel forward. "first" is the first key a call sees: the sequence's first token, unless a windowed KV
cache has evicted it.

The positions come from a base scheme (``base=``: any registered NoPE, rotary or bias scheme without positions
from content, default ``rotary``; ``base_params=``), whose rotation and bias enter l⁰ as they enter every
head; ``head`` picks the selecting head (the paper's 0).
"""
from __future__ import annotations

import torch

from .base import Delegating, PositionalScheme, SchemeError
from .registry import REGISTRY, build, register, scheme_params

#: model sizes passed on to a base scheme that takes them
_SIZES = ("dim", "layers", "head_dim", "init_std", "original_length")


@register
class Selective(Delegating, PositionalScheme):
    name = "selective"
    kind = "score"
    has_content = True  # each key's accumulated selection F, carried by the KV cache
    paper = ("Leviathan et al. 2025 (Selective Attention, ICLR), arXiv 2410.02703 §3: l − F, F = Σ_{k<i} "
             "ReLU(l⁰_kj), head 0's logits")
    summary = "tokens mask earlier tokens for later queries: logits minus the cumulated ReLU of head 0's logits"
    reference_only = ("selective attention subtracts F[i, j] = Σ_{k<i} ReLU(l⁰_kj), which needs every earlier "
                      "query's logits of head 0: no fused kernel computes it; reference path")
    no_trf = "selective attention's mask depends on the text (head 0's logits), not on the distance: no formula for the TRF"

    def __init__(self, num_heads: int, base: str = "rotary", base_params: dict | None = None, head: int = 0,
                 dim: int = 128, layers: int = 4, head_dim: int = 32, init_std: float = 0.02,
                 original_length: int = 512) -> None:
        super().__init__(num_heads)
        if not 0 <= int(head) < self.num_heads:
            raise SchemeError(f"selective head must be one of 0..{self.num_heads - 1} (the selecting head), got {head}")
        self.base_name, self.base_params, self.head = str(base), dict(base_params or {}), int(head)
        cls = REGISTRY.get(self.base_name)
        if cls is None or cls.kind not in ("none", "rotary", "bias") or cls.has_weight or cls.has_content \
                or cls.reference_only:
            raise SchemeError(f"selective base={self.base_name!r} must be a registered NoPE, rotary or bias scheme "
                              "without positions from content, score hooks or a multiplicative kernel, e.g. rotary, "
                              "none or alibi")
        self._sizes = {"dim": int(dim), "layers": int(layers), "head_dim": int(head_dim), "init_std": float(init_std),
                       "original_length": int(original_length)}
        accepted = scheme_params(cls)
        extra = {k: v for k, v in self._sizes.items() if k in accepted and k not in self.base_params}
        self.base = build(self.base_name, num_heads, **self.base_params, **extra)
        if self.base.second_pass() is not None:
            raise SchemeError(f"selective base={self.base_name!r} scores far keys in a second pass; pick a one-pass scheme")
        self.relative = self.base.relative  # F is a function of the logits, translation invariant with them

    # ---- delegated to the base scheme --------------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        return self.base.has_bias

    def bias(self, q_pos, k_pos, layer=0):
        return self.base.bias(q_pos, k_pos, layer) if self.base.has_bias else None

    # ---- selective attention ------------------------------------------------------------------------
    def content_positions(self, x, layer=0, past=None):
        """Each new token's accumulated selection: 0 (no later query has seen it yet), [B, H, L] float64."""
        return torch.zeros(x.shape[0], self.num_heads, x.shape[1], dtype=torch.float64, device=x.device)

    def accumulate(self, logits, block):
        S = torch.relu(logits[:, self.head])  # [B, bq, bk]: masked entries (-inf) give 0
        keep = (block.k_pos != block.k_pos[0])[None, :] & (block.q_pos[:, None] != block.k_pos[None, :])  # [bq, bk]
        return S * keep.to(S.dtype)  # not the first token, not the query itself

    def options(self):
        return {"base": self.base_name, "base_params": self.base_params, "head": self.head, **self._sizes}

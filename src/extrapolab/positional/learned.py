"""learned APE: one trained row per position up to L_tr (ALiBi §2.2, footnote 4).

It has no embedding beyond its table, so it refuses longer inputs with a clear error instead of
silently wrapping or extrapolating. ``std``: the table's init std (GPT-2: 0.02; fairseq's
``PositionalEmbedding`` uses dim^-0.5, matching its token embeddings; the GPT picks it from
``model.embed_scale`` in ``build_scheme``).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import PositionalScheme, SchemeError
from .positions import top
from .registry import register


@register
class LearnedAPE(PositionalScheme):
    name = "learned"
    kind = "absolute"
    relative = False
    paper = "ALiBi §2.2 footnote 4 (no way to encode positions >= L)"
    summary = "trained absolute embedding table of max_length rows; refuses longer inputs"

    def __init__(self, num_heads: int, max_length: int = 512, dim: int = 0, std: float = 0.02) -> None:
        super().__init__(num_heads)
        if int(max_length) < 1:
            raise SchemeError(f"learned APE max_length must be >= 1, got {max_length}")
        self.max_length = int(max_length)
        if not std > 0:
            raise SchemeError(f"learned APE std must be > 0, got {std}")
        self.dim = int(dim)
        self.std = float(std)
        self.table = nn.Parameter(torch.zeros(self.max_length, max(self.dim, 1)))
        nn.init.normal_(self.table, std=self.std)

    def ensure_dim(self, dim: int) -> None:
        if self.table.shape[1] != dim:
            self.dim = dim
            self.table = nn.Parameter(torch.randn(self.max_length, dim) * self.std)

    def check_length(self, length: int) -> None:
        if length > self.max_length:
            raise SchemeError(
                f"learned APE has no embedding for positions >= {self.max_length} "
                f"(asked for {length}); evaluate at lengths <= {self.max_length} or use a relative scheme"
            )

    def embed(self, positions, dim):
        if top(positions) > self.max_length:
            self.check_length(top(positions))
        return self.table[positions]  # [L, dim]

    def options(self):
        return {"max_length": self.max_length, "std": self.std}

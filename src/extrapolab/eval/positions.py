"""Evaluation at randomized positions (Ruoss et al., ACL 2023, arXiv 2305.16843; positional/randomized.py).

Their evaluation (google-deepmind/randomized_positional_encodings, ``range_evaluation.py``) calls the
model with a fresh rng key for every batch, so a model trained at random positions is also scored at
sorted positions drawn from [0, L_max), one draw per batch. :class:`RandomPositions` does that for
the protocols that feed whole windows (E1-E3); a length above L_max cannot be drawn and is recorded
as an error line. Each (protocol, length) gets its own seeded stream, so results are reproducible.
"""
from __future__ import annotations

import torch
from torch import nn

from ..io import UserError
from ..model.attention import AttnOptions
from ..positional.randomized import STREAM_EVAL, PositionSampler


class RandomPositions(nn.Module):
    """``model`` called at sorted random positions from [0, max_length), one draw per forward."""

    def __init__(self, model: nn.Module, max_length: int, seed: int = 0) -> None:
        super().__init__()
        self.model = model
        self.sampler = PositionSampler(max_length, seed, STREAM_EVAL)
        self.cfg = getattr(model, "cfg", None)

    def check_opts(self, opts: AttnOptions) -> None:
        self.model.check_opts(opts)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None, **kw) -> torch.Tensor:
        if positions is not None:
            raise UserError("evaluation at random positions draws its own positions; pass none "
                            "(or use eval.positions=contiguous)")
        return self.model(idx, positions=self.sampler.draw(idx.shape[1], idx.device), **kw)  # [B, L, V]

"""Baselines of thesis Table 6.1/6.2 and the model factory for the regular-language benchmark.

* ``TransformerClassifier``: the vanilla causal transformer — ``model.gpt.GPT`` (pre-LN, any
  registered positional scheme) read out at the last position by a linear class head. The
  thesis uses Transformer-XL relative embeddings, which extrapolab does not implement; the
  default here is the closest registered relative scheme, learned T5 buckets (``scheme="t5"``).
* ``RecurrentClassifier``: an LSTM or an Elman RNN (tanh), last hidden state -> class head.
* ``build_model(kind, vocab_size, num_classes, **opts)`` builds any of them (and RegularGPT).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..io import UserError
from ..model.gpt import GPT, ModelConfig
from .regular_gpt import RegularGPT, RegularGPTConfig


class TransformerClassifier(nn.Module):
    kind = "transformer"

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 64, heads: int = 8,
                 layers: int = 4, scheme: str = "t5", scheme_params: dict | None = None,
                 train_length: int = 64) -> None:
        super().__init__()
        cfg = ModelConfig(vocab_size=vocab_size, layers=layers, heads=heads, dim=dim,
                          scheme=scheme, scheme_params=dict(scheme_params or {}),
                          train_length=train_length, tie_weights=False)
        self.gpt = GPT(cfg)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` [T]: 0..T-1 by default; sorted random ones for randomized positions."""
        h = self.gpt(idx, positions, return_hidden=True)["hidden"]  # [B, T, D] after the final LayerNorm
        return self.head(h[:, -1])  # [B, classes]

    def forward_prefixes(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal, so position i sees exactly the prefix idx[:, :i+1]: [B, T] -> [B, T, classes]."""
        return self.head(self.gpt(idx, positions, return_hidden=True)["hidden"])

    def constrain_(self) -> None:
        self.gpt.constrain_()


class RecurrentClassifier(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, hidden: int = 128, cell: str = "lstm",
                 layers: int = 1) -> None:
        super().__init__()
        if cell not in ("lstm", "rnn"):
            raise UserError(f"recurrent cell must be lstm or rnn, got {cell!r}")
        self.kind = cell
        self.emb = nn.Embedding(vocab_size, hidden)
        rnn_cls = nn.LSTM if cell == "lstm" else nn.RNN
        self.rnn = rnn_cls(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))  # [B, T, hidden]
        return self.head(out[:, -1])  # [B, classes]

    def forward_prefixes(self, idx: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, classes], the hidden state after every prefix."""
        out, _ = self.rnn(self.emb(idx))  # [B, T, hidden]
        return self.head(out)


MODEL_KINDS = ("regulargpt", "transformer", "lstm", "rnn")


def build_model(kind: str, vocab_size: int, num_classes: int, **opts) -> nn.Module:
    """kind in MODEL_KINDS; ``opts`` are the chosen model's constructor options."""
    try:
        if kind == "regulargpt":
            return RegularGPT(RegularGPTConfig(vocab_size=vocab_size, num_classes=num_classes, **opts))
        if kind == "transformer":
            return TransformerClassifier(vocab_size, num_classes, **opts)
        if kind in ("lstm", "rnn"):
            return RecurrentClassifier(vocab_size, num_classes, cell=kind, **opts)
    except TypeError as e:
        raise UserError(f"bad option for model {kind!r}: {e}; see `extrapolab regular train --help`") from None
    raise UserError(f"unknown model kind {kind!r}; valid: {', '.join(MODEL_KINDS)}")


def classify_loss(model: nn.Module, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx), labels)

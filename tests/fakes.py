"""Tiny fake LMs with the GPT call signature whose perplexities are known by hand.

They check what each protocol scores: :class:`Bigram` is context-independent beyond one token (any
protocol that scores each token once gives the stream's bigram ppl); :class:`ContextProbe` makes
each token's NLL reveal how many tokens of context it was given; :class:`OOMOnBatch` raises an
out-of-memory error above a batch size, to exercise the batch-1 fallback.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class Bigram(nn.Module):
    """p(next | context) = P[last token, next]: context-independent beyond one token."""

    def __init__(self, vocab: int = 11, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.logp = nn.Parameter(torch.log_softmax(torch.randn(vocab, vocab, generator=g), -1),
                                 requires_grad=False)  # [V, V]
        self.calls: list[tuple[int, ...]] = []

    def forward(self, idx, positions=None, opts=None, **_):
        self.calls.append(tuple(idx.shape))
        return self.logp[idx]  # [B, L, V]

    def stream_nll(self, tokens: np.ndarray) -> np.ndarray:
        """-log P[x_{t-1}, x_t] for t = 1 .. n-1 (float64)."""
        lp = self.logp.detach().double().numpy()
        return -lp[tokens[:-1], tokens[1:]]


class ContextProbe(nn.Module):
    """For a stream of ids 0,1,2,... (so the true next id is idx + 1): the true next id y gets
    logit log(c) + a[y], every other id logit 0, where c is the number of tokens the position
    sees (i+1, or min(i+1, opts.window)). So NLL(y, c) = -log(c e^a / (c e^a + V - 1)) tells which
    context each protocol gave each scored token. Records the inputs it was called with."""

    def __init__(self, vocab: int = 2000, a: np.ndarray | None = None) -> None:
        super().__init__()
        self.vocab = vocab
        a = np.zeros(vocab) if a is None else a
        self.a = torch.as_tensor(a, dtype=torch.float64)  # [V]
        self.inputs: list[np.ndarray] = []

    def forward(self, idx, positions=None, opts=None, **_):
        B, L = idx.shape
        self.inputs.append(idx.cpu().numpy().copy())
        c = torch.arange(1, L + 1, dtype=torch.float64)  # [L]
        if opts is not None and opts.window is not None:
            c = c.clamp(max=opts.window)
        y = (idx + 1) % self.vocab  # [B, L]
        logits = torch.zeros(B, L, self.vocab, dtype=torch.float64)
        logits.scatter_(2, y[..., None], (torch.log(c)[None] + self.a[y])[..., None])
        return logits.float()

    def nll(self, y: int, c: int) -> float:
        w = c * math.exp(float(self.a[y]))
        return -math.log(w / (w + self.vocab - 1))


class OOMOnBatch(Bigram):
    """Raises an out-of-memory error for batches above ``max_rows`` rows."""

    def __init__(self, max_rows: int = 1, message: str = "CUDA out of memory. Tried to allocate 2 GiB", **kw):
        super().__init__(**kw)
        self.max_rows, self.message = max_rows, message

    def forward(self, idx, positions=None, opts=None, **kw):
        if idx.shape[0] > self.max_rows:
            raise RuntimeError(self.message)
        return super().forward(idx, positions, opts, **kw)

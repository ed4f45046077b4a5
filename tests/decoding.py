"""Incremental decoding for the cached-vs-parallel tests: a prompt, then one token at a time."""
from __future__ import annotations

import torch


def decode(model, idx: torch.Tensor, prompt: int, cache) -> torch.Tensor:
    """``model``'s outputs for ``idx`` [B, L] with a KV ``cache``: the first ``prompt`` tokens in one call,
    then each later token alone at its position; the calls' outputs concatenated, [B, L, V]."""
    steps = [model(idx[:, :prompt], positions=torch.arange(prompt), cache=cache)]
    steps += [model(idx[:, t:t + 1], positions=torch.tensor([t]), cache=cache) for t in range(prompt, idx.shape[1])]
    return torch.cat(steps, 1)

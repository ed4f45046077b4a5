"""Randomized positions (Ruoss et al., ACL 2023, "Randomized Positional Encodings Boost Length
Generalization of Transformers", arXiv 2305.16843, §3): for any scheme, feed a sequence of length
L the positions of a random ordered subset of [0, L_max), L_max well above the longest length the
model will see, so that at test time a longer sequence uses positions it has trained on.

Checked against google-deepmind/randomized_positional_encodings (``models/positional_encodings.py``
``noisy_fixed_positional_encodings``, ``models/transformer.py``; read at commit e8c6474):

* drawn without replacement from ``arange(noise_max_length)`` and sorted (``jrandom.choice(...,
  replace=False)``, ``jnp.sort``);
* one draw per forward call, shared by every sequence of the batch (the sample has shape
  ``(sequence_length,)``; q and k of a layer use the same rng key) -- so positions are [L] here too,
  what ``GPT.forward(positions=...)`` takes;
* the same sampling at evaluation: ``range_evaluation.py`` calls the model with a fresh rng key for
  every batch and the model has no training switch. ``eval.positions=train`` (the default) follows
  that (eval/positions.py); ``eval.positions=contiguous`` scores at 0..L-1 instead.

Their noisy ALiBi and relative variants sample a sorted set of *distances* per offset rather than
positions; here every scheme is fed sampled *positions*, so ALiBi's bias is -slope x (p_m - p_n). At
positions with gaps, ALiBi (and FoX, whose bias has the same ALiBi form) take the attention "folded"
path (the key term as an extra head dimension of the fused causal kernel, exact at any increasing
positions); other bias schemes (T5, KERPLE, Sandwich, FIRE, ...) take the "fallback" path (a dense
mask per query block): correct, slower than the Toeplitz path (docs/attention.md, path table).
"""
from __future__ import annotations

import numpy as np
import torch

from .base import SchemeError
from .positions import to_device

STREAM_TRAIN, STREAM_VALID, STREAM_EVAL = 0x7A1, 0x7A2, 0x7A3  # independent draws for each use


def parse(spec: str, what: str = "train.positions") -> int | None:
    """"contiguous" -> None, "random:L_MAX" -> L_MAX; anything else a one-line SchemeError."""
    text = str(spec).strip()
    if text == "contiguous":
        return None
    head, _, tail = text.partition(":")
    if head == "random" and tail.strip().isdigit() and int(tail) >= 1:
        return int(tail)
    raise SchemeError(f"{what} must be 'contiguous' or 'random:L_MAX' (e.g. random:2048), got {spec!r}")


def check(max_length: int, scheme, train_length: int, what: str = "train.positions") -> None:
    """One-line SchemeError unless L_MAX >= L_tr and ``scheme`` encodes positions up to L_MAX - 1."""
    if max_length < train_length:
        raise SchemeError(f"{what}=random:{max_length} draws {train_length} distinct positions (the training "
                          f"length) from [0, {max_length}): L_MAX must be >= {train_length}, e.g. "
                          f"random:{4 * train_length}")
    table = getattr(scheme, "max_length", None)  # learned APE: one row per position
    if table is not None and table < max_length:
        raise SchemeError(f"learned APE has {table} rows but {what}=random:{max_length} draws positions up to "
                          f"{max_length - 1}; pass --set model.scheme_params.max_length={max_length}")
    try:
        scheme.check_length(max_length)
    except SchemeError as e:
        raise SchemeError(f"{what}=random:{max_length}: {e}") from None


def draw(rng: np.random.Generator, max_length: int, length: int) -> np.ndarray:
    """``length`` sorted distinct positions from [0, max_length) drawn from ``rng``: int64 [length]."""
    if length > max_length:
        raise SchemeError(f"random positions: cannot draw {length} distinct positions from "
                          f"[0, {max_length}); use L_MAX >= {length} or a shorter length")
    return np.sort(rng.choice(int(max_length), size=int(length), replace=False)).astype(np.int64)  # [length]


def draw_on(rng: np.random.Generator, max_length: int, length: int, device=None) -> torch.Tensor:
    """:func:`draw` as a tensor on ``device`` [length], to CUDA without blocking (:func:`.to_device`)."""
    return to_device(torch.from_numpy(draw(rng, max_length, length)), device)


class PositionSampler:
    """Sorted positions drawn without replacement from [0, max_length), from a seeded numpy generator
    whose state a checkpoint saves (``state_dict``), so a resumed run draws what an uninterrupted one
    would. ``stream`` separates training, validation and evaluation draws of the same seed."""

    def __init__(self, max_length: int, seed: int = 0, stream: int = STREAM_TRAIN) -> None:
        self.max_length = int(max_length)
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(stream)])))

    def draw(self, length: int, device=None) -> torch.Tensor:
        """[length] int64, strictly increasing, in [0, max_length), on ``device`` (:func:`draw_on`)."""
        return draw_on(self.rng, self.max_length, length, device)

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]

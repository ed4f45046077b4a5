"""Regular-language tasks of thesis Table 6.1: a common interface and a DFA toolkit.

Every task maps a token sequence to one class read out at the last position (DeepMind's
"language transduction" framing, Deletang et al. 2023; thesis §6.1.1). Two families:

* ``TransductionTask`` (Deletang et al.): uniformly random input strings, label = a function
  of the final state of a small automaton (Even Pairs, Modular Arithmetic, Parity, Cycle
  Navigation). Trained on lengths 1..40, tested on 41..500.
* ``MembershipTask`` (Bhattacharya et al. 2020 languages: Tomita 3-6, D_n): balanced binary
  membership classification. Positives are *uniform* over the language's strings of length T
  (exact path counting in the DFA); negatives are half uniform over the complement at length T,
  half "near misses": a uniform positive with one symbol flipped or one adjacent unequal pair
  swapped, kept only if it left the language. Lengths with no positive or no negative string
  (e.g. odd lengths for D_n and Tomita 5) are not valid. Trained on 1..50, tested on 51..100.

All sampling is numpy-vectorised and driven by an explicit ``np.random.Generator`` (determinism
by seed).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...io import UserError


#: target value for positions without a label (PyTorch cross_entropy's default ignore_index)
IGNORE = -100


class Task:
    name: str = "task"
    family: str = ""  # "deletang" | "bhattacharya"
    vocab_size: int = 2
    num_classes: int = 2
    symbols: str = "01"  # one character per token id, for decode()
    train_max: int = 40
    test_lengths: tuple[int, int] = (41, 500)

    def length_ok(self, length: int) -> bool:
        return length >= 1

    def lengths(self, lo: int, hi: int) -> list[int]:
        """The valid lengths in [lo, hi] (inclusive)."""
        return [t for t in range(max(1, int(lo)), int(hi) + 1) if self.length_ok(t)]

    def check_length(self, length: int) -> None:
        if not self.length_ok(length):
            ok = self.lengths(max(1, length - 3), length + 3)
            raise UserError(f"task {self.name!r} has no valid samples at length {length}; "
                            f"use a valid length such as {ok[:3]}")

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """-> tokens int64 [batch, length], labels int64 [batch]."""
        raise NotImplementedError

    def label(self, tokens: np.ndarray) -> np.ndarray:
        """Vectorised labels of a [B, T] token array -> [B]."""
        raise NotImplementedError

    def prefix_labels(self, tokens: np.ndarray) -> np.ndarray:
        """Labels of every prefix: [B, T] -> [B, T], column i = ``label(tokens[:, :i+1])``, and
        IGNORE where length i+1 is not valid (e.g. even lengths of Modular Arithmetic). The
        per-position targets of ``supervision="prefix"`` (the semiautomaton state at every step,
        Liu et al. 2023a, which thesis §6.1.1 cites for its transduction protocol)."""
        out = np.full(tokens.shape, IGNORE, dtype=np.int64)  # [B, T]
        for t in range(1, tokens.shape[1] + 1):
            if self.length_ok(t):
                out[:, t - 1] = self.label(tokens[:, :t])
        return out

    def decode(self, tokens) -> str:
        return "".join(self.symbols[int(t)] for t in tokens)

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "vocab_size": self.vocab_size,
                "num_classes": self.num_classes, "train_max": self.train_max,
                "test_lengths": list(self.test_lengths)}


class TransductionTask(Task):
    family = "deletang"
    train_max = 40
    test_lengths = (41, 500)

    def sample(self, rng, batch, length):
        self.check_length(length)
        tokens = rng.integers(0, self.vocab_size, size=(batch, length), dtype=np.int64)  # [B, T]
        return tokens, self.label(tokens)


class DFA:
    """Deterministic automaton: ``delta`` [Q, A] next-state table, ``start``, ``accept`` [Q]."""

    def __init__(self, delta, start: int, accept) -> None:
        self.delta = np.asarray(delta, dtype=np.int64)  # [Q, A]
        self.start = int(start)
        self.accept = np.asarray(accept, dtype=bool)  # [Q]
        self.num_states, self.alphabet = self.delta.shape

    def run(self, tokens: np.ndarray) -> np.ndarray:
        """Final states for a [B, T] token array -> [B]."""
        state = np.full(tokens.shape[0], self.start, dtype=np.int64)  # [B]
        for t in range(tokens.shape[1]):
            state = self.delta[state, tokens[:, t]]
        return state

    def accepts(self, tokens: np.ndarray) -> np.ndarray:
        return self.accept[self.run(tokens)]

    def complement(self) -> "DFA":
        return DFA(self.delta, self.start, ~self.accept)

    def counts(self, length: int) -> list[list[int]]:
        """counts[t][q] = number of accepted strings of length t read from state q (exact ints)."""
        return _counts(self.delta.tobytes(), self.delta.shape, self.accept.tobytes(), int(length))

    def num_accepted(self, length: int) -> int:
        return self.counts(length)[length][self.start]

    def sample_accepted(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        """Uniform samples from the accepted strings of exactly ``length`` symbols -> [B, T]."""
        probs = _step_probs(self.delta.tobytes(), self.delta.shape, self.accept.tobytes(), int(length),
                            self.start)
        if probs is None:
            raise UserError(f"the language has no string of length {length}; pick another length")
        state = np.full(batch, self.start, dtype=np.int64)  # [B]
        out = np.empty((batch, length), dtype=np.int64)  # [B, T]
        u = rng.random((batch, length))  # [B, T]
        for t in range(length):
            p = probs[length - t][state]  # [B, A]: next-symbol probabilities with length-t left
            sym = (u[:, t:t + 1] > np.cumsum(p, axis=1)).sum(axis=1)  # inverse CDF
            sym = np.minimum(sym, self.alphabet - 1)
            out[:, t] = sym
            state = self.delta[state, sym]
        return out


@lru_cache(maxsize=256)
def _counts(delta_b: bytes, shape: tuple, accept_b: bytes, length: int) -> list[list[int]]:
    delta = np.frombuffer(delta_b, dtype=np.int64).reshape(shape)
    accept = np.frombuffer(accept_b, dtype=bool)
    Q, A = shape
    rows = [[int(a) for a in accept]]
    for _ in range(length):
        prev = rows[-1]
        rows.append([sum(prev[int(delta[q, a])] for a in range(A)) for q in range(Q)])
    return rows


@lru_cache(maxsize=256)
def _step_probs(delta_b: bytes, shape: tuple, accept_b: bytes, length: int, start: int):
    """probs[t][q, a] = P(next symbol a | state q, t symbols left) for uniform accepted strings."""
    counts = _counts(delta_b, shape, accept_b, length)
    delta = np.frombuffer(delta_b, dtype=np.int64).reshape(shape)
    Q, A = shape
    if counts[length][start] == 0:
        return None
    probs = np.zeros((length + 1, Q, A))  # [T+1, Q, A]
    for t in range(1, length + 1):
        for q in range(Q):
            tot = counts[t][q]
            if tot:
                for a in range(A):
                    probs[t, q, a] = counts[t - 1][int(delta[q, a])] / tot  # exact ints -> float
    return probs


class MembershipTask(Task):
    """Balanced membership classification for a regular language given by ``self.dfa``."""

    family = "bhattacharya"
    train_max = 50
    test_lengths = (51, 100)
    dfa: DFA

    def length_ok(self, length: int) -> bool:
        if length < 1:
            return False
        pos = self.dfa.num_accepted(length)
        return 0 < pos < self.dfa.alphabet ** length

    def label(self, tokens):
        return self.dfa.accepts(tokens).astype(np.int64)

    def sample(self, rng, batch, length):
        self.check_length(length)
        labels = (rng.random(batch) < 0.5).astype(np.int64)  # [B]
        tokens = self.dfa.sample_accepted(rng, batch, length)  # [B, T] positives
        neg = np.flatnonzero(labels == 0)
        if neg.size:
            tokens[neg] = self._negatives(rng, neg.size, length)
        return tokens, labels

    def _negatives(self, rng, n: int, length: int) -> np.ndarray:
        """Half uniform over the complement, half perturbed positives that left the language."""
        out = self.dfa.complement().sample_accepted(rng, n, length)  # [n, T] uniform negatives
        near = np.flatnonzero(rng.random(n) < 0.5)
        for _ in range(8):  # perturbation attempts; failures keep their uniform negative
            if near.size == 0:
                break
            cand = self._perturb(rng, self.dfa.sample_accepted(rng, near.size, length))
            good = ~self.dfa.accepts(cand)
            out[near[good]] = cand[good]
            near = near[~good]
        return out

    def _perturb(self, rng, tokens: np.ndarray) -> np.ndarray:
        """Flip one random symbol (binary alphabet), or swap one random adjacent pair."""
        B, T = tokens.shape
        out = tokens.copy()
        rows = np.arange(B)
        pos = rng.integers(0, T, size=B)
        flip = rng.random(B) < 0.5
        if T < 2:
            flip[:] = True
        out[rows[flip], pos[flip]] = (self.dfa.alphabet - 1) - out[rows[flip], pos[flip]]
        sw = rows[~flip]
        p = np.minimum(pos[sw], T - 2)
        a, b = out[sw, p].copy(), out[sw, p + 1].copy()
        out[sw, p], out[sw, p + 1] = b, a
        return out

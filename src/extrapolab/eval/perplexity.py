"""Perplexity protocols E1-E3 (docs/protocols.md).

E1 ``nonoverlapping`` — ALiBi (Press et al., 2022) §2.1 "Nonoverlapping Inference": the stream
   is cut into L-length subsequences evaluated independently. Convention used here: the k-th
   subsequence feeds tokens kL .. kL+L-1 and is scored on tokens kL+1 .. kL+L, so a window of
   L+1 stream tokens gives exactly L predictions (ALiBi: "it includes L predictions, which on
   average have access to (L+1)/2 tokens of context"); every token 1 .. nL is scored exactly
   once and no token is predicted from nothing. A trailing partial subsequence is dropped, so
   every subsequence has exactly L predictions.
E2 ``sliding`` — ALiBi appendix B "sliding window evaluation": windows of L inputs advance by
   stride S; the first window scores all L predictions, every later one only its last S, so each
   of those tokens sees at least L-S tokens of context. A last window ending at the stream's end
   scores the tokens a whole stride could not reach, so every token 1 .. T is scored exactly once.
   S = L is E1; S = 1 gives every prediction L tokens of context.
E3 ``last_token`` — Sandwich (Chi et al., 2023) §3.4, Fig. 3: N fixed end tokens; at each L_ex
   the model is fed the L_ex-1 tokens before each end token and only the end token is scored,
   PPL = exp(1/N sum -log p_i). The end tokens are the same at every L_ex; only their number of
   previous tokens changes.
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np
from torch import nn

from ..io import UserError
from ..model.attention import AttnOptions
from .core import as_tokens, check_length, evenly_spaced, score_windows


def ppl_of(nll: float) -> float:
    """exp(mean NLL); inf instead of an overflow error."""
    return math.exp(nll) if nll < 709.0 else math.inf


def _result(scores, length: int, **extra) -> dict:
    nll = scores.mean_nll
    return {"ppl": ppl_of(nll), "nll": nll,
            "tokens": scores.count, "length": length, **extra}


def _too_short(n_tokens: int, need: int, what: str) -> UserError:
    return UserError(f"{what} needs at least {need} tokens but the stream has {n_tokens}; "
                     "use a larger test split or shorter lengths")


def chunk_starts(n_tokens: int, length: int, max_tokens: int, what: str) -> np.ndarray:
    """Starts of the consecutive ``length``-token chunks of a stream of ``n_tokens`` (each needs one
    more token as its last target); ``max_tokens`` > 0 keeps the first max(1, max_tokens // length)."""
    n_chunks = (n_tokens - 1) // length
    if n_chunks < 1:
        raise _too_short(n_tokens, length + 1, f"{what} at length {length}")
    if max_tokens > 0:
        n_chunks = min(n_chunks, max(1, int(max_tokens) // length))
    return np.arange(n_chunks, dtype=np.int64) * length


def nonoverlapping(
    model: nn.Module,
    tokens,
    length: int,
    *,
    max_tokens: int = 0,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    progress: bool = False,
) -> dict:
    """E1: ppl over consecutive L-length subsequences -> {ppl, nll, tokens, length}.

    ``max_tokens`` > 0 scores only the first max(1, max_tokens // L) subsequences.
    """
    tok = as_tokens(tokens)
    L = check_length(length)
    starts = chunk_starts(len(tok), L, max_tokens, "nonoverlapping evaluation")
    s = score_windows(model, tok, starts, L, 0, batch_size=batch_size, opts=opts,
                      progress=progress, desc=f"nonoverlapping L={L}")
    return _result(s, L)


def sliding_windows(n_tokens: int, length: int, stride: int, max_tokens: int = 0):
    """(starts, score_from) of E2 over targets 1..T, T = n_tokens-1 (or the first max_tokens)."""
    L, S = check_length(length), check_length(stride, "stride")
    if S > L:
        raise UserError(f"stride {S} is longer than the window {L}; use a stride between 1 and {L}")
    T = n_tokens - 1
    if max_tokens > 0:
        T = min(T, max(L, int(max_tokens)))
    if T < L:
        raise _too_short(n_tokens, L + 1, f"sliding-window evaluation at length {L}")
    starts = np.arange(0, T - L + 1, S, dtype=np.int64)  # window j covers targets jS+1 .. jS+L
    score_from = np.full(len(starts), L - S, dtype=np.int64)
    score_from[0] = 0
    reached = int(starts[-1]) + L
    if reached < T:  # tail: one window ending at target T scores the T - reached left-over tokens
        starts = np.append(starts, T - L)
        score_from = np.append(score_from, L - (T - reached))
    return starts, score_from


def sliding(
    model: nn.Module,
    tokens,
    length: int,
    stride: int,
    *,
    max_tokens: int = 0,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    progress: bool = False,
) -> dict:
    """E2: sliding-window ppl, window L, stride S -> {ppl, nll, tokens, length, stride}."""
    tok = as_tokens(tokens)
    starts, score_from = sliding_windows(len(tok), length, stride, max_tokens)
    s = score_windows(model, tok, starts, int(length), score_from, batch_size=batch_size, opts=opts,
                      progress=progress, desc=f"sliding L={length} S={stride}")
    return _result(s, int(length), stride=int(stride))


def last_token_ends(n_tokens: int, max_length: int, n: int) -> np.ndarray:
    """Stream indices of the N end tokens of E3, evenly spaced over [max_length-1, n_tokens-1].

    Every end token has at least ``max_length - 1`` tokens before it, so each is scored at every
    L_ex <= max_length. Fewer than ``n`` are returned only when the stream has fewer candidates.
    """
    Lmax = check_length(max_length)
    if n_tokens < Lmax:
        raise _too_short(n_tokens, Lmax, f"last-token evaluation at length {Lmax}")
    return evenly_spaced(Lmax - 1, n_tokens - 1, check_length(n, "last-token N"))


def _lengths(lengths: Iterable[int]) -> list[int]:
    out = sorted({check_length(x) for x in lengths})
    if not out:
        raise UserError("no evaluation length given; pass at least one length, e.g. 128 256 512")
    return out


def last_token(
    model: nn.Module,
    tokens,
    lengths: Iterable[int],
    *,
    n: int = 64,
    max_length: int | None = None,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    progress: bool = False,
) -> dict[int, float]:
    """E3: {L_ex: ppl of the N end tokens, each given its L_ex-1 previous tokens}.

    End tokens come from :func:`last_token_ends` with ``max_length`` (default max(lengths)), so
    calls with the same stream, N and max_length score the same tokens.
    """
    tok = as_tokens(tokens)
    Ls = _lengths(lengths)
    if Ls[0] < 2:
        raise UserError("last-token evaluation needs L_ex >= 2 (at least one context token)")
    Lmax = max(Ls[-1], int(max_length or 0))
    ends = last_token_ends(len(tok), Lmax, n)
    out = {}
    for L in Ls:  # input: the L-1 tokens before each end token; score only the last position
        s = score_windows(model, tok, ends - (L - 1), L - 1, L - 2, batch_size=batch_size, opts=opts,
                          progress=progress, desc=f"last-token L={L}")
        out[L] = _result(s, L)["ppl"]
    return out

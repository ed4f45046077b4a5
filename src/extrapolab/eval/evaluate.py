"""Run the requested evaluation protocols (E1-E6, docs/protocols.md) and return one JSON-able dict.

Protocols: ``nonoverlapping`` (E1), ``sliding`` (E2), ``last_token`` (E3), ``positionwise`` (E4,
with its windowed@L_tr reference), ``cached`` and ``recomputed`` (E5). The verdict (E6, Qin def.
0.1) is computed for every perplexity-by-length protocol that ran; ``train_length`` is added to the
lengths when one of them exceeds it, because it is the verdict's reference ppl_m (when every length
is at most L_tr there is nothing beyond L_tr to judge, and L_tr is not run: :func:`eval_lengths`).

A length that cannot run (no learned embedding past L_tr, stream too short, does not fit in
memory even at batch size 1) is recorded as ``{"error": "<one line>"}`` and the other lengths go
on. Lengths are string keys in the output so it survives a JSON round trip unchanged.
"""
from __future__ import annotations

import math
import time
from typing import Iterable, Sequence

import numpy as np
from torch import nn

from ..config import PROTOCOLS, check_protocols  # noqa: F401 (re-exported by eval/)
from ..io import UserError
from ..model.attention import AttnOptions, temperature_record
from ..positional import randomized
from ..positional.base import SchemeError
from .bca import BlockwiseCausal, block_size
from .cached import cached_window_ppl, check_sinks, recomputed_window_ppl
from .positions import RandomPositions
from .core import as_tokens, check_length, check_vocab, resolve_opts
from .perplexity import last_token, last_token_ends, nonoverlapping, sliding
from .positionwise import positionwise_with_reference
from .verdict import verdict

BY_LENGTH = ("nonoverlapping", "sliding", "last_token", "cached", "recomputed")


def _jsonable(x):
    """numpy -> Python; non-finite floats -> None (strict JSON has no inf/nan)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def eval_lengths(lengths: Iterable[int], train_length: int) -> tuple[list[int], str]:
    """(the lengths :func:`evaluate` runs, sorted, and why): the requested ones, plus L_tr -- the
    verdict's reference -- when some requested length exceeds it."""
    asked = sorted({check_length(x) for x in lengths})
    m = check_length(train_length, "train_length")
    shown = ", ".join(f"{L:,}" for L in asked)
    if not asked:
        return [m], f"L_tr = {m:,} only (no lengths asked for)"
    if asked[-1] > m and m not in asked:
        return sorted({*asked, m}), (f"lengths {shown} and L_tr = {m:,} (the verdict's reference: "
                                     f"ppl at L_tr against each length above it)")
    if asked[-1] > m:
        return asked, f"lengths {shown} (L_tr = {m:,} among them, the verdict's reference)"
    return asked, (f"lengths {shown} only: none exceeds L_tr = {m:,}, so there is no verdict and L_tr is "
                   "not added")


def _per_length(fn, lengths):
    res = {}
    for L in lengths:
        try:
            res[L] = fn(L)
        except (UserError, SchemeError) as err:
            res[L] = {"error": str(err).splitlines()[0] if str(err) else type(err).__name__}
    return res


def evaluate(
    model: nn.Module,
    tokens,
    *,
    train_length: int,
    protocols: Iterable[str] = ("nonoverlapping", "last_token"),
    lengths: Iterable[int] = (128, 256, 512, 1024, 2048),
    num_tokens: int = 0,
    last_token_n: int = 64,
    sliding_stride: int = 0,
    position_length: int = 0,
    position_segments: int = 16,
    cache_window: int = 0,
    sinks: int = -1,
    delta: float = 0.1,
    batch_size: int = 4,
    temperature: float | Sequence[float] = 1.0,
    bca: bool = False,
    bca_block: int = 0,
    positions: str = "contiguous",
    opts: AttnOptions | None = None,
    progress: bool = False,
) -> dict:
    """Run ``protocols`` at ``lengths`` -> JSON-able results (see module doc).

    ``bca``: E1-E4 with blockwise causal attention of ``bca_block``-token blocks (0 = L_tr / 2; xPos
    §3.3, eval/bca.py); E5 keeps its own KV-cache window and records an error line instead.
    ``positions``: "contiguous" (0..L-1) or "random:L_MAX": E1-E3 at sorted positions drawn per batch
    from [0, L_MAX) (Ruoss et al. 2023, eval/positions.py); E4 and E5 need positions 0..L-1 (E4's
    windowed reference counts keys by position distance) and record an error line instead.

    Defaults follow ``EvalConfig``: 0 means whole stream (num_tokens), L_tr // 2 (sliding_stride),
    max length (position_length), 2·L_tr (cache_window). E5 scores ``num_tokens`` tokens per length,
    or batch_size·max(lengths) when num_tokens is 0 (token-by-token decoding is slow).
    """
    tok = as_tokens(tokens)
    check_vocab(model, tok)
    m = check_length(train_length, "train_length")
    protos = check_protocols(protocols)
    Ls, _ = eval_lengths(lengths, m)
    opts = resolve_opts(opts, temperature=None if temperature == 1.0 else temperature_record(temperature))
    if hasattr(model, "check_opts"):  # a per-layer temperature that does not fit fails once, here
        model.check_opts(opts)
    stride = int(sliding_stride) or max(1, m // 2)
    window = int(cache_window) or 2 * m
    k = check_sinks(model, sinks) if {"cached", "recomputed"} & set(protos) else None  # bad value: fails here
    pos_len = int(position_length) or Ls[-1]
    cache_tokens = int(num_tokens) or int(batch_size) * Ls[-1]
    kw = dict(batch_size=batch_size, opts=opts)
    block = block_size(bca_block, m) if bca else None
    L_max = randomized.parse(positions, "eval.positions")

    def scored(L: int) -> nn.Module:  # what E1-E4 call at length L
        out = BlockwiseCausal(model, block) if bca else model
        return RandomPositions(out, L_max, seed=L) if L_max else out  # one seeded stream per length
    out: dict = {"train_length": m, "lengths": Ls, "protocols": protos, "settings": {
        "attention": opts.impl, "num_tokens": int(num_tokens), "sliding_stride": stride, "last_token_n": int(last_token_n),
        "position_length": pos_len, "position_segments": int(position_segments),
        "cache_window": window, "cache_sinks": -1 if k is None else k, "cache_tokens": cache_tokens,
        "delta": float(delta),
        "batch_size": int(batch_size), "temperature": temperature_record(opts.temperature),
        "bca_block": block, "positions": str(positions), "stream_tokens": int(len(tok))}, "seconds": {}}
    for p in protos:
        t0 = time.perf_counter()
        if p in ("cached", "recomputed") and bca:
            out[p] = {L: {"error": f"{p} (E5) keeps its own KV-cache window; run it without eval.bca"} for L in Ls}
        elif p in ("cached", "recomputed") and L_max:
            out[p] = {L: {"error": f"{p} (E5) decodes at positions 0..L-1; run it with eval.positions=contiguous"}
                      for L in Ls}
        elif p == "positionwise" and L_max:
            out[p] = {"error": "positionwise (E4) needs positions 0..L-1 (its windowed@L_tr reference counts keys "
                               "by position distance); run it with eval.positions=contiguous", "length": pos_len}
        elif p == "nonoverlapping":
            out[p] = _per_length(lambda L: nonoverlapping(scored(L), tok, L, max_tokens=num_tokens,
                                                          progress=progress, **kw), Ls)
        elif p == "sliding":
            out[p] = _per_length(lambda L: sliding(scored(L), tok, L, min(stride, L), max_tokens=num_tokens,
                                                   progress=progress, **kw), Ls)
        elif p == "last_token":
            try:
                ends = last_token_ends(len(tok), Ls[-1], last_token_n)
                out["settings"]["last_token_n_used"] = int(len(ends))
                out[p] = _per_length(lambda L: {"ppl": last_token(
                    scored(L), tok, [L], n=last_token_n, max_length=Ls[-1], progress=progress, **kw)[L],
                    "tokens": int(len(ends)), "length": L}, Ls)
            except UserError as err:
                out[p] = {L: {"error": str(err)} for L in Ls}
        elif p == "positionwise":
            try:
                out[p] = positionwise_with_reference(scored(pos_len), tok, pos_len, m, n_segments=position_segments,
                                                     progress=progress, **kw)
            except (UserError, SchemeError) as err:
                out[p] = {"error": str(err), "length": pos_len}
        elif p == "cached":
            out[p] = _per_length(lambda L: cached_window_ppl(model, tok, L, window=window, sinks=k,
                                                             max_tokens=cache_tokens, **kw), Ls)
        elif p == "recomputed":
            out[p] = _per_length(lambda L: recomputed_window_ppl(model, tok, L, window=window, sinks=k,
                                                                 max_tokens=cache_tokens, progress=progress,
                                                                 **kw), Ls)
        out["seconds"][p] = time.perf_counter() - t0
    out["ppl"] = {p: {L: out[p][L].get("ppl") for L in Ls} for p in protos if p in BY_LENGTH}
    out["verdict"] = {}
    for p, table in out["ppl"].items():
        if Ls[-1] <= m:  # nothing beyond L_tr to judge
            out["verdict"][p] = {"skipped": f"every length is at most L_tr = {m}"}
            continue
        try:
            out["verdict"][p] = verdict(table, m, delta)
        except UserError as err:
            out["verdict"][p] = {"error": str(err)}
    return _jsonable(out)


def evaluate_config(model: nn.Module, tokens, eval_cfg, train_length: int, **kw) -> dict:
    """:func:`evaluate` with the fields of a ``config.EvalConfig`` (``split`` is the caller's job).

    ``eval.positions="train"`` means the run's ``train.positions``, which only the caller knows
    (``config.eval_positions``): pass ``positions=``; without it "train" evaluates at 0..L-1."""
    fields = ("protocols", "lengths", "num_tokens", "last_token_n", "sliding_stride", "position_length",
              "position_segments",
              "cache_window", "sinks", "delta", "batch_size", "temperature", "bca", "bca_block")
    args = {f: getattr(eval_cfg, f) for f in fields if hasattr(eval_cfg, f)}
    if getattr(eval_cfg, "positions", "train") != "train":
        args["positions"] = eval_cfg.positions
    if getattr(eval_cfg, "attention", "auto") != "auto" and kw.get("opts") is None:
        args["opts"] = AttnOptions(impl=eval_cfg.attention)  # eval.attention: the path every protocol runs on
    args.update(kw)
    return evaluate(model, tokens, train_length=train_length, **args)

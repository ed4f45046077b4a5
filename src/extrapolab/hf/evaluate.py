"""E1-E4 on an HF causal LM with the protocols of ``eval/`` unchanged (docs/protocols.md).

E1 nonoverlapping, E2 sliding and E3 last-token run through ``eval.evaluate`` on the
:class:`~extrapolab.hf.adapter.HFCausalLM`; E4 position-wise runs ``eval.positionwise`` without
its windowed@L_tr reference (an HF model has no windowed attention without an L x L mask, see
adapter.py). E5 (cached / recomputed windows, with ``eval.sinks``) runs on RoPE models: the cached
window is the model's own ``DynamicCache`` of keys before rotation (hf/cached.py, StreamingLLM's
cache), through the registered attention function. The result has the layout of ``eval.evaluate``
(eval.json), plus a ``model`` block saying what was loaded.
"""
from __future__ import annotations

import copy
import time

import numpy as np

from ..eval import eval_lengths, evaluate_config, positionwise
from ..io import UserError
from ..model.attention import AttnOptions, temperature_record
from .cached import prepare

PROTOCOLS = ("nonoverlapping", "sliding", "last_token", "positionwise", "cached", "recomputed")


def check_hf_protocols(protocols) -> list[str]:
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad:
        raise UserError(f"protocol {bad[0]!r} is not available for HF models; use {', '.join(PROTOCOLS)}")
    return list(protocols)


def check_hf_lengths(model, lengths) -> None:
    """A learned-position model refuses every requested length past its table up front."""
    for L in lengths:
        model.check_length(L)


def model_block(model) -> dict:
    m = model.loaded
    return {"source": f"hf:{m.path}", "name": m.name, "family": m.family, "positions": m.positions,
            "max_length": m.max_length, "train_length": m.train_length, "rope": m.rope,
            "attn_implementation": m.attn_implementation, **m.info}


def _finite(x) -> list:
    return [float(v) if np.isfinite(v) else None for v in x]  # strict JSON has no inf / nan


def evaluate_hf(model, tokens, ecfg, train_length: int, progress: bool = False) -> dict:
    """``eval.evaluate`` with ``ecfg`` (an EvalConfig) on an ``HFCausalLM``; see module doc."""
    protos = check_hf_protocols(ecfg.protocols)
    if "cached" in protos:  # a model the cached window cannot serve fails here, in one line
        prepare(model)
    by_length = [p for p in protos if p != "positionwise"]
    if by_length:
        sub = copy.deepcopy(ecfg)
        sub.protocols = by_length
        res = evaluate_config(model, tokens, sub, train_length, progress=progress)
    else:  # position-wise only: the same layout without per-length tables
        res = {"train_length": int(train_length), "lengths": eval_lengths(ecfg.lengths, train_length)[0],
               "settings": {"position_segments": int(ecfg.position_segments), "batch_size": int(ecfg.batch_size),
                            "temperature": temperature_record(ecfg.temperature), "stream_tokens": int(len(tokens))},
               "seconds": {}, "ppl": {}, "verdict": {}}
    if "positionwise" in protos:
        t0 = time.perf_counter()
        L = int(ecfg.position_length) or max(res["lengths"])
        try:
            opts = AttnOptions(temperature=temperature_record(ecfg.temperature))
            pw = positionwise(model, tokens, L, n_segments=ecfg.position_segments, batch_size=ecfg.batch_size,
                              opts=opts, progress=progress)
            res["positionwise"] = {"length": L, "segments": pw["segments"], "nll": _finite(pw["nll"]),
                                   "ppl": _finite(pw["ppl"]),
                                   "window": None, "note": "no windowed@L_tr reference for HF models"}
        except UserError as err:
            res["positionwise"] = {"error": str(err), "length": L}
        res["seconds"]["positionwise"] = time.perf_counter() - t0
    res["protocols"] = protos
    res["model"] = model_block(model)
    return res

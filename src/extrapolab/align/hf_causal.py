"""Thesis ch. 5 on a local Hugging Face causal LM (``hf:PATH``): Algorithm 1 and retrieval.

:func:`align_hf` runs Algorithm 1 (one tau for every softmax of the model per length, §5.4), the
length rule and Props. 5.1/5.2. Families whose attention goes through transformers' attention
interface (GPT-2, GPT-NeoX, Llama, Mistral, Qwen2, ...) are loaded with
``attn_implementation="extrapolab"`` (hf/extend.py, which also applies any ``--rope`` extension)
and aligned by :func:`align_onepass_hf`: each FINDS(tau) is one fused forward whose statistics come
from ``rows`` sampled query rows per layer (every row at 0), and tau is found by bisection over the
grid (:mod:`.onepass`), ~4 forwards per length where the block-wise reference takes 11. With
``blockwise=True`` (or ``propagate=False``) they are aligned by :func:`.algorithm.align` over
:class:`extrapolab.hf.HFBlockTarget` instead: statistics of every row per query block on the
reference path, one forward per grid tau (no [H, L, L] tensor, but slow at long L). The others
(BLOOM, MPT) fall back to ``eager`` and :class:`extrapolab.hf.HFTarget`, which reads the attention
probabilities: [B, H, L, L] per layer, O(L²) memory at the alignment lengths. Data: the test split
of the preset's corpus in the model's tokenizer (hf/data.py). Output: OUT/temperature.json (+
.png/.svg), the same format either way, which ``extrapolab eval hf:PATH --out OUT --temperature
auto`` reads.

:func:`retrieval_hf` scores passkey / key-value retrieval (:mod:`extrapolab.tasks.retrieval`) with prompts built in
the model's tokenizer, at tau = 1 and at each rule's tau from OUT/temperature.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from .. import config as C
from ..io import UserError, atomic_write_json
from .algorithm import (align, check_modes, closed_form_taus, load_temperature, save_temperature, segments_at,
                        window_starts)
from .plots import align_table, plot_temperature_curves
from .rules import GRID, MODES, canonical_rule


def _load(spec, *, attn: str, device: str, dtype: str, rope: str | None, train_length: int | None,
          cache_dir=None):
    from ..hf import HFCausalLM, load_hf

    model = HFCausalLM(load_hf(spec, device=device, dtype=dtype, attn=attn, rope=rope, train_length=train_length,
                               cache_dir=cache_dir))
    if not model.loaded.train_length:
        raise UserError(f"{spec} names no pre-training length in its config; pass --train-length")
    return model


def align_onepass_hf(model, tokens, train_length: int, lengths: Sequence[int], modes: Sequence[str] = MODES, *,
                     n_segments: int = 2, rows: int = 256, search: str = "bisect", taus: Sequence[float] = GRID,
                     block: int = 128, seed: int = 0, progress: Callable[[str], None] | None = None) -> dict:
    """Algorithm 1 on an ``HFCausalLM`` loaded with the extrapolab attention, in fused forwards
    (:func:`.onepass.align_global`), on the windows :func:`.algorithm.align` would take; returns the
    dict :func:`.algorithm.align` returns (statistics of the grid taus not evaluated are None),
    plus ``rows``, ``search``, ``forwards`` and ``fallback``."""
    from .onepass import align_global

    modes = check_modes(modes)
    train_length = int(train_length)
    tokens, lengths, starts = window_starts(tokens, train_length, lengths, n_segments, seed)
    g = align_global(model, segments_at(tokens, starts, train_length),
                     {L: segments_at(tokens, starts, L) for L in lengths}, modes=modes, taus=taus, rows=rows,
                     block=block, search=search, layer0=True, say=progress or (lambda _m: None))
    tr, l0 = g["train"], g.get("layer0", {})
    res = {"version": 1, "train_length": train_length, "lengths": lengths, "grid": g["grid"], "modes": modes,
           "propagate": True, "segments": int(n_segments), "seed": int(seed), "method": "onepass",
           "rows": int(rows), "search": search, "forwards": g["forwards"], "fallback": g["fallback"],
           "tau": {r: {} for r in modes + ["length", "prop51", "prop52"]},
           "stats": {"train": {"pmax": tr["pmax"], "entropy": tr["entropy"], "layer0": l0.get("train"),
                               "per_layer_pmax": tr["per_layer_pmax"], "per_layer_entropy": tr["per_layer_entropy"]},
                     "ex": {}}}
    for L in lengths:
        key = str(L)
        for m in modes:
            res["tau"][m][key] = g["tau"][m][key]
        closed_form_taus(res, L, l0.get("train"), l0.get(key))
        runs = g["finds"][key]
        res["stats"]["ex"][key] = {m: [r[m] if r else None for r in runs] for m in MODES}
        res["stats"]["ex"][key]["layer0"] = l0.get(key)
    return res


def align_hf(spec: str, lengths: Sequence[int] | None = None, modes: Sequence[str] = ("pmax", "entropy"),
             segments: int = 2, split: str = "test", propagate: bool = True, seed: int = 0, *, out=None,
             preset: str | None = None, overrides=None, device: str = "auto", dtype: str = "fp32",
             rope: str | None = None, train_length: int | None = None, rows: int = 256, search: str = "bisect",
             blockwise: bool = False, say: Callable[[str], None] = print) -> dict:
    """Algorithm 1 on ``hf:PATH`` -> OUT/temperature.json and the curves (see module doc).
    ``rows``: query rows per layer the one-pass statistics read (0 = all); ``search``: bisect | grid."""
    from ..hf import ATTN, HFBlockTarget, HFTarget, default_out, hf_split
    from ..hf.evaluate import check_hf_lengths, model_block
    from ..hf.temperature import block_statistics

    if rows < 0:
        raise UserError(f"--rows must be >= 0 (0 = every query row), got {rows}")
    cfg = C.resolve(preset, overrides)
    model = _load(spec, attn=ATTN, device=device, dtype=dtype, rope=rope, train_length=train_length,
                  cache_dir=cfg.data.cache_dir)
    block = block_statistics(model.loaded.family)
    if not block:  # BLOOM, MPT: their own attention, probabilities from eager
        model = _load(spec, attn="eager", device=device, dtype=dtype, rope=rope, train_length=train_length,
                      cache_dir=cfg.data.cache_dir)
    L_tr = model.loaded.train_length
    lengths = list(lengths or [L for L in cfg.eval.lengths if L > L_tr] or [2 * L_tr, 4 * L_tr])
    check_hf_lengths(model, [*lengths, L_tr])
    tokens = hf_split(cfg.data, model.loaded.tokenizer, split)
    if block and propagate and not blockwise:
        res = align_onepass_hf(model, tokens, L_tr, lengths, modes, n_segments=segments, rows=rows, search=search,
                               seed=seed, progress=say)
    else:
        target = HFBlockTarget(model) if block else HFTarget(model)
        res = align(target, tokens, L_tr, lengths, modes, n_segments=segments, propagate=propagate,
                    seed=seed, progress=say)
        res["method"] = "blockwise" if block else "eager"
    res["run"], res["scheme"], res["split"], res["model"] = f"hf:{model.loaded.name}", model.loaded.positions, \
        split, model_block(model)
    out = Path(out) if out else default_out(model.loaded)
    out.mkdir(parents=True, exist_ok=True)
    path = save_temperature(out, res)
    figs = plot_temperature_curves(res, out / "temperature", title=f"hf:{model.loaded.name} ({model.loaded.family})")
    return {"result": res, "table": align_table(res), "path": str(path), "figures": [str(f) for f in figs]}


def retrieval_hf(spec: str, task: str = "passkey", lengths: Sequence[int] | None = None,
                 depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), n: int = 5,
                 rules: Sequence[str] = ("none",), seed: int = 0, preamble: bool = True, batch_size: int = 8, *,
                 out=None, device: str = "auto", dtype: str = "auto", rope: str | None = None,
                 train_length: int | None = None, cache_dir=None) -> dict:
    """Exact-match retrieval per length x depth for each rule -> OUT/retrieval-<task>.json + heat map.
    ``cache_dir``: where a GGUF file's converted folder lives (default ``.extrapolab-cache``)."""
    from ..hf import default_out, hf_temperature
    from ..hf.data import HFCodec
    from ..hf.evaluate import check_hf_lengths
    from ..tasks.retrieval import make_examples, plot_heatmap, retrieval_table, score

    model = _load(spec, attn="sdpa", device=device, dtype=dtype, rope=rope, train_length=train_length,
                  cache_dir=cache_dir)
    L_tr = model.loaded.train_length
    lengths = list(lengths or [L_tr, 2 * L_tr, 4 * L_tr])
    check_hf_lengths(model, lengths)
    out = Path(out) if out else default_out(model.loaded)
    out.mkdir(parents=True, exist_ok=True)
    examples = make_examples(task, lengths, depths, n, seed, tokenizer=HFCodec(model.loaded.tokenizer),
                             preamble=preamble)
    taus = {}
    if any(canonical_rule(r) != "none" for r in rules) and not (out / "temperature.json").is_file():
        raise UserError(f"no temperature.json in {out}; run `extrapolab align {spec} --out {out}` first or use "
                        "--rules none")
    for rule in rules:
        r = canonical_rule(rule)
        taus[r] = {L: load_temperature(out, L, r) for L in lengths}  # fails before decoding if one is missing
    records = []
    for rule, per_length in taus.items():
        for L, tau in per_length.items():
            group = [e for e in examples if e.target_length == L]
            with hf_temperature(model, tau):
                recs = score(model, group, None, batch_size, rule)
            records += [{**r, "tau": tau} for r in recs]
    table = retrieval_table(records)
    path = out / f"retrieval-{task}.json"
    atomic_write_json(path, {"task": task, "model": f"hf:{model.loaded.name}", "lengths": lengths,
                             "depths": list(depths), "n": n, "seed": seed, "train_length": L_tr,
                             "table": table, "records": records})
    figs = plot_heatmap(records, out / f"retrieval-{task}", title=f"{task}: hf:{model.loaded.name}")
    return {"records": records, "table": table, "path": str(path), "figures": [str(f) for f in figs]}

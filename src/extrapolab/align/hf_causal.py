"""Thesis ch. 5 on a local Hugging Face causal LM (``hf:PATH``): Algorithm 1 and retrieval.

:func:`align_hf` runs :func:`.algorithm.align` (Algorithm 1, the length rule, Props. 5.1/5.2)
with per-layer temperatures through each family's own attention (hf/temperature.py). Families
whose attention goes through transformers' attention interface (GPT-2, GPT-NeoX, Llama, Mistral,
Qwen2, ...) are loaded with ``attn_implementation="extrapolab"`` and aligned by
:class:`extrapolab.hf.HFBlockTarget`: statistics per query block from the model's own q and k, no
[H, L, L] tensor (hf/extend.py), which also applies any ``--rope`` extension. The others (BLOOM,
MPT) fall back to ``eager`` and :class:`extrapolab.hf.HFTarget`, which reads the attention
probabilities: [B, H, L, L] per layer, O(L²) memory at the alignment lengths. Data: the test split of the
preset's corpus in the model's tokenizer (hf/data.py). Output: OUT/temperature.json (+ .png/.svg),
which ``extrapolab eval hf:PATH --out OUT --temperature auto`` reads.

:func:`retrieval_hf` scores passkey / key-value retrieval (:mod:`.retrieval`) with prompts built in
the model's tokenizer, at tau = 1 and at each rule's tau from OUT/temperature.json.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from .. import config as C
from ..io import UserError, atomic_write_json
from .algorithm import align, load_temperature, save_temperature
from .plots import align_table, plot_temperature_curves
from .rules import canonical_rule


def _load(spec, *, attn: str, device: str, dtype: str, rope: str | None, train_length: int | None,
          cache_dir=None):
    from ..hf import HFCausalLM, load_hf

    model = HFCausalLM(load_hf(spec, device=device, dtype=dtype, attn=attn, rope=rope, train_length=train_length,
                               cache_dir=cache_dir))
    if not model.loaded.train_length:
        raise UserError(f"{spec} names no pre-training length in its config; pass --train-length")
    return model


def align_hf(spec: str, lengths: Sequence[int] | None = None, modes: Sequence[str] = ("pmax", "entropy"),
             segments: int = 2, split: str = "test", propagate: bool = True, seed: int = 0, *, out=None,
             preset: str | None = None, overrides=None, device: str = "auto", dtype: str = "fp32",
             rope: str | None = None, train_length: int | None = None,
             say: Callable[[str], None] = print) -> dict:
    """Algorithm 1 on ``hf:PATH`` -> OUT/temperature.json and the curves (see module doc)."""
    from ..hf import ATTN, HFBlockTarget, HFTarget, default_out, hf_split
    from ..hf.evaluate import check_hf_lengths, model_block
    from ..hf.temperature import block_statistics

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
    target = HFBlockTarget(model) if block else HFTarget(model)
    res = align(target, tokens, L_tr, lengths, modes, n_segments=segments, propagate=propagate,
                seed=seed, progress=say)
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
    from .retrieval import make_examples, plot_heatmap, retrieval_table, score

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

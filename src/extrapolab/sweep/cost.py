"""The sweep report's cost section (E8): one bench pass after training, in this one process.

Ratios across sweep runs would divide timings of different pool workers, taken under different
load and in run order, so the sweep measures its schemes again with :func:`extrapolab.perf.bench`
at the sweep's own model config (sizes, vocabulary, L_tr, batch), on the device and in the precision
the runs trained with (``train.device`` / ``train.precision``: a GPU sweep is timed on its GPU under
bf16 autocast, never on the CPU), each call timed next to a NoPE call (``perf.timing.paired_rounds``),
and stores the result in results.sqlite (meta ``cost_bench``) for the report.
"""
from __future__ import annotations

import os
from dataclasses import asdict, replace

import torch

from .. import config as C
from ..model.gpt import ModelConfig
from ..perf.bench import as_specs, run_bench
from ..train.placement import run_placement

#: an entry's model fields the bench builds its model with: its layer types (a layout is timed as itself)
LAYER_FIELDS = ("layout", "layer_types", "types")
WARMUP = 1  # rounds (sweep.cost_rounds, 7 by default) are one step per scheme each: seconds at demo size


def attention_options(model: dict) -> dict:
    """The attention options (model.sinks, ssmax, qk_norm, gate) and layer types (model.layout, layer_types,
    types) among a sweep entry's model overrides: the bench times each entry with them (a layout as itself)."""
    keys = ("sinks", "ssmax", "qk_norm", "gate", *LAYER_FIELDS)
    return {k: v for k, v in (model or {}).items() if k in keys and v}


def bench_settings(base: C.RunConfig, vocab_size: int, schemes, rounds: int) -> dict:
    """What a stored bench pass must match to be reused on resume."""
    model = replace(ModelConfig(**{k: v for k, v in asdict(base.model).items() if k in ModelConfig.__dataclass_fields__}),
                    vocab_size=int(vocab_size))
    specs = [(s.label, s.name, dict(s.params)) + ((0, "auto", opts) if (opts := attention_options(s.model)) else ())
             for s in schemes]
    place = run_placement(base.train)
    return {"model": asdict(model), "batch": base.train.batch_size, "L": base.model.train_length,
            "schemes": specs, "rounds": int(rounds), "device": str(place.device), "precision": place.precision}


def run_cost_bench(base: C.RunConfig, vocab_size: int, schemes, workers: int = 1, rounds: int = 7,
                   say=lambda m: None) -> dict:
    """Train step, eval forward and attention-only timings of every swept scheme vs NoPE, at the
    threads each run trained with (one per worker on a shared CPU: robust to load from others)."""
    st = bench_settings(base, vocab_size, schemes, rounds)
    model = ModelConfig(**st["model"])
    threads = base.train.threads or max(1, (os.cpu_count() or 1) // max(1, workers))
    before = torch.get_num_threads()
    specs = as_specs([tuple(s) for s in st["schemes"]])
    say(f"cost: one bench pass over {len(specs)} schemes (NoPE the baseline) at L_tr = {st['L']}, batch {st['batch']}, "
        f"on {st['device']} ({st['precision']}), {threads} threads, {rounds} rounds (one process; each call next to a "
        "NoPE call)")
    try:
        res = run_bench(specs, lengths_train=(st["L"],), model_cfg=model, device=st["device"], dtype=st["precision"],
                        repeats=rounds, warmup=WARMUP, threads=threads, groups=("train",),
                        batch=st["batch"], flush=base.train.flush_denormals, progress=False)
    finally:
        torch.set_num_threads(before)
    return {"settings": st, "meta": res["meta"], "rows": res["train"][str(st["L"])]}

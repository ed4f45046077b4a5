"""E8 cost table: speed and memory of every scheme against bias-free SDPA (docs/protocols.md, E8).

Follows the comparisons of ALiBi Fig. 2 (train/inference speed and memory vs L), thesis Table 3.4
(train sec/step, tokens/s per kernel) and Sandwich appendix B (cached sliding-window generation
costs O(w̄·L) against O(w̄²·L) for re-encoding the window). Everything is measured in ONE process,
every ratio to NoPE (``none``: bias-free ``scaled_dot_product_attention(is_causal=True)``) divides
a call by the NoPE call timed next to it (train and long rows) and is refused across processes or
sizes (:mod:`.timing`). Row groups:

* train: full-model step (forward + backward + AdamW + ``constrain_``), no-grad forward, and the
  attention alone (bias tables + every layer's attention, forward + backward; at demo size the
  vocabulary projection dominates a model step and hides it), at each L_tr;
* long: one-sequence forward and attention-only forward at 4k-64k tokens, warmed up at that
  length, ``long_repeats`` >= 3 rotated rounds (``quick``: as many as the train rows); window-limited
  schemes are marked "sparse";
* generation: per-token time with a ``KVCache(window=w̄)`` at positions w̄..8·w̄ against one
  forward over the last w̄ tokens (re-encoding);
* denormals: ALiBi and NoPE train steps with flush-to-zero on and off, one thread, same process;
* profile (on request only): one profiled train step per scheme, its kernels (CUDA) or operators (CPU) by
  time (:mod:`.profile`): why a row is slower, not how much;
* layouts (on request only): the causal path's one SDPA call in the three layouts the model hands it
  (:mod:`.layouts`), wall and host time per call.

Memory: extrapolab.memory.PeakMemory around one extra, untimed call per row.
To add a row group (e.g. a RegularGPT LM), write ``fn(ctx: Context) -> dict`` in ``perf/groups.py``, add it to
``GROUPS`` here and a formatter to ``perf.table.FORMATTERS``.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, replace
from typing import Callable

import torch

from .. import config as C
from .. import positional
from ..io import UserError, atomic_write_json
from ..model.attention import flush_denormals
from ..model.gpt import ModelConfig
from ..train.step import resolve_precision
from .context import BASE, Context, Spec, as_specs, build_model  # noqa: F401  (re-exported: sweep/cost.py, tests)
from .groups import (attention_only, bench_denormals, bench_generation, bench_long, bench_train,  # noqa: F401
                     unfused_reason, window_limited)
from .layouts import bench_layouts
from .profile import bench_profile

DEMO = ModelConfig(vocab_size=4096, layers=4, heads=4, dim=128, scheme=BASE)
ROUNDS = 9  # paired rounds per row: a median's 95% interval within ±3% on an idle 2-core CPU
#: --quick: one long length, so its forwards get as many rounds as the train rows (a 4,096-token round of
#: 18 of these schemes, before the RoPE kinds llama3 / LongRoPE / p-RoPE joined, took ~20 s on a 2-core CPU;
#: with 3 rounds its ratios spread ±20%)
QUICK = dict(lengths_train=(128, 512), long_lengths=(4096,), gen_window=64, long_repeats=ROUNDS,
             schemes=("sinusoidal", "rotary", "alibi", "t5", "kerple-log", "sandwich", "windowed",
                      "xpos", ("rotary+random", "rotary", {}, 2048), ("alibi+random", "alibi", {}, 2048),
                      "fox", "hybrid", "nope-headscale", "cope", "fire", "dape-alibi", "stick-breaking",
                      "rotary-llama3", "rotary-longrope", "rotary-proportional",
                      # attention options (model.*) on RoPE, ALiBi's sinks on the folded path; PoPE, selective
                      Spec("rotary+sinks", "rotary", model={"sinks": True}),
                      Spec("alibi+sinks", "alibi", model={"sinks": True}),
                      Spec("rotary+ssmax", "rotary", model={"ssmax": True}),
                      Spec("rotary+qk-norm", "rotary", model={"qk_norm": True}),
                      Spec("rotary+gate", "rotary", model={"gate": True}),
                      "pope", "selective",
                      # layer types at these 4 layers (3:1; Gemma 3's 5:1 needs 6k layers: layouts-quick's cost pass)
                      Spec("rnope-swa", "rotary", model={"layout": "rnope-swa"}),
                      Spec("irope", "rotary", model={"layout": "irope"})))


def preset_settings(name: str) -> dict:
    """``run_bench`` keywords at a demo preset's shape (``extrapolab bench --preset gpu-quick``): its
    model sizes and vocabulary, its schemes, its batch; train steps at L_tr and 4·L_tr, long
    forwards at 16·L_tr and 64·L_tr (gpu-quick: 512, 2,048; 8,192, 32,768)."""
    preset = name if name.startswith("demo-") or name.endswith((".yaml", ".yml")) else f"demo-{name}"
    raw = C.load_preset(preset)
    cfg = C.resolve(base=raw)
    L = cfg.model.train_length
    model = replace(ModelConfig(**{k: v for k, v in cfg.model.to_dict().items() if k in ModelConfig.__dataclass_fields__}),
                    vocab_size=int(cfg.data.vocab_size), scheme=BASE, dropout=0.0)
    schemes = [s if isinstance(s, (str, tuple, Spec)) else
               Spec(s.get("label") or s["name"], s["name"], dict(s.get("params") or {}),
                    model=dict(s.get("model") or {}))
               for s in (raw.get("sweep") or {}).get("schemes", QUICK["schemes"])]
    return {"model_cfg": model, "schemes": schemes, "lengths_train": (L, 4 * L), "long_lengths": (16 * L, 64 * L),
            "batch": cfg.train.batch_size, "gen_window": L}


#: row groups in the order run_bench measures them (see the module docstring to add one)
GROUPS: dict[str, Callable[[Context], dict]] = {
    "train": bench_train, "long": bench_long, "generation": bench_generation, "denormals": bench_denormals,
    "profile": bench_profile, "layouts": bench_layouts}
#: the groups a bench runs unless told (``profile`` lists kernels and ``layouts`` times SDPA alone: on request)
DEFAULT_GROUPS = ("train", "long", "generation", "denormals")


def _stderr(msg: str) -> None:
    import sys

    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_bench(schemes=None, lengths_train=(128, 512), long_lengths=(4096, 16384, 65536),
              model_cfg: ModelConfig | None = None, repeats: int = ROUNDS, warmup: int = 2,
              gen_window: int = 256, out_json=None, *, quick: bool = False, batch_tokens: int = 4096,
              long_repeats: int = 3, gen_probes=(1, 2, 4, 8), gen_reps: int = 8, threads: int | None = None,
              device: str = "cpu", groups=None, batch: int | None = None, flush: bool = True,
              progress: bool = True, dtype: str = "fp32") -> dict:
    """Measure every scheme (default: all registered) in one process; write ``out_json`` if given.

    ``dtype`` fp32 | bf16 | fp16 | auto: every timed call runs under that autocast, as training does
    (``auto``: bf16 on a GPU that supports it, fp32 on the CPU)."""
    if quick:
        lengths_train, long_lengths, gen_window = QUICK["lengths_train"], QUICK["long_lengths"], QUICK["gen_window"]
        long_repeats = max(long_repeats, min(QUICK["long_repeats"], repeats))
    specs = as_specs(schemes or (QUICK["schemes"] if quick else positional.names()))
    if repeats < 1 or warmup < 0 or gen_window < 1 or any(int(L) < 2 for L in (*lengths_train, *long_lengths)):
        raise UserError("bench needs repeats >= 1, warmup >= 0, gen_window >= 1 and lengths >= 2")
    groups = list(groups or DEFAULT_GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise UserError(f"unknown bench group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA device; use --device cpu")
    precision = resolve_precision(dtype, dev, what="--dtype")
    cfg = model_cfg or DEMO
    gen_end = gen_window * max(gen_probes) + gen_reps if "generation" in groups else 0
    cfg = replace(cfg, train_length=max(cfg.train_length, *lengths_train, gen_end))
    if threads:
        torch.set_num_threads(int(threads))
    if dev.type == "cpu" and flush:
        flush_denormals(True)  # every row but `denormals` runs as the CLI and the trainer do
    ctx = Context(specs, cfg, dev, int(repeats), int(warmup), _stderr if progress else (lambda m: None),
                  dict(lengths_train=tuple(lengths_train), long_lengths=tuple(long_lengths), batch_tokens=batch_tokens,
                       long_repeats=long_repeats, batch=batch, gen_window=gen_window, gen_probes=gen_probes, gen_reps=gen_reps),
                  precision)
    t0 = time.time()
    res = {"meta": {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(dev), "precision": precision,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "pid": os.getpid(),
        "model": asdict(cfg), "repeats": ctx.rounds, "warmup": ctx.warmup, "long_repeats": max(3, long_repeats),
        "batch_tokens": batch_tokens, "flush_denormals": dev.type == "cpu" and flush,
        "memory": "peak increase over the entry level (extrapolab.memory.PeakMemory), one untimed call",
        "baseline": f"{BASE} (bias-free SDPA is_causal)", "load_avg_start": os.getloadavg()}}
    for g in groups:
        res[g] = GROUPS[g](ctx)
    res["meta"].update(seconds=time.time() - t0, load_avg_end=os.getloadavg())
    if out_json:
        atomic_write_json(out_json, res)
    return res

"""`extrapolab extend hf:PATH`: training-free context extension of a pretrained RoPE model, measured.

On the SAME weights (a local folder or a GGUF file), with L_ctx the model's context:

1. Algorithm 1 (:mod:`extrapolab.align.onepass`) at every L > L_ctx on the first corpus's windows: ``pmax`` /
   ``entropy`` as the thesis runs it, one tau for every softmax, FINDS(1) at L_ctx and FINDS(tau)
   at L one fused forward each, bisection over the grid (~4 forwards per L, shared by both modes);
   ``pmax-layer``, a variant, a tau per layer in one forward at L (plus one at L_ctx); statistics
   from ``align_rows`` sampled query rows per layer;
2. ``full_factors`` (1x, 2x): every method of :data:`.cells.METHODS` -- plain RoPE, PI,
   NTK-aware, dynamic NTK, YaRN, Self-Extend, ReRoPE (+ log-n, as Su's patch), log-n, Algorithm 1's
   tau (P_max, entropy; the per-layer variant) and the length rule tau = log L_ctx / log L -- on
   every corpus: E1, E3, E4
   from the same forwards (:func:`.cells.score_cell`); cells whose settings coincide run once;
3. a method HOLDS at L when, on every corpus measured at L, the perplexity of the last L_ctx
   predictions of its windows (the tokens plain RoPE's 1x cell scores, now after L - L_ctx more
   tokens) is at most ``hold_ratio`` (1.10) x plain RoPE's E1 at L_ctx: it reads L tokens at no
   more than 10% perplexity cost on the same tokens. Each of
   ``long_factors`` (4x) takes the methods that held at the factor before it, best (lowest mean
   ratio) first, at most ``long_methods``, on ``long_corpora``;
4. passkey (chat template where the tokenizer has one; teacher-forced: the value retrieved, and the
   whole answer = greedy exact match, :func:`.cells.passkey_records`): plain RoPE at
   ``passkey_lengths`` and L_ctx (the in-context baseline), and at each of ``passkey_factors`` > 1
   the methods that hold there (at most ``passkey_methods``, best first);
5. the ERF (Sandwich §5.1) at ``erf_factor`` x L_ctx for ``erf_methods`` (``best``: the method that
   holds best at 2x), with transformers' gradient checkpointing;
6. tables, figures, report.md / report.html (:mod:`.report`).

Every cell is stored as JSON under ``<out>/cells`` keyed by the model's sha256 and the cell's
settings (:class:`extrapolab.report.stages.Stages`), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import config as C
from ..io import UserError, atomic_write_json
from ..report.stages import Stages, sayer
from .cells import (ALIGNED, METHODS, OPT_IN, Models, erf_record, passkey_records, score_cell, setting,
                    window_ends)
from .plan import Plan

SECTION = "extend"


@dataclass
class ExtendSpec:
    context: int = 0  # L_ctx: 0 = the model's config (max_position_embeddings); else the L_tr to extend from
    corpora: list[str] = field(default_factory=lambda: ["pydoc", "stdlib"])  # prose, code; the first feeds Alg. 1
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m not in OPT_IN])
    full_factors: list[float] = field(default_factory=lambda: [1.0, 2.0])  # L = f x L_ctx, every method
    long_factors: list[float] = field(default_factory=lambda: [4.0])  # the methods that held at the factor before
    windows: int = 1  # windows per (method, L, corpus): E1 over them, E3 at their ends, E4 per position
    hold_ratio: float = 1.10
    long_methods: int = 2
    long_corpora: list[str] = field(default_factory=lambda: ["pydoc"])
    align_rows: int = 256  # query rows per layer read by Algorithm 1's statistics (0 = all: exact)
    passkey_lengths: list[int] = field(default_factory=lambda: [2048, 4096])  # plain RoPE below L_ctx
    passkey_factors: list[float] = field(default_factory=lambda: [1.0, 2.0])
    passkey_methods: int = 2
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    passkey_n: int = 1
    passkey_chat: bool = True  # the tokenizer's chat template around the prompt, where it has one
    erf_factor: float = 1.0
    erf_methods: list[str] = field(default_factory=lambda: ["rope", "rerope"])
    erf_segments: int = 1
    seed: int = 1
    budget: str = ""


def load_extend_preset(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, ExtendSpec]:
    cfg, spec = C.load_study_preset(name_or_path, overrides, SECTION, ExtendSpec)
    bad = [m for m in spec.methods if m not in METHODS]
    if bad or "rope" not in spec.methods:
        raise UserError(f"extend.methods must include rope (the baseline) and name only {', '.join(METHODS)}; "
                        f"got {spec.methods}")
    full = sorted(float(f) for f in spec.full_factors)
    if not full or full[0] != 1.0 or any(f < 1 for f in [*full, *spec.long_factors]) or (
            spec.long_factors and min(spec.long_factors) <= full[-1]):
        raise UserError("extend.full_factors must start at 1 (the model's context) and extend.long_factors "
                        f"exceed them; got {spec.full_factors} and {spec.long_factors}")
    if not spec.corpora or any(c not in spec.corpora for c in spec.long_corpora):
        raise UserError(f"extend.long_corpora {spec.long_corpora} must be among extend.corpora {spec.corpora}")
    if spec.windows < 1 or spec.passkey_n < 0 or spec.erf_segments < 0 or not spec.hold_ratio > 0 or (
            any(not 0 <= d <= 1 for d in spec.passkey_depths)):
        raise UserError("extend.windows >= 1, passkey_n and erf_segments >= 0, hold_ratio > 0, "
                        "passkey_depths in [0, 1]")
    spec.full_factors, spec.long_factors = full, sorted(float(f) for f in spec.long_factors)
    return cfg, spec


def model_key(loaded) -> dict:
    """What the cells are keyed by: the GGUF file's sha256, or one over a folder's config and weights."""
    g = loaded.info.get("gguf")
    if g:
        return {"sha256": g["sha256"], "file_type": g.get("file_type"), "dtype": loaded.info.get("dtype")}
    h = hashlib.sha256()
    for p in sorted(Path(loaded.path).iterdir()):
        if p.suffix in (".json", ".safetensors", ".bin") and p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return {"sha256": h.hexdigest(), "dtype": loaded.info.get("dtype")}


def _host() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_avg": list(os.getloadavg())}


def run_extend_study(model: str, preset: str = "extend-quick", out: Path | None = None,
                     overrides: list[str] | None = None, progress: bool = True) -> dict:
    """The whole study (module doc); returns {"report", "wall_s", "out", "results"}."""
    from ..hf import ATTN, hf_split
    from ..hf.data import HFCodec, chat_wrap
    from ..align.onepass import align_global, align_layers
    from ..tasks.retrieval import make_examples
    from .report import write_extend_report

    t0 = time.time()
    cfg, spec = load_extend_preset(preset, overrides)
    out = Path(out) if out else Path(cfg.out_dir) / cfg.name
    (out / "cells").mkdir(parents=True, exist_ok=True)
    say = sayer(progress, "extend")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    host = _host()
    dtype = {"auto": "auto", "bf16": "bf16"}.get(cfg.train.precision, "fp32")
    models = Models(model, device=cfg.train.device, dtype=dtype, cache_dir=cfg.data.cache_dir,
                    train_length=spec.context or None)
    from ..hf.evaluate import model_block

    base = models.get(None)
    loaded, L_ctx = base.loaded, int(base.loaded.train_length or 0)
    if loaded.positions != "rope" or not L_ctx:
        raise UserError(f"{model} is a {loaded.family} model with {loaded.positions} positions; the extension "
                        "study needs a RoPE model whose config names its context (max_position_embeddings)")
    key, block, tok = model_key(loaded), model_block(base), loaded.tokenizer
    del base, loaded  # only the Models cache holds a model from here on (one copy of the weights)
    stages = Stages(out, key, say)
    C.save(cfg, out / "config.yaml")
    atomic_write_json(out / "extend-spec.json", dataclasses.asdict(spec))
    plan = Plan(spec, L_ctx)
    tokens = {c: hf_split(dataclasses.replace(cfg.data, corpus=c), tok, cfg.eval.split)
              for c in spec.corpora}
    ends = {c: window_ends(len(tokens[c]), plan.longest(c), spec.windows, f"the {cfg.eval.split} split of {c}")
            for c in spec.corpora}
    chat = chat_wrap(tok) if spec.passkey_chat else None
    first = spec.corpora[0]

    def segs(L):  # Algorithm 1's inputs: the first corpus's cell windows at L
        return np.stack([np.asarray(tokens[first][e - L:e], dtype=np.int64) for e in ends[first]])  # [n, L]

    def aligned(L, methods):  # Algorithm 1's tau at L for the aligned methods among ``methods`` (stored)
        need = [m for m in methods if m in ALIGNED and str(L) not in plan.align_tau.get(m, {})]
        if L <= L_ctx or not need:
            return
        st = {"L": L, "L_ctx": L_ctx, "corpus": first, "ends": ends[first].tolist(), "rows": spec.align_rows}
        modes = [m for m in ("pmax", "entropy") if m in need]
        if modes:  # the thesis' one tau per length; both modes from the same forwards
            res = stages.run(f"cells/align-{L}-{'-'.join(modes)}", {**st, "modes": modes}, lambda: align_global(
                models.get(None, ATTN), segs(L_ctx), {L: segs(L)}, modes=modes, rows=spec.align_rows, say=say))
            plan.align.setdefault(str(L), {})["global"] = res
            for m in modes:
                plan.align_tau.setdefault(m, {})[str(L)] = res["tau"][m][str(L)]
        if "pmax-layer" in need:  # the per-layer variant, one forward at L
            res = stages.run(f"cells/align-{L}-layer", st, lambda: align_layers(
                models.get(None, ATTN), segs(L_ctx), {L: segs(L)}, rows=spec.align_rows, say=say))
            plan.align.setdefault(str(L), {})["layer"] = res
            plan.align_tau.setdefault("pmax-layer", {})[str(L)] = res["tau"][str(L)]

    def e_cells(L, methods, corpora):
        aligned(L, methods)
        for k, group in plan.groups(L, methods).items():
            st0 = setting(group[0], L, L_ctx, plan.align_tau)
            for c in corpora:
                st = {"L": L, "corpus": c, "ends": ends[c].tolist(), "rope": st0.rope, "tau": st0.tau, "tail": L_ctx}
                say(f"L={L} {c}: {', '.join(group)} (--rope {st0.rope or 'none'}, tau {plan.tau_text(st0.tau)})")
                res = stages.run(f"cells/e-{plan.slug(c)}-{L}-{plan.short(k)}", st, lambda st0=st0, c=c: score_cell(
                    models.get(st0.rope), tokens[c], ends[c], L, st0.tau, L_ctx))
                plan.record(L, c, group, st0, res)

    for f in spec.full_factors:
        e_cells(plan.length(f), spec.methods, spec.corpora)
    for f in spec.long_factors:
        L = plan.length(f)
        plan.long[str(L)] = plan.best(plan.previous(f), spec.long_methods)
        e_cells(L, plan.long[str(L)], spec.long_corpora)
    for f in spec.passkey_factors:
        L = plan.length(f)
        methods = ["rope"] if f == 1 else plan.best(L, spec.passkey_methods)
        lengths = sorted({*spec.passkey_lengths, L_ctx}) if f == 1 else [L]
        for m in methods:
            st0 = setting(m, L, L_ctx, plan.align_tau)
            for Lp in lengths:
                ex = make_examples("passkey", [Lp], spec.passkey_depths, spec.passkey_n, spec.seed,
                                   tokenizer=HFCodec(tok), preamble=True, chat=chat)
                st = {"L": Lp, "rope": st0.rope, "tau": st0.tau, "depths": spec.passkey_depths, "n": spec.passkey_n,
                      "seed": spec.seed, "chat": chat is not None, "scoring": "value"}
                say(f"passkey L={Lp}: {m} ({len(ex)} trials)")
                plan.passkey.setdefault(m, {})[str(Lp)] = stages.run(
                    f"cells/passkey-{Lp}-{plan.short(st0.key())}", st,
                    lambda st0=st0, ex=ex: passkey_records(models.get(st0.rope), ex, st0.tau))
    if spec.erf_segments:
        L = plan.length(spec.erf_factor)
        aligned(L, [*spec.erf_methods, *plan.best(plan.length(spec.full_factors[-1]), 1)])  # "best" resolved
        for m in plan.erf_methods(spec.erf_methods, L):
            st0 = setting(m, L, L_ctx, plan.align_tau)
            e = ends[first][:spec.erf_segments]
            st = {"L": L, "rope": st0.rope, "tau": st0.tau, "ends": e.tolist(), "corpus": first}
            say(f"ERF at L={L}: {m}")
            seg = np.stack([np.asarray(tokens[first][x - L:x + 1], dtype=np.int64) for x in e])  # [n, L+1]
            plan.erf[m] = stages.run(f"cells/erf-{L}-{plan.short(st0.key())}", st,
                                     lambda st0=st0, seg=seg: erf_record(models.get(st0.rope), seg, st0.tau))
    host["load_avg_end"] = list(os.getloadavg())
    wall = time.time() - t0
    results = {"model_spec": model, "preset": str(preset), "overrides": list(overrides or []), "budget": spec.budget,
               "spec": dataclasses.asdict(spec), "config": cfg.to_dict(), "model": block, "key": key,
               "L_ctx": L_ctx, "lengths": plan.lengths_table(), "ends": {c: e.tolist() for c, e in ends.items()},
               "chat": chat is not None, **plan.to_dict(), "stage_seconds": stages.seconds, "wall_s": wall,
               "model_loads": models.loads, "host": host}
    atomic_write_json(out / "results.json", results)
    report = write_extend_report(out, results)
    say(f"report: {report} (wall time {wall:.0f} s)")
    return {"report": report, "wall_s": wall, "out": out, "results": results}

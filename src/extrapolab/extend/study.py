"""`extrapolab extend hf:PATH`: training-free context extension of a pretrained RoPE model, measured.

On the SAME weights (a local folder or a GGUF file), with L_ctx the model's context:

1. Algorithm 1 (:mod:`extrapolab.align.onepass`) at every L > L_ctx on the first ``align_windows``
   windows of the first corpus: ``pmax`` / ``entropy`` as the thesis runs it, one tau for every
   softmax, FINDS(1) at L_ctx and FINDS(tau) at L one fused forward each, bisection over the grid
   (~4 forwards per L, shared by both modes); ``pmax-layer``, a variant, a tau per layer in one
   forward at L (plus one at L_ctx); statistics from ``align_rows`` sampled query rows per layer;
2. ``full_factors`` (1x, 2x): every method of :data:`.cells.METHODS` -- plain RoPE, PI,
   NTK-aware, dynamic NTK, YaRN, Self-Extend, ReRoPE (+ log-n, as Su's patch), log-n, Algorithm 1's
   tau (P_max, entropy; the per-layer variant) and the length rule tau = log L_ctx / log L -- on
   every corpus, on ``windows`` windows per cell whose end tokens are the same for every method and
   length (paired): E1, E3, E4 from the same forwards (:func:`.cells.score_cell`); cells whose
   settings coincide run once;
3. a method HOLDS at L when, on every corpus measured at L, the 95% paired interval of the ratio of
   the perplexity of the last L_ctx predictions of its windows (the tokens plain RoPE's 1x cell
   scores, now after L - L_ctx more tokens) to plain RoPE's E1 at L_ctx lies at or below
   ``hold_ratio`` (1.10); it FAILS when on some corpus the interval lies above; else it is
   UNRESOLVED (:mod:`.plan`). Each of ``long_factors`` (4x) takes the methods that held at the
   factor before it, best (lowest mean ratio) first, at most ``long_methods``, on ``long_corpora``,
   on ``long_windows`` of the corpus's window ends at least that L apart;
4. passkey (chat template where the tokenizer has one; teacher-forced: the value retrieved, and the
   whole answer = greedy exact match, :func:`.cells.passkey_records`) at each of
   ``passkey_factors``: plain RoPE also at ``passkey_lengths`` below L_ctx; at 1x every method
   (coinciding settings once); beyond, plain RoPE where it was measured and the ``passkey_methods``
   best methods that hold there (0: every method measured there);
5. the ERF (Sandwich §5.1) at ``erf_factor`` x L_ctx for ``erf_methods`` (``best``: the method that
   holds best at 2x), with transformers' gradient checkpointing;
6. tables, figures, report.md / report.html (:mod:`.report`).

Every cell is stored as JSON under ``<out>/cells`` keyed by the model's sha256 and the cell's
settings (:class:`extrapolab.report.stages.Stages`), so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import torch

from .. import config as C
from ..data.origin import corpus_provenance
from ..io import UserError, atomic_write_json
from ..report.stages import Stages, sayer
from .cells import ALIGNED, Models, erf_record, niah_records, passkey_records, score_cell, setting, spaced, window_ends
from .plan import Plan
from .spec import host, load_extend_preset, model_key


def run_extend_study(model: str, preset: str = "extend-quick", out: Path | None = None,
                     overrides: list[str] | None = None, progress: bool = True) -> dict:
    """The whole study (module doc); returns {"report", "wall_s", "out", "results"}."""
    from ..align.onepass import align_global, align_layers
    from ..hf import ATTN, hf_split
    from ..hf.data import HFCodec, chat_wrap
    from ..hf.evaluate import model_block
    from ..tasks.retrieval import make_examples
    from ..tasks.ruler import ruler_samples
    from ..tasks.ruler.fit import TooShort
    from .report import write_extend_report

    t0 = time.time()
    cfg, spec = load_extend_preset(preset, overrides)
    out = Path(out) if out else Path(cfg.out_dir) / cfg.name
    say = sayer(progress, "extend")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    at_start = host()
    dtype = {"auto": "auto", "bf16": "bf16"}.get(cfg.train.precision, "fp32")
    models = Models(model, device=cfg.train.device, dtype=dtype, cache_dir=cfg.data.cache_dir,
                    train_length=spec.context or None)
    base = models.get(None)
    loaded, L_ctx = base.loaded, int(base.loaded.train_length or 0)
    if loaded.positions != "rope" or not L_ctx:
        raise UserError(f"{model} is a {loaded.family} model with {loaded.positions} positions; the extension "
                        "study needs a RoPE model whose config names its context (max_position_embeddings)")
    key, block, tok = model_key(loaded), model_block(base), loaded.tokenizer
    del base, loaded  # only the Models cache holds a model from here on (one copy of the weights)
    plan = Plan(spec, L_ctx)
    tokens = {c: hf_split(dataclasses.replace(cfg.data, corpus=c), tok, cfg.eval.split)
              for c in spec.corpora}
    ends = {c: window_ends(len(tokens[c]), plan.longest(c), plan.spacing(), spec.windows,
                           f"the {cfg.eval.split} split of {c}") for c in spec.corpora}
    chat = chat_wrap(tok) if spec.passkey_chat else None
    (out / "cells").mkdir(parents=True, exist_ok=True)  # nothing is written before the inputs are checked
    stages = Stages(out, key, say)
    C.save(cfg, out / "config.yaml")
    atomic_write_json(out / "extend-spec.json", dataclasses.asdict(spec))
    first = spec.corpora[0]
    a_ends = ends[first][:spec.align_windows]

    def segs(L):  # Algorithm 1's inputs: the first corpus's first windows at L
        return np.stack([np.asarray(tokens[first][e - L:e], dtype=np.int64) for e in a_ends])  # [n, L]

    def aligned(L, methods):  # Algorithm 1's tau at L for the aligned methods among ``methods`` (stored)
        need = [m for m in methods if m in ALIGNED and str(L) not in plan.align_tau.get(m, {})]
        if L <= L_ctx or not need:
            return
        st = {"L": L, "L_ctx": L_ctx, "corpus": first, "ends": a_ends.tolist(), "rows": spec.align_rows}
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

    def e_cells(L, methods, corpora, long=False):
        aligned(L, methods)
        for k, group in plan.groups(L, methods).items():
            st0 = setting(group[0], L, L_ctx, plan.align_tau)
            for c in corpora:
                e = spaced(ends[c], L, spec.long_windows) if long else ends[c]
                st = {"L": L, "corpus": c, "ends": e.tolist(), "rope": st0.rope, "tau": st0.tau, "tail": L_ctx,
                      "per_window": True}
                say(f"L={L} {c}: {', '.join(group)} (--rope {st0.rope or 'none'}, tau {plan.tau_text(st0.tau)}, "
                    f"{len(e)} windows)")
                res = stages.run(f"cells/e-{plan.slug(c)}-{L}-{plan.short(k)}", st, lambda st0=st0, e=e: score_cell(
                    models.get(st0.rope), tokens[c], e, L, st0.tau, L_ctx))
                plan.record(L, c, group, st0, res)

    def fits(L):  # RULER's needle task fits L tokens (its smallest haystack); said once when it does not
        try:
            ruler_samples(spec.niah_task, L, tok, spec.niah_n, chat="auto" if chat else "off",
                          cache_dir=cfg.data.cache_dir)
            return True
        except TooShort as err:
            say(f"{spec.niah_task} skipped at L={L}: {err}")
            return False

    def passkey(f):  # the passkey (and RULER needle) cells at factor f (module doc, step 4)
        L = plan.length(f)
        measured = [m for m in spec.methods if plan.cells.get(m, {}).get(str(L))]
        chosen = measured if f == 1 or not spec.passkey_methods else \
            [*(["rope"] if "rope" in measured else []), *plan.best(L, spec.passkey_methods)]
        todo = [(Lp, ["rope"]) for Lp in sorted(set(spec.passkey_lengths)) if Lp < L_ctx] if f == 1 else []
        for Lp, methods in [*todo, (L, chosen)]:
            ex = make_examples("passkey", [Lp], spec.passkey_depths, spec.passkey_n, spec.seed,
                               tokenizer=HFCodec(tok), preamble=True, chat=chat)
            for k, group in plan.groups(L, methods).items():  # below L_ctx plain RoPE is RoPE at L_ctx
                st0 = setting(group[0], L, L_ctx, plan.align_tau)
                st = {"L": Lp, "rope": st0.rope, "tau": st0.tau, "depths": spec.passkey_depths, "n": spec.passkey_n,
                      "seed": spec.seed, "chat": chat is not None, "scoring": "value"}
                say(f"passkey L={Lp}: {', '.join(group)} ({len(ex)} trials)")
                plan.record_task("passkey", Lp, group, stages.run(
                    f"cells/passkey-{Lp}-{plan.short(st0.key())}", st,
                    lambda st0=st0, ex=ex: passkey_records(models.get(st0.rope), ex, st0.tau)))
                if spec.niah_task and spec.niah_n and st0.tau == 1.0 and fits(Lp):  # RULER's reader: no temperature
                    st = {"L": Lp, "rope": st0.rope, "task": spec.niah_task, "n": spec.niah_n,
                          "chat": chat is not None, "scoring": "teacher-forced"}
                    say(f"{spec.niah_task} L={Lp}: {', '.join(group)} ({spec.niah_n} samples)")
                    plan.record_task("niah", Lp, group, stages.run(
                        f"cells/niah-{Lp}-{plan.short(st0.key())}", st,
                        lambda st0=st0, Lp=Lp: niah_records(models.get(st0.rope), spec.niah_task, Lp, tok,
                                                            spec.niah_n, chat is not None, cfg.data.cache_dir)))

    for f in spec.full_factors:
        e_cells(plan.length(f), spec.methods, spec.corpora)
    for f in spec.long_factors:
        L = plan.length(f)
        plan.long[str(L)] = plan.best(plan.previous(f), spec.long_methods)
        e_cells(L, plan.long[str(L)], spec.long_corpora, long=True)
    for f in spec.passkey_factors:
        passkey(f)
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
    at_start["load_avg_end"] = list(os.getloadavg())
    wall = time.time() - t0
    results = {"model_spec": model, "preset": str(preset), "overrides": list(overrides or []), "budget": spec.budget,
               "spec": dataclasses.asdict(spec), "config": cfg.to_dict(), "model": block, "key": key,
               "L_ctx": L_ctx, "lengths": plan.lengths_table(), "ends": {c: e.tolist() for c, e in ends.items()},
               "chat": chat is not None, **plan.to_dict(), "stage_seconds": stages.seconds, "wall_s": wall,
               "model_loads": models.loads, "host": at_start,
               "corpora": {c: corpus_provenance(dataclasses.replace(cfg.data, corpus=c))  # which texts (hosts differ)
                           for c in spec.corpora}}
    atomic_write_json(out / "results.json", results)
    report = write_extend_report(out, results)
    say(f"report: {report} (wall time {wall:.0f} s)")
    return {"report": report, "wall_s": wall, "out": out, "results": results}

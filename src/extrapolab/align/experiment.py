"""`extrapolab align experiment`: thesis ch. 5's result in one command (docs/protocols.md, "Beyond recency").

1. train (resumably, with the ordinary trainer) one model -- a T5-bias GPT in the align presets --
   at L_tr on the corpus's train split mixed with generated retrieval documents
   (:func:`extrapolab.tasks.retrieval.retrieval_stream`);
2. Algorithm 1 in both modes (P_max, entropy) plus the length rule and Props. 5.1/5.2 at every
   L_ex, stored as ``<out>/run/temperature.json`` (so ``extrapolab eval <out>/run --temperature
   auto`` works afterwards);
3. E1 nonoverlapping perplexity on the corpus's test split at L_tr and every L_ex with tau=1 and
   with each rule's tau;
4. exact-match retrieval accuracy (passkey, key-value lines) per rule x length x needle depth, the
   rules including Algorithm 1 run on each task's own prompts (``pmax@task``, ``entropy@task``;
   thesis Table 5.9 picks tau per task);
5. tables (markdown + CSV), heat maps, the temperature curves and ``report.html``
   (:mod:`.align_tables`).

The experiment's own settings sit in the preset's ``align:`` section (:class:`AlignSpec`,
``--set align.n=4`` works as for any key). Each evaluation stage stores its result as JSON keyed
by the trained model and the settings it used, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import config as C
from ..data import TokenData, prepare, provenance
from ..eval.perplexity import nonoverlapping
from ..io import UserError, atomic_write_json
from ..model.attention import AttnOptions
from ..report.stages import Stages, sayer
from ..tasks.retrieval import KINDS, make_examples, retrieval_stream, score
from ..train import load_model, run_placement, train
from .algorithm import align, collect_logit_stats, load_temperature, save_temperature
from .rules import GRID, MODES, canonical_rule, pick_tau
from .tables import write_report
from .temperature import temperature_scope

ALL_RULES = ["none", "pmax", "entropy", "length", "prop51", "prop52"]


@dataclass
class AlignSpec:
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])  # L_ex (> L_tr)
    task_mix: str = "mix"  # retrieval documents in the training mixture: passkey | kv | mix | none
    task_ratio: float = 1.0  # retrieval tokens per corpus train token
    corpus_tokens: int = 0  # cap on the corpus train tokens used (0 = the whole train split)
    tasks: list[str] = field(default_factory=lambda: ["passkey", "kv"])  # scored retrieval tasks
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    n: int = 8  # retrieval examples per (task, length, depth)
    retrieval_lengths: list[int] = field(default_factory=list)  # default: L_tr and every L_ex
    rules: list[str] = field(default_factory=lambda: list(ALL_RULES))
    segments: int = 4  # Algorithm 1 sequences per length
    propagate: bool = True  # Algorithm 1 as written (one forward per grid tau)
    task_align: bool = True  # also Algorithm 1 on each task's own prompts (thesis Table 5.9): rules pmax@task, entropy@task
    ppl_tokens: int = 32768  # tokens scored per (rule, length); 0 = the whole test split
    seed: int = 1  # retrieval examples (training documents use train.seed)
    batch_size: int = 8  # retrieval decoding batch
    budget: str = ""


def sorted_lengths(lengths, train_length: int, section: str) -> list[int]:
    """The study's L_ex, sorted and unique; each must exceed L_tr (one-line error naming the key)."""
    out = sorted({int(L) for L in lengths})
    if not out or min(out) <= train_length:
        raise UserError(f"{section}.lengths must all exceed model.train_length={train_length}, got {out}")
    return out


def load_align_preset(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, AlignSpec]:
    cfg, spec = C.load_study_preset(name_or_path, overrides, "align", AlignSpec)
    L_tr = cfg.model.train_length
    spec.lengths = sorted_lengths(spec.lengths, L_tr, "align")
    spec.rules = list(dict.fromkeys(canonical_rule(r) for r in spec.rules))
    if spec.task_mix not in (*KINDS, "mix", "none"):
        raise UserError(f"align.task_mix must be one of {', '.join(KINDS)}, mix, none; got {spec.task_mix!r}")
    bad = [t for t in spec.tasks if t not in KINDS]
    if bad or any(not 0 <= d <= 1 for d in spec.depths) or spec.n < 1 or spec.segments < 1:
        raise UserError(f"align.tasks must be in {KINDS}, align.depths in [0, 1], align.n and align.segments >= 1")
    spec.retrieval_lengths = sorted({int(L) for L in spec.retrieval_lengths} or {L_tr, *spec.lengths})
    return cfg, spec


def training_mixture(data, cfg: C.RunConfig, spec: AlignSpec):
    """TokenData whose train split is the corpus's (capped) followed by retrieval documents; the
    trainer's random windows then sample both. Valid and test stay the corpus's."""

    corpus = np.asarray(data.split("train"))
    if spec.corpus_tokens > 0:
        corpus = corpus[:spec.corpus_tokens]
    parts = [corpus]
    if spec.task_mix != "none" and spec.task_ratio > 0:
        n = int(round(corpus.size * spec.task_ratio))
        parts.append(retrieval_stream(spec.task_mix, n, cfg.model.train_length, seed=cfg.train.seed,
                                      tokenizer=data).astype(corpus.dtype))
    mix = TokenData.from_arrays(np.concatenate(parts), data.split("valid"), data.split("test"),
                                data.vocab_size, data.eot_id)
    sizes = {"corpus_train_tokens": int(corpus.size), "retrieval_train_tokens": int(sum(p.size for p in parts[1:])),
             "task_mix": spec.task_mix, "seed": cfg.train.seed, "document_length": cfg.model.train_length}
    return mix, sizes


def _check_mixture(run_dir: Path, sizes: dict) -> None:
    path = run_dir / "mixture.json"
    if path.is_file() and (run_dir / "checkpoints").is_dir():
        old = json.loads(path.read_text())
        if old != sizes:
            raise UserError(f"{run_dir} was trained on another mixture ({old}); use the same align.* data settings "
                            "or another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, sizes)


def rule_taus(run_dir: Path, rules, lengths) -> dict:
    """{rule: {L: tau or None}} from ``run_dir``/temperature.json (None: the rule gave no tau)."""

    out = {}
    for rule in rules:
        row = {}
        for L in lengths:
            try:
                tau = 1.0 if rule == "none" else load_temperature(run_dir, L, rule)
                row[L] = tau if math.isfinite(tau) else None
            except UserError:
                row[L] = None
        out[rule] = row
    return out


def measure_ppl(model, tokens, taus: dict, spec: AlignSpec, batch_size: int) -> dict:
    """{rule: {L: {"tau", "ppl"}}}: E1 nonoverlapping perplexity, one evaluation per distinct tau."""

    base = getattr(model, "attn_opts", None) or AttnOptions()
    memo: dict = {}
    out: dict = {}
    for rule, row in taus.items():
        out[rule] = {}
        for L, tau in row.items():
            if tau is None:
                out[rule][str(L)] = {"tau": None, "ppl": None}
                continue
            if (L, tau) not in memo:
                opts = dataclasses.replace(base, temperature=tau)
                memo[(L, tau)] = nonoverlapping(model, tokens, L, max_tokens=spec.ppl_tokens, batch_size=batch_size,
                                                opts=opts)["ppl"]
            out[rule][str(L)] = {"tau": tau, "ppl": memo[(L, tau)]}
    return out


def measure_retrieval(model, task: str, taus: dict, spec: AlignSpec, tokenizer) -> list[dict]:
    """Exact-match records per rule x length x depth; each (length, tau) is decoded once."""

    records = []
    for L in spec.retrieval_lengths:
        examples = make_examples(task, [L], spec.depths, spec.n, spec.seed, tokenizer=tokenizer, preamble=False)
        memo: dict = {}
        for rule, row in taus.items():
            tau = row.get(L)
            if tau is None:
                continue
            if tau not in memo:
                memo[tau] = score(model, examples, tau, spec.batch_size, rule, scope=temperature_scope)
            records += [{**r, "rule": rule} for r in memo[tau]]
    return records


def task_alignment(model, task: str, spec: AlignSpec, train_length: int, tokenizer) -> dict:
    """Algorithm 1 on ``task``'s own prompts (as thesis Table 5.9 aligns per task):
    {"pmax": {L: tau}, "entropy": {L: tau}}. The prompts use another seed than the scored examples;
    the ``segments`` prompts of one length are cut to their shortest (dropping leading tokens)."""

    def prompts(L: int) -> np.ndarray:
        per_depth = -(-spec.segments // len(spec.depths))
        ex = make_examples(task, [L], spec.depths, per_depth, spec.seed + 7919, tokenizer=tokenizer,
                           preamble=False)[:spec.segments]
        m = min(len(e.prompt) for e in ex)
        return np.array([e.prompt[-m:] for e in ex], dtype=np.int64)  # [segments, m]

    tr = collect_logit_stats(model, prompts(train_length), [1.0])
    out: dict = {m: {} for m in MODES}
    for L in spec.lengths:
        ex = collect_logit_stats(model, prompts(L), GRID, propagate=spec.propagate)
        for m in MODES:
            out[m][str(L)] = pick_tau(tr[m][0], list(GRID), ex[m])
    return out


def _with_task_rules(taus: dict, task_tau: dict, train_length: int) -> dict:
    """Add rules "<mode>@task" (tau 1 up to L_tr, the task-aligned tau at each aligned L_ex)."""
    out = dict(taus)
    for mode, row in task_tau.items():
        lengths = next(iter(taus.values())).keys()
        out[f"{mode}@task"] = {L: 1.0 if L <= train_length else row.get(str(L)) for L in lengths}
    return out


def train_on_mixture(cfg: C.RunConfig, spec, out: Path, spec_file: str, say, progress: bool = True):
    """Prepare the corpus, train (resumably) on the corpus + retrieval mixture into ``out``/run and load
    its best checkpoint; shared by `align experiment` and `align rope`. ``spec`` (a dataclass) needs
    ``task_mix``, ``task_ratio``, ``corpus_tokens`` and is saved as ``out``/``spec_file``.
    Returns (data, mixture sizes, run_dir, train summary, training wall s, model in eval mode, placement)."""
    out.mkdir(parents=True, exist_ok=True)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    data = prepare(cfg.data, progress=progress)
    mix, sizes = training_mixture(data, cfg, spec)
    run_dir = out / "run"
    _check_mixture(run_dir, sizes)
    C.save(cfg, out / "config.yaml")
    atomic_write_json(out / spec_file, dataclasses.asdict(spec))
    say(f"training {cfg.model.scheme} at L_tr={cfg.model.train_length} on {sizes} -> {run_dir}")
    t = time.time()
    summary = train(cfg, run_dir, data=mix, progress=progress)
    train_wall = time.time() - t
    place = run_placement(cfg.train)  # measure where (and in the precision) the model trained
    model, _ = load_model(run_dir, which="best", device=place.device)
    return data, sizes, run_dir, summary, train_wall, model.eval(), place


def run_align_experiment(preset: str, out: Path | None = None, overrides: list[str] | None = None,
                         progress: bool = True) -> dict:
    """Train, align, measure and write the report; returns {"report", "wall_s", "out", "results"}."""

    t0 = time.time()
    cfg, spec = load_align_preset(preset, overrides)
    out = Path(out) if out else Path(cfg.out_dir) / cfg.name
    say = sayer(progress)
    data, sizes, run_dir, summary, train_wall, model, place = train_on_mixture(cfg, spec, out, "align-spec.json",
                                                                               say, progress)
    L_tr = cfg.model.train_length
    tokens = data.split(cfg.eval.split)
    model_key = {k: summary.get(k) for k in ("steps", "best_step", "best_valid_loss", "params")}
    stages = Stages(out, model_key, say, place.autocast)
    settings = {k: getattr(spec, k) for k in ("lengths", "segments", "propagate")} | {"seed": cfg.train.seed}
    res = stages.run("align", settings, lambda: align(
        model, tokens, L_tr, spec.lengths, MODES, n_segments=spec.segments, propagate=spec.propagate,
        seed=cfg.train.seed, progress=say))
    res.update(run=cfg.name, scheme=cfg.model.scheme, split=cfg.eval.split)
    save_temperature(run_dir, res)
    taus = rule_taus(run_dir, spec.rules, [L_tr, *spec.lengths])
    say("perplexity with tau=1 and each rule")
    ppl = stages.run("ppl", {"taus": taus, "tokens": spec.ppl_tokens},
                     lambda: measure_ppl(model, tokens, taus, spec, cfg.eval.batch_size))
    retrieval = {}
    rtaus = rule_taus(run_dir, spec.rules, spec.retrieval_lengths)
    task_taus = {}
    for task in spec.tasks:
        if spec.task_align:
            say(f"Algorithm 1 on {task} prompts")
            ts = settings | {"depths": spec.depths, "prompt_seed": spec.seed}
            task_taus[task] = stages.run(f"task-align-{task}", ts, lambda task=task: task_alignment(
                model, task, spec, L_tr, data))
        t_taus = _with_task_rules(rtaus, task_taus[task], L_tr) if spec.task_align else rtaus
        say(f"retrieval: {task}")
        rs = {k: getattr(spec, k) for k in ("retrieval_lengths", "depths", "n", "seed")} | {"taus": t_taus}
        retrieval[task] = stages.run(f"retrieval-{task}", rs, lambda task=task, t_taus=t_taus: measure_retrieval(
            model, task, t_taus, spec, data))
    wall = time.time() - t0
    results = {"preset": str(preset), "budget": spec.budget, "spec": dataclasses.asdict(spec),
               "config": cfg.to_dict(), "train": summary, "mixture": sizes, "align": res, "taus": taus,
               "task_taus": task_taus, "ppl": ppl, "retrieval": retrieval, "wall_s": wall, "train_wall_s": train_wall,
               "stage_seconds": stages.seconds, "data": provenance(data)}  # which text of the corpus
    atomic_write_json(out / "results.json", results)
    report = write_report(out, results)
    say(f"report: {report} (wall time {wall:.0f} s)")
    return {"report": report, "wall_s": wall, "out": out, "results": results}

"""Sweeps (E7/E8): train a grid of schemes x seeds x datasets, evaluate, record, report.

Resumable: a run whose row in ``results.sqlite`` is 'done' is skipped; an unfinished run resumes
from its last checkpoint. Every number in the report comes from the database, so
``extrapolab report DIR`` regenerates all tables and figures without training.
"""
from __future__ import annotations

import copy
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import config as C
from ..io import LockBusy, UserError, is_locked, run_lock, run_lock_path
from ..report.db import ResultsDB
from .progress import Monitor
from .record import curve_series, evaluate_run_dir, flatten_eval


@dataclass
class SchemeSpec:
    name: str
    params: dict = field(default_factory=dict)
    label: str = ""
    model: dict = field(default_factory=dict)  # model.* overrides of this entry, e.g. {arch: regulargpt, C: 8}
    train: dict = field(default_factory=dict)  # train.* overrides of this entry, e.g. {positions: random:2048}

    def __post_init__(self):
        if not self.label:
            extra = ",".join(f"{k}={v}" for k, v in {**self.params, **self.model, **self.train}.items())
            self.label = f"{self.name}({extra})" if extra else self.name


@dataclass
class ModelSpec:
    """A pretrained model listed next to the trained runs (``models:`` in the sweep section)."""

    source: str  # hf:PATH
    label: str = ""
    rope: str | None = None
    train_length: int | None = None

    @classmethod
    def parse(cls, entry) -> "ModelSpec":
        d = {"source": entry} if isinstance(entry, str) else dict(entry or {})
        src = str(d.get("source") or d.get("path") or "")
        if not src.startswith("hf:"):
            raise UserError(f"sweep model entry {entry!r} must be hf:PATH or {{source: hf:PATH, label: ..., "
                            "rope: yarn:4, train_length: ...}}")
        label = str(d.get("label") or "hf:" + Path(src[3:]).name + (f"+{d['rope']}" if d.get("rope") else ""))
        return cls(src, label, d.get("rope"), d.get("train_length"))


@dataclass
class SweepSpec:
    schemes: list[SchemeSpec]
    seeds: list[int]
    datasets: list[str]
    reference: str
    budget: str = ""
    workers: int = 1  # runs trained in parallel processes (threads split between them)
    cost_rounds: int = 7  # paired rounds of the cost bench pass after training
    models: list[ModelSpec] = field(default_factory=list)  # hf: models evaluated next to the runs
    #: stop between runs when the next would end past this many seconds of the invocation (0: no
    #: limit); the same command resumes the rest, so a sweep fits jobs of a short GPU slot
    time_budget_s: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "SweepSpec":
        if not isinstance(d, dict) or not d.get("schemes"):
            raise UserError("sweep config needs a `sweep:` section with a non-empty `schemes:` list")
        schemes = []
        for s in d["schemes"]:
            if isinstance(s, str):
                schemes.append(SchemeSpec(s))
            elif isinstance(s, dict) and "name" in s:
                schemes.append(SchemeSpec(s["name"], dict(s.get("params") or {}), s.get("label", ""),
                                          dict(s.get("model") or {}), dict(s.get("train") or {})))
                if "seed" in schemes[-1].train:
                    raise UserError(f"sweep scheme entry {s['name']!r} sets train.seed; the seeds come from sweep.seeds")
            else:
                raise UserError(f"sweep scheme entry {s!r} must be a name or {{name: ..., params: {{...}}, "
                                "model: {...}, train: {...}}}")
        labels = [s.label for s in schemes]
        ref = str(d.get("reference") or labels[0])
        if ref not in labels:
            raise UserError(f"sweep reference {ref!r} is not one of the swept schemes: {', '.join(labels)}")
        seeds = [int(x) for x in d.get("seeds", [0])]
        datasets = [str(x) for x in d.get("datasets", ["stdlib"])]
        workers = int(d.get("workers", 1))
        rounds = int(d.get("cost_rounds", 7))
        if workers < 1 or rounds < 1:
            raise UserError(f"sweep.workers and sweep.cost_rounds must be >= 1, got {workers} and {rounds}")
        models = [ModelSpec.parse(m) for m in d.get("models") or []]
        budget_s = float(d.get("time_budget_s") or 0)
        if budget_s < 0 or (budget_s and workers > 1):
            raise UserError(f"sweep.time_budget_s={budget_s:g} needs a value >= 0 and sweep.workers=1 "
                            f"(got workers={workers}); pass --set sweep.workers=1 or --set sweep.time_budget_s=0")
        return cls(schemes, seeds, datasets, ref, str(d.get("budget", "")), workers, rounds, models, budget_s)


def load_sweep(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, SweepSpec]:
    raw = C.apply_overrides(C.load_preset(name_or_path), overrides or [])
    spec = SweepSpec.from_dict(raw.get("sweep") or {})
    base = C.resolve(base=raw)
    from ..positional import build

    for s in spec.schemes:  # fail fast on unknown schemes/options, before any training
        entry_config(base, s)  # an entry's model.* overrides (RegularGPT C, K) are checked too
        params = dict(s.params)
        if s.name == "learned":
            params.setdefault("max_length", base.model.train_length)
        build(s.name, num_heads=base.model.heads, **params)
    return base, spec


def entry_config(base: C.RunConfig, scheme: SchemeSpec) -> C.RunConfig:
    """``base`` with this entry's scheme, model and train overrides, validated (a copy)."""
    cfg = copy.deepcopy(base)
    cfg.model.scheme, cfg.model.scheme_params = scheme.name, dict(scheme.params)
    model = C.from_dict(type(cfg.model), {**cfg.model.to_dict(), **scheme.model}, "sweep scheme model")
    cfg.model = model
    cfg.train = C.from_dict(type(cfg.train), {**cfg.to_dict()["train"], **scheme.train}, "sweep scheme train")
    C.regular_scheme(cfg, [f"model.scheme={scheme.name}"])  # the entry names its scheme explicitly
    C.validate(cfg)
    return cfg


def run_id(dataset: str, scheme: SchemeSpec, seed: int) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in scheme.label)
    return f"{dataset}--{safe}--s{seed}"


def run_sweep(name_or_path: str, out: Path | None = None, overrides: list[str] | None = None,
              progress: bool = True) -> dict:
    from ..data import prepare

    t0 = time.time()
    base, spec = load_sweep(name_or_path, overrides)
    out = Path(out) if out else Path(base.out_dir) / base.name
    out.mkdir(parents=True, exist_ok=True)
    C.save(base, out / "sweep-config.yaml")
    db = ResultsDB(out / "results.sqlite")
    db.set_meta(name=base.name, preset=str(name_or_path), budget=spec.budget, reference=spec.reference,
                train_length=base.model.train_length, lengths=base.eval.lengths,
                protocols=base.eval.protocols,
                schemes=[s.label for s in spec.schemes] + [m.label for m in spec.models],
                seeds=spec.seeds, datasets=spec.datasets)
    grid = [(d, s, seed) for d in spec.datasets for s in spec.schemes for seed in spec.seeds]
    todo = [(i, d, s, seed) for i, (d, s, seed) in enumerate(grid, 1) if db.status(run_id(d, s, seed)) != "done"]
    workers = max(1, min(spec.workers, len(todo)))
    _say(progress, f"sweep {base.name}: {len(grid)} runs ({len(grid) - len(todo)} already done, "
                   f"{workers} worker{'s' if workers > 1 else ''}) -> {out}")
    vocab = {}
    for d in spec.datasets:  # tokenize once, before any worker starts
        cfg = copy.deepcopy(base)
        cfg.data.corpus = d
        vocab[d] = int(prepare(cfg.data, progress=progress).vocab_size)
    jobs = []
    tail = len(todo) % workers if workers > 1 and len(todo) > workers else 0  # runs left for the last round
    for n, (i, dataset, scheme, seed) in enumerate(todo):
        rid = run_id(dataset, scheme, seed)
        holder = is_locked(run_lock_path(out / "runs" / rid))  # _run_job checks again, under the lock
        if holder:
            _say(progress, f"[{i}/{len(grid)}] {rid}: skipped, another process is on it ({holder}); "
                           "re-run this sweep later for its results")
            continue
        cfg = entry_config(base, scheme)
        cfg.name, cfg.out_dir = rid, str(out / "runs")
        cfg.train.seed, cfg.data.corpus = seed, dataset
        if workers > 1 and not cfg.train.threads:  # the last round's runs share the cores the pool freed
            cfg.train.threads = max(1, (os.cpu_count() or 1) // (tail if n >= len(todo) - tail else workers))
        db.mark(rid, dataset=dataset, scheme=scheme.name, label=scheme.label, seed=seed,
                status="queued", run_dir=str(out / "runs" / rid), config=cfg.to_dict())
        jobs.append((str(out), rid, cfg.to_dict(), f"[{i}/{len(grid)}] {rid}"))
    left = 0  # runs the time budget left for the next invocation
    with Monitor(out, [j[1] for j in jobs], base.train.steps, workers, enabled=progress) as mon:
        if workers == 1:
            took = run_seconds(db)  # what one run took here before: the budget's estimate of the next
            for n, job in enumerate(jobs):
                # every invocation starts at least one run (a killed one resumes from its checkpoint)
                if n and spec.time_budget_s and time.time() - t0 + max(took) > spec.time_budget_s:
                    left = len(jobs) - n
                    break
                t1 = time.time()
                mon.say(_run_job(job, False))
                took.append(time.time() - t1)
        else:  # independent runs in parallel processes; each records its own rows in one transaction
            head, last = (jobs[:-tail], jobs[-tail:]) if tail else (jobs, [])
            ctx = multiprocessing.get_context("spawn")
            for group, n_proc in ((head, workers), (last, tail)):
                if not group:
                    continue
                with ProcessPoolExecutor(max_workers=n_proc, mp_context=ctx, initializer=exit_with_parent,
                                         initargs=(os.getpid(),)) as pool:
                    for fut in as_completed([pool.submit(_run_job, job, False) for job in group]):
                        mon.say(fut.result())
        cost = None
        if left:
            mon.say(f"time budget: {left} of {len(grid)} runs left after {time.time() - t0:.0f} s of "
                    f"sweep.time_budget_s={spec.time_budget_s:g}; run the same command again to continue")
        else:
            evaluate_models(out, base, spec, db, False)
            mon.phase = "cost: one bench pass over the schemes (seconds to a minute)"
            cost = cost_section(db, base, spec, vocab, mon.say)
    wall = time.time() - t0
    db.set_meta(last_wall_s=wall, **({"cost_bench": cost} if cost else {}))
    report = rebuild_report(out, wall_s=wall)
    db.close()
    return {"report": report, "wall_s": wall, "out": out, "runs_left": left}


def run_seconds(db: ResultsDB) -> list[float]:
    """Wall seconds (training + evaluation + analysis) of the finished runs recorded in ``db``."""
    out = []
    for r in db.runs(status="done"):
        sm = r["summary"]
        total = sum(float(sm.get(k) or 0) for k in ("wall_seconds", "eval_wall_s", "analysis_wall_s"))
        if total > 0:
            out.append(total)
    return out


def cost_section(db: ResultsDB, base: C.RunConfig, spec: SweepSpec, vocab: dict, say) -> dict | None:
    """The report's E8 ratios: one bench pass in this process, unless one with these settings is stored."""
    from .cost import bench_settings, run_cost_bench

    ds = spec.datasets[0]
    stored = db.meta().get("cost_bench")
    if stored and stored.get("settings") == json.loads(json.dumps(bench_settings(base, vocab[ds], spec.schemes, spec.cost_rounds))):
        return None
    t = time.time()
    res = run_cost_bench(base, vocab[ds], spec.schemes, spec.workers, spec.cost_rounds, say)
    res["seconds"] = time.time() - t
    say(f"cost: bench pass done in {res['seconds']:.0f} s")
    return res


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """Worker initializer: end this worker when the sweep process is gone (killed by SIGTERM/SIGKILL,
    which a process pool does not pass on), so no orphan keeps training and holding a run lock.
    The run resumes from its last checkpoint when the sweep is started again."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(143)  # like SIGTERM: the parent went away

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _run_job(job: tuple, progress: bool) -> str:
    """Train (resuming) and evaluate one sweep run, then record it; runs in a worker process too."""
    from ..data import prepare
    from ..train import train

    out, rid, cfg_dict, tag = job
    cfg = C.from_dict(C.RunConfig, cfg_dict)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(out) / "runs" / rid
    db = ResultsDB(Path(out) / "results.sqlite")
    try:  # one process per run: another sweep (or `extrapolab train`) on it -> skip, leave its row alone
        with run_lock(run_dir, owner=f"sweep {out}: {rid}"):
            if db.status(rid) == "done":  # finished by another sweep since this one listed it
                return f"{tag}: done by another process"
            db.set_status(rid, "training")
            data = prepare(cfg.data, progress=False)
            summary = train(cfg, run_dir, data=data, progress=progress)
            db.set_status(rid, "evaluating")
            scalars, series, extra = evaluate_run_dir(run_dir, cfg, data)
            series += curve_series(run_dir, summary)  # the report's training curves
            db.record(rid, {**summary, **extra}, scalars, series)
    except LockBusy as e:
        return (f"{tag}: skipped, another process is on it ({e.holder or 'pid unknown'}); "
                "re-run this sweep later for its results")
    finally:
        db.close()
    ppl = next((v for p, L, m, v in scalars if p == "nonoverlapping" and L == cfg.model.train_length
                and m == "ppl"), None)
    return f"{tag}: done" + (f" (ppl at L_tr {ppl:.2f})" if ppl else "")


def evaluate_models(out: Path, base: C.RunConfig, spec: SweepSpec, db: ResultsDB, progress: bool = True) -> None:
    """Evaluate each ``models:`` entry (hf:PATH) on every dataset with the sweep's eval settings (the
    protocols HF models support) and record it under its label, like a trained run with seed 0."""
    from ..hf import PROTOCOLS, evaluate_hf, hf_split, open_hf
    from ..io import atomic_write_json

    for d in spec.datasets:
        for m in spec.models:
            rid = run_id(d, SchemeSpec(m.label), 0)
            if db.status(rid) == "done":
                continue
            cfg = copy.deepcopy(base)
            cfg.data.corpus = d
            cfg.eval.protocols = [p for p in cfg.eval.protocols if p in PROTOCOLS]
            run_dir = out / "runs" / rid
            db.mark(rid, dataset=d, scheme="hf", label=m.label, seed=0, status="evaluating",
                    run_dir=str(run_dir), config={**cfg.to_dict(), "hf": vars(m)})
            _say(progress, f"{rid}: evaluating {m.source}")
            t = time.time()
            model = open_hf(m.source, device=cfg.train.device, dtype="fp32", rope=m.rope,
                            train_length=m.train_length, cache_dir=cfg.data.cache_dir)
            res = evaluate_hf(model, hf_split(cfg.data, model.loaded.tokenizer, cfg.eval.split), cfg.eval,
                              model.loaded.train_length or cfg.model.train_length)
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(run_dir / "eval.json", res)
            scalars, series = flatten_eval(res)
            keep = {0, base.model.train_length, *base.eval.lengths}  # the model's own L_tr only in eval.json
            scalars = [row for row in scalars if row[1] in keep or row[0] == "positionwise"]
            db.record(rid, {"model": res["model"], "params": res["model"]["parameters"],
                            "eval_wall_s": time.time() - t}, scalars, series)


def rebuild_report(out: Path, wall_s: float | None = None) -> Path:
    from ..report.build import build_report

    out = Path(out)
    if not (out / "results.sqlite").is_file():
        raise UserError(f"no results.sqlite in {out}; run `extrapolab sweep` or `extrapolab demo --out {out}` first")
    return build_report(out, wall_s=wall_s)


def _say(progress: bool, msg: str) -> None:
    if progress:
        from rich.console import Console

        Console(stderr=True, soft_wrap=True).print(f"[bold cyan]extrapolab[/] {msg}")

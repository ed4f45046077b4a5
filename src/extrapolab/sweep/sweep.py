"""Sweeps (E7/E8): train a grid of schemes x seeds x datasets, evaluate, record, report.

Resumable: a run whose row in ``results.sqlite`` is 'done' is skipped; an unfinished run resumes
from its last checkpoint. Every number in the report comes from the database, so
``extrapolab report DIR`` regenerates all tables and figures without training.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from .. import config as C
from ..executor import Job, open_executor
from ..io import UserError, is_locked, run_lock_path
from ..report.corpora import record_corpora
from ..report.db import ResultsDB
from .execute import run_all
from .job import run_job
from .progress import Monitor
from .record import flatten_eval
from .spec import ModelSpec, SchemeSpec, SweepSpec, entry_config, load_sweep, run_id  # noqa: F401 - the sweep API


def run_sweep(name_or_path: str, out: Path | None = None, overrides: list[str] | None = None,
              progress: bool = True) -> dict:
    t0 = time.time()
    base, spec = load_sweep(name_or_path, overrides)
    if spec.engine.engine == "local":  # a Ray driver needs no GPU of its own: the cluster's are checked
        check_device(base)  # before anything is written: a GPU preset on a machine without one stops here
    out = Path(out) if out else Path(base.out_dir) / base.name
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder; pass a new folder (or a sweep's, to resume it)")
    # devices, the cluster, its resources and storage are checked before anything is written
    ex = open_executor(spec.engine, device=base.train.device, threads=base.train.threads, out=out)
    with ex:  # closed (a local pool stopped, a Ray connection shut) as soon as the runs are done, or on an error
        res = _sweep(name_or_path, out, base, spec, ex, t0, progress)
    return res


def _sweep(name_or_path, out: Path, base: C.RunConfig, spec: SweepSpec, ex, t0: float, progress: bool) -> dict:
    from ..data import prepare, provenance

    out.mkdir(parents=True, exist_ok=True)
    C.save(base, out / "sweep-config.yaml")
    db = ResultsDB(out / "results.sqlite")
    db.set_meta(name=base.name, preset=str(name_or_path), budget=spec.budget, reference=spec.reference,
                train_length=base.model.train_length, lengths=base.eval.lengths,
                protocols=base.eval.protocols,
                schemes=[s.label for s in spec.schemes] + [m.label for m in spec.models],
                seeds=spec.seeds, datasets=spec.datasets)
    # runs that train first, then the entries derived from them (`from:`, sweep/derived.py)
    grid = [(d, s, seed) for derived in (False, True) for d in spec.datasets for s in spec.schemes
            for seed in spec.seeds if s.derived == derived]
    todo = [(i, d, s, seed) for i, (d, s, seed) in enumerate(grid, 1) if db.status(run_id(d, s, seed)) != "done"]
    n_derived = sum(s.derived for _, _, s, _ in todo)
    workers = max(1, min(ex.slots, len(todo)))
    _say(progress, f"sweep {base.name}: {len(grid)} runs ({len(grid) - len(todo)} already done, "
                   f"{ex.describe(workers)}) -> {out}")
    vocab, corpora, stages = {}, {}, {"start": time.time() - t0}  # stages: wall seconds by stage (meta stages_s)
    t1 = time.time()
    for d in spec.datasets:  # tokenize once, before any worker starts
        cfg = copy.deepcopy(base)
        cfg.data.corpus = d
        data = prepare(cfg.data, progress=progress)
        vocab[d], corpora[d] = int(data.vocab_size), provenance(data)
    stages["tokenize"] = time.time() - t1
    for line in record_corpora(db, corpora):  # the corpus hashes; a resume on another text: warned
        _say(progress, line)
    trains, derived = [], []
    home = out.resolve()  # runs are told absolute paths: a Ray worker starts in a folder of its own
    n_train = len(todo) - n_derived
    tail = n_train % workers if workers > 1 and n_train > workers else 0  # runs left for the last round
    for n, (i, dataset, scheme, seed) in enumerate(todo):
        rid = run_id(dataset, scheme, seed)
        holder = is_locked(run_lock_path(out / "runs" / rid))  # run_job checks again, under the lock
        if holder:
            _say(progress, f"[{i}/{len(grid)}] {rid}: skipped, another process is on it ({holder}); "
                           "re-run this sweep later for its results")
            continue
        cfg = entry_config(base, scheme)
        cfg.name, cfg.out_dir = rid, str(home / "runs")
        cfg.train.seed, cfg.data.corpus = seed, dataset
        cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())
        if workers > 1 and not cfg.train.threads:  # the last round's runs share the cores the pool freed
            share = min(workers, n_derived) if scheme.derived else tail if n >= n_train - tail else workers
            cfg.train.threads = ex.run_threads(share)
        db.mark(rid, dataset=dataset, scheme=scheme.name, label=scheme.label, seed=seed,
                status="queued", run_dir=str(out / "runs" / rid), config=cfg.to_dict())
        derive = {"source": run_id(dataset, spec.entry(scheme.source), seed), "step": scheme.step} \
            if scheme.derived else None
        job = Job(rid, run_job, (str(home), rid, cfg.to_dict(), f"[{i}/{len(grid)}] {rid}", derive,
                                 spec.engine.procs_per_run), tag=f"[{i}/{len(grid)}] {rid}", threads=cfg.train.threads)
        if derive:
            derived.append((job, derive["source"]))
        else:
            trains.append(job)
    with Monitor(out, [j.key for j in trains], base.train.steps, workers, enabled=progress, where=ex.where) as mon:
        t1 = time.time()
        left = run_all(ex, db, trains, derived, spec.time_budget_s, t0, mon.say)
        stages["runs"] = time.time() - t1
        ex.close()
        cost = None
        if left:
            mon.say(f"time budget: {left} of {len(grid)} runs left after {time.time() - t0:.0f} s of "
                    f"sweep.time_budget_s={spec.time_budget_s:g}; run the same command again to continue")
        else:
            t1 = time.time()
            evaluate_models(out, base, spec, db, False)
            stages["models"] = time.time() - t1
            mon.phase = "cost: one bench pass over the schemes (seconds to a minute)"
            t1 = time.time()
            cost = cost_section(db, base, spec, vocab, mon.say)
            stages["cost"] = time.time() - t1
    t1 = time.time()
    db.set_meta(stages_s={k: round(v, 1) for k, v in stages.items()}, **({"cost_bench": cost} if cost else {}))
    report = rebuild_report(out, wall_s=time.time() - t0)
    stages["report"] = time.time() - t1
    wall = time.time() - t0
    db.set_meta(last_wall_s=wall, stages_s={k: round(v, 1) for k, v in stages.items()})
    _say(progress, "wall time by stage: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
         + f"; {wall:.0f} s in all")
    db.close()
    return {"report": report, "wall_s": wall, "out": out, "runs_left": left, "runs_wall_s": stages["runs"],
            "overhead": ex.overhead(), "engine": ex.kind, "slots": ex.slots}


def check_device(base: C.RunConfig) -> None:
    """A sweep whose preset asks for CUDA (``train.device: cuda``, e.g. demo-gpu-quick) on a machine without a
    visible GPU: one line naming the way to run it anyway, rather than hours on the CPU or a late failure."""
    import torch

    from ..train import run_placement

    dev = str(base.train.device or "auto")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{base.name} asks for a CUDA GPU (train.device={dev}) and none is visible here; run it on a "
                        "GPU machine, or pass --device cpu to run it on the CPU anyway (many times slower)")
    run_placement(base.train)  # any other bad train.device / train.precision, in its own one line


def cost_section(db: ResultsDB, base: C.RunConfig, spec: SweepSpec, vocab: dict, say) -> dict | None:
    """The report's E8 ratios: one bench pass in this process, unless one with these settings is stored."""
    from .cost import bench_settings, run_cost_bench

    ds = spec.datasets[0]
    trained = [s for s in spec.schemes if not s.derived]  # a derived entry's model is timed as its source's
    stored = db.meta().get("cost_bench")
    if stored and stored.get("settings") == json.loads(json.dumps(bench_settings(base, vocab[ds], trained, spec.cost_rounds))):
        return None
    t = time.time()
    res = run_cost_bench(base, vocab[ds], trained, spec.engine.workers, spec.cost_rounds, say)
    res["seconds"] = time.time() - t
    say(f"cost: bench pass done in {res['seconds']:.0f} s")
    return res


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

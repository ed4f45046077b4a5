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
from pathlib import Path

import torch

from .. import config as C
from ..io import LockBusy, UserError, is_locked, run_lock, run_lock_path
from ..report.corpora import record_corpora
from ..report.db import ResultsDB
from .progress import Monitor
from .record import curve_series, evaluate_run_dir, flatten_eval
from .spec import ModelSpec, SchemeSpec, SweepSpec, entry_config, load_sweep, run_id  # noqa: F401 - the sweep API


def run_sweep(name_or_path: str, out: Path | None = None, overrides: list[str] | None = None,
              progress: bool = True) -> dict:
    from ..data import prepare

    t0 = time.time()
    base, spec = load_sweep(name_or_path, overrides)
    check_device(base)  # before anything is written: a GPU preset on a machine without one stops here
    out = Path(out) if out else Path(base.out_dir) / base.name
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
    workers = max(1, min(spec.workers, len(todo)))
    _say(progress, f"sweep {base.name}: {len(grid)} runs ({len(grid) - len(todo)} already done, "
                   f"{workers} worker{'s' if workers > 1 else ''}) -> {out}")
    vocab = {}
    for d in spec.datasets:  # tokenize once, before any worker starts
        cfg = copy.deepcopy(base)
        cfg.data.corpus = d
        vocab[d] = int(prepare(cfg.data, progress=progress).vocab_size)
    for line in record_corpora(db, base, spec.datasets):  # the corpus hashes; a resume on another text: warned
        _say(progress, line)
    jobs = []
    n_train = len(todo) - n_derived
    tail = n_train % workers if workers > 1 and n_train > workers else 0  # runs left for the last round
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
            share = min(workers, n_derived) if scheme.derived else tail if n >= n_train - tail else workers
            cfg.train.threads = max(1, (os.cpu_count() or 1) // share)
        db.mark(rid, dataset=dataset, scheme=scheme.name, label=scheme.label, seed=seed,
                status="queued", run_dir=str(out / "runs" / rid), config=cfg.to_dict())
        derive = {"source": run_id(dataset, spec.entry(scheme.source), seed), "step": scheme.step} \
            if scheme.derived else None
        jobs.append((str(out), rid, cfg.to_dict(), f"[{i}/{len(grid)}] {rid}", derive))
    left = 0  # runs the time budget left for the next invocation
    with Monitor(out, [j[1] for j in jobs if not j[4]], base.train.steps, workers, enabled=progress) as mon:
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
            trains, derived = [j for j in jobs if not j[4]], [j for j in jobs if j[4]]
            head, last = (trains[:-tail], trains[-tail:]) if tail else (trains, [])
            ctx = multiprocessing.get_context("spawn")
            for group, n_proc in ((head, workers), (last, tail), (derived, min(workers, len(derived)))):
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


def check_device(base: C.RunConfig) -> None:
    """A sweep whose preset asks for CUDA (``train.device: cuda``, e.g. demo-gpu-quick) on a machine without a
    visible GPU: one line naming the way to run it anyway, rather than hours on the CPU or a late failure."""
    from ..train import run_placement

    dev = str(base.train.device or "auto")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{base.name} asks for a CUDA GPU (train.device={dev}) and none is visible here; run it on a "
                        "GPU machine, or pass --device cpu to run it on the CPU anyway (many times slower)")
    run_placement(base.train)  # any other bad train.device / train.precision, in its own one line


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
    trained = [s for s in spec.schemes if not s.derived]  # a derived entry's model is timed as its source's
    stored = db.meta().get("cost_bench")
    if stored and stored.get("settings") == json.loads(json.dumps(bench_settings(base, vocab[ds], trained, spec.cost_rounds))):
        return None
    t = time.time()
    res = run_cost_bench(base, vocab[ds], trained, spec.workers, spec.cost_rounds, say)
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
    """Train (resuming) and evaluate one sweep run, then record it; runs in a worker process too.
    A derived entry's job (5th item: {"source": run id, "step": {...}}) makes its run from its source's
    instead of training (sweep/derived.py)."""
    from ..data import prepare
    from ..train import train

    out, rid, cfg_dict, tag, *rest = job
    derive = rest[0] if rest else None
    cfg = C.from_dict(C.RunConfig, cfg_dict)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = Path(out) / "runs" / rid
    db = ResultsDB(Path(out) / "results.sqlite")
    try:  # one process per run: another sweep (or `extrapolab train`) on it -> skip, leave its row alone
        with run_lock(run_dir, owner=f"sweep {out}: {rid}"):
            if db.status(rid) == "done":  # finished by another sweep since this one listed it
                return f"{tag}: done by another process"
            if derive and db.status(derive["source"]) != "done":
                return f"{tag}: skipped, its source run {derive['source']} is not done; re-run this sweep after it"
            db.set_status(rid, "deriving" if derive else "training")
            data = prepare(cfg.data, progress=False)
            if derive:
                from .derived import derive_run

                model_dir, summary = derive_run(Path(out), derive, run_dir, cfg, data)
            else:
                model_dir, summary = run_dir, train(cfg, run_dir, data=data, progress=progress)
            db.set_status(rid, "evaluating")
            scalars, series, extra = evaluate_run_dir(run_dir, cfg, data, model_dir=model_dir)
            if not derive:
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

"""Thesis Table 6.1 (length generalisation on regular languages, Max/Avg over seeds) and the
P(sigma=1) sweep of Table 6.2, as resumable one-command experiments.

Every (task, model, seed) is one run folder ``<out>/runs/<task>/<model>/seed<k>`` (config,
weights, result.json); a folder with a result.json for the same config is reused, so a killed
``table`` resumes where it stopped. For each (task, model): per seed, the mean accuracy over
the evaluated test lengths (see ``train.py``: every valid length 41..500 resp. 51..100 unless a
stride is given); Max = the best seed, Avg = the mean over seeds (thesis: 3 seeds).
``--budget`` picks a preset of run options (``BUDGETS``: quick on a CPU, thesis = Table 6.5);
``wall_time`` sums the recorded per-run seconds and projects the runs still missing.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from ..executor import EngineSpec, open_executor, worker
from ..io import UserError, atomic_write_json, atomic_write_text
from .columns import (BUDGETS, DEFAULT_MODELS, MODEL_GROUPS, MODEL_SPECS, MODERN_COLUMNS, RANDOM_COLUMNS,  # noqa: F401
                      available, budget_options, run_config)
from .erf import erf_for_table, erf_markdown
from .parallel import cpu_count, job_cost, run_jobs
from .plots import plot_per_length
from .reference import THESIS_TABLE_6_1, THESIS_TABLE_6_2  # noqa: F401 - the table's published numbers
from .table_md import SWEEP_P, _hours, sweep_markdown, table_markdown  # noqa: F401
from .tasks import BHATTACHARYA, DELETANG, make_task
from .train import PLACEMENT, RegularRunConfig, evaluate_lengths, load_run, max_position, run, run_placement

def ensure_run(cfg: RegularRunConfig, run_dir: Path, progress: bool = True, train: bool = True) -> dict | None:
    """Reuse ``run_dir``'s result when it was made by the same config, else train it (or, with
    ``train=False``, return None)."""
    res = Path(run_dir) / "result.json"
    if res.is_file():
        try:
            old = json.loads(res.read_text())
            # through from_dict, so options added later compare at their defaults; where a run computed
            # (device, precision) is not what it is, so a run trained on another device is reused
            saved = _identity(RegularRunConfig.from_dict(old.get("config") or {}))
            if saved == _identity(cfg.resolved()):
                return old
        except (ValueError, OSError, TypeError, UserError):
            pass
    if not train:
        return None
    out = run(replace(cfg, device=worker.device(cfg.device)), run_dir, progress=progress)  # a GPU slot: its GPU
    out.pop("model", None)
    return out


def _identity(cfg: RegularRunConfig) -> dict:
    d = {k: v for k, v in asdict(cfg).items() if k not in PLACEMENT}
    return json.loads(json.dumps(d))


def parse_cells(only) -> list[tuple[str, str]]:
    """``"modular_arithmetic:regulargpt-C2,tomita6:regulargpt-C3"`` (or a list) -> [(task, column)]."""
    items = only.split(",") if isinstance(only, str) else list(only)
    cells = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        task, sep, model = item.partition(":")
        if not sep or not task or not model:
            raise UserError(f"--only cell {item!r} must look like TASK:COLUMN, e.g. modular_arithmetic:regulargpt-C2")
        make_task(task.strip())  # unknown task -> one-line error naming the valid ones
        if model.strip() not in MODEL_SPECS:
            raise UserError(f"unknown table column {model.strip()!r} in --only; valid: {', '.join(MODEL_SPECS)}")
        if (task.strip(), model.strip()) not in cells:
            cells.append((task.strip(), model.strip()))
    if not cells:
        raise UserError("--only needs at least one TASK:COLUMN cell, e.g. modular_arithmetic:regulargpt-C2")
    return cells


def _models(value, default) -> list[str]:
    """``--models``: comma-separated columns, a shorthand of MODEL_GROUPS among them ("modern")."""
    out = []
    for m in _parse_list(value, default):
        out += [c for c in MODEL_GROUPS.get(m, (m,)) if c not in out]
    return out


def _grid(tasks, models, only) -> tuple[list, list, set | None, list[str]]:
    """(tasks, models, cells or None, skipped): ``only`` limits the table to those (task, column) cells;
    a column whose scheme is not registered is dropped with one line in ``skipped``."""
    if only is None:
        ts, ms, cells = _parse_list(tasks, DELETANG + BHATTACHARYA), _models(models, DEFAULT_MODELS), None
    else:
        cells = parse_cells(only)
        ts = _parse_list(tasks, dict.fromkeys(t for t, _ in cells))
        ms = _models(models, dict.fromkeys(m for _, m in cells))
    unknown = [m for m in ms if m not in MODEL_SPECS]
    if unknown:
        raise UserError(f"unknown table model {unknown[0]!r}; valid: {', '.join(MODEL_SPECS)} "
                        f"(or {', '.join(MODEL_GROUPS)})")
    ms, skipped = available(ms)
    if not ms:
        raise UserError(skipped[0] + "; nothing left to run")
    return ts, ms, None if cells is None else {c for c in cells if c[0] in ts and c[1] in ms}, skipped


#: the cells the quick budget does not reproduce (docs/results/regular-table-6.1.md), for --budget thesis
THESIS_GAPS = "modular_arithmetic:regulargpt-C2,cycle_navigation:regulargpt-C3,tomita6:regulargpt-C3"


def _parse_list(value, default, kind=str) -> list:
    if value is None:
        return list(default)
    items = value.split(",") if isinstance(value, str) else list(value)
    return [kind(v.strip() if isinstance(v, str) else v) for v in items if str(v).strip()]


def _planned(tasks, models, seeds: int, budget: str, per_model: dict, overrides: dict, cells=None) -> dict:
    return {(t, m, s): run_config(t, m, s, budget, **{**overrides, **per_model.get(m, {})})
            for t in tasks for m in models for s in range(seeds) if cells is None or (t, m) in cells}


def regular_table(out_dir, tasks=None, models=None, seeds: int = 3, progress: bool = True,
                  per_model: dict | None = None, skip_missing: bool = False, budget: str = "quick",
                  workers: int = 1, threads: int = 1, only=None, engine: EngineSpec | None = None,
                  **overrides) -> dict:
    """Run (or reuse) every (task, model, seed) and write table.json, table.md and plots.

    ``budget``: a preset of ``BUDGETS`` ("quick" on a CPU, "thesis" = Table 6.5 sizes);
    ``overrides`` apply to every run on top of it (e.g. steps=2000); ``per_model`` =
    {column: {option: value}} to one model column only (e.g. {"transformer": {"test_stride": 5}}).
    ``skip_missing``: only tabulate runs already on disk (cells without runs show "—").
    ``workers`` > 1: train the missing runs in that many spawned processes of ``threads`` torch
    threads each (see ``parallel.py``); the table records this invocation's wall-clock time.
    ``engine``: how the runs are executed (executor/spec.py: a Ray cluster, GPUs of this machine; its
    ``workers`` is this ``workers``).
    ``only``: "TASK:COLUMN,..." cells to run and tabulate instead of the whole tasks x models grid
    (e.g. ``THESIS_GAPS``). ``device`` / ``precision`` in ``overrides`` place every run (see
    ``RegularRunConfig``); they do not change which finished runs are reused.
    """
    t0 = time.perf_counter()
    per_model = per_model or {}
    out = Path(out_dir)
    tasks, models, cells, skipped = _grid(tasks, models, only)
    if seeds < 1:
        raise UserError(f"seeds must be >= 1, got {seeds}")
    if workers < 1 or threads < 1:
        raise UserError(f"workers and threads must be >= 1, got {workers} and {threads}")
    cfgs = _planned(tasks, models, seeds, budget, per_model, overrides, cells)
    dirs = {k: out / "runs" / k[0] / k[1] / f"seed{k[2]}" for k in cfgs}
    found = {k: ensure_run(cfg, dirs[k], progress=False, train=False) for k, cfg in cfgs.items()}
    todo = {} if skip_missing else {k: (cfgs[k], dirs[k].resolve(), job_cost(k[1], make_task(k[0]).family))
                                    for k, r in found.items() if r is None}
    engine = EngineSpec(**{**vars(engine or EngineSpec(where="--")), "workers": workers}).validated()
    if todo:  # a missing device, a bad device list or an unusable cluster fails here, before any run starts
        run_placement(next(iter(todo.values()))[0])
        with open_executor(engine, device=str(overrides.get("device") or "auto"), threads=threads, out=out,
                           device_what="--device") as ex:
            found.update(run_jobs(todo, ensure_run, ex, threads, progress))
    rows = {}
    for (t, m, s) in cfgs:
        if found[(t, m, s)] is not None:
            rows.setdefault(t, {}).setdefault(m, []).append(found[(t, m, s)])
    table = {"tasks": {}, "seeds": seeds, "budget": budget, "overrides": overrides, "per_model": per_model,
             "only": sorted(f"{t}:{m}" for t, m in cells) if cells is not None else None, "skipped": skipped,
             "wall_time": wall_time(out, tasks, models, seeds, budget, per_model, only=only, **overrides)}
    table["invocation"] = {"trained": len(todo), "reused": len(cfgs) - len(todo), "workers": workers,
                           "engine": engine.engine,
                           "threads": threads if workers > 1 else torch.get_num_threads(),
                           "cpus": cpu_count(), "elapsed_s": None}
    for t in tasks:
        if t not in rows:
            continue
        by_model = rows[t]
        entry = table["tasks"][t] = {}
        curves = {}
        for m, results in by_model.items():
            means = [100 * r["mean_test"] for r in results]
            entry[m] = {"max": max(means), "avg": float(np.mean(means)), "per_seed": means, "seeds": len(means),
                        "train_len_avg": float(np.mean([100 * r["mean_train_lengths"] for r in results])),
                        "train_seconds": [r["train_seconds"] for r in results],
                        "eval_seconds": [r.get("eval_seconds", 0.0) for r in results],
                        "test_lengths": results[0]["test_lengths"],
                        "thesis": THESIS_TABLE_6_1.get(t, {}).get("rnn" if m == "lstm" else m)}
            lens = results[0]["per_length"].keys()
            curves[m] = {int(k): float(np.mean([r["per_length"][k] for r in results])) for k in lens}
        task = make_task(t)
        entry["_plots"] = plot_per_length(curves, out / "plots" / f"per_length_{t}",
                                          f"{t}: accuracy vs length (mean over the seeds run)", task.train_max)
    table["erf"] = erf_for_table(out, [t for t in tasks if t in rows], models)
    table["invocation"]["elapsed_s"] = time.perf_counter() - t0  # training + tabulation, this call
    atomic_write_json(out / "table.json", table)
    atomic_write_text(out / "table.md", table_markdown(table, models) + erf_markdown(table["erf"], models))
    return table


def _run_seconds(res: dict) -> float:
    return float(res.get("train_seconds", 0.0)) + float(res.get("eval_seconds", 0.0))


def wall_time(out_dir, tasks=None, models=None, seeds: int = 3, budget: str = "quick",
              per_model: dict | None = None, only=None, **overrides) -> dict:
    """Measured and projected compute time of ``regular table`` (same arguments).

    Every planned run whose result is on disk with the same config counts its recorded
    train_seconds + eval_seconds. A missing run is estimated by the mean of the finished runs of
    the same model column on the same task, else on the same task family (Deletang: test
    41..500; Bhattacharya: 51..100), else on any task; "unknown" when the column has no run.
    """
    out = Path(out_dir)
    tasks, models, cells, skipped = _grid(tasks, models, only)
    cfgs = _planned(tasks, models, seeds, budget, per_model or {}, overrides, cells)
    done: dict = {}
    for (t, m, s), cfg in cfgs.items():
        res = ensure_run(cfg, out / "runs" / t / m / f"seed{s}", progress=False, train=False)
        if res is not None:
            done[(t, m, s)] = _run_seconds(res)
    measured = sum(done.values())
    estimated, unknown, per_column = 0.0, [], {}
    for (t, m, s) in cfgs:
        col = per_column.setdefault(m, {"done": 0, "measured_s": 0.0, "missing": 0, "estimated_s": 0.0})
        if (t, m, s) in done:
            col["done"] += 1
            col["measured_s"] += done[(t, m, s)]
            continue
        fam = make_task(t).family
        for pick in (lambda k: k[0] == t, lambda k: make_task(k[0]).family == fam, lambda k: True):
            pool = [v for k, v in done.items() if k[1] == m and pick(k)]
            if pool:
                break
        col["missing"] += 1
        if pool:
            col["estimated_s"] += float(np.mean(pool))
            estimated += float(np.mean(pool))
        else:
            unknown.append(f"{t}/{m}/seed{s}")
    return {"runs": len(cfgs), "done": len(done), "measured_s": measured, "missing": len(cfgs) - len(done),
            "estimated_missing_s": estimated, "projected_total_s": measured + estimated,
            "unknown": unknown, "per_column": per_column, "budget": budget, "skipped": skipped,
            "note": "sum of per-run train+eval seconds recorded in result.json (torch threads as "
                    "recorded there); missing runs estimated from finished ones"}


def sweep_p(out_dir, models=None, seeds: int = 3, ps=SWEEP_P, progress: bool = True,
            per_model: dict | None = None, eval_stride: int | None = None,
            eval_samples: int | None = None, budget: str = "quick", **overrides) -> dict:
    """Table 6.2: train on Parity with P(sigma=1) = 0.5, evaluate with P(sigma=1) = p at the
    training length 40 ("same length") and over 41..500 ("extrapolation"; every
    ``eval_stride``-th length with ``eval_samples`` strings, default: the run's test settings)."""
    out = Path(out_dir)
    models = _parse_list(models, ("regulargpt-C2", "rnn", "transformer"))
    ps = [float(p) for p in _parse_list(ps, SWEEP_P, float)]
    res = {"p": ps, "same": {}, "extrapolation": {}, "thesis": THESIS_TABLE_6_2}
    for m in models:
        same, extra = [], []
        for s in range(seeds):
            cfg = run_config("parity", m, s, budget, **{**overrides, **(per_model or {}).get(m, {})})
            run_dir = out / "runs" / "parity" / m / f"seed{s}"
            ensure_run(cfg, run_dir, progress)
            model, rcfg, _ = load_run(run_dir)
            rcfg = rcfg.resolved()
            stride, n = eval_stride or rcfg.test_stride, eval_samples or rcfg.test_samples
            lengths = make_task("parity").lengths(rcfg.test_min, rcfg.test_max)[::stride]
            res["lengths"] = {"min": lengths[0], "max": lengths[-1], "stride": stride, "count": len(lengths),
                              "samples_per_length": n, "same_length": rcfg.train_max}
            s_row, e_row = [], []
            for p in ps:
                task = make_task("parity", p=p)
                L_max = max_position(rcfg)
                s_row.append(evaluate_lengths(model, task, [rcfg.train_max], n, s, max_position=L_max)[rcfg.train_max])
                e_row.append(float(np.mean(list(evaluate_lengths(model, task, lengths, n, s,
                                                                 max_position=L_max).values()))))
            same.append(s_row)
            extra.append(e_row)
        res["same"][m] = (100 * np.mean(same, axis=0)).tolist()
        res["extrapolation"][m] = (100 * np.mean(extra, axis=0)).tolist()
    atomic_write_json(out / "sweep_p.json", res)
    atomic_write_text(out / "sweep_p.md", sweep_markdown(res))
    return res

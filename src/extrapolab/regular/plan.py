"""``regular table --plan``: measured + projected wall time, with a timing probe for columns that have
no finished run yet (e.g. the thesis budget, Table 6.5, before its first run on a GPU).

``wall_time`` (table.py) estimates a missing run from finished runs of the same column. Where there
is none, :func:`probe_run` times the run's own configuration on its own device for a few steps:
seconds per optimizer step (one length drawn per step, as in training), per validation round, and
the final scoring (every ``k``-th test length timed, scaled to all of them). The projection
``steps x step + ceil(steps / eval_every) x validation + scoring`` is an UPPER bound: it assumes no
early stop, while the quick budget stops most runs far earlier.
"""
from __future__ import annotations

import math
import time

import torch

from .baselines import build_model
from .tasks import make_task
from .train import (TRAIN_STREAM, VAL_STREAM, RegularRunConfig, _rng, accuracy_at, evaluate_lengths, max_position,
                    run_placement, train_step)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_run(cfg: RegularRunConfig, steps: int = 20, warmup: int = 3, test_points: int = 8) -> dict:
    """Time ``steps`` training steps, one validation round and a sample of the final scoring of ``cfg``
    on its device (nothing is saved); returns seconds per part and the projected run seconds."""
    cfg = cfg.resolved()
    task = make_task(cfg.task, **cfg.task_options)
    place = run_placement(cfg)
    torch.manual_seed(cfg.seed)
    model = place.put(build_model(cfg.model, task.vocab_size, task.num_classes, **cfg.model_options))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = _rng(TRAIN_STREAM, cfg.seed)
    lengths = task.lengths(cfg.train_min, cfg.train_max)

    for _ in range(max(0, warmup)):
        train_step(model, opt, task, rng, lengths, cfg, place)
    _sync(place.device)
    t = time.perf_counter()
    for _ in range(max(1, steps)):
        train_step(model, opt, task, rng, lengths, cfg, place)
    _sync(place.device)
    step_s = (time.perf_counter() - t) / max(1, steps)

    t = time.perf_counter()
    with place.autocast():
        for L in [lengths[-1], *cfg.val_lengths]:
            accuracy_at(model, task, int(L), cfg.val_samples, _rng(VAL_STREAM, cfg.seed, L),
                        max_position=max_position(cfg))
    _sync(place.device)
    val_s = time.perf_counter() - t

    test = task.lengths(cfg.test_min, cfg.test_max)[:: cfg.test_stride] + lengths  # final scoring: both sets
    sample = test[:: max(1, math.ceil(len(test) / max(1, test_points)))]
    t = time.perf_counter()
    with place.autocast():
        evaluate_lengths(model, task, sample, cfg.test_samples, cfg.seed, cfg.eval_tokens,
                         max_position=max_position(cfg))
    _sync(place.device)
    score_s = (time.perf_counter() - t) * len(test) / len(sample)
    rounds = math.ceil(cfg.steps / cfg.eval_every)
    total = cfg.steps * step_s + rounds * val_s + score_s
    return {"step_s": step_s, "validation_round_s": val_s, "validation_rounds": rounds, "scoring_s": score_s,
            "steps": cfg.steps, "projected_s": total, "probe_steps": steps, **place.describe(),
            "torch_threads": torch.get_num_threads()}


def plan(out_dir, tasks=None, models=None, seeds: int = 3, budget: str = "quick", per_model: dict | None = None,
         only=None, probe_steps: int = 20, **overrides) -> dict:
    """``wall_time`` of the table, with each run it cannot estimate projected by :func:`probe_run`: one
    probe per column and task family (``column@deletang``: tests up to 500, ``column@bhattacharya``: up
    to 100), on the first such cell, shared by the family's tasks and seeds; ``probe_steps=0``: no probe."""
    from .table import _grid, _planned, wall_time

    wt = wall_time(out_dir, tasks, models, seeds, budget, per_model, only=only, **overrides)
    wt["probes"] = {}
    if not wt["unknown"] or probe_steps <= 0:
        return wt
    ts, ms, cells, _ = _grid(tasks, models, only)
    cfgs = _planned(ts, ms, seeds, budget, per_model or {}, overrides, cells)
    for name in wt["unknown"]:
        t, m, s = name.split("/")
        key = f"{m}@{make_task(t).family}"
        if key not in wt["probes"]:
            wt["probes"][key] = probe_run(cfgs[(t, m, int(s[len("seed"):]))], steps=probe_steps)
        sec = wt["probes"][key]["projected_s"]
        wt["estimated_missing_s"] += sec
        wt["per_column"][m]["estimated_s"] += sec
    wt["unknown"] = []
    wt["projected_total_s"] = wt["measured_s"] + wt["estimated_missing_s"]
    wt["note"] += ("; runs of columns with no finished run: projected by a timing probe on this device "
                   "(upper bound: no early stop)")
    return wt


def plan_lines(wt: dict) -> list[str]:
    """The --plan printout: totals, then one line per probed task x column."""
    from .table_md import _hours

    lines = list(wt.get("skipped") or [])
    lines += [f"{wt['done']}/{wt['runs']} runs finished ({_hours(wt['measured_s'])} measured); {wt['missing']} missing, "
             f"estimated {_hours(wt['estimated_missing_s'])}; projected full table {_hours(wt['projected_total_s'])}"
             + (f" + {len(wt['unknown'])} runs with no estimate" if wt["unknown"] else "")]
    for key, p in wt.get("probes", {}).items():
        lines.append(f"  {key}: probe on {p['device']} ({p['precision']}): {1000 * p['step_s']:.1f} ms/step x "
                     f"{p['steps']:,} steps + {p['validation_rounds']} validations x {p['validation_round_s']:.2f} s + "
                     f"scoring {p['scoring_s']:.0f} s = {_hours(p['projected_s'])} per seed (upper bound: no early stop)")
    return lines

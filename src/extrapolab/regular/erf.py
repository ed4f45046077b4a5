"""Receptive field of a regular-language classifier (thesis §6.6.4, Fig. 6.4a).

The thesis applies the gradient tool of the Sandwich paper (§5.1, ``analysis/erf.py``) to
RegularGPT: s_m = ||g_m|| / sum_n ||g_n|| with g_m the gradient of the classification loss
(label read at the last position) w.r.t. the input embedding of token m, and the cumulative
c_m = sum_{n >= m} s_n from the most recent token back. A model that solves a regular language
must use every token, so on a length-500 string c should fall as a slanted line over the whole
input (Fig. 6.4a), not collapse onto the last L_tr = 40 tokens.

Here all T tokens are inputs (there is no target token), so c has T entries with c_1 = 1; we
append c_{T+1} = 0 to reuse ``analysis.erf.erf`` unchanged: ``erf_tokens`` is the fewest most
recent tokens holding > 99% of the gradient. We also report ``share_beyond_train`` = 1 - c at
the L_tr-th token from the end: the gradient share of the tokens older than the training length
(1 - L_tr/T if every token counted equally).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..analysis.erf import erf, plot_erf
from ..io import UserError, atomic_write_json
from .tasks import make_task
from .train import _rng, load_run

ERF_STREAM = 9002


def _embedding(model) -> torch.nn.Module:
    for name in ("tok", "emb"):
        if isinstance(getattr(model, name, None), torch.nn.Embedding):
            return getattr(model, name)
    if hasattr(model, "gpt"):
        return model.gpt.tok
    raise UserError(f"no token embedding found on {type(model).__name__}")


def cumulative_gradient(model, tokens: np.ndarray, labels: np.ndarray, batch: int = 16) -> np.ndarray:
    """c [N, T + 1] (float64) for strings tokens [N, T] with their labels [N] (module docstring)."""
    emb = _embedding(model)
    store = {}

    def keep(_module, _inp, out):
        store["e"] = out  # [B, T, D]: the input embeddings the gradient is taken against

    was_training = model.training
    model.eval()
    handle = emb.register_forward_hook(keep)
    rows = []
    try:
        for s in range(0, len(tokens), batch):
            x = torch.from_numpy(tokens[s:s + batch])  # [B, T]
            y = torch.from_numpy(labels[s:s + batch])  # [B]
            loss = F.cross_entropy(model(x), y, reduction="sum")
            (g,) = torch.autograd.grad(loss, store["e"])  # [B, T, D]
            norms = g.double().norm(dim=-1)  # [B, T]
            sm = norms / norms.sum(-1, keepdim=True).clamp_min(1e-300)  # [B, T]
            c = sm.flip(-1).cumsum(-1).flip(-1)  # [B, T]: c_m = sum_{n >= m} s_n
            rows.append(torch.cat([c, torch.zeros(len(c), 1, dtype=c.dtype)], 1).numpy())  # [B, T+1]
    finally:
        handle.remove()
        model.train(was_training)
    return np.concatenate(rows)


def regular_erf(run_dirs, out_dir, length: int = 500, samples: int = 32, seed: int = 0,
                threshold: float = 0.99) -> dict:
    """Cumulative-gradient curves of trained runs on the same strings of ``length``: erf.json +
    erf.png/svg in ``out_dir``. Runs must share one task."""
    runs = [(Path(d), *load_run(d)) for d in run_dirs]
    if not runs:
        raise UserError("give at least one run folder (made by `extrapolab regular train`)")
    tasks = {(cfg.task, tuple(sorted(cfg.task_options.items()))) for _, _, cfg, _ in runs}
    if len(tasks) > 1:
        raise UserError(f"runs are on different tasks {sorted(t for t, _ in tasks)}; compare runs of one task")
    cfg0 = runs[0][2]
    task = make_task(cfg0.task, **cfg0.task_options)
    task.check_length(length)
    if samples < 1:
        raise UserError(f"samples must be >= 1, got {samples}")
    x, y = task.sample(_rng(ERF_STREAM, seed, length), samples, length)
    train_max = cfg0.train_max or task.train_max
    curves, rows = {}, []
    for d, model, cfg, _ in runs:
        name = f"{cfg.model}" + (f" C={model.cfg.C}" if cfg.model == "regulargpt" else "") + f" seed{cfg.seed}"
        c = cumulative_gradient(model, x, y).mean(0)  # [T + 1]
        info = erf(c, threshold)
        curves[name] = c
        rows.append({"run": str(d), "name": name, "erf_tokens": info["erf_tokens"],
                     "share_beyond_train": float(1.0 - c[length - train_max]) if length > train_max else 0.0,
                     "c": c.tolist()})
    out = Path(out_dir)
    figs = plot_erf(curves, out / "erf", train_length=train_max, threshold=threshold,
                    title=f"{task.name}: cumulative gradient at length {length}",
                    xlabel="position m (1-based; the class is read after the last token)")
    result = {"task": task.name, "length": length, "samples": samples, "train_max": train_max,
              "threshold": threshold, "runs": rows, "figures": figs}
    atomic_write_json(out / "erf.json", result)
    return result


def erf_for_table(out_dir, tasks, models, samples: int = 16) -> dict:
    """Fig. 6.4a for every task of a ``regular table`` folder: the seed-0 run of each column, on
    the same strings of the longest length the first column was tested at -> {task: {"length", "train_max", "figures",
    "columns": {model: {"erf_tokens", "share_beyond_train"}}}} (runs not on disk are left out)."""
    out, res = Path(out_dir), {}
    for t in tasks:
        cols = [m for m in models if (out / "runs" / t / m / "seed0" / "result.json").is_file()]
        if not cols:
            continue
        task = make_task(t)
        tested = json.loads((out / "runs" / t / cols[0] / "seed0" / "result.json").read_text())["test_lengths"]
        length = task.lengths(tested["min"], tested["max"])[-1]  # the longest length the table scored
        r = regular_erf([out / "runs" / t / m / "seed0" for m in cols], out / "erf" / t, length, samples)
        res[t] = {"length": length, "train_max": r["train_max"], "figures": r["figures"],
                  "columns": {m: {"erf_tokens": row["erf_tokens"], "share_beyond_train": row["share_beyond_train"]}
                              for m, row in zip(cols, r["runs"])}}
    return res


def erf_markdown(erf_table: dict, models) -> str:
    """The receptive-field section of table.md (share beyond L_tr, ERF tokens)."""
    if not erf_table:
        return ""
    lines = ["", "## Receptive field (thesis §6.6.4, Fig. 6.4a; seed 0)", "",
             "Gradient of the class loss w.r.t. each input embedding at the longest test length T, mean "
             "over the same strings for every column: the share of the gradient on tokens older than the "
             "training length L_tr (a model that uses every token puts about 1 - L_tr/T there), and in "
             "brackets the ERF, the fewest most recent tokens holding 99%. Figures: `erf/<task>/erf.png`.",
             "", "| task | T | L_tr | 1 - L_tr/T | " + " | ".join(models) + " |",
             "|---|---|---|---|" + "---|" * len(models)]
    for t, e in erf_table.items():
        cells = []
        for m in models:
            c = e["columns"].get(m)
            cells.append(f"{100 * c['share_beyond_train']:.0f}% ({c['erf_tokens']})" if c else "—")
        lines.append(f"| {t} | {e['length']} | {e['train_max']} | {100 * (1 - e['train_max'] / e['length']):.0f}% | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

"""The columns of ``regular table`` (thesis Table 6.1 and the columns added beside it), the run-option
budgets, and the run config of one (task, column, seed).

A column is a model with its options and learning rate (``MODEL_SPECS``); ``BUDGETS`` layers run
options on them (quick on a CPU, thesis = Table 6.5). Columns whose positional scheme this build does
not register are skipped with one line (:func:`available`), so a column can be listed before its
scheme lands (``transformer-fire`` needs the FIRE scheme, Li et al. 2024).
"""
from __future__ import annotations

import copy

from ..io import UserError
from .tasks import make_task
from .train import RegularRunConfig

#: column -> run options (model kind, its options, learning rate, ...); CPU-sized: the thesis
#: trains 100k steps at hidden size 256 (Table 6.5), these stop at 3000 (2000 for the O(T²)
#: transformer) at width 64 / 128; ``BUDGETS["thesis"]`` restores the thesis sizes
MODEL_SPECS: dict[str, dict] = {
    "rnn": {"model": "rnn", "model_options": {"hidden": 128}, "lr": 1e-3},
    "lstm": {"model": "lstm", "model_options": {"hidden": 128}, "lr": 1e-3},
    "transformer": {"model": "transformer", "model_options": {"scheme": "t5", "layers": 4},
                    "lr": 3e-4, "steps": 2000},
    "regulargpt-C2": {"model": "regulargpt", "model_options": {"C": 2}, "lr": 1e-3},
    "regulargpt-C3": {"model": "regulargpt", "model_options": {"C": 3}, "lr": 1e-3},
    # the transformer at randomized positions (Ruoss et al. 2023: sorted positions from [0, 2048) per
    # batch, the official code's noise_max_length), with RoPE or ALiBi; opt-in with --models
    "transformer-rope-random": {"model": "transformer", "model_options": {"scheme": "rotary", "layers": 4},
                                "lr": 3e-4, "steps": 2000, "positions": "random:2048"},
    "transformer-alibi-random": {"model": "transformer", "model_options": {"scheme": "alibi", "layers": 4},
                                 "lr": 3e-4, "steps": 2000, "positions": "random:2048"},
    # FIRE (Li et al. 2024): learned f(ψ(i-j)/ψ(max(L, i))) at contiguous positions; opt-in with --models
    "transformer-fire": {"model": "transformer", "model_options": {"scheme": "fire", "layers": 4},
                         "lr": 3e-4, "steps": 2000},
}
RANDOM_COLUMNS = ("transformer-rope-random", "transformer-alibi-random")
#: the columns added for issue "schemes after 2023": ``--models modern``
MODERN_COLUMNS = (*RANDOM_COLUMNS, "transformer-fire")
TRANSFORMER_COLUMNS = ("transformer", *MODERN_COLUMNS)
DEFAULT_MODELS = ("rnn", "lstm", "transformer", "regulargpt-C2", "regulargpt-C3")
#: ``--models NAME`` shorthands
MODEL_GROUPS = {"modern": MODERN_COLUMNS, "default": DEFAULT_MODELS}

#: ``regular table --budget``: run options layered on MODEL_SPECS. Keys: "*" (every run), a family
#: ("deletang" | "bhattacharya"), a column, a task, "column@family" or "column@task", applied in
#: that order (later wins; model_options are merged key by key).
#: * quick (default, 1 CPU thread): the MODEL_SPECS step caps (3000; transformer 2000) with early
#:   stopping at 100% train-length + validation accuracy. The O(T²) transformers are validated at
#:   length 80 only (81 for odd-only Modular Arithmetic: a preset validation length moves to the
#:   task's next valid one) and, on the Deletang tasks (test 41..500), scored on every 5th valid test
#:   length with 64 strings each (41, 46, ..., 496; Modular Arithmetic: 41, 51, ..., 491).
#: * thesis: Table 6.5 — hidden size 256, 8 heads, batch 128, up to 100,000 steps, Adam lr 3e-4
#:   (the thesis lists 1e-4/3e-4/5e-4) for the attention models; every test length, 128 strings.
#:   Meant for a GPU; on one CPU core a single RegularGPT run takes hours.
BUDGETS: dict[str, dict[str, dict]] = {
    "quick": {
        **{c: {"val_lengths": [80], "test_samples": 64} for c in TRANSFORMER_COLUMNS},
        **{f"{c}@deletang": {"test_stride": 5} for c in TRANSFORMER_COLUMNS},
    },
    "thesis": {
        "*": {"steps": 100_000},
        "rnn": {"model_options": {"hidden": 256}},
        "lstm": {"model_options": {"hidden": 256}},
        **{c: {"model_options": {"dim": 256, "heads": 8}, "lr": 3e-4}
           for c in (*TRANSFORMER_COLUMNS, "regulargpt-C2", "regulargpt-C3")},
    },
}


def _merge(base: dict, extra: dict) -> dict:
    """``base`` updated by ``extra`` (None values skipped); model_options merged key by key."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if v is None:
            continue
        if k == "model_options" and isinstance(v, dict):
            out[k] = {**out.get(k, {}), **v}
        else:
            out[k] = copy.deepcopy(v)
    return out


def budget_options(budget: str, task: str, model: str) -> dict:
    """The run options preset ``budget`` gives (task, model column); see ``BUDGETS``."""
    if budget not in BUDGETS:
        raise UserError(f"unknown budget {budget!r}; valid: {', '.join(BUDGETS)}")
    t = make_task(task)
    out: dict = {}
    for key in ("*", t.family, model, task, f"{model}@{t.family}", f"{model}@{task}"):
        out = _merge(out, BUDGETS[budget].get(key, {}))
    if "val_lengths" in out:  # a preset length -> the task's first valid length from there (80 -> 81 odd-only)
        out["val_lengths"] = [t.lengths(int(v), 2 * int(v) + 2)[0] for v in out["val_lengths"]]
    return out


def run_config(task: str, model: str, seed: int, budget: str | None = None, **overrides) -> RegularRunConfig:
    """MODEL_SPECS[model], then the ``budget`` preset, then ``overrides`` (None values ignored)."""
    if model not in MODEL_SPECS:
        raise UserError(f"unknown table model {model!r}; valid: {', '.join(MODEL_SPECS)}")
    make_task(task)  # validates the name
    base = {"task": task, **copy.deepcopy(MODEL_SPECS[model]), "seed": seed}
    if budget is not None:
        base = _merge(base, budget_options(budget, task, model))
    return RegularRunConfig.from_dict(_merge(base, overrides))


def missing_scheme(column: str) -> str | None:
    """The positional scheme ``column`` needs and this build does not register, else None."""
    from ..positional import REGISTRY

    scheme = MODEL_SPECS.get(column, {}).get("model_options", {}).get("scheme")
    return scheme if scheme is not None and scheme not in REGISTRY else None


def available(models) -> tuple[list[str], list[str]]:
    """(the columns that can run, one line per column skipped because its scheme is not registered)."""
    keep, skipped = [], []
    for m in models:
        scheme = missing_scheme(m)
        if scheme is None:
            keep.append(m)
        else:
            skipped.append(f"skipping column {m}: scheme {scheme!r} is not registered in this extrapolab "
                           f"(`extrapolab schemes` lists the ones that are)")
    return keep, skipped

"""`extrapolab regular ...`: RegularGPT and the regular-language benchmark (thesis ch. 6).

Each command is a thin wrapper over a library function in ``extrapolab.regular``.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
import yaml

from ..io import UserError, atomic_write_json
from ..positional.base import SchemeError
from .common import AddressOpt, DeviceOpt

app = typer.Typer(help="RegularGPT and the regular-language length-generalisation benchmark (thesis ch. 6).",
                  no_args_is_help=True, add_completion=False)


def _guard(fn):
    """Bad input -> one line on stderr and exit code 2 (no traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, SchemeError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
    return wrapper


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, int(n)))


def _kv(items: Optional[List[str]], what: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"{what} {item!r} must look like key=value, e.g. --opt C=3")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def _per_model(items: Optional[List[str]]) -> dict:
    per_model: dict = {}
    for item in items or []:
        if ":" not in item:
            raise UserError(f"--run-opt {item!r} must look like MODEL:key=value, e.g. transformer:steps=2000")
        m, kv = item.split(":", 1)
        per_model.setdefault(m.strip(), {}).update(_kv([kv], "--run-opt"))
    return per_model


RUN_OPT = typer.Option(None, "--run-opt",
                       help="per-model run option MODEL:key=value (repeatable), e.g. transformer:test_stride=5")
OPT = typer.Option(None, "--opt", help="model option key=value (repeatable), e.g. --opt C=3 --opt dim=64")
TASK_OPT = typer.Option(None, "--task-opt", help="task option key=value, e.g. --task-opt p=0.3 (parity)")
#: fp32 by default here (not the shared DtypeOpt's auto): the models are small, and the thesis numbers are fp32
REG_DTYPE = typer.Option("fp32", "--dtype", help="fp32 | bf16 | auto: autocast of the forward passes "
                         "(auto: bf16 on a GPU that supports it)")


@app.command()
@_guard
def train(
    task: str = typer.Option("parity", help="task name (see `regular tasks`)"),
    model: str = typer.Option("regulargpt", help="regulargpt | transformer | lstm | rnn"),
    out: Path = typer.Option(..., help="run folder (config.json, model.safetensors, result.json)"),
    seed: int = 0,
    steps: int = typer.Option(3000, help="maximum optimizer steps (early stop at stop-acc)"),
    lr: float = 1e-3,
    batch_size: int = 128,
    opt: Optional[List[str]] = OPT,
    task_opt: Optional[List[str]] = TASK_OPT,
    stop_acc: Optional[float] = typer.Option(1.0, help="stop when train-length and validation accuracy reach it"),
    test_stride: int = typer.Option(1, help="evaluate every k-th valid test length"),
    test_samples: int = typer.Option(128, help="strings per test length"),
    supervision: str = typer.Option("last", help="last: loss on the whole string's label (thesis "
                                    "Table 6.1 here); prefix: on the label of every prefix"),
    positions: str = typer.Option("contiguous", help="transformer only: contiguous, or random:L_MAX (sorted "
                                  "positions from [0, L_MAX) per batch, in training and scoring; Ruoss et al. 2023)"),
    threads: int = typer.Option(1, help="torch CPU threads"),
    progress: bool = True,
    device: str = DeviceOpt,
    dtype: str = REG_DTYPE,
):
    """Train one model on one task, then score every test length."""
    from ..regular.train import RegularRunConfig, run

    _threads(threads)
    cfg = RegularRunConfig(task=task, task_options=_kv(task_opt, "--task-opt"), model=model,
                           model_options=_kv(opt, "--opt"), seed=seed, steps=steps, lr=lr,
                           batch_size=batch_size, stop_acc=stop_acc, test_stride=test_stride,
                           test_samples=test_samples, supervision=supervision, positions=positions,
                           device=device, precision=dtype)
    res = run(cfg, out, progress=progress)
    typer.echo(f"{task}/{model}/seed{seed}: {res['steps_run']} steps ({res['train_seconds']:.1f} s), best step "
               f"{res['best_step']}; accuracy at train lengths {100 * res['mean_train_lengths']:.1f}%, mean over "
               f"{res['test_lengths']['count']} test lengths {res['test_lengths']['min']}..{res['test_lengths']['max']}: "
               f"{100 * res['mean_test']:.2f}% (worst {100 * res['min_test']:.1f}%) -> {out}")


@app.command("eval")
@_guard
def eval_(
    run_dir: Path = typer.Argument(..., help="a folder written by `regular train`"),
    min_len: Optional[int] = typer.Option(None, "--min", help="first length (default: the task's)"),
    max_len: Optional[int] = typer.Option(None, "--max", help="last length (default: the task's)"),
    stride: int = 1,
    samples: int = 128,
    p: Optional[float] = typer.Option(None, help="Parity only: P(sigma=1) at test time"),
    out: Optional[Path] = typer.Option(None, help="write eval.json and a per-length plot here"),
    threads: int = 1,
    device: str = DeviceOpt,
    dtype: str = REG_DTYPE,
):
    """Score a trained run at every valid length from --min to --max."""
    import numpy as np

    from ..regular.plots import plot_per_length
    from ..regular.tasks import make_task
    from ..regular.train import evaluate_lengths, load_run, max_position
    from ..train import placement

    _threads(threads)
    place = placement(device, dtype)
    model, cfg, _ = load_run(run_dir)
    place.put(model)
    rc = cfg.resolved()
    opts = dict(cfg.task_options, **({"p": p} if p is not None else {}))
    task = make_task(cfg.task, **opts)
    lo, hi = min_len or rc.test_min, max_len or rc.test_max
    lengths = task.lengths(lo, hi)[::max(1, stride)]
    if not lengths:
        raise UserError(f"no valid length in [{lo}, {hi}] for task {cfg.task}")
    with place.autocast():
        acc = evaluate_lengths(model, task, lengths, samples, cfg.seed, progress=True, max_position=max_position(rc))
    mean = float(np.mean(list(acc.values())))
    typer.echo(f"{cfg.task}/{cfg.model}: mean accuracy {100 * mean:.2f}% over {len(acc)} lengths {lengths[0]}..{lengths[-1]}"
               f" (worst {100 * min(acc.values()):.1f}% at T={min(acc, key=acc.get)})")
    if out is not None:
        atomic_write_json(Path(out) / "eval.json", {"run": str(run_dir), "mean": mean, "per_length": acc,
                                                   "task_options": opts})
        plot_per_length({cfg.model: acc}, Path(out) / "eval_per_length", f"{cfg.task}", rc.train_max)


@app.command()
@_guard
def table(
    out: Path = typer.Option(Path("reports/regular"), help="output folder (runs/, table.md, table.json, plots/)"),
    tasks: Optional[str] = typer.Option(None, help="comma list; default: all 12 tasks of Table 6.1"),
    models: Optional[str] = typer.Option(None, help="comma list of rnn,lstm,transformer,regulargpt-C2,"
                                         "regulargpt-C3 (default) and transformer-rope-random,"
                                         "transformer-alibi-random (randomized positions), transformer-fire; "
                                         "'modern' = the last three (table.md then adds Ruoss et al. 2023 Table 1)"),
    seeds: int = 3,
    budget: str = typer.Option("quick", help="quick: CPU step caps (3000, transformer 2000, early stop; "
                               "transformer scored on every 5th length 41..500); thesis: Table 6.5 sizes "
                               "(hidden 256, lr 3e-4, 100k steps; GPU-scale)"),
    only: Optional[str] = typer.Option(None, help="run and tabulate only these TASK:COLUMN cells, comma-separated; "
                                       "'gaps' = the cells the quick budget does not reproduce ("
                                       "modular_arithmetic:regulargpt-C2,cycle_navigation:regulargpt-C3,"
                                       "tomita6:regulargpt-C3)"),
    steps: Optional[int] = typer.Option(None, help="max steps per run (overrides the budget)"),
    test_stride: Optional[int] = None,
    test_samples: Optional[int] = None,
    run_opt: Optional[List[str]] = RUN_OPT,
    skip_missing: bool = typer.Option(False, help="only tabulate runs already on disk, train nothing"),
    plan: bool = typer.Option(False, help="print the measured and projected wall time, train nothing"),
    threads: int = typer.Option(1, help="torch threads per run (per worker with --workers)"),
    workers: int = typer.Option(1, help="train missing runs in this many processes at once "
                                "(e.g. the number of cores with --threads 1)"),
    progress: bool = True,
    probe_steps: int = typer.Option(20, help="--plan: time this many steps of a column with no finished run "
                                    "on --device to project it (0: no probe)"),
    device: str = DeviceOpt,
    dtype: str = REG_DTYPE,
    engine: str = typer.Option("local", "--engine", help="local (this machine) | ray (a Ray cluster; docs/scale-out.md)"),
    address: Optional[str] = AddressOpt,
    devices: str = typer.Option("auto", "--devices", help="GPU runs: the GPUs to use, e.g. 0,2,3 (auto: every "
                                "visible one; one worker per GPU)"),
    runs_per_device: int = typer.Option(1, "--runs-per-device", help="GPU runs: runs packed onto one GPU at once"),
):
    """Thesis Table 6.1 in one command (resumable: finished runs are reused).

    Every task x model column x seed is one run folder under OUT/runs.

    table.md ends with the measured compute time and the projection for missing runs (--plan: only that).
    """
    from ..executor import EngineSpec
    from ..regular.plan import plan as plan_table
    from ..regular.plan import plan_lines
    from ..regular.table import THESIS_GAPS, regular_table

    _threads(threads)
    over = dict(steps=steps, test_stride=test_stride, test_samples=test_samples, device=device, precision=dtype)
    only = THESIS_GAPS if only == "gaps" else only
    if plan:
        wt = plan_table(out, tasks, models, seeds, budget, _per_model(run_opt), only, probe_steps, **over)
        typer.echo("\n".join(plan_lines(wt)))
        return
    eng = EngineSpec.from_dict({"engine": engine, "address": address, "devices": devices, "workers": workers,
                                "runs_per_device": runs_per_device}, where="--")
    res = regular_table(out, tasks, models, seeds, progress, _per_model(run_opt), skip_missing, budget,
                        workers=workers, threads=threads, only=only, engine=eng, **over)
    for line in res["skipped"]:
        typer.echo(line, err=True)
    typer.echo((Path(out) / "table.md").read_text())
    typer.echo(f"wrote {out}/table.md, table.json and plots/ ({len(res['tasks'])} tasks)")


@app.command("sweep-p")
@_guard
def sweep_p_(
    out: Path = typer.Option(Path("reports/regular"), help="output folder (shares runs/ with `table`)"),
    models: Optional[str] = typer.Option(None, help="default regulargpt-C2,rnn,transformer"),
    seeds: int = 3,
    ps: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="comma list of P(sigma=1) values"),
    steps: Optional[int] = None,
    test_stride: Optional[int] = None,
    test_samples: Optional[int] = None,
    run_opt: Optional[List[str]] = RUN_OPT,
    eval_stride: Optional[int] = typer.Option(None, help="score every k-th length 41..500 (default: the run's)"),
    eval_samples: Optional[int] = typer.Option(None, help="strings per length (default: the run's)"),
    budget: str = typer.Option("quick", help="run preset shared with `regular table` (quick | thesis)"),
    threads: int = 1,
):
    """Thesis Table 6.2: Parity trained at P(sigma=1)=0.5, tested at other P(sigma=1)."""
    from ..regular.table import sweep_p

    _threads(threads)
    sweep_p(out, models, seeds, ps, True, _per_model(run_opt), eval_stride, eval_samples, budget,
            steps=steps, test_stride=test_stride, test_samples=test_samples)
    typer.echo((Path(out) / "sweep_p.md").read_text())


@app.command()
@_guard
def pca(
    run_dir: Path = typer.Argument(..., help="a regulargpt run on parity or cycle_navigation"),
    out: Path = typer.Option(Path("reports/regular/pca")),
    length: int = 500,
    batch: int = 8,
    threads: int = 1,
):
    """Fig. 6.3: PCA clustering of RegularGPT's layer outputs across all levels."""
    from ..regular.pca import pca_figure

    _threads(threads)
    res = pca_figure(run_dir, out, length, batch)
    typer.echo(json.dumps({k: v for k, v in res.items() if k != "plots"}, indent=1))
    typer.echo("wrote " + ", ".join(res["plots"]))


@app.command()
@_guard
def erf(
    run_dirs: List[Path] = typer.Argument(..., help="run folders of one task (any model kinds)"),
    out: Path = typer.Option(Path("reports/regular/erf"), help="writes erf.json, erf.png/svg here"),
    length: int = typer.Option(500, help="string length T (Deletang tests: 41..500)"),
    samples: int = typer.Option(32, help="strings averaged"),
    threads: int = 1,
):
    """Fig. 6.4a: cumulative gradient c_m from the last token back, per run, on the same strings."""
    from ..regular.erf import regular_erf

    _threads(threads)
    res = regular_erf(run_dirs, out, length, samples)
    for r in res["runs"]:
        typer.echo(f"{r['name']}: ERF {r['erf_tokens']} of {length} tokens hold 99% of the gradient; "
                   f"{100 * r['share_beyond_train']:.1f}% lies beyond the last {res['train_max']} tokens")
    typer.echo("wrote " + ", ".join(res["figures"]) + f", {out / 'erf.json'}")


@app.command()
@_guard
def lemma(
    out: Path = typer.Option(Path("reports/regular"), help="writes lemma_6_1.json here"),
    samples: int = typer.Option(20000, help="random (A, B) pairs for n = 3, 4 (n = 2 is exhaustive)"),
):
    """Lemma 6.1: check the two-layer ReLU binary-matrix-product construction; write W1, W2."""
    from ..regular.lemma import lemma_artifact

    art = lemma_artifact(out, (2, 3, 4), samples)
    for c in art["checks"]:
        kind = "all" if c["exhaustive"] else "random"
        typer.echo(f"n={c['n']}: {c['pairs']} {kind} (A, B) pairs, mismatches {c['mismatches']}")
    typer.echo(f"thesis §6.9.6 example -> {art['thesis_example']['out']} (expected [0, 1, 0, 1])")
    if any(c["mismatches"] for c in art["checks"]):
        raise typer.Exit(1)


@app.command()
@_guard
def bench(
    lengths: str = typer.Option("500,1024,2048,4096", help="comma list of sequence lengths"),
    C: int = typer.Option(2, "--C", help="chunk size"),
    dim: int = 64,
    heads: int = 8,
    batch: int = 1,
    repeats: int = 3,
    threads: int = 1,
    out: Optional[Path] = typer.Option(None, help="also write bench.json here"),
):
    """Sliding-dilated O(T·C) attention vs full O(T²) attention: times and ratios."""
    from ..regular.bench import benchmark, format_bench

    _threads(threads)
    try:
        ls = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths must be integers like 500,1024, got {lengths!r}") from None
    if not ls or min(ls) < 2 or C < 2:
        raise UserError("--lengths must be >= 2 and --C >= 2")
    res = benchmark(ls, C, dim, heads, batch, repeats)
    typer.echo(format_bench(res))
    if out is not None:
        atomic_write_json(Path(out) / "bench.json", res)


@app.command()
def tasks():
    """List the tasks with their train / test lengths."""
    from ..regular.tasks import TASKS, make_task

    for name in TASKS:
        t = make_task(name)
        typer.echo(f"{name:20s} {t.family:13s} vocab={t.vocab_size} classes={t.num_classes} "
                   f"train 1..{t.train_max} test {t.test_lengths[0]}..{t.test_lengths[1]}")


if __name__ == "__main__":  # pragma: no cover
    app(sys.argv[1:])

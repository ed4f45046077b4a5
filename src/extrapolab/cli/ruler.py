"""`extrapolab ruler MODEL`: RULER's offline synthetic tasks (tasks/ruler/run.py ``run_ruler``)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import ROPE_HELP, DeviceOpt, DtypeOpt, friendly


@friendly
def ruler(
    model: str = typer.Argument(..., help="hf:PATH (a local Hugging Face causal LM folder or GGUF file) or a run "
                                "folder made by `extrapolab train`"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help="ruler-quick (2-core CPU, <= 45 min on "
                                         "SmolLM2-135M) | ruler-gpu (one GPU, 4k-32k) | a YAML file with ruler:"),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="all | niah | comma-separated names: niah_single_1..3, "
                                        "niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated lengths in tokens (the "
                                          "prompt plus tokens_to_generate), e.g. 4096,8192,16384,32768"),
    n: Optional[int] = typer.Option(None, "--n", help="samples per task and length (default 5)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="RULER's --random_seed (default 42)"),
    seeding: Optional[str] = typer.Option(None, "--seeding", help="chunk (default: sample i seeded seed + i, as "
                                          "RULER's prepare.py --chunk_amount N) | stream (RULER's default: one "
                                          "stream seeded seed)"),
    chat: Optional[str] = typer.Option(None, "--chat", help="auto | on | off: the tokenizer's chat template around "
                                       "each prompt (default auto: where the tokenizer has one)"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="auto | both | greedy | teacher (auto: both "
                                          "for hf:, teacher-forced for runs)"),
    rope: Optional[str] = typer.Option(None, "--rope", help=ROPE_HELP),
    train_length: Optional[int] = typer.Option(None, "--train-length", help="hf: only: L_tr for --rope "
                                               "(default: from its config)"),
    out: Optional[Path] = typer.Option(None, "--out", help="results folder (default runs/hf-<name>[-rope]/ruler "
                                       "or RUN/ruler)"),
    which: str = typer.Option("best", "--checkpoint", help="runs: best|last"),
    prepare: bool = typer.Option(False, "--prepare", help="generate and cache the sample sets, score nothing "
                                 "(CPU work to do before a GPU run)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a preset value, e.g. --set ruler.n=2"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """RULER's 11 offline tasks (NIAH x 8, vt, cwe, fwe) at each length: score per task, length and
    needle depth; resumable per (task, length)."""
    from ..tasks.ruler import run_ruler

    given = [("--preset", preset), ("--tasks", tasks), ("--lengths", lengths), ("--n", n), ("--seed", seed),
             ("--seeding", seeding), ("--chat", chat), ("--metrics", metrics), ("--rope", rope), ("--train-length", train_length),
             ("--out", out), ("--prepare", "" if prepare else None), *[("--set", s) for s in set_ or []],
             ("--checkpoint", which if which != "best" else None), ("--device", device if device != "auto" else None),
             ("--dtype", dtype if dtype != "auto" else None)]
    command = " ".join(["extrapolab ruler", model] + [f"{k} {v}".rstrip() for k, v in given if v is not None])
    res = run_ruler(model, preset=preset, overrides=set_, tasks=tasks, lengths=lengths.split(",") if lengths else None,
                    n=n, seed=seed, chat=chat, metrics=metrics, seeding=seeding, rope=rope, train_length=train_length, out=out,
                    which=which, device=device, dtype=dtype, command=command, prepare_only=prepare,
                    say=lambda m: typer.echo(m, err=True))
    typer.echo(res["markdown"])
    if prepare:
        return
    typer.echo(f"wrote {res['path']}/report.md, ruler.json, ruler.csv (wall time {res['wall_s']:.0f} s)")

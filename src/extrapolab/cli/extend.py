"""`extrapolab extend hf:PATH`: the training-free context-extension study on a pretrained RoPE model
(extrapolab.extend; also spelled `extrapolab align rope hf:PATH`).

    extrapolab extend hf:FILE.gguf [--preset extend-quick] [--out OUT] [--set extend.windows=4]
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import DeviceOpt, DtypeOpt, friendly, run_study

PRESET_HELP = ("extend-smoke (seconds) | extend-quick (default, ~1.8 h on 2 idle cores) | "
               "extend-standard (2 h 43 min) | extend-gpu | YAML file")


def extend_study(model: str, preset: Optional[str], out: Optional[Path], set_: Optional[List[str]], device: str,
                 dtype: str) -> None:
    """Check that ``model`` names a pretrained model, run the study, print its summary."""
    from functools import partial

    from ..extend.study import run_extend_study
    from ..hf import is_hf_spec
    from ..io import UserError

    if not is_hf_spec(model):
        raise UserError(f"the extension study takes a pretrained model as hf:PATH (a folder or a .gguf file); "
                        f"got {model!r}")
    run_study(partial(run_extend_study, model), preset or "extend-quick", out, set_, device, dtype)


@friendly
def extend(
    model: str = typer.Argument(..., help="hf:PATH: a local folder or GGUF file of a pretrained RoPE model"),
    preset: Optional[str] = typer.Option(None, "--preset", "-p", help=PRESET_HELP),
    out: Optional[Path] = typer.Option(None, "--out", help="report folder (default out_dir/name, e.g. "
                                       "reports/extend-quick)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="override a config value, e.g. "
                                             "--set extend.windows=2 (repeatable)"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Every training-free context extension (PI, NTK, dynamic NTK, YaRN, Self-Extend, ReRoPE, log-n, softmax
    temperatures) on one pretrained model's weights at 1x, 2x, 4x its context -> report.html (resumable)."""
    extend_study(model, preset, out, set_, device, dtype)

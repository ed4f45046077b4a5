"""Shared CLI helpers: one-line input errors with a non-zero exit; running a one-command study."""
from __future__ import annotations

import errno
import functools
from pathlib import Path
from typing import List, Optional

import typer

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _user_errors():
    from ..config import ConfigError
    from ..io import UserError
    from ..positional.base import SchemeError

    return (UserError, SchemeError, ConfigError, FileNotFoundError)


def friendly(fn):
    """Turn input errors into one red line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_errors() as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            typer.secho(f"error: {msg}", fg="red", err=True)
            raise typer.Exit(2) from None
        except OSError as e:  # disk full / quota / read-only: the user's to fix, not a bug
            if e.errno not in DISK_ERRNOS:
                raise
            where = f" writing {e.filename}" if e.filename else ""
            typer.secho(f"error: {e.strerror}{where}; free disk space (or use a writable folder) and re-run "
                        "the same command: it resumes from the last checkpoint", fg="red", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.secho("interrupted; re-run the same command to resume from the last checkpoint", err=True)
            raise typer.Exit(130) from None

    return wrapper


#: the device and precision options every verb that runs a model takes (resolved by
#: ``extrapolab.train.dist.resolve_device`` and ``train.step.resolve_precision``)
#: --rope on hf: models (hf/load.py parse_rope)
ROPE_HELP = ("hf: only: RoPE override or extension: linear|dynamic|yarn|ntk|llama3:S[,key=value], "
             "longrope:S,long=[...], proportional:P, selfextend:G[,w], rerope[:w], rerope-leaky[:w[,k]], dca[:C[,w]], "
             "streaming[:K[,W]], logn; join with +, e.g. rerope:512+logn (docs/hf.md)")
#: --rope of `eval`: hf: models and runs trained with plain rotary (align/rope_methods.py)
EVAL_ROPE_HELP = ("RoPE override or extension: linear|dynamic|yarn|ntk|llama3:S[,key=value], longrope:S,long=[...], "
                  "proportional:P, selfextend:G[,w], rerope[:w], rerope-leaky[:w[,k]], dca[:C[,w]], streaming[:K[,W]], "
                  "logn; join with +, e.g. rerope:512+logn. On hf: models and on runs trained with plain rotary (a "
                  "rewrite joined with a multi-pass method: hf: only) -> eval-rope-<tag>.json")
DeviceOpt = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N (auto: cuda when visible)")
DtypeOpt = typer.Option("auto", "--dtype", help="auto | fp32 | bf16 (auto: bf16 on a GPU that supports it, else fp32)")


EngineOpt = typer.Option(None, "--engine", help="local (this machine: sweep.workers, or one run per GPU of "
                         "sweep.devices) | ray (a Ray cluster; docs/scale-out.md); default: the preset's sweep.engine")
AddressOpt = typer.Option(None, "--address", help="--engine ray: auto (the cluster this machine joined with `ray "
                          "start`) | HOST:PORT (its head) | left out: a Ray of this machine only")


def engine_overrides(engine: Optional[str], address: Optional[str]) -> list[str]:
    """``--engine`` / ``--address`` as ``--set sweep.engine=... sweep.address=...`` (JSON strings are YAML)."""
    import json

    return ([f"sweep.engine={json.dumps(engine)}"] if engine else []) + \
        ([f"sweep.address={json.dumps(address)}"] if address else [])


def run_study(run, preset: str, out: Optional[Path], set_: Optional[List[str]], device: str, dtype: str) -> None:
    """Run one study (``run(preset, out=..., overrides=...)`` -> {"out", "report", "wall_s"}) with the
    --set overrides and the placement flags, then print its summary and where the report is."""
    from ..train.placement import placement_overrides

    res = run(preset, out=out, overrides=[*(set_ or []), *placement_overrides(device, dtype)])
    typer.echo((res["out"] / "summary.md").read_text())
    typer.echo(f"report: {res['report']}  (wall time {res['wall_s']:.0f} s)")

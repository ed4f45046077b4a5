"""Crash-safe checkpoints (a killed training run resumes from its last checkpoint; docs/reliability.md).

A checkpoint is a folder::

    model.safetensors   weights; tied aliases (head.weight = tok.weight) stored once
    state.pt            optimizer state, step, RNG states, sampler state, counters (torch.save)
    config.yaml         the resolved RunConfig (vocab size from the data)
    manifest.json       size + sha256 of the three files above, written last

It is written into a temp folder next to its destination, every file fsynced, then renamed into
place (the previous copy is moved to ``.NAME.old`` first and removed after), so a checkpoint is
complete or absent. ``load_checkpoint`` re-checks the manifest and refuses truncated or corrupt
files, and a checkpoint whose architecture differs from the config, with a one-line UserError.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .. import config as config_mod
from ..config import ConfigError, RunConfig
from ..io import UserError, atomic_write_text, fsync_path, sha256_file
from ..model.gpt import GPT, ModelConfig
from ..model.regular_lm import build_model

WEIGHTS, STATE, CONFIG, MANIFEST = "model.safetensors", "state.pt", "config.yaml", "manifest.json"
# vocab_size is not here: it comes from the data, not the config (train() checks it separately)
ARCH_FIELDS = ("layers", "heads", "dim", "mlp_ratio", "scheme", "scheme_params", "train_length", "tie_weights",
               "layer_types", "types", "layout")


@dataclass
class Checkpoint:
    path: Path
    config: RunConfig
    weights: dict[str, torch.Tensor]
    state: dict | None

    @property
    def step(self) -> int:
        return int(self.state["step"]) if self.state else -1


# ---- tied weights --------------------------------------------------------------------------------
def aliases(model: nn.Module) -> dict[str, str]:
    """{alias name: canonical name} for parameters/buffers registered under several names."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if id(t) in first and first[id(t)] != name:
            out[name] = first[id(t)]
        first.setdefault(id(t), name)
    return out


def unique_weights(state: dict[str, torch.Tensor], alias: dict[str, str]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k not in alias}


# ---- writing -------------------------------------------------------------------------------------

def write_folder_atomically(dest: Path, writer: Callable[[Path], None]) -> None:
    """``writer(tmp_folder)`` fills a temp folder; add a manifest, fsync, rename it to ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is as readable as its run dir
    old = dest.parent / f".{dest.name}.old"
    try:
        writer(tmp)
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
        atomic_write_text(tmp / MANIFEST, json.dumps({"files": manifest}, indent=1) + "\n")
        for p in files:
            fsync_path(p)
        fsync_path(tmp)
        if dest.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(dest, old)
        os.replace(tmp, dest)
        fsync_path(dest.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, quota, read-only or permissions: one line, old copy kept
            raise UserError(
                f"could not write checkpoint {dest} ({e.strerror or e}); free disk space or fix the folder's "
                "permissions, then re-run the same command to resume from the previous checkpoint") from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(dest: Path, weights: dict[str, torch.Tensor], cfg: RunConfig, state: dict | None) -> None:
    def writer(tmp: Path) -> None:
        meta = {"format": "pt", "extrapolab": "1", "step": str(state["step"] if state else -1)}
        save_file(weights, str(tmp / WEIGHTS), metadata=meta)
        if state is not None:
            torch.save(state, tmp / STATE)
        config_mod.save(cfg, tmp / CONFIG)

    write_folder_atomically(Path(dest), writer)


def clean_stale(ckpt_root: Path) -> None:
    """Remove temp folders left by a process killed while writing."""
    if ckpt_root.is_dir():
        for p in ckpt_root.glob(".*.tmp"):
            shutil.rmtree(p, ignore_errors=True)


# ---- reading -------------------------------------------------------------------------------------
def checkpoint_path(run_dir: Path, which: str = "last") -> Path | None:
    """The folder of checkpoint ``which`` (recovering ``.which.old`` after a crash mid-swap)."""
    root = Path(run_dir) / "checkpoints"
    if (root / which).is_dir():
        return root / which  # load_checkpoint refuses it if it is damaged
    old = root / f".{which}.old"
    return old if (old / MANIFEST).is_file() else None


def _corrupt(path: Path, what: str) -> UserError:
    return UserError(
        f"checkpoint {path} is damaged ({what}); delete that folder to resume from scratch, "
        "or restore it from a backup"
    )


def _verify(path: Path) -> set[str]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise _corrupt(path, f"no {MANIFEST}: it was not completely written") from None
    except (ValueError, KeyError, TypeError):
        raise _corrupt(path, f"{MANIFEST} is unreadable") from None
    for name, info in manifest.items():
        f = path / name
        if not f.is_file():
            raise _corrupt(path, f"{name} is missing")
        if f.stat().st_size != info["bytes"]:
            raise _corrupt(path, f"{name} is truncated: {f.stat().st_size} of {info['bytes']} bytes")
        if sha256_file(f) != info["sha256"]:
            raise _corrupt(path, f"{name} fails its sha256 check")
    if WEIGHTS not in manifest or CONFIG not in manifest:
        raise _corrupt(path, f"{WEIGHTS} or {CONFIG} is missing")
    return set(manifest)


def check_architecture(found: ModelConfig, wanted: ModelConfig, path: Path) -> None:
    for key in ARCH_FIELDS:
        a, b = getattr(found, key), getattr(wanted, key)
        if a != b:
            raise UserError(
                f"checkpoint {path} holds a model with model.{key}={a!r} but the config asks for {b!r}; "
                f"use the checkpoint's own config ({path / CONFIG}) or start a new run with another --name"
            )


def load_checkpoint(path: str | Path, cfg: RunConfig | None = None, *, with_state: bool = True) -> Checkpoint:
    """Load and validate a checkpoint folder (or a run dir: its ``checkpoints/last``)."""
    path = Path(path)
    if not (path / MANIFEST).exists() and (path / "checkpoints").is_dir():
        path = checkpoint_path(path, "last") or path / "checkpoints" / "last"
    if not path.is_dir():
        raise UserError(f"no checkpoint at {path}; train first (`extrapolab train`) or check the path")
    files = _verify(path)
    try:
        ckpt_cfg = config_mod.load(path / CONFIG)
    except ConfigError as e:
        raise _corrupt(path, str(e)) from None
    try:
        weights = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise _corrupt(path, f"{WEIGHTS}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    state = None
    if with_state and STATE in files:
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            raise _corrupt(path, f"{STATE}: {type(e).__name__}") from None
    if cfg is not None:
        check_architecture(ckpt_cfg.model, cfg.model, path)
    return Checkpoint(path, ckpt_cfg, weights, state)


def full_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Check names/shapes against ``model`` and re-add tied aliases; the dict load_state_dict wants."""
    alias = aliases(model)
    expected = {k: v for k, v in model.state_dict().items() if k not in alias}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise UserError(f"checkpoint {path} does not fit this model ({what}); "
                        "use the checkpoint's own config or start a new run with another --name")
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise UserError(f"checkpoint {path} does not fit this model ({k}: {tuple(weights[k].shape)} "
                            f"vs {tuple(v.shape)}); use the checkpoint's own config or another --name")
    out = dict(weights)
    for a, canon in alias.items():
        out[a] = weights[canon]
    return out


def load_model(run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu") -> tuple[GPT, RunConfig]:
    """The trained model of a run directory (``which``: best | last) in eval mode, and its config."""
    if which not in ("best", "last"):
        raise UserError(f"which must be 'best' or 'last', got {which!r}")
    path = checkpoint_path(Path(run_dir), which)
    if path is None:
        other = "last" if which == "best" else "best"
        hint = f"; try which='{other}'" if checkpoint_path(Path(run_dir), other) else \
            "; train it first with `extrapolab train`"
        raise UserError(f"run {run_dir} has no '{which}' checkpoint{hint}")
    ckpt = load_checkpoint(path, with_state=False)
    model = build_model(ckpt.config.model)
    model.load_state_dict(full_weights(model, ckpt.weights, path))
    return model.to(device).eval(), ckpt.config

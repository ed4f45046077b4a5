"""What the training loop checks and loads before its first step, and its test hook after the last.

``check_train`` refuses bad ``train.*`` values with one line before any data is read;
``load_data`` prepares the corpus on rank 0 first; ``same_data`` refuses to resume a run on other
data; ``write_checksum`` (only with ``$EXTRAPOLAB_RANK_CHECKSUMS`` set) lets the distributed tests
compare every rank's weights and first batch.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from ..config import RunConfig
from ..io import UserError
from . import dist as D
from . import tb

CHECKSUM_ENV = "EXTRAPOLAB_RANK_CHECKSUMS"  # test hook: every rank writes rank<r>.checksum.json


def check_train(cfg: RunConfig) -> None:
    t = cfg.train
    for key in ("steps", "batch_size", "grad_accum", "log_every"):
        if getattr(t, key) < 1:
            raise UserError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    for key in ("eval_every", "checkpoint_every", "warmup_steps", "eval_batches"):
        if getattr(t, key) < 0:
            raise UserError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.strategy not in D.STRATEGIES:
        raise UserError(f"unknown train.strategy {t.strategy!r}; use one of {', '.join(D.STRATEGIES)}")
    if t.tensorboard:
        tb.require()


def load_data(cfg: RunConfig, env: D.DistEnv, progress: bool):
    from .. import data as data_mod

    if not hasattr(data_mod, "prepare"):
        raise UserError("extrapolab.data.prepare is not available in this install; pass data=TokenData(...)")
    out = data_mod.prepare(cfg.data, progress=progress) if env.is_main else None
    env.barrier()  # rank 0 builds the tokenizer/cache first; the others then read it
    return out if env.is_main else data_mod.prepare(cfg.data, progress=False)


def same_data(found: RunConfig, wanted: RunConfig, run_dir: Path) -> None:
    a, b = dataclasses.asdict(found.data), dataclasses.asdict(wanted.data)
    for key in a:
        if key != "cache_dir" and a[key] != b.get(key):
            raise UserError(f"run {run_dir} was trained with data.{key}={a[key]!r}, not {b.get(key)!r}; "
                            "use the same data settings to resume, or start a new run with another --name")
    if found.train.positions != wanted.train.positions:
        raise UserError(f"run {run_dir} was trained with train.positions={found.train.positions}, not "
                        f"{wanted.train.positions}; use the same setting to resume, or another --name")


def write_checksum(model, env: D.DistEnv, run_dir: Path, step: int, first_batch: str | None) -> None:
    if not os.environ.get(CHECKSUM_ENV):
        return
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP: gather the shards
        h.update(name.encode())
        h.update(full.detach().float().cpu().numpy().tobytes())
    out = {"rank": env.rank, "world": env.world, "step": step,
           "params_sha256": h.hexdigest(), "first_batch_sha256": first_batch}
    (Path(run_dir) / f"rank{env.rank}.checksum.json").write_text(json.dumps(out) + "\n")

"""Optional TensorBoard event files of a training run (``train.tensorboard=true``).

Every row the trainer appends to ``metrics.jsonl`` (train/records.py) is also written as scalars
to ``RUN/tensorboard/`` with torch's ``SummaryWriter`` (the ``tensorboard`` package, the ``tb``
extra): ``train/loss``, ``train/lr``, ``train/tokens``, ``train/tokens_per_s``,
``train/sec_per_step``, ``train/grad_norm`` (when clipping computes it) and ``valid/loss``,
``valid/ppl``, each at its optimizer step. ``tensorboard --logdir RUN`` shows them.

Resume: the rows after the checkpoint's step are re-done, so the writer is opened with
``purge_step = step + 1``; TensorBoard then drops the events a killed process wrote after the
checkpoint (its readers honour the ``SessionLog.START`` record this writes) and each step appears
once. A run started over (``resume=False``, or killed before its first checkpoint) first removes
the folder. Only the main process writes.
"""
from __future__ import annotations

import shutil
from numbers import Real
from pathlib import Path

from ..io import UserError

TB_DIR = "tensorboard"


def tags(row: dict) -> dict[str, float]:
    """A metrics.jsonl row -> {tag: value}: ``valid_x`` -> ``valid/x``, any other number -> ``train/x``."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, Real):
            continue
        out[f"valid/{key[6:]}" if key.startswith("valid_") else f"train/{key}"] = float(value)
    return out


def require() -> None:
    """A one-line UserError when the tensorboard package is missing (checked before any work)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserError("train.tensorboard=true needs the tensorboard package: pip install -e '.[tb]' "
                        "(or --set train.tensorboard=false)") from None


class TensorBoardLog:
    """``row(dict)`` -> scalars at ``row['step']``; ``close()`` flushes. ``step``: the checkpoint step
    resumed from (0 for a fresh run)."""

    def __init__(self, run_dir: Path, step: int, fresh: bool) -> None:
        require()
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir) / TB_DIR
        if fresh:
            shutil.rmtree(self.dir, ignore_errors=True)  # events of a run that is being started over
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=step + 1 if step else None)

    def row(self, row: dict) -> None:
        for tag, value in tags(row).items():
            self.writer.add_scalar(tag, value, global_step=int(row["step"]))

    def close(self) -> None:
        self.writer.close()

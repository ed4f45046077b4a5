"""Shared helpers of the analysis tools (A1-A5): figures, segments, JSON (peak memory: extrapolab.memory).

Figures use matplotlib's object-oriented ``Figure`` (no pyplot state, Agg canvas) and are
written as PNG + SVG through :func:`extrapolab.io.atomic_write_with`, so a figure is either
complete or absent.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from ..io import UserError, atomic_write_with

FORMATS = ("png", "svg")


# ---- figures -------------------------------------------------------------------------------
def new_figure(width: float = 6.4, height: float = 4.0, ncols: int = 1, nrows: int = 1):
    """(fig, axes) on an Agg canvas; axes is one Axes when nrows = ncols = 1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=True)
    return fig, axes


def save_figure(fig, stem: str | Path, formats: Iterable[str] = FORMATS) -> list[str]:
    """Write ``stem.png`` and ``stem.svg`` atomically; returns the paths written."""
    stem = Path(stem)
    out = []
    for ext in formats:
        path = stem.with_suffix(f".{ext}")
        atomic_write_with(path, lambda p, e=ext: fig.savefig(p, format=e, dpi=130))
        out.append(str(path))
    return out


# ---- data ------------------------------------------------------------------------------------
def segments_from_stream(tokens, length: int, n: int) -> torch.Tensor:
    """N segments [N, length] of a 1-D token stream, starts evenly spaced (deterministic)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise UserError(f"token stream must be 1-D, got shape {arr.shape}")
    length, n = int(length), int(n)
    if length < 2 or n < 1:
        raise UserError(f"need length >= 2 and n >= 1 segments, got length={length}, n={n}")
    if arr.size < length:
        raise UserError(
            f"corpus too small: {arr.size} test tokens cannot hold one segment of {length}; "
            "use a smaller length or a bigger corpus")
    starts = np.unique(np.linspace(0, arr.size - length, num=n).round().astype(np.int64))
    return torch.from_numpy(np.stack([np.asarray(arr[s:s + length], dtype=np.int64) for s in starts]))


def as_segments(segments) -> torch.Tensor:
    seg = torch.as_tensor(np.asarray(segments) if not isinstance(segments, torch.Tensor) else segments)
    if seg.dim() == 1:
        seg = seg[None]
    if seg.dim() != 2 or seg.dtype.is_floating_point:
        raise UserError(f"segments must be an integer array [N, L], got shape {tuple(seg.shape)}")
    return seg.long()


# ---- JSON ------------------------------------------------------------------------------------
def jsonable(obj):
    """Convert numpy/torch scalars and arrays, and non-finite floats, into plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    return obj

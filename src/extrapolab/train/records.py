"""Run records: ``metrics.jsonl`` (one JSON row per log / validation), ``summary.json``, this run's peak memory.

Rows: ``{"step", "loss", "lr", "tokens", "sec_per_step", "tokens_per_s", "grad_norm"}`` every
``log_every`` steps (loss = mean train loss over the steps since the previous row, averaged over
micro-batches and processes; grad_norm = the mean global gradient norm before clipping over those
steps, present when ``train.grad_clip`` > 0) and ``{"step", "valid_loss", "valid_ppl"}`` at each validation. On resume the rows
after the checkpoint's step are dropped (they are re-done), so the file reads as one clean run.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from ..io import atomic_write_text
from ..memory import PeakMemory

METRICS, SUMMARY = "metrics.jsonl", "summary.json"
CURVES = ("train_step", "train_loss", "train_tokens", "valid_step", "valid_loss", "valid_tokens")


def read_rows(run_dir: Path) -> list[dict]:
    """All complete rows of ``metrics.jsonl`` (a torn last line from a kill is skipped)."""
    path = Path(run_dir) / METRICS
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def truncate_rows(run_dir: Path, step: int) -> None:
    """Keep only rows with ``row['step'] <= step`` (atomic rewrite)."""
    rows = [r for r in read_rows(run_dir) if int(r.get("step", 0)) <= step]
    atomic_write_text(Path(run_dir) / METRICS, "".join(json.dumps(r) + "\n" for r in rows))


def append_row(run_dir: Path, row: dict) -> None:
    with open(Path(run_dir) / METRICS, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def start_peak_memory(device: torch.device) -> PeakMemory:
    """Start measuring this run's own peak (CUDA peak stats / the kernel's RSS peak are reset), so a
    run in a reused process (a sweep worker) does not inherit the peaks of earlier runs."""
    mem = PeakMemory(device, interval=0.05)
    mem.__enter__()
    return mem


def peak_memory(mem: PeakMemory) -> tuple[float, str]:
    """(MiB, kind) of a run started with :func:`start_peak_memory`: CUDA max allocated on GPU, else
    the peak resident set size of the process during the run."""
    mem.__exit__(None, None, None)
    return mem.abs_mib, "cuda_max_allocated" if mem.device.type == "cuda" else "cpu_max_rss"


def build_summary(run_dir: Path, base: dict, tokens_per_step: int) -> dict:
    rows = read_rows(run_dir)
    secs = [r["sec_per_step"] for r in rows if "sec_per_step" in r]
    valid = [r for r in rows if "valid_loss" in r]
    med = statistics.median(secs) if secs else float("nan")
    best = min(valid, key=lambda r: r["valid_loss"]) if valid else None
    out = {
        **base,
        "final_valid_loss": valid[-1]["valid_loss"] if valid else None,
        "final_valid_ppl": valid[-1]["valid_ppl"] if valid else None,
        "best_valid_loss": best["valid_loss"] if best else None,
        "best_valid_ppl": best["valid_ppl"] if best else None,
        "best_step": best["step"] if best else None,
        "median_sec_per_step": med,
        "tokens_per_s": tokens_per_step / med if secs and med > 0 else None,
        "tokens_per_step": tokens_per_step,
    }
    return out


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write_text(Path(run_dir) / SUMMARY, json.dumps(summary, indent=2, default=str) + "\n")


def read_summary(run_dir: Path) -> dict | None:
    path = Path(run_dir) / SUMMARY
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def curves(rows: list[dict], tokens_per_step: float | None = None) -> dict[str, list[float]]:
    """metrics.jsonl rows -> {name: values} for :data:`CURVES` (the report's training curves).
    Validation rows carry no token count: it is step x tokens per step (from the summary, else from
    the train rows)."""
    train = [r for r in rows if "loss" in r and "step" in r]
    valid = [r for r in rows if "valid_loss" in r and "step" in r]
    if not tokens_per_step:
        tokens_per_step = next((r["tokens"] / r["step"] for r in train if r.get("tokens") and r["step"]), None)
    tps = float(tokens_per_step) if tokens_per_step else math.nan
    return {
        "train_step": [float(r["step"]) for r in train],
        "train_loss": [float(r["loss"]) for r in train],
        "train_tokens": [float(r.get("tokens", r["step"] * tps)) for r in train],
        "valid_step": [float(r["step"]) for r in valid],
        "valid_loss": [float(r["valid_loss"]) for r in valid],
        "valid_tokens": [float(r["step"]) * tps for r in valid],
    }

"""Timing rules of every ratio the bench and the sweep report print (docs/protocols.md, E8).

A ratio to NoPE is only meaningful when both numbers come from the same process, at the same sizes,
threads and device, measured interleaved. So every measured row carries its provenance (``pid`` and
a ``config`` key of sizes / threads / device), and :func:`paired_ratio` refuses two rows whose
provenance differs. Rounds rotate the order of the jobs (NoPE is not always first), so load from
other processes hits every scheme alike. In the bench's row groups (:func:`paired_rounds`) every call
of a scheme is timed right next to a call of NoPE (before it in one round, after it in the next), so
a slowdown of the host that lasts seconds hits both calls of a pair; the ratio of a scheme is the
median over rounds of (scheme time / the NoPE time next to it), printed with the min-max of those
per-round ratios. Groups of a few jobs (:func:`round_robin`) pair a job with the other's call in the
same round.

Timings are wall-clock ``perf_counter`` around the call only (on CUDA between two
``torch.cuda.synchronize``); no memory sampler runs during a timed call (extrapolab.memory).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Callable

import torch
from scipy import stats

#: two invocations should agree within this relative tolerance; wider 95% intervals are flagged
TOLERANCE = 0.03


class ProvenanceError(ValueError):
    """Two rows measured in different processes or at different sizes were about to be divided."""


def provenance(device: torch.device, **sizes) -> dict:
    """What a row must share with its baseline: this process, device, threads and the sizes."""
    key = {"device": str(device), "threads": torch.get_num_threads(), **sizes}
    return {"pid": os.getpid(), "config": json.dumps(key, sort_keys=True, default=str)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def enqueued(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(host seconds, wall seconds) of one call with the queue drained before: the host's time is until ``fn``
    returns, having issued its work (on a GPU, before waiting for it unless ``fn`` itself waits), the wall's until
    the device has done it too. On the CPU the two are one."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    sync(device)
    return t1 - t0, time.perf_counter() - t0


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, with the device's queue drained before and after."""
    return enqueued(fn, device)[1]


def rotated(names: list[str], r: int) -> list[str]:
    """Round r's order: the list rotated by r, so each job leads in turn."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def round_robin(jobs: dict[str, Callable], rounds: int, device: torch.device,
                before: dict[str, Callable] | None = None) -> dict[str, list[float]]:
    """Per-round seconds of each job; ``before[name]`` runs untimed just before that job's call."""
    names, times = list(jobs), {n: [] for n in jobs}
    for r in range(rounds):
        for n in rotated(names, r):
            if before and n in before:
                before[n]()
            times[n].append(timed(jobs[n], device))
    return times


def paired_rounds(jobs: dict[str, Callable], base_of: dict[str, str], rounds: int,
                  device: torch.device) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-round seconds of each job, every job not a baseline timed next to a call of its baseline
    ``base_of[name]`` (a job of ``jobs``): the pairs follow the rotated order of the other jobs, and a
    job runs after its baseline's call in one round and before it in the next (so neither side is
    always the one that runs second; neighbouring jobs of a round take opposite sides).

    Returns (times, beside): times[name] per round (a baseline's: the median of its calls in that
    round), beside[name] = the baseline's time next to it in each round (jobs without a baseline are
    timed alone and have none)."""
    bases = set(base_of.values())
    others = [n for n in jobs if n not in bases]
    times, beside = {n: [] for n in jobs}, {n: [] for n in others if n in base_of}
    side = {n: j % 2 for j, n in enumerate(others)}
    for r in range(rounds):
        calls = {b: [] for b in bases}
        for n in rotated(others, r):
            b = base_of.get(n)
            if b is None:  # no baseline: timed alone
                times[n].append(timed(jobs[n], device))
                continue
            if (side[n] + r) % 2 == 0:  # the baseline first
                tb, tn = timed(jobs[b], device), timed(jobs[n], device)
            else:
                tn, tb = timed(jobs[n], device), timed(jobs[b], device)
            times[n].append(tn)
            beside[n].append(tb)
            calls[b].append(tb)
        for b in bases:
            times[b].append(statistics.median(calls[b]) if calls[b] else timed(jobs[b], device))
    return times, beside


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median from order statistics (binomial)."""
    s, n = sorted(xs), len(xs)
    if n < 2:
        return (s[0], s[0]) if s else (math.nan, math.nan)
    k = 1  # largest k with P(Binomial(n, 1/2) <= k - 1) <= (1 - level) / 2
    while k + 1 <= (n + 1) // 2 and stats.binom.cdf(k, n, 0.5) <= (1 - level) / 2:
        k += 1
    return s[k - 1], s[n - k]


def paired_ratio(row: dict, base: dict, key: str) -> dict:
    """Median and spread of the per-round ratios row[key][r] / base[key][r], or / row[key + "_beside"][r]
    when the row carries the baseline's time next to each of its calls (:func:`paired_rounds`).

    Refuses (ProvenanceError) rows from another process or another size/thread/device setting,
    and per-round lists of different lengths (not the same rounds)."""
    for field in ("pid", "config"):
        if row.get(field) is None or row.get(field) != base.get(field):
            raise ProvenanceError(
                f"refusing to divide {key} timings with different {field} "
                f"({row.get(field)!r} vs baseline {base.get(field)!r}); measure both in one bench pass")
    a, b = row[key], row.get(key + "_beside") or base[key]
    if len(a) != len(b) or not a:
        raise ProvenanceError(f"{key}: {len(a)} rounds vs {len(b)} for the baseline; not the same rounds")
    per = [x / y for x, y in zip(a, b)]
    med = statistics.median(per)
    lo, hi = median_ci(per)
    return {"median": med, "min": min(per), "max": max(per), "ci95": [lo, hi], "rounds": len(per),
            "stable": hi / med - 1 <= TOLERANCE and 1 - lo / med <= TOLERANCE}


def add_ratios(rows: dict[str, dict], base: str, keys: tuple[str, ...]) -> None:
    """row[key + '_ratio'] = paired_ratio(row, rows[base], key) for every row and key present."""
    for row in rows.values():
        for key in keys:
            if key in row and key in rows[base]:
                row[key + "_ratio"] = paired_ratio(row, rows[base], key)


def fmt_ratio(r: dict | None) -> str:
    """'1.04 (0.98–1.10)', with '~' when the median's 95% interval is wider than ±3%."""
    if not r:
        return "—"
    flag = "" if r["stable"] else " ~"
    return f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}){flag}"

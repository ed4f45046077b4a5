"""RULER results as tables: per task and length, and per task, length and needle depth.

The RULER score of a cell is ``string_match_all`` (or ``string_match_part``) over its samples'
greedy outputs, the number the RULER paper's tables report (Hsieh et al. 2024, Table 3: the
average over its 13 tasks; here over the offline ones, so the averages are not comparable with
the paper's). Teacher-forced columns: ``tf_exact`` = % of samples whose every target token is the
argmax after the right prefix, ``tf_logp`` = the mean log-probability per target token.
Depth bins (NIAH and vt): the first answer's token position over the prompt length, in fifths.
"""
from __future__ import annotations

import csv
import io
import math

import numpy as np

from .score import task_score

DEPTH_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0000001)


def depth_bin(depth) -> str | None:
    if depth is None:
        return None
    for lo, hi in zip(DEPTH_BINS, DEPTH_BINS[1:]):
        if lo <= float(depth) < hi:
            return f"{int(round(lo * 100))}-{int(round(min(hi, 1.0) * 100))}%"
    return None


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs if x is not None]
    return round(float(np.mean(xs)), 4) if xs else None


def cell_summary(records: list[dict]) -> dict:
    """n, RULER score (its samples' metric terms averaged and rounded once, as RULER does: :func:`.score.task_score`),
    teacher-forced exact match and token accuracy (%), mean log-prob per target token, mean prompt tokens, seconds."""
    out = {"n": len(records), "tokens": _mean(r.get("tokens") for r in records),
           "seconds": round(sum(r.get("seconds", 0.0) for r in records), 2)}
    if records and "match" in records[0]:
        out["score"] = task_score([r["match"] for r in records])
    elif records and "score" in records[0]:  # records without their terms (older cells): the scores' mean
        out["score"] = round(float(np.mean([r["score"] for r in records])), 2)
    if records and "tf_exact" in records[0]:
        out["tf_exact"] = round(100.0 * float(np.mean([r["tf_exact"] for r in records])), 2)
        out["tf_token_acc"] = round(100.0 * float(np.mean([r["tf_token_acc"] for r in records])), 2)
        out["tf_logp"] = _mean(r["tf_mean_logprob"] for r in records)
        out["tf_logprob"] = _mean(r["tf_logprob"] for r in records)
    return out


def summarize(records: list[dict], tasks: list[str], lengths: list[int]) -> dict:
    """{"cells": {task: {length: summary}}, "depth": [rows], "average": {length: summary of the
    per-task values}} from every sample record."""
    cells: dict = {}
    for t in tasks:
        for L in lengths:
            rec = [r for r in records if r["task"] == t and r["length"] == L]
            if rec:
                cells.setdefault(t, {})[L] = cell_summary(rec)
    avg = {}
    for L in lengths:
        per = [cells[t][L] for t in tasks if L in cells.get(t, {})]
        avg[L] = {k: _mean(p.get(k) for p in per) for k in ("score", "tf_exact", "tf_logp") if any(k in p for p in per)}
        avg[L]["tasks"] = len(per)
    depth = []
    for t in tasks:
        for L in lengths:
            rec = [r for r in records if r["task"] == t and r["length"] == L and r.get("depth") is not None]
            for b in dict.fromkeys(depth_bin(r["depth"]) for r in sorted(rec, key=lambda r: r["depth"])):
                depth.append({"task": t, "length": L, "depth": b,
                              **cell_summary([r for r in rec if depth_bin(r["depth"]) == b])})
    return {"cells": cells, "average": avg, "depth": depth}


def _fmt(v, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if pct else f"{v:.2f}"


def markdown(summary: dict, tasks: list[str], lengths: list[int], greedy: bool, teacher: bool) -> str:
    """The tables of report.md (module doc)."""
    cells, avg = summary["cells"], summary["average"]
    head = "| task | " + " | ".join(str(L) for L in lengths) + " |\n|---" + "|---:" * len(lengths) + "|"
    out = []
    if greedy:
        out += ["RULER score (% of references in the greedy output, string_match_all), per task and length:", "",
                head]
        for t in tasks:
            out.append(f"| {t} | " + " | ".join(_fmt(cells.get(t, {}).get(L, {}).get("score"), True)
                                               for L in lengths) + " |")
        out.append("| **average** | " + " | ".join(_fmt(avg[L].get("score"), True) for L in lengths) + " |")
        out.append("")
    if teacher:
        out += ["Teacher-forced answer after the answer prefix: exact match % (mean log-prob per target token):", "",
                head]
        for t in tasks:
            row = []
            for L in lengths:
                c = cells.get(t, {}).get(L)
                row.append("-" if not c else f"{_fmt(c.get('tf_exact'), True)} ({_fmt(c.get('tf_logp'))})")
            out.append(f"| {t} | " + " | ".join(row) + " |")
        out.append("| **average** | " + " | ".join(f"{_fmt(avg[L].get('tf_exact'), True)} "
                                                 f"({_fmt(avg[L].get('tf_logp'))})" for L in lengths) + " |")
        out.append("")
    if summary["depth"]:
        cols = (["score"] if greedy else []) + (["tf_exact", "tf_logp"] if teacher else [])
        out += ["Per needle depth (first answer's token position / prompt length; NIAH and vt):", "",
                "| task | length | depth | n | " + " | ".join(cols) + " |", "|---|---:|---|---:" + "|---:" * len(cols)
                + "|"]
        for r in summary["depth"]:
            vals = [_fmt(r.get(c), c != "tf_logp") for c in cols]
            out.append(f"| {r['task']} | {r['length']} | {r['depth']} | {r['n']} | " + " | ".join(vals) + " |")
    return "\n".join(out).rstrip() + "\n"


def csv_text(summary: dict) -> str:
    """One row per (task, length) and per (task, length, depth bin); depth "all" for the cell."""
    cols = ["task", "length", "depth", "n", "score", "tf_exact", "tf_token_acc", "tf_logp", "tf_logprob", "tokens",
            "seconds"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for t, per in summary["cells"].items():
        for L, c in per.items():
            w.writerow({"task": t, "length": L, "depth": "all", **c})
    for r in summary["depth"]:
        w.writerow(r)
    return buf.getvalue()

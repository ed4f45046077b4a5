"""Tables (markdown + CSV), figures and report.html of `extrapolab align experiment`.

Everything is rendered from the ``results`` dict that :mod:`.align_report` also stores as
``results.json``; the page is a :class:`..report.html.StudyReport`.
"""
from __future__ import annotations

import csv
import datetime as dt
import html
import io
import math
import platform
from pathlib import Path

import numpy as np

from ..data.origin import corpus_line
from ..io import atomic_write_text
from ..report.html import StudyReport
from ..report.plots import plot_ppl_vs_length
from ..tasks.retrieval import plot_heatmap, retrieval_table
from .plots import align_table, plot_temperature_curves

RULE_LABELS = {"none": "none (τ=1)", "pmax": "Alg. 1 P_max", "entropy": "Alg. 1 H", "length": "log_{L_ex} L_tr",
               "prop51": "Prop. 5.1", "prop52": "Prop. 5.2", "pmax@task": "Alg. 1 P_max on task prompts",
               "entropy@task": "Alg. 1 H on task prompts"}


def _csv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _lengths(results: dict) -> list[int]:
    return [results["config"]["model"]["train_length"], *results["spec"]["lengths"]]


def temperature_csv(res: dict) -> str:
    return _csv(["rule", "length", "tau"], [[r, L, row.get(str(L))] for r, row in res["tau"].items() for L in res["lengths"]])


def ppl_tables(results: dict) -> tuple[str, str]:
    """Markdown (rule x L: ppl and its tau) and CSV (rule, length, tau, ppl, ratio to tau=1)."""
    Ls, ppl = _lengths(results), results["ppl"]
    none = ppl.get("none", {})
    lines = [f"E1 nonoverlapping perplexity on the test split (L_tr = {Ls[0]}; "
             f"{results['spec']['ppl_tokens'] or 'all'} tokens per cell; the τ used in brackets)", "",
             "| rule | " + " | ".join(map(str, Ls)) + " |", "|---" * (len(Ls) + 1) + "|"]
    rows = []
    for rule, byL in ppl.items():
        cells = []
        for L in Ls:
            c = byL.get(str(L), {})
            cells.append(f"{_num(c.get('ppl'), '.3f')} (τ {_num(c.get('tau'), '.2f')})")
            base = none.get(str(L), {}).get("ppl")
            ratio = c["ppl"] / base if c.get("ppl") and base else None
            rows.append([rule, L, c.get("tau"), c.get("ppl"), ratio])
        lines.append(f"| {RULE_LABELS.get(rule, rule)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", _csv(["rule", "length", "tau", "ppl", "ppl_over_tau1"], rows)


def retrieval_csv(retrieval: dict) -> str:
    rows = []
    for task, records in retrieval.items():
        cells: dict = {}
        for r in records:
            cells.setdefault((r["rule"], r["length"], r["depth"]), []).append(r)
        for (rule, L, d), rs in cells.items():
            k = sum(bool(r["correct"]) for r in rs)
            rows.append([task, rule, L, d, rs[0]["tau"], len(rs), k, k / len(rs)])
    return _csv(["task", "rule", "length", "depth", "tau", "n", "correct", "accuracy"], rows)


def _acc(records, rule, keep) -> float | None:
    sel = [r["correct"] for r in records if r["rule"] == rule and keep(r["length"])]
    return float(np.mean(sel)) if sel else None


def summary_table(results: dict) -> str:
    """The result that matters: per rule, perplexity at the longest L_ex and its mean ratio to
    tau=1 over L_ex, and retrieval accuracy at L_tr and beyond it."""
    L_tr, Ls = results["config"]["model"]["train_length"], results["spec"]["lengths"]
    tasks = list(results["retrieval"])
    head = ["rule", f"ppl @ {Ls[-1]}", "ppl / ppl(τ=1), mean over L_ex"]
    for t in tasks:
        head += [f"{t} acc @ L_tr (%)", f"{t} acc > L_tr (%)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    none = results["ppl"].get("none", {})
    rules = list(dict.fromkeys([*results["ppl"], *(r["rule"] for recs in results["retrieval"].values() for r in recs)]))
    for rule in rules:
        byL = results["ppl"].get(rule, {})
        ratios = [byL[str(L)]["ppl"] / none[str(L)]["ppl"] for L in Ls
                  if byL.get(str(L), {}).get("ppl") and none.get(str(L), {}).get("ppl")]
        cells = [RULE_LABELS.get(rule, rule), _num(byL.get(str(Ls[-1]), {}).get("ppl"), ".3f"),
                 _num(float(np.mean(ratios)) if ratios else None, ".3f")]
        for t in tasks:
            recs = results["retrieval"][t]
            for keep in (lambda L: L == L_tr, lambda L: L > L_tr):
                a = _acc(recs, rule, keep)
                cells.append(_num(100 * a if a is not None else None, ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def task_tau_table(results: dict) -> str:
    """Algorithm 1 on each task's own prompts (thesis Table 5.9), next to the corpus-aligned tau."""
    Ls = [str(L) for L in results["spec"]["lengths"]]
    lines = ["| task | rule | " + " | ".join(Ls) + " |", "|---" * (len(Ls) + 2) + "|"]
    corpus = results["align"]["tau"]
    for mode in ("pmax", "entropy"):
        lines.append(f"| corpus | {RULE_LABELS[mode]} | " + " | ".join(_num(corpus[mode].get(L), ".2f") for L in Ls) + " |")
    for task, modes in results.get("task_taus", {}).items():
        for mode, row in modes.items():
            lines.append(f"| {task} | {RULE_LABELS[mode]} | " + " | ".join(_num(row.get(L), ".2f") for L in Ls) + " |")
    return "\n".join(lines) + "\n"


def _training_md(results: dict) -> str:
    s, m, cfg = results["train"], results["mixture"], results["config"]
    mc, tc = cfg["model"], cfg["train"]
    return "\n".join([
        "| item | value |", "|---|---|",
        f"| model | {mc['scheme']}, R={mc['layers']}, H={mc['heads']}, d={mc['dim']}, L_tr={mc['train_length']}, "
        f"{s.get('params', 0):,} parameters |",
        f"| data | {cfg['data']['corpus']} ({cfg['data']['tokenizer']}): {m['corpus_train_tokens']:,} corpus + "
        f"{m['retrieval_train_tokens']:,} retrieval ({m['task_mix']}) train tokens |",
        f"| training | {s.get('steps')} steps x {tc['batch_size']} x {mc['train_length']} tokens, lr {tc['lr']}, "
        f"{_num(s.get('train_seconds'), '.0f')} s (summary), valid ppl {_num(s.get('final_valid_ppl'), '.3f')} |",
    ]) + "\n"


def write_report(out: Path, results: dict) -> Path:
    """Write every table, figure, report.md and report.html under ``out``; returns report.html."""

    out = Path(out)
    res, L_tr = results["align"], results["config"]["model"]["train_length"]
    report = StudyReport(out, f"Temperature alignment experiment: {results['config']['name']}")
    add, figs = report.add, report.figures

    report.add_summary("The result: τ=1 vs each alignment rule", summary_table(results))
    ttab = align_table(res)
    atomic_write_text(out / "temperature.md", ttab + "\n")
    atomic_write_text(out / "temperature.csv", temperature_csv(res))
    tpng = plot_temperature_curves(res, figs / "temperature", title=f"{results['config']['name']} (L_tr = {L_tr})")[0]
    add("Chosen temperatures (thesis Tables 5.8-5.11, Figs. 5.3-5.4)", ttab, [tpng],
        "<p>Algorithm 1 modes: P_max and entropy; grid 1.0, 0.95, …, 0.5; "
        f"{'propagated through the layers' if res.get('propagate') else 'per-softmax re-temperatured'}; "
        f"{res.get('segments')} sequences per length. CSV: <code>temperature.csv</code>.</p>")
    if results.get("task_taus"):
        tt = task_tau_table(results)
        atomic_write_text(out / "temperature-tasks.md", tt)
        add("Algorithm 1 on the retrieval prompts themselves (thesis Table 5.9)", tt,
            extra_html="<p>Used by the retrieval rules <code>pmax@task</code> and <code>entropy@task</code>; the prompts "
                       "come from another seed than the scored examples.</p>")
    pmd, pcsv = ppl_tables(results)
    atomic_write_text(out / "ppl.md", pmd)
    atomic_write_text(out / "ppl.csv", pcsv)
    means = {RULE_LABELS.get(r, r): {int(L): {"mean": c["ppl"], "std": None} for L, c in byL.items() if c.get("ppl")}
             for r, byL in results["ppl"].items()}
    ppng = plot_ppl_vs_length(means, L_tr, figs / "ppl", title="perplexity vs L_ex per temperature rule")
    add("Perplexity beyond L_tr with τ=1 and each rule", pmd, [ppng], "<p>CSV: <code>ppl.csv</code>.</p>")
    atomic_write_text(out / "retrieval.csv", retrieval_csv(results["retrieval"]))
    for task, records in results["retrieval"].items():
        rtab = retrieval_table(records)
        atomic_write_text(out / f"retrieval-{task}.md", rtab + "\n")
        heat = plot_heatmap(records, figs / f"retrieval-{task}", title=f"{task}: accuracy per depth x length")[0]
        add(f"Retrieval: {task} (exact match, greedy; {results['spec']['n']} examples per length x depth)", rtab,
            [heat], "<p>CSV (all tasks, per cell): <code>retrieval.csv</code>.</p>")
    add("Trained model", _training_md(results))
    stage = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("stage_seconds", {}).items())
    corpus = html.escape(corpus_line(results.get("data"), results["config"]["data"]["corpus"]))  # hosts' texts differ
    note = (f"Preset <b>{html.escape(results['preset'])}</b> — budget: {html.escape(results.get('budget') or '')}. "
            f"Wall time {results['wall_s']:.0f} s (training {results['train_wall_s']:.0f} s this invocation; "
            f"stages: {html.escape(stage)}). {corpus}"
            f". Generated {dt.datetime.now().isoformat(timespec='seconds')} on "
            f"{html.escape(platform.platform())}. τ per length is stored in <code>run/temperature.json</code> "
            "(<code>extrapolab eval RUN --temperature auto</code>); every number is in <code>results.json</code>.")
    return report.write(f"Softmax-temperature alignment: {results['config']['name']}", note)

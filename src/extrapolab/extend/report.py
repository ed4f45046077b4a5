"""Figures, report.md and report.html of `extrapolab extend hf:PATH` (tables: :mod:`.tables`).

Everything is rendered from the ``results`` dict the study also stores as ``results.json``
(:mod:`.study`). report.md is written to be pasted into a results page as it is: the command, the
model file (sha256, quantisation), the host, the measured wall time per stage, the summary table, one
sentence per method on whether it holds at each length beyond the context (with its interval), how
many windows each cell had and what that resolves, and every table and figure.
"""
from __future__ import annotations

import datetime as dt
import html
from pathlib import Path

from ..data.origin import NOT_RECORDED, corpus_line
from ..io import atomic_write_text
from ..report.html import StudyReport
from .figures import label, plot_e1, plot_erf_curves, plot_passkey, plot_positionwise
from .tables import (TASKS, comparison_table, cost_table, hold_sentences, metric_table, resolution, summary_table,
                     task_table, temperature_table)


def command(results: dict, out: Path) -> str:
    sets = " ".join(f"--set {o}" for o in results["overrides"])
    return f"extrapolab extend {results['model_spec']} --preset {results['preset']} --out {out} {sets}".strip()


def write_extend_report(out: Path, results: dict) -> Path:
    """Every table, figure, report.md and report.html under ``out``; returns report.html."""
    out = Path(out)
    mb, g = results["model"], results["model"].get("gguf") or {}
    title = f"Training-free context extension of {mb['name']}: the same weights, every method"
    report = StudyReport(out, title)
    add, figs = report.add, report.figures
    report.add_summary("The result", summary_table(results) + "\n" + "\n".join(hold_sentences(results)) + "\n\n"
                       + resolution(results))
    c_md, c_csv = comparison_table(results)
    atomic_write_text(out / "comparisons.md", c_md)
    atomic_write_text(out / "comparisons.csv", c_csv)
    add("Paired comparisons", c_md, [], "<p>CSV: <code>comparisons.csv</code></p>")
    for key, name, what in (("e1", "e1", "E1: perplexity of every prediction of the windows [95% interval over the windows]"),
                            ("tail_ppl", "tail", "Perplexity of the last L_ctx predictions of each window (the tokens "
                                                 "of the 1x cell; what 'holds' compares) [95% interval]"),
                            ("e3", "e3", "E3: perplexity of the windows' end tokens (one per window: the same tokens "
                                         "at every L, each predicted from the L tokens before it)")):
        md, tcsv = metric_table(results, key, what)
        atomic_write_text(out / f"{name}.md", md)
        atomic_write_text(out / f"{name}.csv", tcsv)
        pngs = [plot_e1(results, c, figs / f"e1-{i}") for i, c in enumerate(results["spec"]["corpora"])] \
            if key == "e1" else []
        heading = {"e1": "E1 perplexity", "tail_ppl": "The 1x tokens read at L", "e3": "E3 last-token perplexity"}[key]
        add(heading, md, pngs, f"<p>CSV: <code>{name}.csv</code></p>")
    e4 = plot_positionwise(results, figs / "e4")
    add("E4 loss vs position", "Mean NLL per position (bins of the window, lightly smoothed), one line per method "
        "whose cell was computed; copies of identical cells are left out.\n", [e4] if e4 else [])
    for task in TASKS:
        if not results.get("tasks", {}).get(task):
            continue
        t_md, t_csv = task_table(results, task)
        atomic_write_text(out / f"{task}.md", t_md)
        atomic_write_text(out / f"{task}.csv", t_csv)
        if task == "niah":
            add("RULER needle retrieval", t_md, [], "<p>CSV: <code>niah.csv</code> (each sample: its depth, the answer "
                "exact, the mean log-probability and fraction of its tokens right, teacher-forced)</p>")
            continue
        pk = plot_passkey(results, figs / task)
        add("Passkey retrieval", t_md, [pk] if pk else [], "<p>CSV: <code>passkey.csv</code> (each trial: the value "
            "retrieved, the whole answer right, the separator first, the value's NLL, the teacher-forced argmax, the "
            "fraction of answer tokens right)</p>")
    erf_rows = [f"| {label(m)} | {r['erf_tokens']:,} | {r['segments']} | {r['peak_memory_mb']:.0f} | "
                f"{'yes' if r['checkpointed'] else 'no'} |" for m, r in results["erf"].items()]
    erf_L = int(round(results["spec"]["erf_factor"] * results["L_ctx"]))
    erf_md = (f"ERF at L = {erf_L:,} ({erf_L / results['L_ctx']:.3g}x) (tokens holding 99% of the last token's input gradient; Sandwich "
              "§5.1)\n\n| method | ERF tokens | segments | peak RSS MiB | checkpointed |\n|---|---|---|---|---|\n"
              + "\n".join(erf_rows) + "\n")
    ep = plot_erf_curves(results, figs / "erf")
    add("Empirical receptive field", erf_md, [ep] if ep else [])
    t_md, t_csv = temperature_table(results)
    atomic_write_text(out / "temperature.md", t_md)
    atomic_write_text(out / "temperature.csv", t_csv)
    add("Temperatures", t_md, [], "<p>CSV: <code>temperature.csv</code> (the per-layer variant's every layer)</p>")
    add("Cost (measured)", cost_table(results) + f"\nThis invocation: {results['wall_s']:.0f} s wall, "
        f"{results['model_loads']} model loads (stages computed earlier keep the seconds they took then).\n")
    h = results["host"]
    quant = ", ".join(f"{k} x{v}" for k, v in (g.get("quantization") or {}).items())
    weights = (f"GGUF <code>{html.escape(Path(g['file']).name)}</code>, sha256 <code>{g['sha256']}</code>, "
               f"{g.get('file_type')} ({html.escape(quant)} tensors), de-quantised to {mb.get('dtype')}"
               if g else f"folder <code>{html.escape(mb['source'])}</code>, sha256 {results['key']['sha256'][:16]}…")
    note = (f"Command: <code>{html.escape(command(results, out))}</code>. Model: {mb['name']} ({mb['family']}, "
            f"{mb.get('parameters', 0):,} parameters, L_ctx = {results['L_ctx']:,}); weights: {weights}. Preset "
            f"<b>{html.escape(results['preset'])}</b> — {html.escape(results.get('budget') or '')}. Wall time "
            f"{results['wall_s']:.0f} s this invocation, {sum(results['stage_seconds'].values()):.0f} s over all stages "
            f"as each was measured when computed (see Cost), on {html.escape(h['platform'])}, {h['cpus']} CPUs, "
            f"{h['torch_threads']} torch "
            f"threads, load average {h['load_avg'][0]:.1f} at the start and {h['load_avg_end'][0]:.1f} at the end. "
            "Static methods use s = L / L_ctx; identical cells ran once (see extend/cells.py). "
            + "".join(f"{html.escape(corpus_line(p, c))}. " for c, p in (results.get("corpora") or {}).items())
            + ("" if "corpora" in results else f"{NOT_RECORDED}. ") + "Generated "
            f"{dt.datetime.now().isoformat(timespec='seconds')}; every number is in <code>results.json</code>.")
    return report.write(title, note)

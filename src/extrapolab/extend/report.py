"""Tables (markdown + CSV), figures, report.md and report.html of `extrapolab extend hf:PATH`.

Everything is rendered from the ``results`` dict the study also stores as ``results.json``
(:mod:`.study`). report.md is written to be pasted into a results page as it is: the command,
the model file (sha256, quantisation), the host, the measured wall time per stage, the summary
table, one sentence per method on whether it holds at each length beyond the context, and every
table and figure.
"""
from __future__ import annotations

import csv
import datetime as dt
import html
import io
import math
from pathlib import Path

import numpy as np

from ..io import atomic_write_text
from ..positional.rotary_yarn import yarn_attention_factor
from ..report.html import StudyReport
from .figures import label, plot_e1, plot_erf_curves, plot_passkey, plot_positionwise


def _csv(header: list, rows: list) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    return buf.getvalue()


def _num(v, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "—"


def _x(results: dict, L) -> str:
    return f"{int(L):,} ({int(L) / results['L_ctx']:.3g}x)"


def _columns(results: dict) -> list[tuple[str, str]]:
    """(str(L), corpus) of every measured column, by length then corpus order."""
    Ls = sorted({L for byL in results["cells"].values() for L in byL}, key=int)
    return [(L, c) for L in Ls for c in results["spec"]["corpora"]
            if any(c in byL.get(L, {}) for byL in results["cells"].values())]


def _acc(recs, key: str = "retrieved") -> float | None:
    """Fraction of ``recs`` whose ``key`` holds: ``retrieved`` (the value, after the separator) or
    ``correct`` (the whole answer: greedy exact match)."""
    return float(np.mean([r.get(key, r["correct"]) for r in recs])) if recs else None


def metric_table(results: dict, key: str, title: str, fmt: str = ".3f") -> tuple[str, str]:
    """method x (L, corpus) table of ``key`` ("e1" | "e3"); "=" marks a cell identical to another method's."""
    cols = _columns(results)
    lines = [title, "", "| method | " + " | ".join(f"{c} @ {_x(results, L)}" for L, c in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    rows = []
    for m, byL in results["cells"].items():
        cells = []
        for L, c in cols:
            cell = byL.get(L, {}).get(c)
            if cell is None:
                cells.append("—")
                continue
            same = f" (= {label(cell['same_as'])})" if cell.get("same_as") else ""
            cells.append(_num(cell[key], fmt) + same)
            rows.append([m, L, c, cell["rope"], cell["tau"] if not isinstance(cell["tau"], list) else "per layer",
                         cell[key], cell.get(key.replace("_ppl", "") + "_nll"), cell.get("same_as") or ""])
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", _csv(["method", "length", "corpus", "rope", "tau", key, "nll", "same_as"], rows)


def hold_sentences(results: dict) -> list[str]:
    """One sentence per method on each length beyond the context (module doc's hold rule)."""
    ratio, k = results["spec"]["hold_ratio"], results["spec"]["long_methods"]
    Ls = sorted(results["holds"], key=int)
    out = []
    for m in results["cells"]:
        parts, prev = [], None
        for L in Ls:
            h = results["holds"][L].get(m)
            if h is not None:
                cell = next(iter(results["cells"][m][L].values()))
                r = ", ".join(f"{c} ×{v:.2f}" for c, v in h["ratio"].items())
                same = f", the same forwards as {label(cell['same_as'])}" if cell.get("same_as") else ""
                parts.append(f"{'holds' if h['holds'] else 'does not hold'} at {_x(results, L)} (last-L_ctx ppl / "
                             f"plain RoPE's E1 at L_ctx: {r}{same})")
            elif prev is not None:
                hp = results["holds"][prev].get(m)
                cell = next(iter(results["cells"][m].get(prev, {}).values()), {})
                why = ("it does not hold at the length before" if hp is None or not hp["holds"] else
                       f"its cells at the length before are {label(cell['same_as'])}'s" if cell.get("same_as") else
                       f"it holds at the length before but ranks below the best {k}")
                parts.append(f"not run at {_x(results, L)} ({why})")
            prev = L
        if parts:
            out.append(f"- **{label(m)}**: " + "; ".join(parts) + ".")
    return [f"A method holds at L when, on every corpus measured at L, the perplexity of the last L_ctx = "
            f"{results['L_ctx']:,} predictions of its windows -- the tokens plain RoPE's 1x cell scores, now read "
            f"after L - L_ctx more -- is at most {ratio:.2f}x plain RoPE's E1 at L_ctx (it reads L tokens at no "
            f"more than {100 * (ratio - 1):.0f}% perplexity cost on the same tokens).", "", *out]


def summary_table(results: dict) -> str:
    cols = _columns(results)
    Lx = [L for L in sorted(results["holds"], key=int)]
    head = ["method", *[f"E1 {c} @ {int(L) / results['L_ctx']:g}x" for L, c in cols],
            *[f"holds @ {int(L) / results['L_ctx']:g}x" for L in Lx], "passkey retrieved beyond L_ctx (%)"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m, byL in results["cells"].items():
        e1 = [_num(byL.get(L, {}).get(c, {}).get("e1")) for L, c in cols]
        holds = [("yes" if results["holds"][L][m]["holds"] else "no") if m in results["holds"][L] else "—" for L in Lx]
        beyond = [r for L, recs in results["passkey"].get(m, {}).items() if int(L) > results["L_ctx"] for r in recs]
        acc = _acc(beyond)
        lines.append("| " + " | ".join([label(m), *e1, *holds, _num(100 * acc, ".0f") if acc is not None else "—"])
                     + " |")
    return "\n".join(lines) + "\n"


def passkey_table(results: dict) -> tuple[str, str]:
    Ls = sorted({L for byL in results["passkey"].values() for L in byL}, key=int)
    s = results["spec"]
    lines = [f"Passkey retrieved (%): the key's digits read out of the haystack (teacher-forced exact match of "
             "the value's tokens after the answer prefix and its separator); in parentheses the whole answer as "
             "greedy decoding gives it (separator first). "
             f"{len(s['passkey_depths'])} depths {s['passkey_depths']} x n = {s['passkey_n']} per length; chat "
             f"template: {'yes' if results['chat'] else 'no'}; plain RoPE in context is the baseline", "",
             "| method | " + " | ".join(_x(results, L) for L in Ls) + " |", "|---" * (len(Ls) + 1) + "|"]
    rows = []
    for m, byL in results["passkey"].items():
        cells = []
        for L in Ls:
            acc, whole = _acc(byL.get(L)), _acc(byL.get(L), "correct")
            cells.append(f"{_num(100 * acc, '.0f')} ({_num(100 * whole, '.0f')})" if acc is not None else "—")
            rows += [[m, L, r["depth"], r.get("retrieved"), r["correct"], r.get("lead_ok"), r.get("value_nll"),
                      r.get("token_acc"), " ".join(map(str, r["pred"])), " ".join(map(str, r["answer"]))]
                     for r in byL.get(L, [])]
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    header = ["method", "length", "depth", "retrieved", "correct", "lead_ok", "value_nll", "token_acc", "pred",
              "answer"]
    return "\n".join(lines) + "\n", _csv(header, rows)


def temperature_table(results: dict) -> tuple[str, str]:
    """Per L: Algorithm 1's tau (one per length: P_max, entropy; and the per-layer variant's min /
    mean / max), the forwards and peak of its global search, the length rule, YaRN's 1/f^2."""
    L_ctx, rows, at = results["L_ctx"], [], results["align_tau"]
    lines = ["Softmax temperatures (tau < 1 sharpens): Algorithm 1 as the thesis runs it (one tau for every softmax, "
             "P_max and entropy; forwards of its bisection over the grid), its per-layer variant (one forward, P_max), "
             "the length rule log L_ctx / log L, and YaRN's attention factor f = 0.1 ln s + 1 as tau = 1/f²", "",
             "| L | Alg. 1 P_max | Alg. 1 H | forwards | peak RSS MiB | per layer min / mean / max (layers < 1) | "
             "length rule | YaRN 1/f² |", "|---|---|---|---|---|---|---|---|"]
    for L in sorted({L for byL in at.values() for L in byL}, key=int):
        f = yarn_attention_factor(int(L) / L_ctx)
        lr = math.log(L_ctx) / math.log(int(L))
        g = results["align"].get(L, {}).get("global") or {}
        pl = at.get("pmax-layer", {}).get(L)
        layer = f"{min(pl):.2f} / {np.mean(pl):.3f} / {max(pl):.2f} ({sum(t < 1 for t in pl)} of {len(pl)})" \
            if pl else "—"
        lines.append(f"| {_x(results, L)} | {_num(at.get('pmax', {}).get(L), '.2f')} | "
                     f"{_num(at.get('entropy', {}).get(L), '.2f')} | {g.get('forwards', {}).get(L, '—')} | "
                     f"{_num(g.get('peak_mib', {}).get(L), '.0f')} | {layer} | {lr:.3f} | {1 / f ** 2:.3f} |")
        rows.append([L, at.get("pmax", {}).get(L), at.get("entropy", {}).get(L), " ".join(map(str, pl or [])), lr,
                     1 / f ** 2])
    header = ["length", "pmax_tau", "entropy_tau", "pmax_layer_taus", "length_rule_tau", "yarn_tau"]
    return "\n".join(lines) + "\n", _csv(header, rows)


def cost_table(results: dict) -> str:
    """Measured seconds per stage group (as measured when each cell was computed)."""
    groups: dict = {}
    for name, sec in results["stage_seconds"].items():
        kind, *rest = name.split("/", 1)[-1].split("-")
        L = rest[-2] if kind == "e" else rest[0]
        groups.setdefault((kind, int(L)), []).append(sec)
    names = {"align": "Algorithm 1 (its forwards at L and the L_ctx reference)", "e": "E1/E3/E4 cells",
             "passkey": "passkey",
             "erf": "ERF"}  # each cell's seconds include the model load it needed
    lines = ["| stage | L | cells | seconds (model loads included) |", "|---|---|---|---|"]
    for (kind, L), secs in sorted(groups.items(), key=lambda kv: (list(names).index(kv[0][0]), kv[0][1])):
        lines.append(f"| {names.get(kind, kind)} | {L:,} | {len(secs)} | {sum(secs):.0f} |")
    total = sum(results["stage_seconds"].values())
    lines.append(f"| all stages | | {len(results['stage_seconds'])} | {total:.0f} |")
    return "\n".join(lines) + "\n"


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
    report.add_summary("The result", summary_table(results) + "\n" + "\n".join(hold_sentences(results)) + "\n")
    for key, name, what in (("e1", "e1", "E1: perplexity of every prediction of the windows"),
                            ("tail_ppl", "tail", "Perplexity of the last L_ctx predictions of each window (the tokens "
                                                 "of the 1x cell; what 'holds' compares)"),
                            ("e3", "e3", f"E3: perplexity of the windows' end tokens (n = {results['spec']['windows']} "
                                         "per corpus, the same tokens at every L, each predicted from the L tokens "
                                         "before it)")):
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
    pk_md, pk_csv = passkey_table(results)
    atomic_write_text(out / "passkey.md", pk_md)
    atomic_write_text(out / "passkey.csv", pk_csv)
    pk = plot_passkey(results, figs / "passkey")
    add("Passkey retrieval", pk_md, [pk] if pk else [], "<p>CSV: <code>passkey.csv</code> (each trial: the value "
        "retrieved, the whole answer right, the separator first, the value's NLL, the teacher-forced argmax, the "
        "fraction of answer tokens right)</p>")
    erf_rows = [f"| {label(m)} | {r['erf_tokens']:,} | {r['segments']} | {r['peak_memory_mb']:.0f} | "
                f"{'yes' if r['checkpointed'] else 'no'} |" for m, r in results["erf"].items()]
    erf_L = int(round(results["spec"]["erf_factor"] * results["L_ctx"]))
    erf_md = (f"ERF at L = {_x(results, erf_L)} (tokens holding 99% of the last token's input gradient; Sandwich "
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
            "Static methods use s = L / L_ctx; identical cells ran once (see extend/cells.py). Generated "
            f"{dt.datetime.now().isoformat(timespec='seconds')}; every number is in <code>results.json</code>.")
    return report.write(title, note)

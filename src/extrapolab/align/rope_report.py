"""Tables (markdown + CSV), figures and report.html of `extrapolab align rope` (:mod:`.rope_study`).

Everything is rendered from the ``results`` dict that the study also stores as ``results.json``.
The temperature table sets YaRN's attention factor f = 0.1·ln(s) + 1 (Peng et al. 2023 §3.4; q and k
are each multiplied by f, the logits by f^2, i.e. a softmax temperature tau = 1/f^2) beside the
thesis' length rule tau = log L_tr / log L (thesis §5.5) and Algorithm 1's tau (thesis §5.4).
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

from ..analysis.common import new_figure, save_figure
from ..analysis.erf import plot_erf
from ..data.origin import corpus_line
from ..io import atomic_write_text
from ..positional.rotary_yarn import yarn_attention_factor
from ..report.html import StudyReport
from ..report.plots import plain_log_ticks, plot_ppl_vs_length

LABELS = {"rope": "RoPE (plain)", "pi": "PI (Chen et al. 2023)", "ntk": "NTK-aware", "dynamic": "dynamic NTK",
          "yarn": "YaRN", "yarn-ramp": "YaRN ramp, no temperature", "pmax": "τ: Alg. 1 P_max",
          "entropy": "τ: Alg. 1 H", "length": "τ: log_L L_tr", "selfextend": "Self-Extend (w = L_tr/4)",
          "rerope": "ReRoPE + log-n (w = L_tr/8)", "rerope-leaky": "leaky ReRoPE + log-n (k = 16)",
          "dca": "DCA (C = 3/4·L_tr, w = C/6)", "streaming": "StreamingLLM (4 sinks + L_tr - 4)",
          "logn": "RoPE + log-n"}


def _csv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    return buf.getvalue()


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "n/a"


def _lengths(results: dict) -> list[int]:
    return [results["config"]["model"]["train_length"], *results["spec"]["lengths"]]


def _acc(cell: dict) -> float | None:
    recs = cell.get("passkey")
    return float(np.mean([r["correct"] for r in recs])) if recs else None


def metric_tables(results: dict) -> dict[str, tuple[str, str]]:
    """{"ppl" | "passkey" | "erf": (markdown, csv)}: method x length."""
    Ls, L_tr = _lengths(results), results["config"]["model"]["train_length"]
    head = "| method | " + " | ".join(f"{L} ({L // L_tr}x)" if L % L_tr == 0 else str(L) for L in Ls) + " |"
    out = {}
    for key, title, get, fmt in (
        ("ppl", f"E1 nonoverlapping perplexity, test split ({results['spec']['ppl_tokens'] or 'all'} tokens per cell)",
         lambda c: c.get("ppl"), ".3f"),
        ("passkey", f"Passkey accuracy (%), exact match, {results['spec']['n']} examples x "
                    f"{len(results['spec']['depths'])} depths per length", lambda c: _acc(c), ".0%"),
        ("erf", "ERF (tokens holding 99% of the last token's input gradient; Sandwich paper §5.1)",
         lambda c: c.get("erf_tokens"), "d"),
    ):
        lines, rows = [title, "", head, "|---" * (len(Ls) + 1) + "|"], []
        for m, byL in results["methods"].items():
            cells = []
            for L in Ls:
                c = byL.get(str(L), {})
                v = get(c)
                cells.append(_num(v, fmt) if fmt != ".0%" else (_num(100 * v, ".0f") if v is not None else "n/a"))
                rows.append([m, L, c.get("tau"), (c.get("options") or {}).get("factor"), v])
            lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
        out[key] = ("\n".join(lines) + "\n", _csv(["method", "length", "tau", "factor", key], rows))
    return out


def temperature_table(results: dict) -> tuple[str, str]:
    """Per L_ex: YaRN's f and its tau = 1/f^2, the length rule, Algorithm 1 (P_max, H)."""
    L_tr, Ls = results["config"]["model"]["train_length"], results["spec"]["lengths"]
    taus = results["taus"]
    rows = []
    for L in Ls:
        f = yarn_attention_factor(L / L_tr)
        rows.append([L, L / L_tr, f, 1 / f ** 2, taus.get("length", {}).get(str(L)),
                     taus.get("pmax", {}).get(str(L)), taus.get("entropy", {}).get(str(L))])
    lines = ["Softmax temperature each rule puts on the logits (tau < 1 sharpens; tau = 1/f^2 for YaRN)", "",
             "| L_ex | s = L_ex/L_tr | YaRN f = 0.1 ln s + 1 | YaRN tau = 1/f² | length rule log L_tr/log L_ex | "
             "Alg. 1 P_max | Alg. 1 H |", "|---" * 7 + "|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]:g} | {r[2]:.3f} | {r[3]:.3f} | {_num(r[4], '.3f')} | {_num(r[5], '.2f')} | "
                     f"{_num(r[6], '.2f')} |")
    return "\n".join(lines) + "\n", _csv(["length", "s", "yarn_f", "yarn_tau", "length_rule_tau", "pmax_tau",
                                          "entropy_tau"], rows)


def summary_table(results: dict) -> str:
    """Per method: ppl at the longest L and its ratio to plain RoPE, mean passkey beyond L_tr, ERF there."""
    L_tr, Lmax = results["config"]["model"]["train_length"], results["spec"]["lengths"][-1]
    rope = results["methods"].get("rope", {})
    lines = [f"| method | ppl @ L_tr | ppl @ {Lmax} | ppl / RoPE's, mean over L_ex | passkey @ L_tr (%) | "
             f"passkey > L_tr (%) | ERF @ {Lmax} |", "|---" * 7 + "|"]
    for m, byL in results["methods"].items():
        ratios = [byL[str(L)]["ppl"] / rope[str(L)]["ppl"] for L in results["spec"]["lengths"]
                  if byL.get(str(L), {}).get("ppl") and rope.get(str(L), {}).get("ppl")]
        beyond = [r["correct"] for L in results["spec"]["lengths"] for r in byL.get(str(L), {}).get("passkey") or []]
        at_tr = _acc(byL.get(str(L_tr), {}))
        lines.append(" | ".join([
            f"| {LABELS.get(m, m)}", _num(byL.get(str(L_tr), {}).get("ppl"), ".3f"),
            _num(byL.get(str(Lmax), {}).get("ppl"), ".3f"), _num(float(np.mean(ratios)) if ratios else None, ".3f"),
            _num(100 * at_tr if at_tr is not None else None, ".0f"),
            _num(100 * float(np.mean(beyond)) if beyond else None, ".0f"),
            _num(byL.get(str(Lmax), {}).get("erf_tokens"), "d")]) + " |")
    return "\n".join(lines) + "\n"


def _plot_passkey(results: dict, stem: Path) -> str:
    fig, ax = new_figure(7.5, 4.5)
    for m, byL in results["methods"].items():
        Ls = [int(L) for L, c in byL.items() if c.get("passkey")]
        ax.plot(Ls, [100 * _acc(byL[str(L)]) for L in Ls], marker="o", ms=3, label=LABELS.get(m, m))
    ax.axvline(results["config"]["model"]["train_length"], color="grey", ls=":", lw=1, label="L_tr")
    ax.set_xscale("log", base=2)
    plain_log_ticks(ax)
    ax.set_xlabel("evaluation length L_ex")
    ax.set_ylabel("passkey accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.legend(fontsize=7)
    return save_figure(fig, stem)[0]


def write_rope_report(out: Path, results: dict) -> Path:
    """Write every table, figure, report.md and report.html under ``out``; returns report.html."""
    out = Path(out)
    L_tr, Lmax = results["config"]["model"]["train_length"], results["spec"]["lengths"][-1]
    report = StudyReport(out, f"RoPE context extension vs temperature alignment: {results['config']['name']}")
    add, figs = report.add, report.figures

    report.add_summary("The result: every method on the same trained RoPE weights", summary_table(results))
    tables = metric_tables(results)
    for key, (tmd, tcsv) in tables.items():
        atomic_write_text(out / f"{key}.md", tmd)
        atomic_write_text(out / f"{key}.csv", tcsv)
    means = {LABELS.get(m, m): {int(L): {"mean": c.get("ppl"), "std": None} for L, c in byL.items() if c.get("ppl")}
             for m, byL in results["methods"].items()}
    ppng = plot_ppl_vs_length(means, L_tr, figs / "ppl", title="perplexity vs L_ex per method (same weights)")
    add("Perplexity vs length", tables["ppl"][0], [ppng], "<p>CSV: <code>ppl.csv</code>.</p>")
    add("Passkey retrieval", tables["passkey"][0], [_plot_passkey(results, figs / "passkey")],
        "<p>Greedy decoding, full context, no instructions; CSV: <code>passkey.csv</code>.</p>")
    curves = {LABELS.get(m, m): byL[str(Lmax)]["erf_c"] for m, byL in results["methods"].items()
              if byL.get(str(Lmax), {}).get("erf_c")}
    epng = plot_erf(curves, figs / "erf", train_length=L_tr, title=f"cumulative normalized gradient at L = {Lmax}")[0] \
        if curves else None
    add("Empirical receptive field", tables["erf"][0], [epng] if epng else [], "<p>CSV: <code>erf.csv</code>.</p>")
    tt_md, tt_csv = temperature_table(results)
    atomic_write_text(out / "temperature.md", tt_md)
    atomic_write_text(out / "temperature.csv", tt_csv)
    add("YaRN's attention factor vs the thesis' temperatures", tt_md)
    s, mc, tc = results["train"], results["config"]["model"], results["config"]["train"]
    add("Trained model", "\n".join([
        "| item | value |", "|---|---|",
        f"| model | rotary, R={mc['layers']}, H={mc['heads']}, d={mc['dim']}, L_tr={L_tr}, {s.get('params', 0):,} parameters |",
        f"| data | {results['config']['data']['corpus']} ({results['config']['data']['tokenizer']}): "
        f"{results['mixture']['corpus_train_tokens']:,} corpus + {results['mixture']['retrieval_train_tokens']:,} "
        f"passkey train tokens |",
        f"| training | {s.get('steps')} steps x {tc['batch_size']} x {L_tr} tokens, lr {tc['lr']}, valid ppl "
        f"{_num(s.get('final_valid_ppl'), '.3f')} |"]) + "\n")
    stage = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("stage_seconds", {}).items())
    corpus = html.escape(corpus_line(results.get("data"), results["config"]["data"]["corpus"]))  # hosts' texts differ
    note = (f"Preset <b>{html.escape(results['preset'])}</b> — {html.escape(results.get('budget') or '')}. "
            f"Wall time {results['wall_s']:.0f} s (training {results['train_wall_s']:.0f} s this invocation; stages: "
            f"{html.escape(stage)}). {corpus}"
            ". Static methods use s = L_ex / L_tr at each length. Generated "
            f"{dt.datetime.now().isoformat(timespec='seconds')} on {html.escape(platform.platform())}; every number is "
            "in <code>results.json</code>.")
    return report.write(f"RoPE extension vs temperature alignment: {results['config']['name']}", note)

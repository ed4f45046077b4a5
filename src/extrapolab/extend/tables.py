"""Markdown (+ CSV) tables of `extrapolab extend hf:PATH` (:mod:`.report`), rendered from the
``results`` dict the study stores as ``results.json``: the summary, what holds (paired intervals,
:mod:`.plan`), how many windows each cell had and what that resolves, the paired comparisons, the
E1 / last-L_ctx / E3 tables, the tasks (passkey), the temperatures and the measured cost."""
from __future__ import annotations

import csv
import io
import math

import numpy as np
from scipy import stats as sps

from ..eval.stats import t_interval
from ..positional.rotary_yarn import yarn_attention_factor
from .figures import label
from .plan import FAILS, HOLDS, UNRESOLVED, Plan, log_interval

#: task -> (its name in the tables, the record field that counts as a success): the study's table has
#: one column per task and factor, in this order
TASKS = {"passkey": ("passkey retrieved", "retrieved"),
         "niah": ("RULER needle, teacher-forced exact", "retrieved")}
VERDICT = {HOLDS: "yes", FAILS: "no", UNRESOLVED: "unresolved"}


def _csv(header: list, rows: list) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    return buf.getvalue()


def _num(v, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "—"


def _x(results: dict, L) -> str:
    return f"{int(L):,} ({int(L) / results['L_ctx']:.3g}x)"


def _f(results: dict, L) -> str:
    return f"{int(L) / results['L_ctx']:g}x"


def interval(st: dict | None, fmt: str = ".3f") -> str:
    """'7.858 [7.51, 8.22]', or the value alone when one window gives no interval."""
    if not st:
        return "—"
    if not math.isfinite(st["hi"]) or st["n"] < 2:
        return _num(st["value"], fmt)
    return f"{_num(st['value'], fmt)} [{_num(st['lo'], fmt)}, {_num(st['hi'], fmt)}]"


def plan_of(results: dict) -> Plan:
    """A :class:`.plan.Plan` over the stored cells (the intervals are computed from them)."""
    from types import SimpleNamespace

    p = Plan(SimpleNamespace(**results["spec"]), results["L_ctx"])
    p.cells, p.tasks = results["cells"], results.get("tasks", {})
    return p


def columns(results: dict) -> list[tuple[str, str]]:
    """(str(L), corpus) of every measured column, by length then corpus order."""
    Ls = sorted({L for byL in results["cells"].values() for L in byL}, key=int)
    return [(L, c) for L in Ls for c in results["spec"]["corpora"]
            if any(c in byL.get(L, {}) for byL in results["cells"].values())]


def task_lengths(results: dict, task: str) -> list[str]:
    return sorted({L for byL in results.get("tasks", {}).get(task, {}).values() for L in byL}, key=int)


def count(recs, key: str) -> tuple[int, int]:
    return sum(bool(r.get(key, r.get("correct"))) for r in recs), len(recs)


def metric_table(results: dict, key: str, title: str, fmt: str = ".3f") -> tuple[str, str]:
    """method x (L, corpus) table of ``key`` ("e1" | "tail_ppl" | "e3"); E1 and the last-L_ctx perplexity
    with their 95% interval over the cell's windows; "=" marks a cell identical to another method's."""
    cols, win = columns(results), {"e1": "win_nll", "tail_ppl": "win_tail_nll", "e3": "win_e3_nll"}[key]
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
            st = log_interval(t_interval(cell[win])) if win in cell else None
            same = f" (= {label(cell['same_as'])})" if cell.get("same_as") else ""
            cells.append((interval(st, fmt) if key != "e3" and st else _num(cell[key], fmt)) + same)
            rows.append([m, L, c, cell["rope"], cell["tau"] if not isinstance(cell["tau"], list) else "per layer",
                         cell[key], cell.get(key.replace("_ppl", "") + "_nll"), st["lo"] if st else "",
                         st["hi"] if st else "", len(cell.get(win, [])), cell.get("same_as") or ""])
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    header = ["method", "length", "corpus", "rope", "tau", key, "nll", "lo95", "hi95", "windows", "same_as"]
    return "\n".join(lines) + "\n", _csv(header, rows)


def summary_table(results: dict) -> str:
    """Per method: E1 per (L, corpus), the verdict per L > L_ctx, each task's successes per length."""
    cols, Lx = columns(results), sorted(results["holds"], key=int)
    tasks = [(t, L) for t in TASKS for L in task_lengths(results, t) if int(L) >= results["L_ctx"]]
    head = ["method", *[f"E1 {c} @ {_f(results, L)}" for L, c in cols], *[f"holds @ {_f(results, L)}" for L in Lx],
            *[f"{TASKS[t][0]} @ {_f(results, L)}" for t, L in tasks]]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m, byL in results["cells"].items():
        e1 = [_num(byL.get(L, {}).get(c, {}).get("e1")) for L, c in cols]
        holds = [VERDICT.get(results["holds"][L][m]["verdict"], "—") if m in results["holds"][L] else "—"
                 for L in Lx]
        done = []
        for t, L in tasks:
            recs = results["tasks"][t].get(m, {}).get(L)
            done.append("{}/{}".format(*count(recs, TASKS[t][1])) if recs else "—")
        lines.append("| " + " | ".join([label(m), *e1, *holds, *done]) + " |")
    return "\n".join(lines) + "\n"


def _ratio_text(r: dict, c: str) -> str:
    if r["n"][c] < 2:
        return f"{c} ×{r['ratio'][c]:.2f} (1 window: no interval)"
    return f"{c} ×{r['ratio'][c]:.2f} [{r['lo'][c]:.2f}, {r['hi'][c]:.2f}]"


def hold_sentences(results: dict) -> list[str]:
    """One sentence per method on each length beyond the context (the rule of :mod:`.plan`)."""
    ratio, k = results["spec"]["hold_ratio"], results["spec"]["long_methods"]
    Ls = sorted(results["holds"], key=int)
    word = {HOLDS: "holds", FAILS: "does not hold", UNRESOLVED: "unresolved"}
    out = []
    for m in results["cells"]:
        parts, prev = [], None
        for L in Ls:
            h = results["holds"][L].get(m)
            if h is not None:
                cell = next(iter(results["cells"][m][L].values()))
                r = ", ".join(_ratio_text(h, c) for c in h["ratio"])
                same = f", the same forwards as {label(cell['same_as'])}" if cell.get("same_as") else ""
                parts.append(f"{word.get(h['verdict'], 'not measured')} at {_x(results, L)} (last-L_ctx ppl / plain "
                             f"RoPE's E1 at L_ctx: {r}{same})")
            elif prev is not None:
                hp = results["holds"][prev].get(m)
                cell = next(iter(results["cells"][m].get(prev, {}).values()), {})
                why = ("it does not hold at the length before" if hp is None or hp["verdict"] == FAILS else
                       "it is unresolved at the length before" if hp["verdict"] == UNRESOLVED else
                       f"its cells at the length before are {label(cell['same_as'])}'s" if cell.get("same_as") else
                       f"it holds at the length before but ranks below the best {k}")
                parts.append(f"not run at {_x(results, L)} ({why})")
            prev = L
        if parts:
            out.append(f"- **{label(m)}**: " + "; ".join(parts) + ".")
    return [f"A method holds at L when, on every corpus measured at L, the 95% interval of the ratio of the "
            f"perplexity of the last L_ctx = {results['L_ctx']:,} predictions of its windows -- the tokens plain "
            f"RoPE's 1x cell scores, now read after L - L_ctx more -- to plain RoPE's E1 at L_ctx on the same "
            f"windows lies at or below {ratio:.2f} (it reads L tokens at no more than {100 * (ratio - 1):.0f}% "
            f"perplexity cost on the same tokens); it does not hold when on some corpus the interval lies above "
            f"{ratio:.2f}; otherwise the windows do not tell (unresolved). Ratio [95% interval]:", "", *out]


def resolution(results: dict) -> str:
    """How many windows each cell had, and what that resolves (the widths of the ratio intervals)."""
    n = {L: sorted({len(cell.get("win_nll", [])) for byL in results["cells"].values() for cell in byL.get(L, {}).values()})
         for L in sorted({L for byL in results["cells"].values() for L in byL}, key=int)}
    per = "; ".join(f"{_f(results, L)}: {'/'.join(map(str, ns))}" for L, ns in n.items())
    lines = [f"Windows per cell (per corpus; the same end tokens for every method, a long factor's a subset of "
             f"them): {per}. Intervals are paired Student-t intervals over the windows (95%, per cell, not "
             "corrected for the number of cells)."]
    p, lim = plan_of(results), results["spec"]["hold_ratio"]
    for L in sorted(results["holds"], key=int):
        st = [s for m in p.distinct(int(L)) for s in p.ratio_stats(m, int(L)).values() if s["n"] >= 2]
        if not st:
            lines.append(f"At {_x(results, L)} no cell has 2 windows: no ratio is resolved.")
            continue
        half = [100 * (math.exp(s["half_log"]) - 1) for s in st]
        verdicts = [results["holds"][L][m]["verdict"] for m in results["holds"][L]
                    if not next(iter(results["cells"][m][L].values())).get("same_as")]
        open_ = [label(m) for m in results["holds"][L] if results["holds"][L][m]["verdict"] == UNRESOLVED]
        lines.append(f"At {_x(results, L)} the ratio intervals reach ±{min(half):.1f}% to ±{max(half):.1f}% of "
                     f"the ratio (median ±{float(np.median(half)):.1f}%): a ratio farther than that from {lim:.2f} is "
                     f"resolved; {sum(v != UNRESOLVED for v in verdicts)} of {len(verdicts)} distinct methods are "
                     "resolved" + (f" (unresolved: {', '.join(open_)})." if open_ else "."))
    return "\n\n".join(lines) + "\n"


def comparison_table(results: dict) -> tuple[str, str]:
    """Per (L > L_ctx, corpus): each computed method's last-L_ctx perplexity [interval], its ratio to
    plain RoPE's 1x E1 [interval] and to the lowest method there [interval; "tied" when it holds 1]."""
    p, rows = plan_of(results), []
    lines = ["Paired comparisons beyond the context: the last-L_ctx perplexity of each computed cell, its ratio "
             "to plain RoPE's E1 at L_ctx and its ratio to the lowest method at the same L, each on the same "
             "windows with a 95% paired interval; 'tied' when the interval of the ratio to the lowest contains 1",
             "", "| L | corpus | method | last-L_ctx ppl | / plain RoPE @ 1x | / lowest |", "|---|---|---|---|---|---|"]
    for L in sorted(results["holds"], key=int):
        for c in results["spec"]["corpora"]:
            vs = p.versus_lowest(int(L), c)
            for m in sorted(vs, key=lambda m: vs[m]["value"]):
                cell = p.cell(m, int(L), c)
                own = log_interval(t_interval(cell["win_tail_nll"]))
                r = p.ratio_stats(m, int(L)).get(c)
                v = vs[m]
                low = "lowest" if m == v["lowest"] else interval(v, ".3f") + (
                    " tied" if v["n"] >= 2 and v["lo"] <= 1 <= v["hi"] else "")
                lines.append(f"| {_x(results, L)} | {c} | {label(m)} | {interval(own)} | {interval(r)} | {low} |")
                rows.append([L, c, m, own["value"], own["lo"], own["hi"], r["value"] if r else "",
                             r["lo"] if r else "", r["hi"] if r else "", v["value"], v["lo"], v["hi"], v["n"]])
    header = ["length", "corpus", "method", "tail_ppl", "tail_lo95", "tail_hi95", "ratio_plain", "ratio_lo95",
              "ratio_hi95", "ratio_lowest", "lowest_lo95", "lowest_hi95", "windows"]
    return "\n".join(lines) + "\n", _csv(header, rows)


def _task_grid(results: dict, task: str, intro: str, extra, header: list[str], row) -> tuple[str, str]:
    """A task's table: per method and length k/n successes with a 95% Clopper-Pearson interval, then
    ``extra(recs, n)`` (the task's own summary); the CSV one row per record: method, length, ``row(record)``
    (named by ``header``), same_as."""
    Ls = task_lengths(results, task)
    lines = [intro, "", "| method | " + " | ".join(_x(results, L) for L in Ls) + " |", "|---" * (len(Ls) + 1) + "|"]
    rows = []
    for m, byL in results["tasks"].get(task, {}).items():
        cells = []
        for L in Ls:
            recs = byL.get(L)
            if not recs:
                cells.append("—")
                continue
            k, n = count(recs, TASKS[task][1])
            ci = sps.binomtest(k, n).proportion_ci(method="exact")
            same = f" (= {label(recs[0]['same_as'])})" if recs[0].get("same_as") else ""
            cells.append(f"{k}/{n} [{100 * ci.low:.0f}-{100 * ci.high:.0f}%], {extra(recs, n)}{same}")
            rows += [[m, L, *row(r), r.get("same_as") or ""] for r in recs]
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", _csv(["method", "length", *header, "same_as"], rows)


def task_table(results: dict, task: str) -> tuple[str, str]:
    """The task's successes per method and length, k/n with a 95% Clopper-Pearson interval; for
    passkey the whole answer (greedy exact match) beside the value retrieved, for RULER's needle the mean
    log-probability per answer token."""
    s, chat = results["spec"], "yes" if results["chat"] else "no"
    if task == "niah":
        intro = (f"RULER needle ({s['niah_task']}, RULER's prompt and answer prefix, tasks/ruler; the haystack its task "
                 "names: noise sentences, or essays from the python3-doc substitute): the answer's tokens teacher-forced "
                 "after the answer prefix, exact match k/n with a 95% Clopper-Pearson interval and the mean "
                 f"log-probability per answer token; n = {s['niah_n']} per cell; chat template: {chat}; methods with a "
                 "softmax temperature are not run (RULER's reader takes none)")
        fields = ["depth", "retrieved", "tf_mean_logprob", "tf_token_acc"]
        return _task_grid(results, task, intro,
                          lambda recs, n: f"{sum(r.get('tf_mean_logprob', 0.0) for r in recs) / n:.2f} nats/token",
                          fields, lambda r: [r.get(f) for f in fields])
    intro = ("Passkey retrieved: the key's digits read out of the haystack (teacher-forced exact match of the "
             "value's tokens after the answer prefix and its separator), k/n with a 95% Clopper-Pearson interval; "
             "'whole' is the whole answer as greedy decoding gives it (separator first). "
             f"{len(s['passkey_depths'])} depths {s['passkey_depths']} x n = {s['passkey_n']} per length; chat "
             f"template: {chat}; plain RoPE in context is the baseline")
    return _task_grid(results, task, intro, lambda recs, n: f"whole {count(recs, 'correct')[0]}/{n}",
                      ["depth", "retrieved", "correct", "lead_ok", "value_nll", "token_acc", "pred", "answer"],
                      lambda r: [r["depth"], r.get("retrieved"), r["correct"], r.get("lead_ok"), r.get("value_nll"),
                                 r.get("token_acc"), " ".join(map(str, r["pred"])), " ".join(map(str, r["answer"]))])


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
             "passkey": "passkey", "niah": "RULER needle", "erf": "ERF"}  # each cell's seconds include its model load
    lines = ["| stage | L | cells | seconds (model loads included) |", "|---|---|---|---|"]
    for (kind, L), secs in sorted(groups.items(), key=lambda kv: (list(names).index(kv[0][0]), kv[0][1])):
        lines.append(f"| {names.get(kind, kind)} | {L:,} | {len(secs)} | {sum(secs):.0f} |")
    total = sum(results["stage_seconds"].values())
    lines.append(f"| all stages | | {len(results['stage_seconds'])} | {total:.0f} |")
    return "\n".join(lines) + "\n"

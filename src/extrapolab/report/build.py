"""Build a sweep's report from its results.sqlite only: tables (md + csv), figures, report.html.

First the corpora it measured (report/corpora.py: each dataset's corpus hash and the package or
interpreter it came from, and one warning line when the runs span more than one text of a corpus).

Training curves first (report/curves.py: train and validation loss against step and tokens, seeds as
a min-max band). After each dataset's first table, the papers' claims checked on its means
(report/picture.py: "scheme | paper's claim (citation) | this run | shown?"). Tables follow Sandwich paper Table 3 (mean ± std over seeds, paired two-sided t-test
against a reference scheme, † / *); the cost table follows ALiBi Fig. 2 / thesis Table 3.4; the
position-wise figure follows thesis Fig. 3.5 (with the windowed@L_tr reference).
"""
from __future__ import annotations

import datetime as dt
import html
import math
import platform
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..eval.stats import format_table, summary
from ..io import atomic_write_text
from .db import ResultsDB
from .html import img_tag, md_table_to_html, page
from .analysis_section import erf_table, plot_erf_overlay
from .corpora import corpus_section
from .curves import curves_section
from .first_token import first_token_curves, first_token_means, first_token_table, plot_first_token
from .picture import claims_markdown
from .plots import plot_ppl_vs_length, plot_positionwise

PROTOCOL_TITLES = {
    "nonoverlapping": "E1 nonoverlapping perplexity (ALiBi §2.1)",
    "sliding": "E2 sliding-window perplexity (ALiBi appendix B)",
    "last_token": "E3 last-token perplexity: the same N end tokens at every L_ex (Sandwich §3.4)",
    "cached": "E5 cached sliding-window perplexity (Sandwich appendix B)",
    "recomputed": "E5 recomputed-window perplexity (reference for the cached one)",
}


def _by_scheme_length(rows) -> dict:
    """[(run_id, dataset, label, seed, L, v)] -> {dataset: {label: {L: {seed: v}}}}."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for _, ds, label, seed, L, v in rows:
        out[ds][label][int(L)][int(seed)] = v
    return out


def ppl_tables(db: ResultsDB, meta: dict) -> list[dict]:
    tables = []
    labels = meta.get("schemes") or []
    for proto in meta.get("protocols", []):
        if proto not in PROTOCOL_TITLES:
            continue
        data = _by_scheme_length(db.scalars(proto, "ppl"))
        for ds, per in data.items():
            cols = [lb for lb in labels if lb in per] or sorted(per)
            ref = meta.get("reference") if meta.get("reference") in per else cols[0]
            lengths = sorted({L for lb in per.values() for L in lb})
            results = {lb: {L: per[lb].get(L, {}) for L in lengths} for lb in cols}
            md, csv = format_table(results, ref, lengths, schemes=cols)
            tables.append({"protocol": proto, "dataset": ds, "markdown": md, "csv": csv,
                           "means": {lb: {L: summary(results[lb][L]) for L in lengths} for lb in cols}})
    return tables


def verdict_table(db: ResultsDB, meta: dict) -> str:
    rows = ["| dataset | scheme | protocol | extrapolates (all seeds) | worst absolute relative change vs ppl at L_tr (mean over seeds) |",
            "|---|---|---|---|---|"]
    for proto in meta.get("protocols", []):
        ext = _by_scheme_length(db.scalars(f"verdict:{proto}", "extrapolates"))
        worst = _by_scheme_length(db.scalars(f"verdict:{proto}", "worst_ratio"))
        for ds, per in ext.items():
            for label, byL in per.items():
                flags = list(byL[0].values())
                w = list(worst.get(ds, {}).get(label, {}).get(0, {}).values())
                rows.append(f"| {ds} | {label} | {proto} | {'yes' if all(flags) else 'no'} "
                            f"({int(sum(flags))}/{len(flags)}) | {np.mean(w):.3g} |" if w else
                            f"| {ds} | {label} | {proto} | {'yes' if all(flags) else 'no'} | — |")
    return "\n".join(rows) + "\n"


def _ratio(r: dict | None) -> str:
    """A paired ratio stored by the bench pass: 'median (min–max)', '~' where not reproducible to 3%."""
    if not r:
        return "—"
    return f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})" + ("" if r.get("stable") else " ~")


def cost_table(db: ResultsDB) -> str:
    """E8: ratios from the sweep's one bench pass; per-run wall clock below it, with no ratios."""
    meta, rows = db.meta(), []
    bench = meta.get("cost_bench")
    if bench:
        m, st = bench["meta"], bench["settings"]
        ms = lambda xs: f"{1e3 * float(np.median(xs)):.1f}"  # noqa: E731 - per-round seconds -> median ms
        beside = any("step_s_beside" in r for r in bench["rows"].values())  # passes stored before it: per round
        pairing = ("median over rounds of each call's time over the NoPE call timed next to it" if beside else
                   "median of per-round paired ratios")
        rows += [f"One bench pass after training, in one process (pid {m['pid']}, {m['threads']} threads, "
                 f"{m['repeats']} rotated rounds), at this sweep's model (R={st['model']['layers']}, "
                 f"H={st['model']['heads']}, d={st['model']['dim']}, vocabulary {st['model']['vocab_size']}), "
                 f"L_tr = {st['L']}, batch {st['batch']}. ×NoPE: {pairing} (min–max; "
                 "~ = median's 95% interval wider than ±3%). Memory: peak increase during one train step.", "",
                 "| scheme | train step ms | step ×NoPE | eval forward ms | forward ×NoPE | attention-only ×NoPE "
                 "| peak MiB per step | params |", "|---|---|---|---|---|---|---|---|"]
        for label, r in bench["rows"].items():
            rows.append(f"| {label} | {ms(r['step_s'])} | {_ratio(r.get('step_s_ratio'))} | {ms(r['fwd_s'])} | "
                        f"{_ratio(r.get('fwd_s_ratio'))} | {_ratio(r.get('attn_s_ratio'))} | {r['peak_mib']:.0f} | "
                        f"{r['params']:,} |")
        rows.append("")
    per: dict = defaultdict(lambda: defaultdict(list))
    for r in db.runs():
        s = r["summary"]
        for key in ("median_sec_per_step", "eval_wall_s", "analysis_wall_s", "peak_memory_mb"):
            if isinstance(s.get(key), (int, float)):
                per[r["label"]][key].append(float(s[key]))
    if not per and not bench:
        return "no cost data\n"
    if per:
        rows += ["Per-run wall clock (medians over seeds). Each run's figures were taken while it trained and evaluated (one after another or side by side, under "
                 "whatever else ran on the host), so these are not comparable across runs and no ratio is taken; peak RSS is "
                 "each run's own (peak reset when its training starts).", "",
                 "| scheme | train s/step | eval s | ERF/TRF s | peak RSS MB |", "|---|---|---|---|---|"]
        for label, d in per.items():
            med = {k: float(np.median(v)) for k, v in d.items()}
            rows.append(f"| {label} | {med.get('median_sec_per_step', math.nan):.3f} | {med.get('eval_wall_s', math.nan):.0f} | "
                        f"{med.get('analysis_wall_s', math.nan):.0f} | {med.get('peak_memory_mb', math.nan):,.0f} |")
    return "\n".join(rows) + "\n"


def stage_times(stages: dict | None) -> str:
    """`` (start 3 s, tokenize 21 s, runs 300 s, ...)``: the last invocation's wall time by stage (meta stages_s;
    "runs" is training and evaluation in the workers, each run's own split is in the per-run table)."""
    return " (" + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items()) + ")" if stages else ""


def build_report(out: Path, wall_s: float | None = None) -> Path:
    out = Path(out)
    db = ResultsDB(out / "results.sqlite")
    meta = db.meta()
    runs = db.runs()
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    sections: list[tuple[str, str]] = []
    md_parts = [f"# extrapolab report: {meta.get('name', out.name)}\n"]
    corpora, mixed = corpus_section(db, meta, runs)  # which text each dataset is: hosts' packages differ
    text = "\n".join(f"- {c}" for c in corpora) + (f"\n\n**{mixed}**" if mixed else "")
    md_parts.append(f"## Corpora\n\n{text}\n")
    sections.append(("Corpora", "<ul>" + "".join(f"<li>{html.escape(c)}</li>" for c in corpora) + "</ul>"
                     + (f"<p><b>{html.escape(mixed)}</b></p>" if mixed else "")))
    if mixed:
        print(f"extrapolab report {out}: {mixed}", file=sys.stderr, flush=True)
    Ltr = int(meta.get("train_length", 0))
    for title, png, caption in curves_section(db, meta.get("schemes") or [], figs, out):
        sections.append((title, img_tag(png, png.stem) + f"<p>{html.escape(caption)}</p>"))
        md_parts.append(f"## {title}\n\n![]({png.relative_to(out)})\n\n{caption}\n")
    tables = ppl_tables(db, meta)
    means: dict = defaultdict(dict)  # {dataset: {protocol: {label: {L: mean ppl}}}}: the claims' input
    for t in tables:
        means[t["dataset"]][t["protocol"]] = {lb: {L: m["mean"] for L, m in byL.items() if m["mean"] is not None}
                                              for lb, byL in t["means"].items()}
    for ds, per in first_token_means(db).items():  # A6 claims (sinks) read the mass on token 0 like a protocol
        means[ds]["first_token"] = per
    pictured = set()
    for t in tables:
        stem = f"ppl_{t['protocol']}_{t['dataset']}"
        atomic_write_text(out / f"{stem}.md", t["markdown"])
        atomic_write_text(out / f"{stem}.csv", t["csv"])
        png = plot_ppl_vs_length(t["means"], Ltr, figs / stem, title=f"{t['protocol']} ({t['dataset']})")
        title = f"{PROTOCOL_TITLES[t['protocol']]} — {t['dataset']}, L_tr = {Ltr}"
        sections.append((title, md_table_to_html(t["markdown"]) + img_tag(png, stem)
                         + f"<p>CSV: <code>{stem}.csv</code></p>"))
        md_parts.append(f"## {title}\n\n{t['markdown']}\n![]({png.relative_to(out)})\n")
        if t["dataset"] not in pictured:  # after each dataset's first table (E1): every protocol's claims
            pictured.add(t["dataset"])
            pic = claims_markdown(means[t["dataset"]], Ltr, len(meta.get("seeds") or [0]), meta.get("budget", ""))
            if pic:
                atomic_write_text(out / f"picture_{t['dataset']}.md", pic)
                sections.append((f"Does it show the papers' picture? — {t['dataset']}", md_table_to_html(pic)))
                md_parts.append(f"## Does it show the papers' picture? — {t['dataset']}\n\n{pic}")
    pw = db.series("positionwise", "ppl")
    if pw:
        ref = db.series("positionwise", "windowed_ppl")
        png = plot_positionwise(pw, ref, Ltr, figs / "positionwise")
        title = "E4 position-wise perplexity with the windowed@L_tr reference (thesis §3.5.5)"
        sections.append((title, img_tag(png, "positionwise") + "<p>Mean over seeds and segments, "
                         "smoothed; dashed: the same model restricted to the most recent L_tr keys.</p>"))
        md_parts.append(f"## {title}\n\n![]({png.relative_to(out)})\n")
    vt = verdict_table(db, meta)
    atomic_write_text(out / "verdict.md", vt)
    sections.append(("E6 extrapolation verdict (Qin def. 0.1, δ from eval.delta)", md_table_to_html(vt)))
    md_parts.append(f"## E6 extrapolation verdict\n\n{vt}")
    ct = cost_table(db)
    atomic_write_text(out / "cost.md", ct)
    sections.append(("E8 cost per scheme", md_table_to_html(ct)))
    md_parts.append(f"## E8 cost\n\n{ct}")
    erf_png = plot_erf_overlay(db, meta.get("schemes") or [], Ltr, figs / "erf")
    if erf_png is not None or db.scalars("trf", "heads"):
        et = erf_table(db, meta.get("schemes") or [], Ltr)
        atomic_write_text(out / "erf.md", et)
        title = "A1/A2 see why: empirical receptive field (Sandwich §5) and theoretical receptive field (Qin eq. 22)"
        sections.append((title, md_table_to_html(et) + (img_tag(erf_png, "erf") if erf_png else "")
                         + "<p>A scheme extrapolates when its ERF stays inside L_tr (curve reaching 0.99 inside "
                           "the shaded band). TRF is computed from the trained bias formula; a divergent "
                           "Σexp(bias) has no TRF.</p>"))
        md_parts.append(f"## {title}\n\n{et}" + (f"\n![]({erf_png.relative_to(out)})\n" if erf_png else ""))
    ft = first_token_curves(db)
    if ft:
        table = first_token_table(ft, meta.get("schemes") or [], Ltr)
        atomic_write_text(out / "first_token.md", table)
        pngs = plot_first_token(ft, meta.get("schemes") or [], figs / "first_token")
        title = "A6 attention on the first token per layer (StreamingLLM's attention sink, Xiao et al. 2024 §3.1)"
        caption = ("Mean attention weight on token 0 over heads, queries m >= 1, segments and seeds; a sliding or chunked "
                   "layer gives 0 where token 0 is outside its window or chunk. Uniform attention would give ~ln(L)/L.")
        sections.append((title, md_table_to_html(table) + "".join(img_tag(p, p.stem) for p in pngs)
                         + f"<p>{html.escape(caption)}</p>"))
        md_parts.append(f"## {title}\n\n{table}\n" + "".join(f"![]({p.relative_to(out)})\n" for p in pngs)
                        + f"\n{caption}\n")
    analysis_pngs = sorted((out / "analysis").glob("*.png")) + sorted(out.glob("runs/*/analysis/*.png"))
    if analysis_pngs:  # written by `extrapolab analyze ... --out DIR/analysis` or `analyze all RUN`
        body = "".join(f"<h3>{html.escape(str(p.relative_to(out)))}</h3>{img_tag(p, p.stem)}" for p in analysis_pngs)
        sections.append(("Analysis figures (extrapolab analyze)", body))
        md_parts.append("## Analysis figures\n\n" + "\n".join(f"![]({p.relative_to(out)})" for p in analysis_pngs) + "\n")
    run_list = "".join(f"<li><code>{html.escape(r['run_id'])}</code>: {html.escape(str(r['run_dir']))}</li>" for r in runs)
    sections.append(("Runs", f"<ul>{run_list}</ul>"))
    wall = wall_s if wall_s is not None else meta.get("last_wall_s")
    note = (f"Preset <b>{html.escape(str(meta.get('preset')))}</b> — budget: {html.escape(str(meta.get('budget', '')))}. "
            f"{len(runs)} finished runs; seeds {meta.get('seeds')}; datasets {meta.get('datasets')}. "
            + (f"Sweep wall time {wall:.0f} s" + stage_times(meta.get("stages_s")) + ". "
               if isinstance(wall, (int, float)) else "")
            + f"Generated {dt.datetime.now().isoformat(timespec='seconds')} on {html.escape(platform.platform())}. "
            "Every number is read from results.sqlite; `extrapolab report DIR` regenerates this page.")
    atomic_write_text(out / "report.html", page(f"extrapolab report: {meta.get('name', out.name)}", sections, note))
    atomic_write_text(out / "report.md", "\n".join(md_parts))
    db.close()
    return out / "report.html"

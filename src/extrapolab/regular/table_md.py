"""The markdown of ``regular table`` (table.md) and ``regular sweep-p`` (sweep_p.md): ours next to the
thesis' Tables 6.1/6.2 and, for the tasks both have, next to Ruoss et al. 2023 Table 1 (regular/reference.py)."""
from __future__ import annotations

from .reference import (RUOSS_COLUMNS, RUOSS_TABLE_1, RUOSS_TASK_NAMES, THESIS_TABLE_6_1,
                        ruoss_cell)
from .tasks import make_task

SWEEP_P = (0.1, 0.3, 0.5, 0.7, 0.9)


def _hours(sec: float) -> str:
    return f"{sec / 3600:.1f} h" if sec >= 3600 else f"{sec / 60:.0f} min"


def _lengths_text(tl: dict, task: str) -> str:
    lens = make_task(task).lengths(tl["min"], tl["max"])[:: tl["stride"]]
    shown = ", ".join(str(x) for x in lens[:3]) + (f", ..., {lens[-1]}" if len(lens) > 3 else "")
    return f"{tl['count']} lengths ({shown}), {tl['samples_per_length']} strings each"


def table_markdown(table: dict, models) -> str:
    head = "| task | " + " | ".join(f"{m} ours | {m} thesis" for m in models) + " |"
    lines = ["# Table 6.1 — length generalisation on regular languages (Max / Avg accuracy %, over "
             f"{table['seeds']} seeds)", "",
             f"Budget `{table.get('budget', 'quick')}` (see `extrapolab regular table --help`). Ours: per "
             "seed, the mean accuracy over the evaluated test lengths listed below (Max = best seed, "
             "Avg = mean over seeds; a cell run with fewer seeds says so); thesis: Chi 2024 Table 6.1 "
             "(its RNN column is shown for both rnn and lstm).", *[f"{x}." for x in table.get("skipped") or []],
             "", head, "|" + "---|" * (1 + 2 * len(models))]
    for t, entry in table["tasks"].items():
        cells = []
        for m in models:
            e = entry.get(m)
            ours = f"{e['max']:.1f} / {e['avg']:.1f}" if e else "—"
            if e and e["seeds"] != table["seeds"]:
                ours += f" ({e['seeds']} seed{'s' if e['seeds'] > 1 else ''})"
            th = THESIS_TABLE_6_1.get(t, {}).get("rnn" if m == "lstm" else m)
            cells += [ours, f"{th[0]:.1f} / {th[1]:.1f}" if th else "—"]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", "## In-distribution accuracy (mean over the training lengths 1..40 resp. 1..50, Avg over "
              "seeds, %)", "",
              "Near chance here means the model did not fit the training lengths (optimisation), "
              "not a failure to extrapolate.", "",
              "| task | " + " | ".join(models) + " |", "|" + "---|" * (1 + len(models))]
    for t, entry in table["tasks"].items():
        lines.append(f"| {t} | " + " | ".join(f"{entry[m]['train_len_avg']:.1f}" if m in entry else "—"
                                              for m in models) + " |")
    lines += ["", "## Test lengths averaged", ""]
    seen: dict = {}
    for t, entry in table["tasks"].items():
        for m in models:
            if m in entry:
                seen.setdefault((t, _lengths_text(entry[m]["test_lengths"], t)), []).append(m)
    for (t, text), ms in seen.items():
        lines.append(f"- {t} ({', '.join(ms)}): {text}")
    wt = table.get("wall_time")
    if wt:
        lines += ["", "## Wall time", "",
                  f"Measured compute of the {wt['done']} finished runs (train + eval, recorded per run): "
                  f"{_hours(wt['measured_s'])}. Missing: {wt['missing']} of {wt['runs']} runs, estimated "
                  f"{_hours(wt['estimated_missing_s'])} from the finished ones (same column, same task, else "
                  f"same family). Projected full table ({wt['runs']} runs, one process): "
                  f"**{_hours(wt['projected_total_s'])}**"
                  + (f"; no estimate for {len(wt['unknown'])} runs of columns with no finished run."
                     if wt["unknown"] else "."), "",
                  "| column | runs done | measured | missing | estimated |", "|---|---|---|---|---|"]
        for m, c in wt["per_column"].items():
            lines.append(f"| {m} | {c['done']} | {_hours(c['measured_s'])} | {c['missing']} | "
                         f"{_hours(c['estimated_s'])} |")
    inv = table.get("invocation")
    if inv and inv.get("elapsed_s") is not None:
        lines += ["", f"This invocation: trained {inv['trained']} runs and reused {inv['reused']} in "
                  f"**{_hours(inv['elapsed_s'])} wall-clock** ({inv['workers']} worker process"
                  f"{'es' if inv['workers'] > 1 else ''} x {inv['threads']} torch thread"
                  f"{'s' if inv['threads'] > 1 else ''}, {inv['cpus']} CPUs visible)."]
    lines += ruoss_markdown(table, models)
    return "\n".join(lines) + "\n"


def _pct(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def ruoss_markdown(table: dict, models) -> list[str]:
    """Our Max on the tasks Ruoss et al.'s Table 1 shares with thesis Table 6.1, next to their cell for
    each column with a counterpart (marked †; named, not filled, while RUOSS_TABLE_1 is empty) and the
    thesis' RegularGPT; [] when the table has none of those tasks or no column with a counterpart."""
    tasks = [t for t in RUOSS_TASK_NAMES if t in table["tasks"]]
    cols = [m for m in models if m in RUOSS_COLUMNS or m.startswith(("regulargpt", "transformer"))]
    if not tasks or not cols:
        return []
    have = bool(RUOSS_TABLE_1)
    head, cells = [], {t: [] for t in tasks}
    for m in cols:
        head.append(f"{m} (ours)")
        for t in tasks:
            e = table["tasks"][t].get(m)
            cells[t].append(_pct(e["max"]) if e else "—")
        if m in RUOSS_COLUMNS:
            enc, kind = RUOSS_COLUMNS[m]
            head.append(f"Ruoss {enc} {kind} †")
            for t in tasks:
                cells[t].append(_pct(ruoss_cell(t, m)) if have else f"Table 1, {enc} {kind}")
        elif m.startswith("regulargpt"):
            head.append(f"{m} thesis")
            for t in tasks:
                cells[t].append(_pct((THESIS_TABLE_6_1.get(t, {}).get(m) or (None,))[0]))
    if have:
        head += ["Ruoss best standard †", "Ruoss best randomized †"]
        for t in tasks:
            row = RUOSS_TABLE_1[t].values()
            cells[t] += [_pct(max(v[0] for v in row)), _pct(max(v[1] for v in row if v[1] is not None))]
    lines = ["", "## Next to Ruoss et al. 2023, Table 1 (the tasks both tables have)", "",
             "Max accuracy % (mean over the test lengths, best seed). † = Ruoss et al.'s cells (\"Randomized "
             "Positional Encodings Boost Length Generalization of Transformers\", ACL 2023, Table 1; their code, "
             "google-deepmind/randomized_positional_encodings, trains on lengths up to 40, tests up to 500 and "
             "draws randomized positions from 2,048). Their \"relative\" is Transformer-XL's encoding (the "
             "thesis' transformer); our `transformer` uses T5 buckets. `thesis` = Chi 2024 Table 6.1 Max.", "",
             "| task | " + " | ".join(head) + " |", "|" + "---|" * (1 + len(head))]
    lines += [f"| {t} ({RUOSS_TASK_NAMES[t]}) | " + " | ".join(cells[t]) + " |" for t in tasks]
    if not have:
        lines += ["", "† not filled in: Ruoss et al.'s Table 1 could not be read where this table was made, and "
                  "remembered numbers are not printed; each † cell names the Table 1 cell to read "
                  "(regular/reference.py, RUOSS_TABLE_1)."]
    return lines


def sweep_markdown(res: dict) -> str:
    lines = ["# Table 6.2 — Parity with P(sigma=1) = p (trained at p = 0.5; mean over seeds, %)", "",
             "| setting | model | " + " | ".join(f"p={p}" for p in res["p"]) + " |",
             "|---|---|" + "---|" * len(res["p"])]
    for setting in ("same", "extrapolation"):
        for m, row in res[setting].items():
            lines.append(f"| {setting} | {m} (ours) | " + " | ".join(f"{v:.1f}" for v in row) + " |")
            th = res["thesis"][setting].get(m)
            if th and list(res["p"]) == list(SWEEP_P):
                lines.append(f"| {setting} | {m} (thesis) | " + " | ".join(f"{v:.1f}" for v in th) + " |")
    return "\n".join(lines) + "\n"

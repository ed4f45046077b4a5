"""Which corpus a sweep measured: recorded in results.sqlite, printed in its report, and one warning
line when its results span more than one text of the same corpus (data/origin.py says why that
happens across hosts: a ``python3-doc`` one Debian release apart changes the prose tables).

* :func:`record_corpora` -- called by the sweep with the provenance of the datasets it prepared: stores it in
  the meta ``corpora`` (the one this invocation measures on) and, when a resumed sweep
  finds another hash than the one stored, keeps the earlier one in ``corpora_earlier`` and returns the
  warning line for the console;
* :func:`corpus_section` -- the report's lines: one per dataset (the hash and its source, or "corpus
  hash not recorded" for a sweep stored before the hash was), then the warning line when the finished
  runs (each run's summary ``data``) or the sweep's invocations hold different hashes of a corpus.
"""
from __future__ import annotations

from ..data.origin import HASH_DIGITS, corpus_line, mixed_corpora


def record_corpora(db, now: dict) -> list[str]:
    """Store ``now`` ({dataset: :func:`~extrapolab.data.origin.provenance` of its prepared data}, as the sweep
    prepared it) in ``db``'s meta and return the warning lines for a resumed sweep whose corpus changed
    (module doc)."""
    meta = db.meta()
    before, earlier = dict(meta.get("corpora") or {}), dict(meta.get("corpora_earlier") or {})
    warnings = []
    for d in now:
        old = before.get(d)
        if old and now[d] and old.get("corpus_hash") != now[d]["corpus_hash"]:
            earlier.setdefault(d, [])
            if old not in earlier[d]:
                earlier[d].append(old)
            warnings.append(resume_warning(d, old, now[d]))
    db.set_meta(corpora=now, **({"corpora_earlier": earlier} if earlier else {}))
    return warnings


def resume_warning(dataset: str, old: dict, new: dict) -> str:
    """The console's line when a sweep resumes on another text of a corpus than its stored runs measured."""
    def what(p: dict) -> str:
        return f"{p['corpus_hash'][:HASH_DIGITS]}…" + (f" ({p['source']})" if p.get("source") else "")

    return (f"warning: this sweep resumes on corpus {dataset} with sha256 {what(new)}, but its stored runs measured "
            f"{what(old)}; the tables will mix the two texts: compare with care, or run this sweep again in a new "
            "folder")


def corpus_section(db, meta: dict | None = None, runs=None) -> tuple[list[str], str | None]:
    """(one line per dataset, the warning line or None) for a sweep's report (module doc)."""
    meta = db.meta() if meta is None else meta
    runs = db.runs() if runs is None else runs
    stored = meta.get("corpora") or {}
    from_runs = {}
    for r in runs:
        p = (r.get("summary") or {}).get("data")
        if p and r["dataset"] not in from_runs:
            from_runs[r["dataset"]] = p
    datasets = list(meta.get("datasets") or []) or sorted({r["dataset"] for r in runs})
    lines = [corpus_line(stored.get(d) or from_runs.get(d), d) for d in datasets]
    pairs = [(r["run_id"], (r.get("summary") or {}).get("data")) for r in runs]
    pairs += [(f"an earlier invocation ({d})", p) for d, ps in (meta.get("corpora_earlier") or {}).items() for p in ps]
    pairs += [(f"this sweep's data ({d})", p) for d, p in stored.items()]
    return lines, mixed_corpora(pairs)

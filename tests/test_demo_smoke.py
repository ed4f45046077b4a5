"""The main job end to end at smoke scale: train, evaluate, record, report; then resume and rebuild."""
import sqlite3

import pytest

from extrapolab.io import UserError
from extrapolab.sweep.sweep import rebuild_report, run_sweep


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    over = [f"data.cache_dir={tmp / 'cache'}", "sweep.seeds=[0,1]"]
    res = run_sweep("demo-smoke", out=tmp / "out", overrides=over, progress=False)
    return tmp, over, res


def test_demo_smoke_writes_the_report(smoke):
    tmp, _, res = smoke
    out = res["out"]
    html = (out / "report.html").read_text()
    for needle in ("Training curves — stdlib", "E1 nonoverlapping", "E3 last-token", "E4 position-wise",
                   "E6 extrapolation verdict", "E8 cost", "demo-smoke", "data:image/png;base64,"):
        assert needle in html
    md = (out / "ppl_nonoverlapping_stdlib.md").read_text()
    assert all(s in md for s in ("none", "alibi", "sinusoidal"))
    csv_rows = (out / "ppl_last_token_stdlib.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + 3 * 3  # header + 3 lengths x 3 schemes
    for f in ("figures/positionwise.png", "figures/positionwise.svg", "cost.md", "verdict.md",
              "figures/training_curves_stdlib.png", "figures/training_curves_stdlib.svg"):
        assert (out / f).is_file()
    con = sqlite3.connect(out / "results.sqlite")
    # every run's training curves are stored with its results (8 steps, logged every 4)
    steps = con.execute("SELECT data FROM series WHERE protocol='train' AND name='train_step'").fetchall()
    assert len(steps) == 6 and all(s == ("[4.0, 8.0]",) for s in steps)
    assert con.execute("SELECT COUNT(*) FROM runs WHERE status='done'").fetchone()[0] == 6
    n_rows = con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    assert n_rows > 0
    # every perplexity in the table is a measured, finite number
    vals = [v for (v,) in con.execute("SELECT value FROM results WHERE metric='ppl'")]
    assert vals and all(1.0 < v < 1e6 for v in vals)


def test_wall_time_by_stage_is_recorded_and_reported(smoke):
    """The invocation's wall time by stage (what a results page quotes: tokenize, runs, cost pass, report) adds
    up to the sweep's wall time and is printed in the report's note."""
    import json

    out, wall = smoke[2]["out"], smoke[2]["wall_s"]
    con = sqlite3.connect(out / "results.sqlite")
    meta = {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}
    stages = meta["stages_s"]
    assert list(stages) == ["start", "tokenize", "runs", "models", "cost", "report"]
    assert all(v >= 0 for v in stages.values()) and stages["runs"] > 0
    assert sum(stages.values()) == pytest.approx(wall, abs=0.5 + 0.02 * wall)  # stages cover the invocation
    assert f"tokenize {stages['tokenize']:.0f} s, runs {stages['runs']:.0f} s" in (out / "report.html").read_text()


def test_cost_section_is_one_bench_pass_and_per_run_figures_have_no_ratios(smoke):
    """E8 ratios come from one process at the sweep's own sizes; per-run wall clock is only listed."""
    from extrapolab.report.db import ResultsDB
    from extrapolab.perf.timing import paired_ratio

    out = smoke[2]["out"]
    db = ResultsDB(out / "results.sqlite")
    bench = db.meta()["cost_bench"]
    db.close()
    rows = bench["rows"]
    assert list(rows) == ["none", "alibi", "sinusoidal"]
    assert len({(r["pid"], r["config"]) for r in rows.values()}) == 1  # one process, one size
    assert '"L": 32' in rows["none"]["config"] and '"batch": 4' in rows["none"]["config"]  # the sweep's L_tr, batch
    assert bench["settings"]["model"]["dim"] == 32 and bench["settings"]["L"] == 32
    assert rows["alibi"]["step_s_ratio"] == paired_ratio(rows["alibi"], rows["none"], "step_s")
    cost = (out / "cost.md").read_text()
    bench_part, per_run = cost.split("Per-run wall clock")
    assert "One bench pass" in bench_part and "| alibi |" in bench_part and "×NoPE" in bench_part
    assert "×NoPE" not in per_run and "no ratio is taken" in per_run


def test_demo_resume_skips_finished_runs_and_keeps_rows(smoke):
    tmp, over, res = smoke
    out = res["out"]
    before = sqlite3.connect(out / "results.sqlite").execute("SELECT COUNT(*) FROM results").fetchone()[0]
    again = run_sweep("demo-smoke", out=out, overrides=over, progress=False)
    after = sqlite3.connect(out / "results.sqlite").execute("SELECT COUNT(*) FROM results").fetchone()[0]
    assert before == after
    assert again["wall_s"] < res["wall_s"]
    (out / "report.html").unlink()
    assert rebuild_report(out).is_file()


def test_report_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no results.sqlite"):
        rebuild_report(tmp_path)


def test_demo_records_erf_and_trf_and_reports_them(smoke):
    """eval.erf_length: A1 ERF and A2 TRF land in results.sqlite and in the report's see-why section."""
    _, _, res = smoke
    out = res["out"]
    con = sqlite3.connect(out / "results.sqlite")
    rows = con.execute("SELECT r.scheme, s.length, s.value FROM results s JOIN runs r USING (run_id) "
                       "WHERE s.protocol='erf' AND s.metric='erf_tokens'").fetchall()
    assert len(rows) == 6  # 3 schemes x 2 seeds
    for scheme, L, v in rows:
        assert L == 128 and 1 <= v <= L - 1  # fewest most recent inputs holding 99% of the gradient
    n_curves = con.execute("SELECT COUNT(*) FROM series WHERE protocol='erf' AND name='c'").fetchone()[0]
    assert n_curves == 6
    # ALiBi's trained bias is the fixed geometric one: every head converges, with a TRF; NoPE has no bias
    conv = con.execute("SELECT s.value FROM results s JOIN runs r USING (run_id) WHERE r.scheme='alibi' "
                       "AND s.protocol='trf' AND s.metric='converging_heads'").fetchall()
    assert [v for (v,) in conv] == [2.0, 2.0]
    assert not con.execute("SELECT 1 FROM results s JOIN runs r USING (run_id) WHERE r.scheme='none' "
                           "AND s.protocol='trf'").fetchall()
    md = (out / "erf.md").read_text()
    alibi_row = next(line for line in md.splitlines() if line.startswith("| alibi |"))
    assert "| 128 |" in alibi_row and "2/2" in alibi_row
    shares = [float(line.split("|")[5].strip().rstrip("%")) for line in md.splitlines()[2:]]
    assert len(shares) == 3 and all(0 < v <= 100 for v in shares)  # c at distance L_tr, in percent
    assert "| none | 128 |" in md and "no bias" in md
    assert "empirical receptive field" in (out / "report.html").read_text()
    assert (out / "figures" / "erf.png").is_file() and (out / "figures" / "erf.svg").is_file()


def _e1_means(md: str) -> tuple[dict, int]:
    """{label: {L: mean ppl}} and L_tr from the E1 table of a report.md (docs/results/demo-quick.md)."""
    sec = md.split("## E1 nonoverlapping")[1].split("\n## ")[0]
    Ltr = int(sec.split("L_tr = ")[1].split()[0])
    rows = [line.strip("|").split("|") for line in sec.splitlines() if line.startswith("| ")]
    labels = [c.strip() for c in rows[0][1:]]
    means = {lb: {} for lb in labels}
    for r in rows[1:]:
        for lb, cell in zip(labels, r[1:]):
            if cell.strip() not in ("—", ""):
                means[lb][int(r[0])] = float(cell.split("±")[0].strip().rstrip("†*"))
    return means, Ltr


def test_published_demo_table_shows_the_papers_picture():
    """docs/results/demo-quick.md (written by `make demo`) keeps the picture its preset was cut to keep."""
    from pathlib import Path

    from extrapolab.report.picture import picture_checks

    md = (Path(__file__).parents[1] / "docs" / "results" / "demo-quick.md").read_text()
    means, Ltr = _e1_means(md)
    checks = picture_checks(means, Ltr)
    assert {lb.split("(")[0] for lb, _, _ in checks} == {"sinusoidal", "learned", "alibi", "windowed", "t5",
                                                         "kerple-log", "sandwich"}
    assert all(ok for _, ok, _ in checks), [c for c in checks if not c[1]]


def test_picture_check_fails_a_table_without_the_picture():
    from extrapolab.report.picture import picture_checks

    bad = {"sinusoidal": {64: 90.0, 1024: 92.0}, "alibi": {64: 75.0, 1024: 90.0}, "sandwich": {64: 75.0, 1024: 76.0}}
    assert [ok for _, ok, _ in picture_checks(bad, 64)] == [False, False, False]


def test_runs_and_report_name_the_corpus_and_warn_over_two_texts(smoke, tmp_path, capsys):
    """Every run's summary (summary.json, its results.sqlite row) and the sweep's meta record the corpus hash of
    the text it read (the sha256 of the manifest of stdlib's documents, read again here) and its source (this
    interpreter); the report prints it. A resume that finds another text, or runs of two texts in one report,
    is one warning line, in the report and on the console."""
    import json
    import platform
    import shutil

    from dataclasses import replace

    from extrapolab.data import manifest_hash, prepare, provenance, read_corpus
    from extrapolab.report.build import build_report
    from extrapolab.report.corpora import record_corpora
    from extrapolab.report.db import ResultsDB
    from extrapolab.sweep.spec import load_sweep

    tmp, over, res = smoke
    out = res["out"]
    want = manifest_hash(read_corpus("stdlib", 400_000).manifest())  # demo-smoke's data.max_bytes
    db = ResultsDB(out / "results.sqlite")
    runs, meta = db.runs(), db.meta()
    db.close()
    assert meta["corpora"]["stdlib"]["corpus_hash"] == want
    assert meta["corpora"]["stdlib"]["source"].startswith(f"{platform.python_implementation()} "
                                                          f"{platform.python_version()} standard library")
    assert all(r["summary"]["data"]["corpus_hash"] == want for r in runs)
    assert json.loads((out / "runs" / runs[0]["run_id"] / "summary.json").read_text())["data"]["corpus_hash"] == want
    report = (out / "report.md").read_text()
    assert f"- corpus stdlib: sha256 {want[:12]}… of its manifest, from {platform.python_implementation()}" in report
    assert "warning:" not in report and f"sha256 {want[:12]}" in (out / "report.html").read_text()

    copy = tmp_path / "resumed"
    copy.mkdir()
    shutil.copy(out / "results.sqlite", copy / "results.sqlite")
    db = ResultsDB(copy / "results.sqlite")
    other = {**meta["corpora"]["stdlib"], "corpus_hash": "0" * 64, "source": "CPython 3.11.2 standard library"}
    db.set_meta(corpora={"stdlib": other})  # as if the stored runs had read another host's text
    base, spec = load_sweep("demo-smoke", over)
    [line] = record_corpora(db, {d: provenance(prepare(replace(base.data, corpus=d), progress=False))
                                 for d in spec.datasets})
    assert line.startswith("warning: this sweep resumes on corpus stdlib with sha256 " + want[:12])
    assert "its stored runs measured 000000000000… (CPython 3.11.2 standard library)" in line
    assert db.meta()["corpora_earlier"] == {"stdlib": [other]} and db.meta()["corpora"]["stdlib"]["corpus_hash"] == want
    db.close()
    capsys.readouterr()
    build_report(copy)
    mixed = [ln for ln in (copy / "report.md").read_text().splitlines() if "warning:" in ln]
    assert len(mixed) == 1 and "corpus stdlib has 2 hashes" in mixed[0] and "000000000000 (an earlier invocation" in mixed[0]
    assert "corpus stdlib has 2 hashes" in capsys.readouterr().err

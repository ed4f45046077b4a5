"""The sweep's one live progress line: counts, each running run's step (and its node or GPU when not simply
this machine), an ETA from measured step times."""
import json
import socket

from extrapolab.report.db import ResultsDB
from extrapolab.sweep.progress import Monitor


def _db(tmp_path):
    db = ResultsDB(tmp_path / "results.sqlite")
    for rid, status in (("a", "done"), ("b", "training"), ("c", "evaluating"), ("d", "queued")):
        db.mark(rid, dataset="x", scheme="none", label="none", seed=0, status=status, run_dir=str(tmp_path / rid))
    db.record("a", {"median_sec_per_step": 0.5, "eval_wall_s": 20.0, "analysis_wall_s": 10.0}, [], [])
    (tmp_path / "runs" / "b").mkdir(parents=True)
    rows = [{"step": 20, "sec_per_step": 0.5}, {"step": 40, "valid_loss": 5.0}, {"step": 40, "sec_per_step": 0.5}]
    (tmp_path / "runs" / "b" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4')
    return db


def test_line_counts_runs_shows_steps_and_an_eta(tmp_path):
    db = _db(tmp_path)
    line = Monitor(tmp_path, ["a", "b", "c", "d"], steps=100, workers=2).line(db)
    assert line.startswith("runs 1 done / 2 running / 1 queued")
    assert "b: step 40/100" in line and "c: evaluating" in line  # torn last line skipped
    # left: b 60 x 0.5 + 30 s eval = 60, c half an eval = 15, d 100 x 0.5 + 30 = 80; (60+15+80)/2 = 77.5 s
    assert "ETA 1 min 17 s" in line and "0.50 s/step" in line and "guessed" not in line
    db.close()


def test_line_before_any_step_time_has_no_eta(tmp_path):
    db = ResultsDB(tmp_path / "results.sqlite")
    db.mark("a", dataset="x", scheme="none", label="none", seed=0, status="training", run_dir="")
    line = Monitor(tmp_path, ["a"], steps=10, workers=1).line(db)
    assert "runs 0 done / 1 running / 0 queued" in line and "a: step 0/10" in line and "ETA" not in line
    db.close()


def test_line_says_where_a_run_runs_when_it_is_not_simply_this_machine(tmp_path):
    db = _db(tmp_path)
    where = {"b": "10.0.0.7/1a2b3c4d", "c": socket.gethostname()}  # a Ray node; a CPU worker of this machine
    line = Monitor(tmp_path, ["a", "b", "c", "d"], steps=100, workers=2, where=where).line(db)
    assert "b: step 40/100 on 10.0.0.7/1a2b3c4d |" in line and "c: evaluating |" in line
    db.close()

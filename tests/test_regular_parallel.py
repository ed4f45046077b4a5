"""`regular table --workers N`: spawned worker processes give the same runs as one process."""
import json

import pytest
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.regular import table as table_mod
from extrapolab.regular.parallel import job_cost

TINY = dict(steps=3, eval_every=1, val_samples=4, test_samples=4, test_max=44, train_max=6)


def test_workers_reproduce_the_sequential_table_and_record_the_wall_clock(tmp_path):
    seq = table_mod.regular_table(tmp_path / "seq", "parity,even_pairs", "rnn", seeds=2, progress=False, **TINY)
    par = table_mod.regular_table(tmp_path / "par", "parity,even_pairs", "rnn", seeds=2, progress=False,
                                  workers=2, threads=1, **TINY)
    for t in ("parity", "even_pairs"):
        assert par["tasks"][t]["rnn"]["per_seed"] == seq["tasks"][t]["rnn"]["per_seed"]
    for k in range(2):  # bit-identical training: same per-length accuracies and history
        a = json.loads((tmp_path / "seq/runs/parity/rnn" / f"seed{k}" / "result.json").read_text())
        b = json.loads((tmp_path / "par/runs/parity/rnn" / f"seed{k}" / "result.json").read_text())
        strip = lambda h: [{k: v for k, v in e.items() if k != "seconds"} for e in h]  # noqa: E731
        assert a["per_length"] == b["per_length"] and strip(a["history"]) == strip(b["history"])
        assert b["torch_threads"] == 1
    inv = par["invocation"]
    assert (inv["trained"], inv["reused"], inv["workers"], inv["threads"]) == (4, 0, 2, 1)
    assert inv["elapsed_s"] > 0 and "wall-clock** (2 worker processes" in (tmp_path / "par/table.md").read_text()
    again = table_mod.regular_table(tmp_path / "par", "parity,even_pairs", "rnn", seeds=2, progress=False,
                                    workers=2, **TINY)
    assert (again["invocation"]["trained"], again["invocation"]["reused"]) == (0, 4)


def test_a_failing_worker_run_raises_its_error_and_keeps_finished_runs(tmp_path):
    with pytest.raises(UserError, match="valid length"):  # d2 has even lengths only
        table_mod.regular_table(tmp_path, "parity,d2", "rnn", seeds=1, progress=False, workers=2,
                                **{**TINY, "test_max": 60, "val_lengths": [13]})
    assert (tmp_path / "runs/parity/rnn/seed0/result.json").is_file()  # ran beside the failing d2 run
    assert not (tmp_path / "runs/d2/rnn/seed0/result.json").exists()
    with pytest.raises(UserError, match="workers"):
        table_mod.regular_table(tmp_path, "parity", "rnn", seeds=1, progress=False, workers=0, **TINY)
    r = CliRunner().invoke(app, ["table", "--out", str(tmp_path), "--tasks", "parity", "--models", "rnn",
                                 "--seeds", "1", "--steps", "2", "--workers", "0"])
    assert r.exit_code == 2 and "workers" in r.output


def test_longest_runs_start_first():
    assert job_cost("transformer", "deletang") > job_cost("transformer", "bhattacharya")
    assert job_cost("transformer", "bhattacharya") > job_cost("rnn", "deletang")

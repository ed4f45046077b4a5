"""The Ray engine (docs/scale-out.md) on a real two-node cluster on this machine, in a private network namespace:
a head node (127.0.0.1, 2 CPUs) and a worker node (127.0.0.2, 1 CPU) started with `ray start`, sweeps run with
`extrapolab sweep ... --engine ray --address HOST:PORT` (tests/ray_scenarios.py runs them once per session;
the ``ray_cluster_record`` fixture in conftest.py). The refusals it records are in tests/test_bad_input.py.

A sweep's runs spread over both nodes; a node killed mid-training (its raylet SIGKILLed) costs nothing but
time: the run is retried on the other node and resumes from its checkpoint, and every result equals the
uninterrupted sweep's bit for bit (CPU, one thread); a driver killed mid-sweep is continued by the same
command; a run of two processes (torchrun, gloo) is one task holding both CPUs.
"""
import json

import pytest

HEAD, WORKER = "127.0.0.1", "127.0.0.2"


def _scenario(rec: dict, name: str) -> dict:
    r = rec[name]
    assert "error" not in r, r["error"]
    assert r.get("rc", 0) == 0, r.get("stderr")
    return r


def _clean(r: dict) -> None:
    """Every run done once, nothing half-written, no lock left behind."""
    assert all(run["status"] == "done" for run in r["runs"].values()) and r["report"]
    keys = [tuple(row[:4]) for row in r["results"]]
    assert len(keys) == len(set(keys)) and r["results"]  # no duplicate row
    assert not r["lock_files"] and not r["temp_files"], (r["lock_files"], r["temp_files"])


def test_a_sweep_runs_across_both_nodes(ray_cluster_record):
    r = _scenario(ray_cluster_record, "smoke")
    _clean(r)
    assert set(r["nodes"]) == {HEAD, WORKER}
    on = {run["node"].split("/")[0] for run in r["runs"].values()}
    assert on == {HEAD, WORKER}, r["runs"]  # each run records its node; both nodes ran runs
    assert all(run["attempts"] == [run["node"]] and run["resumed_from"] is None for run in r["runs"].values())
    assert "Ray at 127.0.0.1:" in r["stderr"] and "2 nodes: 3 runs at once" in r["stderr"]


def test_ray_runs_equal_the_local_engine(ray_cluster_record, tmp_path):
    """The same sweep in this process (local engine, one worker) gives the same rows, bit for bit."""
    from pathlib import Path

    from ray_scenarios import RUNS, observe

    from extrapolab.sweep.sweep import run_sweep

    ray_rows = _scenario(ray_cluster_record, "smoke")["results"]
    cache = Path(ray_cluster_record["root"]) / "cache"
    run_sweep("demo-smoke", out=tmp_path / "local", overrides=[f"data.cache_dir={cache}", *RUNS], progress=False)
    assert observe(tmp_path / "local")["results"] == ray_rows


def test_a_node_killed_mid_training_is_survived_bit_exactly(ray_cluster_record):
    ref = _scenario(ray_cluster_record, "smoke")
    r = _scenario(ray_cluster_record, "worker_killed")
    victim = r["victim"]
    assert victim and victim != "ended" and r["raylet_pid"], "no run was caught mid-training on the worker node"
    run = r["runs"][victim]
    assert run["attempts"][0].startswith(WORKER) and run["attempts"][-1].startswith(HEAD), run
    assert run["node"] == run["attempts"][-1] and len(run["attempts"]) == 2
    assert run["resumed_from"] and run["resumed_from"] % 20 == 0, run  # from its last checkpoint, not step 0
    _clean(r)
    assert r["results"] == ref["results"]  # every scalar of every run, bit for bit
    assert r["metrics"] == ref["metrics"]  # every logged loss and lr: each step once, identical floats


def test_a_killed_driver_is_continued_by_the_same_command(ray_cluster_record):
    ref = _scenario(ray_cluster_record, "smoke")
    r = _scenario(ray_cluster_record, "driver_killed")
    assert r["killed_rc"] == -9 and r["done_before"], r
    for rid, updated in r["done_before"].items():  # finished runs kept, not redone
        assert r["runs"][rid]["updated"] == updated
    assert "already done" in r["stderr"]
    _clean(r)
    assert r["results"] == ref["results"]


def test_a_run_of_two_processes_is_one_placement(ray_cluster_record):
    r = _scenario(ray_cluster_record, "ddp")
    [run] = r["runs"].values()
    assert run["world_size"] == 2 and run["backend"] == "gloo", run  # torchrun inside one task, DDP on gloo
    assert run["node"].startswith(HEAD)  # the only node with the 2 CPUs the task holds
    assert "2 CPU each" in r["stderr"]
    _clean(r)


def test_regular_table_runs_as_ray_tasks_with_the_local_results(ray_cluster_record, tmp_path):
    """`regular table --engine ray` hands its runs to the same executor: the per-seed accuracies of the runs
    done in this process."""
    from ray_scenarios import REGULAR
    from typer.testing import CliRunner

    from extrapolab.cli.regular import app

    r = _scenario(ray_cluster_record, "regular")
    assert r["invocation"]["engine"] == "ray" and r["invocation"]["trained"] == 4
    assert REGULAR[-2:] == ["--workers", "2"]
    local = CliRunner().invoke(app, ["table", "--out", str(tmp_path), *REGULAR[:-2]])  # one process, in order
    assert local.exit_code == 0, local.output
    table = json.loads((tmp_path / "table.json").read_text())
    assert {t: v["rnn"]["per_seed"] for t, v in table["tasks"].items()} == r["per_seed"]


@pytest.mark.slow
def test_bench_sweep_times_the_three_engines(tmp_path):
    """`extrapolab bench --sweep` (about a minute): local 1 and 2 workers and a two-node Ray of this machine."""
    import os
    import subprocess
    import sys

    from conftest import _private_network

    pytest.importorskip("ray")
    prefix = _private_network()
    if prefix is None:
        pytest.skip("needs a private network namespace (unshare -n)")
    out = tmp_path / "bench.json"
    p = subprocess.run([*prefix, "bash", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, "-m",
                        "extrapolab.cli.main", "bench", "--sweep", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["slots"] for r in rows] == [1, 2, 2] and rows[0]["x_local_1"] == 1.0
    assert all(r["runs"] == 8 and r["runs_per_hour"] > 0 for r in rows)
    assert rows[0]["overhead_mean_s"] < 0.5 and all(r["overhead_max_s"] >= 0 for r in rows)  # in the driver: ~nothing

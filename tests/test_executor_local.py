"""The local engine of the one executor (docs/scale-out.md): which run gets which GPU (a pure function, checked
here with made-up device counts), workers that see only their GPU (spawned for real on the CPU: nothing touches
CUDA, so the ids need not exist), a failing run, the sweep's pool against the driver's own process, and the
Ray import that happens only when Ray is chosen. A GPU test packs two runs onto one GPU."""
import json
import os
import subprocess
import sys
import time

import pytest

from extrapolab.executor import EngineSpec, Job, LocalExecutor, local_executor, worker
from extrapolab.executor.devices import cuda_visible, device_slots, resolve_devices, runs_per_gpu
from extrapolab.io import UserError


@pytest.mark.parametrize("visible", [1, 2, 3, 8])
@pytest.mark.parametrize("per", [1, 2, 3])
def test_each_gpu_takes_at_most_runs_per_device_and_runs_spread_first(visible, per):
    for devices in ("auto", [visible - 1], list(range(0, visible, 2))):
        ids = resolve_devices(devices, visible)
        slots = device_slots(ids, per)
        assert len(slots) == len(ids) * per and runs_per_gpu(slots) == {d: per for d in ids}
        first = [s[0] for s in slots[:len(ids)]]
        assert sorted(first) == sorted(ids)  # the first len(ids) runs go to distinct GPUs
        for n_runs in range(1, len(slots) + 1):  # any number of runs at once: never more than `per` on a GPU
            assert max(runs_per_gpu(slots[:n_runs]).values()) <= per
            assert max(runs_per_gpu(slots[:n_runs]).values()) == -(-n_runs // len(ids))


def test_runs_of_several_processes_take_whole_gpus():
    assert device_slots([0, 1, 2, 3, 4], 1, procs_per_run=2) == [(0, 1), (2, 3)]  # GPU 4 stays idle
    with pytest.raises(UserError, match="needs 4 GPUs per run"):
        device_slots([0, 1], 1, procs_per_run=4)


def test_device_lists_are_checked_against_the_visible_count():
    with pytest.raises(UserError, match=r"names GPU 3 but only 2 CUDA device\(s\) are visible \(ids 0..1\)"):
        resolve_devices([0, 3], 2)
    with pytest.raises(UserError, match="no CUDA device is visible"):
        resolve_devices([0], 0)
    assert resolve_devices("auto", 0) == []
    assert cuda_visible((1,), "GPU-a,GPU-b,GPU-c") == "GPU-b" and cuda_visible((0, 2), "") == "0,2"
    with pytest.raises(UserError, match="runs_per_device=0"):
        EngineSpec.from_dict({"runs_per_device": 0})
    assert EngineSpec.from_dict({"devices": "0, 2,3"}).devices == [0, 2, 3]


def _where(seconds: float) -> dict:
    """A run that says what it sees."""
    time.sleep(seconds)  # runs overlap, so every worker of the pool takes part
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "node": worker.node(),
            "device": worker.device("auto")}


def test_each_worker_sees_only_its_gpus(monkeypatch):
    """Two (made-up) GPUs x two runs each, behind a parent CUDA_VISIBLE_DEVICES: every worker keeps one GPU for
    its life, sees only it, and at most two workers share a GPU; each run's start reaches the driver."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7")  # this process's GPU 0 and 2 are physical 5 and 7
    slots = device_slots(resolve_devices([0, 2], visible=3), 2)
    started, seen = [], []
    with LocalExecutor(slots) as ex:
        assert (ex.slots, ex.gpu, ex.in_process) == (4, True, False)
        ex.run([Job(f"r{i}", _where, (1.0,)) for i in range(8)], on_event=lambda j, ev: started.append(ev),
               on_result=lambda j, res: seen.append(res))
    assert len(seen) == 8 and {s["visible"] for s in seen} == {"5", "7"}
    by_pid = {}
    for s in seen:
        by_pid.setdefault(s["pid"], set()).add(s["visible"])
    assert all(len(v) == 1 for v in by_pid.values()) and len(by_pid) <= 4  # a worker keeps its GPU
    per_gpu = {g: sum(1 for v in by_pid.values() if g in v) for g in ("5", "7")}
    assert max(per_gpu.values()) <= 2
    assert {s["device"] for s in seen} == {"cuda"} and all(s["node"].endswith(("/gpu0", "/gpu2")) for s in seen)
    assert sorted(ev["key"] for ev in started if ev["phase"] == "start") == [f"r{i}" for i in range(8)]


def _fail_or_sleep(i: int) -> int:
    if i == 1:
        raise UserError("run 1 is bad input")
    time.sleep(1.5)
    return i


def test_a_failing_run_stops_handing_out_runs_and_is_raised():
    done = []
    with LocalExecutor([None, None]) as ex:
        with pytest.raises(UserError, match="run 1 is bad input"):
            ex.run([Job(f"r{i}", _fail_or_sleep, (i,)) for i in range(6)], on_result=lambda j, r: done.append(r))
    assert done == [0]  # the run going beside it finished and was passed on; none started after the failure


def test_cpu_runs_get_workers_and_gpu_lists_need_gpus():
    ex = local_executor(EngineSpec(workers=3), device="cpu")
    assert (ex.slots, ex.gpu, ex.in_process) == (3, False, False)
    assert local_executor(EngineSpec(), device="cpu").in_process
    import torch

    if not torch.cuda.is_available():  # on a GPU machine: tests/test_bad_input.py names a GPU beyond the count
        with pytest.raises(UserError, match=r"sweep.devices=\[1\] names GPUs but no CUDA device is visible"):
            local_executor(EngineSpec(devices=[1]), device="auto")


def test_importing_the_studies_does_not_import_ray():
    code = ("import sys, extrapolab.executor, extrapolab.sweep.sweep, extrapolab.regular.table, extrapolab.cli.main; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_sweep_pool_gives_the_rows_of_the_driver_alone(tmp_path):
    """Two spawned workers hand their rows to the driver, which records them: the same rows as runs in the driver."""
    from extrapolab.report.db import ResultsDB
    from extrapolab.sweep.sweep import run_sweep

    over = [f"data.cache_dir={tmp_path / 'cache'}", "sweep.seeds=[0]", "sweep.schemes=[none,alibi]", "train.threads=1",
            "sweep.cost_rounds=1"]
    rows = {}
    for workers in (1, 2):
        res = run_sweep("demo-smoke", out=tmp_path / f"w{workers}", overrides=[*over, f"sweep.workers={workers}"],
                        progress=False)
        assert res["slots"] == workers and res["overhead"]["runs"] == 2
        db = ResultsDB(tmp_path / f"w{workers}" / "results.sqlite")
        rows[workers] = sorted(db.conn.execute("SELECT * FROM results").fetchall())
        assert {r["summary"]["node"] for r in db.runs()} == {worker.host()}
        db.close()
    assert rows[1] == rows[2] and rows[1]


@pytest.mark.gpu
def test_two_runs_packed_onto_one_gpu(tmp_path):
    """runs_per_device=2 on GPU 0: both runs train at once on it, each in its own worker that sees only it."""
    from extrapolab.report.db import ResultsDB
    from extrapolab.sweep.sweep import run_sweep

    over = [f"data.cache_dir={tmp_path / 'cache'}", "sweep.seeds=[0]", "sweep.schemes=[none,alibi]",
            "sweep.devices=[0]", "sweep.runs_per_device=2", "train.device=cuda", "sweep.cost_rounds=1"]
    res = run_sweep("demo-smoke", out=tmp_path / "packed", overrides=over, progress=False)
    assert res["slots"] == 2
    db = ResultsDB(tmp_path / "packed" / "results.sqlite")
    runs = db.runs()
    db.close()
    assert len(runs) == 2 and all(r["summary"]["device"].startswith("cuda") for r in runs)
    assert {r["summary"]["node"] for r in runs} == {worker.host() + "/gpu0"}
    pids = {json.loads((tmp_path / "packed" / "runs" / r["run_id"] / "placement.json").read_text())["attempts"][0]["pid"]
            for r in runs}
    assert len(pids) == 2  # two workers, both on GPU 0

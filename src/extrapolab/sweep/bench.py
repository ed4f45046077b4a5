"""`extrapolab bench --sweep`: what the executor costs, as runs per hour of one smoke sweep (demo-smoke's shape,
8 runs: 4 schemes x 2 seeds, one torch thread each) on the local engine with 1 and with 2 workers and on a
two-node Ray cluster, all measured in one invocation, as ratios to the local engine with 1 worker.

Each sweep starts from an empty folder (the corpus is tokenized once, before any is timed) and is timed
from its first run handed out to its last recorded (``runs_wall_s``: no tokenizing, cost pass or report).
The overhead per run is the executor's own: the seconds between handing a run out and getting its rows
back, minus the run's own time inside its worker (spawning or scheduling, worker start-up and imports,
transfers). Without ``address`` the Ray cluster is two nodes of one CPU each started on this machine
(``ray.cluster_utils``; run the bench inside ``unshare -n`` to keep its traffic on loopback).
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

from .sweep import run_sweep

RUNS = ["sweep.schemes=[none,alibi,sinusoidal,rotary]", "sweep.seeds=[0,1]", "sweep.reference=alibi",
        "train.threads=1", "sweep.cost_rounds=1"]


def bench_sweep(address: str | None = None, cache_dir: str | None = None, say=lambda m: None) -> dict:
    """Three sweeps of 8 runs: local 1 worker, local 2 workers, Ray (``address``, or two local nodes)."""
    from ..data import prepare
    from ..sweep.spec import load_sweep

    rows = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="extrapolab-sweep-bench-") as tmp:
        over = [*RUNS, f"data.cache_dir={cache_dir or Path(tmp) / 'cache'}"]
        prepare(load_sweep("demo-smoke", over)[0].data, progress=False)  # tokenized before anything is timed
        cluster = None if address else _two_nodes()
        try:
            for label, extra in (("local, 1 worker", ["sweep.workers=1"]), ("local, 2 workers", ["sweep.workers=2"]),
                                 ("ray, " + (address or "2 nodes x 1 CPU, this machine"),
                                  ["sweep.engine=ray", f"sweep.address={address or cluster.address}"])):
                say(f"bench --sweep: {label} ...")
                res = run_sweep("demo-smoke", out=Path(tmp) / f"s{len(rows)}", overrides=[*over, *extra], progress=False)
                o = res["overhead"]
                rows.append({"engine": label, "runs": o["runs"], "slots": res["slots"], "runs_wall_s": res["runs_wall_s"],
                             "runs_per_hour": o["runs"] * 3600 / res["runs_wall_s"], "run_s": o["task_s"] / o["runs"],
                             "overhead_mean_s": o["mean_s"], "overhead_max_s": o["max_s"]})
                load.append(os.getloadavg())
        finally:
            if cluster is not None:
                import ray

                ray.shutdown()
                cluster.shutdown()
    base = rows[0]["runs_per_hour"]
    for r in rows:
        r["x_local_1"] = r["runs_per_hour"] / base
    return {"rows": rows, "meta": {"host": socket.gethostname(), "cpus": os.cpu_count(), "loadavg": load,
                                   "runs": "demo-smoke shape, 4 schemes x 2 seeds, 8 steps each, 1 torch thread",
                                   "time": time.strftime("%Y-%m-%d %H:%M:%S")}}


def _two_nodes():
    """A head and a worker node of one CPU each on this machine, this process their driver."""
    from ..executor.cluster import import_ray, private_auth

    private_auth()  # before Ray is imported
    ray = import_ray()
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    return c


def format_sweep_bench(res: dict) -> str:
    m = res["meta"]
    lines = [f"sweep bench ({m['runs']}) on {m['host']}, {m['cpus']} CPUs, load average "
             + " -> ".join(f"{la[0]:.1f}" for la in m["loadavg"]),
             "| engine | runs at once | runs wall s | runs/hour | × local 1 worker | run s (own) | "
             "executor overhead per run s (mean / max) |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['engine']} | {r['slots']} | {r['runs_wall_s']:.1f} | {r['runs_per_hour']:.0f} | "
                     f"{r['x_local_1']:.2f} | {r['run_s']:.2f} | {r['overhead_mean_s']:.2f} / {r['overhead_max_s']:.2f} |")
    return "\n".join(lines)

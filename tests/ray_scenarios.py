"""The Ray engine on a real two-node cluster on this machine, for tests/test_executor_ray.py (not a test module).

Run inside a private network namespace that has only loopback (the test launches it under ``unshare -n``), so
every node, the drivers and all their traffic stay on 127.0.0.0/8: the head node at 127.0.0.1 (2 CPUs), a
worker node at 127.0.0.2 (1 CPU) started in its own mount namespace where ROOT/ro is read-only (a node that
cannot write a folder the driver can). Nodes and drivers are the documented commands: ``ray start --head``,
``ray start --address``, ``extrapolab sweep ... --engine ray --address HOST:PORT``. Every scenario records what
it saw in OUT_JSON; the tests assert on it. ``python tests/ray_scenarios.py ROOT OUT_JSON``
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import traceback
from pathlib import Path

PY = sys.executable
RAY = str(Path(sys.executable).parent / "ray")
#: demo-smoke's shape, 4 runs (2 schemes x 2 seeds) of 200 tiny steps: long enough to be killed mid-training,
#: with a checkpoint every 20 steps; one cost round (the bench pass is not what is tested here)
RUNS = ["sweep.schemes=[none,alibi]", "sweep.seeds=[0,1]", "train.threads=1", "sweep.cost_rounds=1",
        "train.steps=200", "train.checkpoint_every=20", "train.log_every=20", "train.eval_every=200"]

#: `regular table`: 2 tasks x 1 column x 2 seeds of 3 steps
REGULAR = ["--tasks", "parity,even_pairs", "--models", "rnn", "--seeds", "2", "--steps", "3", "--test-samples", "4",
           "--run-opt", "rnn:train_max=6", "--run-opt", "rnn:test_max=44", "--run-opt", "rnn:val_samples=4",
           "--run-opt", "rnn:eval_every=1", "--workers", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout: float, what: str, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root, self.port, self.procs = root, _free_port(), []
        self.address = f"127.0.0.1:{self.port}"
        self.ro = root / "ro"
        self.ro.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self.head = self._start([RAY, "start", "--head", f"--port={self.port}", "--num-cpus=2", "--include-dashboard=false",
                                 "--disable-usage-stats", "--node-ip-address=127.0.0.1", "--block"], "head")
        _wait(lambda: self._answers(), 60, "the head node")
        mount = f"mount --bind {self.ro} {self.ro} && mount -o remount,bind,ro {self.ro} && exec "
        self.worker = self._start(["unshare", "-m", "sh", "-c", mount + " ".join(
            [RAY, "start", f"--address={self.address}", "--num-cpus=1", "--disable-usage-stats",
             "--node-ip-address=127.0.0.2", "--block"])], "worker")
        self.nodes = _wait(lambda: self._nodes(2), 90, "two alive nodes", every=1.0)

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def _answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def _nodes(self, n: int):
        out = subprocess.run([PY, "-c", "import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                              "print(json.dumps([[x['NodeManagerAddress'], x['NodeID']] for x in ray.nodes() "
                              "if x['Alive']]))" % self.address], capture_output=True, text=True, timeout=60)
        try:
            alive = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None
        return dict(alive) if len(alive) >= n else None

    def kill_worker_raylet(self) -> int:
        import psutil

        raylet = next(c for c in psutil.Process(self.worker.pid).children(recursive=True) if c.name() == "raylet")
        raylet.send_signal(signal.SIGKILL)
        return raylet.pid

    def stop(self) -> None:
        """End the nodes this script started, by their process groups (never `ray stop`: that ends every Ray
        process of the machine); `ray start --block` takes its node down when it is told to stop."""
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        forget_cluster(self.address)


def forget_cluster(address: str) -> None:
    """`ray start --head` records its address for `ray.init("auto")` on this machine; a head that was killed
    cannot remove it, and a later `ray.init` would wait on it: remove it if it is still ours."""
    try:
        from ray._common.utils import get_ray_address_file

        rec = Path(get_ray_address_file(None))
    except ImportError:  # another Ray: its default place
        rec = Path("/tmp/ray/ray_current_cluster")
    try:
        if rec.read_text().strip() == address:
            rec.unlink()
    except OSError:
        pass


def sweep_cmd(out: Path, over: list[str], engine: list[str]) -> list[str]:
    return [PY, "-m", "extrapolab.cli.main", "sweep", "demo-smoke", "--out", str(out), *engine,
            *[a for o in over for a in ("--set", o)]]


def sweep(out: Path, over: list[str], engine: list[str], timeout: float = 240) -> dict:
    t = time.monotonic()
    p = subprocess.run(sweep_cmd(out, over, engine), capture_output=True, text=True, timeout=timeout)
    return {"rc": p.returncode, "stderr": p.stderr[-4000:], "wall_s": time.monotonic() - t}


def db_rows(out: Path, sql: str) -> list:
    db = out / "results.sqlite"
    if not db.is_file():
        return []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return [list(r) for r in con.execute(sql).fetchall()]
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


def observe(out: Path) -> dict:
    """What a sweep folder holds: every run's status, node, attempts, resume step; the result rows."""
    runs = {}
    for rid, status, summary, updated in db_rows(out, "SELECT run_id, status, summary, updated FROM runs"):
        sm = json.loads(summary) if summary else {}
        place = out / "runs" / rid / "placement.json"
        runs[rid] = {"status": status, "node": sm.get("node"), "resumed_from": sm.get("resumed_from"),
                     "world_size": sm.get("world_size"), "backend": sm.get("backend"), "updated": updated,
                     "attempts": [a["node"] for a in json.loads(place.read_text())["attempts"]] if place.is_file() else []}
    files = [p for p in out.rglob("*") if p.is_file()]
    return {"runs": runs, "results": sorted(db_rows(out, "SELECT run_id, protocol, length, metric, value FROM results")),
            "temp_files": [str(p.relative_to(out)) for p in files if p.name.endswith(".tmp")],
            "lock_files": [str(p.relative_to(out)) for p in files if p.name.endswith(".lock")],
            "report": (out / "report.html").is_file()}


def metrics(out: Path) -> dict:
    """Each run's logged rows without their timings (identical floats when a resume is exact)."""
    drop = ("sec_per_step", "tokens_per_s")
    return {p.parent.name: [{k: v for k, v in json.loads(line).items() if k not in drop}
                            for line in p.read_text().splitlines() if line.strip()]
            for p in sorted((out / "runs").glob("*/metrics.jsonl"))}


def scenarios(c: Cluster, root: Path, rec: dict) -> None:
    cache = [f"data.cache_dir={root / 'cache'}"]
    ray = ["--engine", "ray", "--address", c.address]
    worker_ip = "127.0.0.2"

    def step(name, fn):
        t = time.monotonic()
        try:
            rec[name] = fn()
        except Exception:
            rec[name] = {"error": traceback.format_exc()[-3000:]}
        rec[name]["seconds"] = round(time.monotonic() - t, 1)

    def smoke():  # across both nodes, uninterrupted: the reference of the kills below
        out = root / "smoke"
        return {**sweep(out, [*cache, *RUNS], ray), **observe(out), "metrics": metrics(out), "nodes": c.nodes}

    def refusals():  # both at once: each is a driver that connects, checks and stops
        cases = {"unwritable out": (c.ro / "sweep", []), "gpu on a cluster without one": (root / "gpu", ["train.device=cuda"])}
        procs = {case: subprocess.Popen(sweep_cmd(out, [*cache, *RUNS, *over], ray), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True) for case, (out, over) in cases.items()}
        got = {}
        for case, p in procs.items():
            _, err = p.communicate(timeout=120)
            got[case] = {"rc": p.returncode, "stderr": err[-4000:], "out_exists": cases[case][0].exists()}
        return got

    def ddp():  # a run of two processes (torchrun, gloo) as one task holding 2 CPUs: only the head fits it
        out = root / "ddp"
        return {**sweep(out, [*cache, "sweep.schemes=[alibi]", "sweep.seeds=[0]", "train.threads=1",
                              "sweep.cost_rounds=1", "sweep.procs_per_run=2"], ray), **observe(out)}

    def regular():  # `regular table` through the same executor: 4 runs as tasks
        out = root / "regular"
        t = time.monotonic()
        p = subprocess.run([PY, "-m", "extrapolab.cli.main", "regular", "table", "--out", str(out), *REGULAR, *ray],
                           capture_output=True, text=True, timeout=240)
        table = json.loads((out / "table.json").read_text()) if (out / "table.json").is_file() else {}
        return {"rc": p.returncode, "stderr": p.stderr[-4000:], "wall_s": time.monotonic() - t,
                "invocation": table.get("invocation"),
                "per_seed": {t: v["rnn"]["per_seed"] for t, v in (table.get("tasks") or {}).items()}}

    def driver_killed():
        out = root / "driver-killed"
        p = subprocess.Popen(sweep_cmd(out, [*cache, *RUNS], ray), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
        _wait(lambda: db_rows(out, "SELECT run_id FROM runs WHERE status='done'") or p.poll() is not None, 240,
              "a finished run")
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        before = {r: u for r, u in db_rows(out, "SELECT run_id, updated FROM runs WHERE status='done'")}
        again = sweep(out, [*cache, *RUNS], ray)
        return {"killed_rc": p.returncode, "done_before": before, **again, **observe(out)}

    def worker_killed():
        out = root / "worker-killed"
        p = subprocess.Popen(sweep_cmd(out, [*cache, *RUNS], ray), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)

        def mid_training_on_worker():
            for run in sorted((out / "runs").glob("*")) if (out / "runs").is_dir() else []:
                try:
                    node = json.loads((run / "placement.json").read_text())["attempts"][-1]["node"]
                except (OSError, ValueError, KeyError, IndexError):
                    continue
                if node.startswith(worker_ip) and (run / "checkpoints" / "last").is_dir() \
                        and not (run / "summary.json").exists():
                    return run.name
            return None

        victim = _wait(lambda: mid_training_on_worker() or (p.poll() is not None and "ended"), 240,
                       "a run mid-training on the worker node", every=0.02)
        killed = c.kill_worker_raylet() if victim != "ended" else None
        _, err = p.communicate(timeout=300)
        return {"victim": victim, "raylet_pid": killed, "rc": p.returncode, "stderr": err[-4000:], **observe(out),
                "metrics": metrics(out)}

    for name, fn in (("smoke", smoke), ("refusals", refusals), ("ddp", ddp), ("regular", regular),
                     ("driver_killed", driver_killed), ("worker_killed", worker_killed)):
        step(name, fn)


def main(root: str, out_json: str) -> None:
    root_p, rec = Path(root), {"root": root}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    t = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped from outside: still stop the nodes (finally)
    cluster = Cluster(root_p)
    try:
        cluster.start()
        rec["cluster_s"] = round(time.monotonic() - t, 1)
        scenarios(cluster, root_p, rec)
    except Exception:
        rec["error"] = traceback.format_exc()[-3000:]
    finally:
        cluster.stop()  # the nodes started so far, whatever failed
        rec["total_s"] = round(time.monotonic() - t, 1)
        Path(out_json).write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The Ray engine: each run a Ray task holding its resources, anywhere on a cluster (docs/scale-out.md).

A run holds ``procs_per_run`` GPUs (GPU runs) or ``procs_per_run x threads`` CPUs, so Ray places it on a
node with room for it; when its worker or node dies, Ray runs it again (``max_retries``) wherever there
is room, and the run resumes from the last checkpoint in its run folder -- which is why the job's folder
must be on storage every node sees (checked from every node before anything is written). The runs hand
their rows back to the driver, which alone records them, and tell it their phases through a small actor
on the driver's node (``_Board``), which the live line shows with the node each run is on.

Ray is imported only here, only when the Ray engine is chosen; usage statistics are off and no
dashboard is started (``RAY_USAGE_STATS_ENABLED=0``, ``include_dashboard=False``).
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from ..io import UserError
from . import worker
from .core import Executor, Job

LOCK_WAIT_S = 60.0  # a retried run waits this long for its killed attempt's process to release the run folder


def import_ray():
    """Ray, or the one-line fix; usage statistics off before Ray starts or joins anything."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise UserError("--engine ray needs Ray, which is not installed: pip install -e '.[ray]' "
                        "(or make setup, which installs it)") from None
    return ray


def private_auth() -> None:
    """For a Ray this process starts itself: token authentication with a token of its own, in the environment
    its Ray processes inherit (so nothing is written to ~/.ray), unless the user chose (RAY_AUTH_MODE set).
    Call it before Ray is imported (Ray reads the mode once)."""
    if "RAY_AUTH_MODE" not in os.environ:
        import secrets

        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))


def check_reachable(address: str) -> None:
    """HOST:PORT must answer on TCP before Ray is asked (which would retry for a minute)."""
    if address in ("", "auto"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r} must be auto or HOST:PORT of the head node "
                        "(the port of `ray start --head --port=6379`)")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise UserError(f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}); start one there "
                        f"with `ray start --head --port={port}`, or fix --address") from None


class _Board:
    """The runs' phases on their way to the driver (an actor on the driver's node)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def put(self, ev: dict) -> None:
        self.events.append(ev)

    def take(self) -> list[dict]:
        out, self.events = self.events, []
        return out


def _task(key: str, fn, args: tuple, threads: int, gpus: int, board):
    """One run on a cluster node (a Ray task): where it is, its phases to the board, its result home."""
    import ray

    node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"

    def channel(ev: dict) -> None:
        try:
            board.put.remote(ev)  # fire and forget: a phase is for the live line, never worth a failed run
        except Exception:
            pass

    return worker.call(key, fn, args, channel, node=node, gpus=gpus, threads=threads, lock_wait_s=LOCK_WAIT_S)


def _probe(out: str, token: str) -> str | None:
    """On one node: read the driver's token file in ``out`` and write one back; None, or what failed."""
    import ray

    try:
        seen = (Path(out) / f".storage-probe-{token}").read_text()
    except OSError as e:
        return f"cannot read it ({e.strerror or type(e).__name__}: not the driver's folder there)"
    if seen != token:
        return "sees another folder at that path"
    nid = ray.get_runtime_context().get_node_id()
    try:
        (Path(out) / f".storage-probe-{token}-{nid}").write_text(nid)
    except OSError as e:
        return f"cannot write it ({e.strerror or type(e).__name__})"
    return None


class RayExecutor(Executor):
    kind = "ray"

    def __init__(self, spec, *, device: str = "auto", threads: int = 0, out: Path | None = None,
                 device_what: str = "train.device") -> None:
        super().__init__()
        if not spec.address:  # before Ray is imported: it reads its authentication mode once
            private_auth()
        self.ray = ray = import_ray()
        self.spec, self.address = spec, spec.address or "this machine"
        check_reachable(spec.address)
        self._own = not ray.is_initialized()
        if self._own:
            kw = {"logging_level": "ERROR", "log_to_driver": False}
            try:
                if spec.address:
                    ray.init(address=spec.address, **kw)
                else:  # "local": a new Ray of this machine, never a cluster `ray start` left recorded in /tmp/ray
                    ray.init(address="local", include_dashboard=False, **kw)
            except ConnectionError as e:
                raise UserError(f"cannot join a Ray cluster at {spec.address} ({str(e).splitlines()[0]}); start one "
                                "with `ray start --head --port=6379` (and `ray start --address=HEAD:6379` on the other "
                                "nodes), or fix --address") from None
        self._nodes_at = 0.0
        try:
            self._setup(device, threads, out, device_what)
        except BaseException:
            self.close(abort=True)
            raise

    def _setup(self, device: str, threads: int, out: Path | None, device_what: str) -> None:
        ray, procs = self.ray, self.spec.procs_per_run
        total = ray.cluster_resources()
        device = (device or "auto").strip()
        self.gpu = device.startswith("cuda") or (device == "auto" and total.get("GPU", 0) > 0)
        if self.gpu and not total.get("GPU", 0):
            fix = f"{device_what} cpu" if device_what.startswith("--") else f"--set {device_what}=cpu"
            raise UserError(f"{device_what}={device} asks for a GPU but the Ray cluster at {self.address} has none "
                            f"({len(self._alive())} node(s), {total.get('CPU', 0):g} CPUs); use {fix}, or start GPU "
                            "nodes (ray start --num-gpus=N)")
        self.threads = max(1, int(threads or 0))
        self.gpus_per_run = procs if self.gpu else 0
        self.cpus_per_run = self.threads * (1 if self.gpu else procs)
        if not self._fits():
            raise UserError(f"a run needs {self.cpus_per_run} CPU(s) and {self.gpus_per_run} GPU(s) but no node of the "
                            f"Ray cluster at {self.address} has that much; lower train.threads or sweep.procs_per_run")
        if out is not None:
            check_storage(ray, Path(out), self._alive())
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._board = ray.remote(_Board).options(num_cpus=0, scheduling_strategy=here).remote()
        self._remote = ray.remote(_task)
        self.slots = self.capacity()

    # ---- cluster state ------------------------------------------------------------------------
    def _alive(self) -> list[dict]:
        if time.monotonic() - self._nodes_at > 2.0:
            self._nodes = [n for n in self.ray.nodes() if n.get("Alive")]
            self._nodes_at = time.monotonic()
        return self._nodes

    def _per_node(self) -> list[int]:
        """How many runs each alive node fits at once."""
        out = []
        for n in self._alive():
            res = n.get("Resources") or {}
            fit = int(res.get("CPU", 0) // self.cpus_per_run)
            if self.gpus_per_run:
                fit = min(fit, int(res.get("GPU", 0) // self.gpus_per_run))
            out.append(fit)
        return out

    def _fits(self) -> bool:
        return any(self._per_node())

    def capacity(self) -> int:
        return max(1, sum(self._per_node()))

    def describe(self, runs: int) -> str:
        what = f"{self.gpus_per_run} GPU" if self.gpu else f"{self.cpus_per_run} CPU"
        return (f"Ray at {self.address}, {len(self._alive())} nodes: {runs} run{'s' if runs > 1 else ''} at once, "
                f"{what} each, retried up to {self.spec.max_retries}x")

    def run_threads(self, share: int) -> int:
        return self.threads  # a task holds its CPUs whatever else runs

    # ---- the loop's hooks ---------------------------------------------------------------------
    def _submit(self, job: Job):
        return self._remote.options(num_cpus=self.cpus_per_run, num_gpus=self.gpus_per_run, name=job.key,
                                    max_retries=self.spec.max_retries, retry_exceptions=False) \
            .remote(job.key, job.fn, job.args, job.threads or self.threads, self.gpus_per_run, self._board)

    def _wait(self, handles: list, timeout: float) -> list:
        ready, _ = self.ray.wait(handles, num_returns=len(handles), timeout=timeout)
        return ready

    def _result(self, handle, job: Job) -> tuple:
        ex = self.ray.exceptions
        try:
            return self.ray.get(handle)
        except ex.RayTaskError as e:  # the run's own error: raised as itself (a UserError stays one line)
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise RuntimeError(f"run {job.key} failed: {str(e).strip().splitlines()[-1]}") from None
        except ex.RayError as e:
            raise RuntimeError(f"run {job.key} was lost {self.spec.max_retries + 1} time(s) (its worker or node died: "
                               f"{str(e).strip().splitlines()[0]}); re-run the same command: it resumes from its last "
                               "checkpoint") from None

    def _events(self) -> list[dict]:
        try:
            return self.ray.get(self._board.take.remote(), timeout=10)
        except Exception:
            return []

    def _cancel(self, handles: list) -> None:
        for h in handles:
            try:
                self.ray.cancel(h, force=True)
            except Exception:
                pass

    def close(self, abort: bool = False) -> None:
        if getattr(self, "_board", None) is not None:
            try:
                self.ray.kill(self._board)
            except Exception:
                pass
            self._board = None
        if self._own and self.ray.is_initialized():
            self.ray.shutdown()
        self._own = False


def check_storage(ray, out: Path, nodes: list[dict]) -> None:
    """Every alive node reads a token the driver wrote in ``out`` and writes one back the driver reads;
    else one line naming the node, and ``out`` is left as it was (folders made for the check removed)."""
    made = [p for p in [out, *out.parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    (out / f".storage-probe-{token}").write_text(token)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    bad = []
    try:
        probe = ray.remote(_probe)
        refs = [(n, probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                 .remote(str(out), token)) for n in nodes]
        for n, ref in refs:
            try:
                why = ray.get(ref, timeout=120)
            except Exception as e:
                why = f"did not answer ({type(e).__name__})"
            back = out / f".storage-probe-{token}-{n['NodeID']}"
            if why is None and not (back.is_file() and back.read_text() == n["NodeID"]):
                why = "writes files the driver does not see there"
            if why:
                bad.append(f"node {n.get('NodeManagerAddress')}/{n['NodeID'][:8]} {why}")
    finally:
        for p in out.glob(f".storage-probe-{token}*"):
            p.unlink(missing_ok=True)
    if bad:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise UserError(f"--out {out} is not on storage every Ray node can use: {bad[0]}; put it on a file system "
                        "every node mounts at the same path (NFS, Lustre, ...)")

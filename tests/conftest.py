import os

import pytest
import torch

# Two xdist workers on a 2-core machine: one intra-op thread each keeps runs predictable.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Under xdist each worker compiles its own kernels: one inductor compile process per worker, not a pool of one
# per CPU in every worker (16 workers x 16 pool processes importing torch stalled every compile on a 16-core
# GPU machine; docs/results/gpu-h100-2026-11-26.md)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After a GPU test, hand its cached blocks back to the device: the GPU check runs several pytest workers on
    one GPU, and 16 workers' caching allocators holding ~6.7 GiB each ran it out of memory on an H100 (an OOM,
    and cuDNN / cuBLAS "internal errors" of the same cause: 20 of 27 failures; docs/results/gpu-h100-2026-11-27.md)."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _restore_scheme_registry():
    """Tests may register user callables; none leaks into the next test."""
    from extrapolab.positional import REGISTRY

    before = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (with the reason) where none is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `"gpu" in item.keywords`: that matches
            # any node named gpu, e.g. a checkout folder called gpu, and would skip the whole suite
            item.add_marker(skip)


def _private_network() -> list[str] | None:
    """How to start a process in a network namespace of its own (loopback only): as root, or through a user
    namespace; None where neither works (a container without the privilege)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


@pytest.fixture(scope="session")
def ray_cluster_record(tmp_path_factory):
    """tests/ray_scenarios.py (a two-node Ray cluster on this machine and the sweeps run on it) run once
    per test session, its record shared by the test modules and xdist workers that ask for it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import extrapolab
    from extrapolab.io import file_lock

    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]', or make setup)")
    prefix = _private_network()
    if prefix is None:
        pytest.skip("the Ray cluster tests need a private network namespace (unshare -n as root, or unshare -rn)")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one folder per session
    root, record = shared / "ray-cluster", shared / "ray-cluster" / "record.json"
    with file_lock(shared / "ray-cluster.lock", wait=None):
        if not record.is_file():
            root.mkdir(exist_ok=True)
            src = str(Path(extrapolab.__file__).parents[1])
            import secrets

            # token authentication with a token of this session's own (Ray 2.60 turns it on by itself where
            # ~/.ray/auth_token exists, and then only for the head): every node and driver inherits it
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
                   "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
            script = Path(__file__).parent / "ray_scenarios.py"
            proc = subprocess.Popen([*prefix, "bash", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
                                     str(script), str(root), str(record)], env=env)
            try:
                proc.wait(timeout=900)
            except subprocess.TimeoutExpired:  # SIGTERM: the script stops the Ray nodes it started, then exits
                proc.terminate()
                proc.wait(timeout=120)
                raise
    rec = json.loads(record.read_text())
    assert "error" not in rec, rec["error"]
    return rec

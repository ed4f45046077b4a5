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

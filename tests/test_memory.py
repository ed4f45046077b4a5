"""extrapolab.memory.PeakMemory: the one peak-memory sampler (trainer, analyses, bench)."""
import threading

import torch

from extrapolab.memory import PeakMemory, reset_hwm


def test_peak_sees_torch_allocations_without_a_sampler_thread():
    threads = threading.active_count()
    with PeakMemory() as mem:
        assert threading.active_count() == threads or not reset_hwm()  # kernel peak: no thread runs
        x = torch.ones(40 * 2**20)  # 160 MiB, touched
        x.add_(1)
        del x
    assert 120 < mem.mib < 400 and mem.abs_mib >= mem.mib
    assert "peak RSS" in mem.method


def test_peak_is_the_blocks_own_and_blocks_nest():
    with PeakMemory() as outer:
        x = torch.ones(30 * 2**20)  # 120 MiB peak inside the outer block only
        x.add_(1)
        del x
        with PeakMemory() as inner:  # resets the kernel peak; the outer block keeps its own
            y = torch.ones(2**20)
            y.add_(1)
    assert inner.mib < 60, inner.mib  # the earlier 120 MiB peak is not this block's
    assert outer.mib > 90, outer.mib


def test_sampling_fallback_when_the_kernel_peak_cannot_be_reset(monkeypatch):
    import extrapolab.memory as M

    monkeypatch.setattr(M, "reset_hwm", lambda: False)
    with PeakMemory(interval=0.001) as mem:
        x = torch.ones(30 * 2**20)
        x.add_(1)
        del x
    assert "sampled" in mem.method and 60 < mem.mib < 400  # not the process-lifetime peak


def test_a_runs_peak_is_its_own_in_a_reused_process(tmp_path):
    """A sweep worker trains run after run in one process: an earlier peak must not show as this run's."""
    import resource

    from test_train import markov_data, tiny_cfg

    from extrapolab.train import train

    x = torch.ones(150 * 2**20)  # a 600 MiB peak before the run, as an earlier run would leave it
    x.add_(1)
    del x
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    s = train(tiny_cfg("train.steps=3", "train.eval_every=3", "train.checkpoint_every=3"), tmp_path / "run",
              data=markov_data(), progress=False)
    assert s["peak_memory_kind"] == "cpu_max_rss" and 10 < s["peak_memory_mb"] < process_peak - 400

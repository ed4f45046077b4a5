"""E8 benchmark (extrapolab.perf.bench): structure, same-run NoPE ratios, memory sampling, errors."""
import json

import pytest
import torch

from extrapolab.perf.bench import PeakRSS, _round_robin, format_table, run_bench
from extrapolab.io import UserError
from extrapolab.model.gpt import ModelConfig

TINY = ModelConfig(vocab_size=64, layers=2, heads=2, dim=16)


def test_tiny_bench_writes_json_with_nope_ratios(tmp_path):
    out = tmp_path / "bench.json"
    res = run_bench(["alibi", "kerple-log", "learned"], lengths_train=(16,), long_lengths=(200,),
                    model_cfg=TINY, repeats=2, warmup=0, gen_window=4, out_json=out, batch_tokens=32,
                    gen_reps=2, progress=False)
    assert json.loads(out.read_text())["meta"]["baseline"].startswith("none")
    rows = res["train"]["16"]
    assert list(rows) == ["none", "alibi", "kerple-log", "learned"]  # NoPE is always measured first
    assert rows["none"]["step_ms_ratio"] == 1.0 and rows["none"]["fwd_ms_ratio"] == 1.0
    for r in rows.values():
        assert r["step_ms"] > 0 and r["batch"] == 2
        assert r["train_tokens_per_s"] == pytest.approx(32 / (r["step_ms"] / 1e3))
        assert r["step_ms_ratio"] == pytest.approx(r["step_ms"] / rows["none"]["step_ms"])
        assert r["step_cpu_ms_ratio"] == pytest.approx(r["step_cpu_ms"] / rows["none"]["step_cpu_ms"])
    long = res["long"]["200"]
    assert "skipped" in long["learned"] and "learned APE" in long["learned"]["skipped"]  # L_tr = 34 rows
    assert long["alibi"]["fwd_s_ratio"] == pytest.approx(long["alibi"]["fwd_s"] / long["none"]["fwd_s"])
    gen = res["generation"]
    assert gen["positions"] == [4, 8, 16, 32] and len(gen["alibi"]["cached_ms"]) == 4
    assert gen["alibi"]["speedup_at_end"] == pytest.approx(gen["alibi"]["reencode_ms"] / gen["alibi"]["cached_ms"][-1])
    table = format_table(res)
    assert "| kerple-log |" in table and "×NoPE" in table and "L = 200" in table


def test_unknown_scheme_and_bad_sizes_fail_in_one_line(tmp_path):
    with pytest.raises(UserError, match="extrapolab schemes"):
        run_bench(["alibbi"], model_cfg=TINY, out_json=tmp_path / "x.json")
    with pytest.raises(UserError, match="repeats"):
        run_bench(["alibi"], model_cfg=TINY, repeats=0)
    assert not (tmp_path / "x.json").exists()


def test_peak_rss_sees_torch_allocations():
    with PeakRSS() as mem:
        x = torch.ones(40 * 2**20 // 4 * 4)  # 160 MiB, touched
        x.add_(1)
        del x
    assert 120 < mem.mib < 400


def test_round_robin_takes_medians():
    calls = []
    res = _round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b", "b", "a", "a", "b"] and set(res) == {"a", "b"}
    assert all(len(v) == 2 and v[0] >= 0 and v[1] >= 0 for v in res.values())  # (wall, cpu) medians

"""RegularGPT-LM benchmark (extrapolab.perf.regular_lm): rows, same-run ratios, depth, errors."""
import statistics

import pytest

from extrapolab.io import UserError
from extrapolab.perf.regular_lm import bench_regular_lm, format_regular_lm


def test_tiny_bench_rows_and_ratios():
    res = bench_regular_lm((8, 17), C=2, K=2, dim=16, heads=2, vocab=32, batch_tokens=64, repeats=2, warmup=0)
    r8, r17 = res["rows"]["8"], res["rows"]["17"]
    assert (r8["levels"], r8["layers"]) == (3, 6) and (r17["levels"], r17["layers"]) == (5, 10)
    assert r8["batch"] == 8 and r17["batch"] == 3
    for r in (r8, r17):
        for k in ("fwd", "step"):
            assert r[f"regular_{k}_ms"] > 0 and r[f"full_{k}_ms"] > 0
            per = [a / b for a, b in zip(r["rounds"][f"regular_{k}"], r["rounds"][f"full_{k}"])]
            ratio = r[f"{k}_ratio"]  # paired per round (perf/timing.py), not a ratio of two medians
            assert len(per) == 2 and ratio["median"] == pytest.approx(statistics.median(per))
            assert ratio["min"] == min(per) and ratio["max"] == max(per)
    assert res["meta"]["device"] == "cpu" and res["meta"]["repeats"] == 2
    table = format_regular_lm(res)
    assert "| 17 | 5 | 10 |" in table and "×full" in table
    assert f"{r17['step_ratio']['median']:.2f} ({r17['step_ratio']['min']:.2f}–" in table


def test_bad_sizes_one_line():
    with pytest.raises(UserError) as e:
        bench_regular_lm((8,), C=1)
    assert "\n" not in str(e.value)

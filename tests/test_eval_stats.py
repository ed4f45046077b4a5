"""E6 verdict (Qin def. 0.1) and E7 multi-seed statistics (Sandwich Table 3 conventions)."""
import csv
import io
import math

import numpy as np
import pytest
from scipy import stats as sps

from extrapolab.eval import format_table, mark, paired_ttest, summarize, summary, verdict
from extrapolab.io import UserError

# ---- E6 ----------------------------------------------------------------------------------


def test_verdict_by_hand():
    v = verdict({512: 20.0, 1024: 21.0, 2048: 21.9}, 512, delta=0.1)
    assert v["extrapolates"] is True
    assert v["worst_length"] == 2048 and v["worst_ratio"] == pytest.approx(0.095)
    assert v["per_length"] == {512: 0.0, 1024: pytest.approx(0.05), 2048: pytest.approx(0.095)}
    # strict inequality: a change of exactly delta fails (2.5 and 0.25 are exact in binary)
    assert verdict({"4": 2.5, "8": 2.5 * 1.25}, 4, delta=0.25)["extrapolates"] is False
    # the definition takes |.|: an improvement by more than delta also breaks it
    assert verdict({512: 20.0, 1024: 17.0}, 512)["extrapolates"] is False


def test_verdict_shorter_lengths_reported_but_not_decisive():
    v = verdict({128: 40.0, 512: 20.0, 1024: 20.5}, 512)
    assert v["extrapolates"] is True and v["checked"] == [1024] and v["per_length"][128] == 1.0


def test_verdict_missing_or_infinite_fails():
    assert verdict({16: 5.0, 32: None}, 16)["extrapolates"] is False
    v = verdict({16: 5.0, 32: 5.1, 64: math.inf}, 16)
    assert v["extrapolates"] is False and v["worst_length"] == 64 and math.isinf(v["worst_ratio"])


def test_verdict_bad_input():
    with pytest.raises(UserError, match="training length 512"):
        verdict({1024: 20.0}, 512)
    with pytest.raises(UserError, match="above the training length"):
        verdict({256: 30.0, 512: 20.0}, 512)
    with pytest.raises(UserError, match="delta"):
        verdict({512: 20.0, 1024: 20.0}, 512, delta=0)


# ---- E7 ----------------------------------------------------------------------------------
REF = [23.5, 19.7, 27.3, 20.1, 26.9]  # a Sandwich-like column over 5 seeds


def test_summary_mean_and_sample_std():
    s = summary(REF)
    assert s["n"] == 5 and s["mean"] == pytest.approx(np.mean(REF))
    assert s["std"] == pytest.approx(np.std(REF, ddof=1))
    assert summary([4.0]) == {"mean": 4.0, "std": None, "n": 1}
    assert summary({0: 1.0, 1: None, 2: 3.0})["n"] == 2
    nested = summarize({"alibi": {512: REF, 1024: [1.0, 2.0]}, "t5": REF})
    assert nested["alibi"][1024]["std"] == pytest.approx(math.sqrt(0.5)) and nested["t5"]["n"] == 5


def test_paired_ttest_matches_scipy():
    other = [r + d for r, d in zip(REF, [0.4, 0.9, 0.2, 0.7, 0.5])]
    res = paired_ttest(other, REF)
    ref = sps.ttest_rel(other, REF)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    assert res["n"] == 5 and res["mean_diff"] == pytest.approx(0.54)
    # pairing by seed key ignores order and unmatched seeds
    a = {s: v for s, v in zip("abcde", other)}
    b = {s: v for s, v in reversed(list(zip("abcdef", REF + [99.0])))}
    assert paired_ttest(a, b)["p"] == pytest.approx(ref.pvalue)


def test_marks_follow_the_table3_caption():
    worse = [r + d for r, d in zip(REF, [0.4, 0.9, 0.2, 0.7, 0.5])]  # higher ppl than reference
    better = [r - d for r, d in zip(REF, [0.4, 0.9, 0.2, 0.7, 0.5])]
    noisy = [r + d for r, d in zip(REF, [0.5, -0.6, 0.3, -0.2, 0.1])]
    assert sps.ttest_rel(worse, REF).pvalue < 0.05 and sps.ttest_rel(noisy, REF).pvalue > 0.05
    assert mark(REF, worse) == "†"  # reference (e.g. Sandwich) significantly better than x
    assert mark(REF, better) == "*"  # reference significantly worse than x
    assert mark(REF, noisy) == ""
    assert mark(REF, worse, lower_is_better=False) == "*"  # accuracy-like metrics flip
    assert mark(REF, worse, alpha=1e-6) == ""


@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")  # scipy on the constant case
def test_degenerate_cases():
    assert math.isnan(paired_ttest([1.0], [2.0])["p"]) and mark([1.0], [2.0]) == ""
    assert paired_ttest(REF, REF) == {"t": 0.0, "p": 1.0, "n": 5, "mean_diff": 0.0}
    assert mark(REF, REF) == ""
    shifted = [x + 1.0 for x in [1.0, 2.0, 3.0]]  # constant difference, zero variance
    assert paired_ttest(shifted, [1.0, 2.0, 3.0])["p"] == 0.0 and mark([1.0, 2.0, 3.0], shifted) == "†"
    assert sps.ttest_rel(shifted, [1.0, 2.0, 3.0]).pvalue == 0.0  # the same as scipy
    assert mark([1.0, math.inf, math.nan], [2.0, 3.0, 4.0]) == ""  # one finite pair left: no test
    with pytest.raises(UserError, match="one value per seed"):
        paired_ttest([1.0, 2.0], [1.0, 2.0, 3.0])


def test_format_table_like_sandwich_table3():
    rng = np.random.RandomState(0)
    base = rng.uniform(20, 27, 5)
    results = {
        "sandwich": {512: list(base), 1024: list(base + 0.1)},
        "alibi": {512: list(base + rng.uniform(0.3, 0.6, 5)), 1024: list(base + rng.normal(0, 0.5, 5))},
        "sinusoidal": {512: list(base * 1.1), 1024: [14168.0, 15001.0, 13020.0, 14999.0, 16000.0]},
        "t5": {512: list(base - rng.uniform(0.3, 0.6, 5)), 1024: [None] * 5},
    }
    md, text = format_table(results, "sandwich", [512, 1024])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 8
    for row in rows:
        vals = results[row["scheme"]][int(row["length"])]
        if row["scheme"] == "sandwich" or vals[0] is None:
            assert row["p_value"] == "" and row["mark"] == ""
            continue
        ref = results["sandwich"][int(row["length"])]
        p = sps.ttest_rel(vals, ref).pvalue
        assert float(row["p_value"]) == pytest.approx(p)
        want = "" if p >= 0.05 else ("†" if np.mean(vals) > np.mean(ref) else "*")
        assert row["mark"] == want
        assert float(row["ppl_mean"]) == pytest.approx(np.mean(vals))
    lines = md.splitlines()
    assert lines[0] == "| L_ex | sandwich | alibi | sinusoidal | t5 |"
    m512 = np.mean(results["alibi"][512]), np.std(results["alibi"][512], ddof=1)
    assert f"{m512[0]:.1f} ± {m512[1]:.1f}†" in lines[2]  # 3 significant digits, mark appended
    assert "14638 ± 1113†" in lines[3] and lines[3].endswith("| — |")  # missing values show a dash
    assert "significantly better than x" in md


def test_format_table_unknown_reference():
    with pytest.raises(UserError, match="reference scheme"):
        format_table({"alibi": {512: [1.0]}}, "sandwich", [512])


def test_one_seed_table_says_no_test_was_run_instead_of_the_legend():
    results = {"sandwich": {512: [20.0], 1024: [21.0]}, "alibi": {512: [25.0], 1024: [30.0]}}
    md, text = format_table(results, "sandwich", [512, 1024])
    last = md.strip().splitlines()[-1]
    assert last.startswith("No t-test was run (one seed per scheme")
    assert "significantly" not in md and "†" not in md.replace("no cell is marked † or *", "")
    assert all(row["p_value"] == "" and row["mark"] == "" for row in csv.DictReader(io.StringIO(text)))
    assert "| 30.0 |" in md  # single values, no "± std"
    # two seeds, but the other scheme has a value for only one of them: still no test anywhere
    md2, _ = format_table({"sandwich": {512: {0: 20.0, 1: 21.0}}, "alibi": {512: {0: 25.0}}}, "sandwich", [512])
    assert "No t-test was run (fewer than 2 seeds paired with sandwich" in md2
    md3, _ = format_table({"sandwich": {512: [20.0, 21.0]}}, "sandwich", [512])
    assert "No t-test was run (only sandwich" in md3
    # as soon as one cell is tested, the †/* key is printed
    md4, _ = format_table({"sandwich": {512: [20.0, 21.0]}, "alibi": {512: [25.0, 27.0]}}, "sandwich", [512])
    assert "significantly better than x" in md4


def test_paired_interval_is_scipys_paired_t_interval():
    from extrapolab.eval import paired_interval, t_interval

    rng = np.random.default_rng(3)
    a, b = rng.normal(2.0, 0.3, 7), rng.normal(1.9, 0.3, 7)
    ref = sps.ttest_rel(a, b).confidence_interval(0.95)  # scipy's own interval of the mean difference
    got = paired_interval(dict(enumerate(a)), dict(enumerate(b)))
    assert (got["lo"], got["hi"], got["n"]) == pytest.approx((ref.low, ref.high, 7), rel=1e-12)
    assert got["mean"] == pytest.approx(paired_ttest(a, b)["mean_diff"], rel=1e-12)
    one = sps.ttest_1samp(a, 0.0).confidence_interval(0.9)
    t = t_interval(a, alpha=0.1)
    assert (t["lo"], t["hi"]) == pytest.approx((one.low, one.high), rel=1e-12)
    assert paired_interval({1: 2.0, 2: 3.0, 9: 1.0}, {2: 2.5, 1: 1.0})["mean"] == pytest.approx(0.75)  # by key
    single = t_interval([1.5])
    assert single["n"] == 1 and single["lo"] == -math.inf and single["hi"] == math.inf  # one value: no interval
    flat = t_interval([2.0, 2.0, 2.0])
    assert flat["lo"] == flat["hi"] == 2.0

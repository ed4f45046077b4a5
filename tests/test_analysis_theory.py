"""A2: convergence of sum exp(bias) and the TRF n_the(eps) (Qin et al. 2024, Thm. 0.4, eq. 22)."""
import json
import math

import numpy as np
import pytest
import torch
from scipy.special import zeta
from typer.testing import CliRunner

from extrapolab import positional
from extrapolab.analysis import convergence, trf
from extrapolab.cli.analyze import app
from extrapolab.io import UserError

N = 2**16  # dense terms for the numeric test in these tests


def brute_trf(b: np.ndarray, eps: float, tail_after: float = 0.0) -> int:
    """Eq. 22 by brute force: smallest j with sum_{t>=j} b_t < eps · B."""
    tails = np.cumsum(b[::-1])[::-1] + tail_after
    return int(np.nonzero(tails < eps * tails[0])[0][0])


@pytest.mark.parametrize("heads", [8, 12])
@pytest.mark.parametrize("eps", [0.1, 0.01, 0.001])
def test_alibi_trf_is_the_geometric_closed_form(heads, eps):
    s = positional.build("alibi", num_heads=heads)
    rows = trf(s, eps, n=N)
    for r, slope in zip(rows, s.slopes.tolist()):
        closed = math.floor(math.log(1 / eps) / slope) + 1  # min{j : exp(-slope j) < eps}
        assert r["converges"] is True and r["trf"] == closed
        assert math.exp(-slope * r["trf"]) < eps <= math.exp(-slope * (r["trf"] - 1))
        assert r["trf"] == brute_trf(np.exp(-slope * np.arange(200000)), eps)
        assert r["B"] == pytest.approx(1 / (1 - math.exp(-slope)), rel=1e-12)


def test_type1_follows_the_p_series_tail():
    """Type1 b = 1/(k+1)^2: B = pi^2/6, tail = Hurwitz zeta(2, j+1) ~ 1/j, TRF = Theta(1/eps) (eq. 29)."""
    B = math.pi**2 / 6
    for eps in (0.1, 0.01, 0.001, 1e-4):
        j = trf("qin-type1", eps, num_heads=2, n=N)[0]["trf"]
        assert zeta(2, j + 1) < eps * B <= zeta(2, j)  # exact p-series tail brackets it
        assert j * eps * B == pytest.approx(1.0, rel=2.5 * eps + 0.01)  # 1/(eps B) asymptotics
    c = convergence("qin-type1", 0, n=N)
    assert c["converges"] is True and c["B"] == pytest.approx(B, rel=1e-12)
    assert c["numeric"]["converges"] is True  # the numeric test agrees
    assert c["numeric"]["octave_ratios"][-1] == pytest.approx(0.5, abs=1e-3)  # 2^(1-p), p = 2


def test_numeric_trf_matches_exact_for_a_user_callable():
    """The same series registered as a user b(k) callable goes through the numeric path only."""
    positional.register_callable("test-a2-type1", lambda k: 1.0 / (k + 1) ** 2, form="b", overwrite=True)
    num = trf("test-a2-type1", 0.01, num_heads=1, n=N)[0]
    exact = trf("qin-type1", 0.01, num_heads=1, n=N)[0]
    assert num["method"].startswith("numeric") and exact["method"].startswith("exact")
    assert num["trf"] == exact["trf"]
    assert num["B"] == pytest.approx(math.pi**2 / 6, rel=1e-6)


def test_user_p_series_tail_bound_covers_the_true_sum():
    positional.register_callable("test-a2-p15", lambda k: (k + 1.0) ** -1.5, form="b", overwrite=True)
    c = convergence("test-a2-p15", 0, num_heads=1, n=N)
    true_tail = zeta(1.5, N + 1)
    assert c["converges"] is True
    assert c["tail_bound"] == pytest.approx(true_tail, rel=0.02)  # geometric octave decay is exact for t^-p
    assert c["B"] == pytest.approx(zeta(1.5), rel=1e-5)


def test_user_geometric_callable():
    positional.register_callable("test-a2-geo", lambda k: -k * math.log(2.0), form="bias", overwrite=True)
    r = trf("test-a2-geo", 0.01, num_heads=1, n=N)[0]
    assert r["converges"] is True and r["trf"] == math.floor(math.log(100) / math.log(2)) + 1
    assert r["B"] == pytest.approx(2.0, rel=1e-12)


@pytest.mark.parametrize("name", ["qin-example1", "qin-example2"])
def test_counter_examples_diverge(name):
    for c in convergence(name, num_heads=2, n=N):
        assert c["converges"] is False and c["B"] == math.inf and "diverges" in c["method"]
    assert all(r["trf"] is None for r in trf(name, 0.01, num_heads=2, n=N))


def test_numeric_test_on_the_borderline_series():
    """Harmonic: octave sums constant -> diverges; Bertrand 1/(n ln n): undetermined, never 'converges'."""
    assert convergence("qin-example1", 0, n=N)["numeric"]["converges"] is False
    assert convergence("qin-example2", 0, n=N)["numeric"]["converges"] is None
    assert convergence("qin-type2", 0, n=N)["converges"] is True


def test_windowed_and_sliding_dilated_finite_support():
    r = trf("windowed", 0.01, num_heads=2, window=64, n=N)[0]
    assert r["B"] == 64 and r["trf"] == math.floor(64 * 0.99) + 1
    s = positional.build("sliding-dilated", num_heads=2, C=3)
    with torch.no_grad():
        s.r.copy_(torch.tensor([[0.0, 1.0, -1.0], [0.0, 0.0, 0.0]]))
    rows = trf(s, 0.2, layer=1, n=N)  # level 1: keys at distances 0, 3, 6
    w = np.exp([0.0, 1.0, -1.0])
    assert rows[0]["B"] == pytest.approx(w.sum())
    assert rows[0]["trf"] == 4  # tail(4) = e^-1 < 0.2 B <= tail(3) = e + e^-1
    assert rows[1]["trf"] == 7  # equal weights: need all three keys, last one at distance 6


def test_kerple_log_hurwitz_tail_and_verdict():
    s = positional.build("kerple-log", num_heads=2)
    with torch.no_grad():
        s.r1.copy_(torch.tensor([1.7, 0.8]))
        s.r2.copy_(torch.tensor([0.5, 0.5]))
    conv = convergence(s, n=N)
    assert conv[0]["converges"] is True and conv[1]["converges"] is False
    r = trf(s, 0.05, n=N)[0]
    b = (1 + 0.5 * np.arange(2_000_000, dtype=np.float64)) ** -1.7
    tail_after = 0.5**-1.7 * zeta(1.7, 2_000_000 + 2.0)
    assert r["trf"] == brute_trf(b, 0.05, tail_after)


def test_non_vanishing_biases_diverge():
    assert all(c["converges"] is False for c in convergence("t5", num_heads=2, n=N))
    assert all(c["converges"] is False for c in convergence("rotary", num_heads=2, n=N))
    sand = convergence("sandwich", num_heads=2, n=2**12)
    assert all(c["converges"] is False and "exp(-dbar/c_h)" in c["method"] for c in sand)
    smooth = positional.build("smoothed-sandwich", num_heads=8)
    for c, (a, _) in zip(convergence(smooth, n=N), smooth.fit_coefficients()):
        assert c["converges"] is (a < -1)


def test_bad_input():
    with pytest.raises(UserError):
        trf("alibi", 1.5)
    with pytest.raises(positional.SchemeError):
        trf("no-such-scheme", 0.01)


def test_cli_trf_json():
    res = CliRunner().invoke(app, ["trf", "alibi", "--eps", "0.01", "--json", "--heads", "4", "--n", str(N)])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    slopes = positional.build("alibi", num_heads=4).slopes.tolist()
    assert [r["trf"] for r in rows] == [math.floor(math.log(100) / s) + 1 for s in slopes]
    assert all(r["converges"] is True for r in rows)
    bad = CliRunner().invoke(app, ["trf", "alibi", "--eps", "2"])
    assert bad.exit_code == 2 and "eps" in bad.output


def test_cli_trf_user_callable_file(tmp_path):
    """User-callable spec string: a b(k) function in a file goes through the numeric test only."""
    f = tmp_path / "mybias.py"
    f.write_text("def b(k):\n    return 0.9 ** k\n")
    res = CliRunner().invoke(app, ["trf", f"b:{f}:b", "--eps", "0.01", "--heads", "1", "--n", str(N), "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)
    assert row["converges"] is True and row["method"].startswith("numeric")
    assert row["trf"] == math.floor(math.log(100) / -math.log(0.9)) + 1
    assert row["B"] == pytest.approx(10.0, rel=1e-9)


def test_barely_convergent_head_reports_a_lower_bound_not_an_error():
    """KERPLE-log with r1 just above 1 is a p-series with p ~ 1: convergent, TRF beyond 2^62."""
    s = positional.build("kerple-log", num_heads=2, r1=[1.001, 3.0], r2=1.0)
    slow, fast = trf(s, 0.01)
    assert slow["converges"] is True and slow["trf"] is None and slow["trf_lower_bound"] == 2**62
    assert fast["converges"] is True and fast["trf"] is not None and fast["trf"] < 100

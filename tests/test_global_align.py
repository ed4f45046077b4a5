"""The thesis' Algorithm 1 (one tau for every softmax per length) on a Hugging Face model in fused
forwards (align/onepass.py ``finds`` / ``align_global``, align/hf_causal.py ``align_onepass_hf``),
against the existing block-wise implementation (HFBlockTarget + SoftmaxStats, every row on the
reference path, one forward per grid tau): FINDS at every row equals the block-wise average; the
chosen taus for P_max and entropy at two lengths are the same; sampled rows are the average over
exactly those rows; bisection over the grid returns what the full grid search returns (and falls
back to it on a non-monotone pair); `align hf:PATH` writes the same temperature.json either way."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, TEXT, save_tiny  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from extrapolab.align.algorithm import align, collect_logit_stats, load_temperature  # noqa: E402
from extrapolab.align.hf_causal import align_onepass_hf  # noqa: E402
from extrapolab.align.onepass import align_global, finds, grid_search, sample_rows  # noqa: E402
from extrapolab.align.rules import GRID, pick_tau  # noqa: E402
from extrapolab.align.temperature import SoftmaxStats  # noqa: E402
from extrapolab.cli.main import app  # noqa: E402
from extrapolab.hf import ATTN, HFBlockTarget, open_hf  # noqa: E402
from extrapolab.io import UserError  # noqa: E402

L_TR = MAXPOS  # 48: the tiny models' pre-training length
LENGTHS = [64, 96]  # taus inside the grid for both modes on this model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """3 layers (FINDS propagates through two), sharpened attention so the grid taus separate."""
    return save_tiny("llama", tmp_path_factory.mktemp("global") / "llama", seed=5, sharpen=14.0, layers=3)


@pytest.fixture(scope="module")
def model(llama):
    return open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN)


def _tokens(model):
    return np.asarray(model.loaded.tokenizer(TEXT * 3)["input_ids"], dtype=np.int64)


def _segs(model, n, L, offset=0):
    ids = _tokens(model)
    return np.stack([ids[offset + i * L: offset + (i + 1) * L] for i in range(n)])  # [n, L]


@pytest.mark.parametrize("tau", [1.0, 0.75])
def test_finds_at_every_row_is_the_blockwise_average(model, tau):
    segs = _segs(model, 2, 2 * L_TR, offset=3)
    sink = SoftmaxStats(3, [], layer0=True)
    got = finds(model, segs, tau, rows=0, block=16, layer0=sink)
    ref = collect_logit_stats(HFBlockTarget(model, block_size=16), segs, [tau], layer0=True)
    assert got["softmaxes"] == ref["softmaxes"] == 3 * 2 * 4 * 2 * L_TR  # layers x batch x heads x rows
    assert got["pmax"] == pytest.approx(ref["pmax"][0], abs=2e-6)
    assert got["entropy"] == pytest.approx(ref["entropy"][0], abs=2e-5)
    assert np.allclose(got["per_layer_pmax"], ref["per_layer_pmax"][0], atol=2e-6)
    assert np.allclose(got["per_layer_entropy"], ref["per_layer_entropy"][0], atol=2e-5)
    l0, l0_ref = sink.summary()["layer0"], ref["layer0"]  # layer 0's logits do not depend on tau
    for k in ("sigma", "l_max", "length", "pmax"):
        assert l0[k] == pytest.approx(l0_ref[k], rel=1e-5), k
    assert l0["rows"] == l0_ref["rows"]


class _Picked:
    """SoftmaxStats of the query rows in ``idx`` only (the reference path hands a sink consecutive
    query blocks in row order, per layer)."""

    def __init__(self, layers, tau, idx):
        self.inner, self.next, self.idx = SoftmaxStats(layers, [tau]), [0] * layers, set(idx)

    def add(self, layer, lg, grid=None):
        start, b = self.next[layer], lg.shape[-2]
        keep = [j for j in range(b) if start + j in self.idx]
        self.next[layer] += b
        if keep:
            self.inner.add(layer, lg[..., keep, :], grid)


def test_sampled_rows_are_the_average_over_those_rows(model):
    """rows = 12: FINDS(0.8) is the mean over 12 evenly spaced query rows (every layer, head and
    sequence) of a forward at tau 0.8, by the block-wise path restricted to those rows."""
    L = 3 * L_TR
    segs = _segs(model, 2, L, offset=11)
    got = finds(model, segs, 0.8, rows=12, block=5)
    idx = sample_rows(L, 12).tolist()
    assert len(idx) == 12
    sink = _Picked(3, 0.8, idx)
    tgt = HFBlockTarget(model, block_size=16)
    with tgt.scope(0.8, sink):
        tgt.forward(torch.as_tensor(segs))
    ref = sink.inner.summary()
    assert got["softmaxes"] == ref["softmaxes"] == 3 * 2 * 4 * 12
    assert got["pmax"] == pytest.approx(ref["pmax"][0], abs=2e-6)
    assert got["entropy"] == pytest.approx(ref["entropy"][0], abs=2e-5)
    full = finds(model, segs, 0.8, rows=0)
    assert abs(got["pmax"] - full["pmax"]) > 1e-6  # a sample, not the whole average


def test_global_tau_equals_the_blockwise_algorithm_1(model):
    """Same windows, every row: the fused one-pass Algorithm 1 (bisection, and the full grid) picks
    the taus of the existing block-wise implementation for P_max and entropy at two lengths, with
    the same statistics and closed-form taus."""
    tokens = _tokens(model)
    ref = align(HFBlockTarget(model, block_size=16), tokens, L_TR, LENGTHS, n_segments=2, seed=2)
    fast = align_onepass_hf(model, tokens, L_TR, LENGTHS, n_segments=2, rows=0, block=16, seed=2)
    grid = align_onepass_hf(model, tokens, L_TR, LENGTHS, n_segments=2, rows=0, block=16, seed=2, search="grid")
    for m in ("pmax", "entropy"):
        assert fast["tau"][m] == ref["tau"][m] == grid["tau"][m], m
        assert fast["stats"]["train"][m] == pytest.approx(ref["stats"]["train"][m], abs=2e-5)
    taus = [fast["tau"][m][str(L)] for m in ("pmax", "entropy") for L in LENGTHS]
    assert all(0.5 < t < 1.0 for t in taus), taus  # inside the grid: the test would notice a wrong tau
    for L in map(str, LENGTHS):
        assert fast["forwards"][L] <= 6 < 11 == grid["forwards"][L]  # both modes share the forwards
        assert not fast["fallback"]["pmax"][L] and not fast["fallback"]["entropy"][L]
        for m in ("pmax", "entropy"):
            assert np.allclose(grid["stats"]["ex"][L][m], ref["stats"]["ex"][L][m], atol=2e-5)
            have = [(v, r) for v, r in zip(fast["stats"]["ex"][L][m], ref["stats"]["ex"][L][m]) if v is not None]
            assert len(have) == fast["forwards"][L] and np.allclose(*zip(*have), atol=2e-5)
        for rule in ("length", "prop51", "prop52"):
            assert fast["tau"][rule][L] == pytest.approx(ref["tau"][rule][L], rel=1e-5, nan_ok=True), rule
    assert set(fast) >= set(ref) and fast["method"] == "onepass"


@pytest.mark.parametrize("spec", [None, "rerope:6+logn"])
def test_bisection_returns_the_grid_search_tau(llama, spec):
    m = open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN, rope=spec)
    train = _segs(m, 1, L_TR)
    segs = {L: _segs(m, 1, L, offset=5) for L in (2 * L_TR, 4 * L_TR)}
    for mode in ("pmax", "entropy"):
        kw = dict(modes=[mode], rows=32, block=16)
        b, g = align_global(m, train, segs, **kw), align_global(m, train, segs, search="grid", **kw)
        assert b["tau"] == g["tau"], (mode, b["tau"], g["tau"])
        for L in map(str, segs):
            assert b["forwards"][L] <= 5 and g["forwards"][L] == 11
            vals = [r[mode] for r in g["finds"][L]]  # FINDS over the grid, 1.0 down to 0.5
            assert np.all(np.diff(vals) > 0) if mode == "pmax" else np.all(np.diff(vals) < 0)  # monotone


def test_grid_search_on_monotone_and_non_monotone_statistics():
    rng = np.random.default_rng(0)
    for _ in range(300):
        vals = np.sort(rng.random(len(GRID)))  # increasing along GRID (1.0 -> 0.5), as P_max
        falls = bool(rng.integers(2))
        if not falls:
            vals = vals[::-1]  # entropy: decreasing as tau falls
        target = float(rng.choice([rng.uniform(-0.2, 1.2), rng.choice(vals)]))
        calls = []
        tau, fell = grid_search(GRID, target, lambda i: calls.append(i) or vals[i], falls=falls)
        assert tau == pick_tau(target, list(GRID), list(vals)) and not fell
        assert len(calls) == len(set(calls)) <= 5
    vals = [0.9, 0.8, 0.85, 0.6, 0.5, 0.45, 0.4, 0.3, 0.25, 0.2, 0.1]  # P_max, one pair out of order
    tau, fell = grid_search(GRID, 0.82, lambda i: vals[i], falls=True)
    assert fell and tau == pick_tau(0.82, list(GRID), vals) == 0.95
    with pytest.raises(UserError, match="bisect"):
        grid_search(GRID, 0.5, lambda i: 0.0, falls=True, search="binary")


def test_align_hf_writes_the_same_temperature_json_either_way(llama, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"d{i}.txt").write_text(TEXT[i * 50:] + TEXT[:i * 50])
    sets = ["--set", f"data.corpus=path:{docs}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", "data.test_percent=50", "--set", "data.valid_percent=10"]
    res = {}
    for name, extra in (("onepass", ["--rows", "0"]), ("blockwise", ["--blockwise"])):
        out = tmp_path / name
        r = CliRunner().invoke(app, ["align", f"hf:{llama}", "--lengths", "96,144", "--segments", "1", "--out",
                                     str(out), "--device", "cpu", *extra, *sets])
        assert r.exit_code == 0, r.output
        res[name] = json.loads((out / "temperature.json").read_text())
        assert (out / "temperature.png").is_file() and "w/ P_max" in r.output
    one, blk = res["onepass"], res["blockwise"]
    assert set(one) - set(blk) == {"rows", "search", "forwards", "fallback"} and set(blk) - set(one) == set()
    assert one["method"] == "onepass" and blk["method"] == "blockwise"
    assert one["tau"]["pmax"] == blk["tau"]["pmax"] and one["tau"]["entropy"] == blk["tau"]["entropy"]
    for L in (96, 144):
        assert load_temperature(tmp_path / "onepass", L, "pmax") == blk["tau"]["pmax"][str(L)]
    r = CliRunner().invoke(app, ["align", f"hf:{llama}", "--lengths", "96", "--rows", "-1", "--out",
                                 str(tmp_path / "bad"), "--device", "cpu", *sets])
    assert r.exit_code == 2 and "--rows" in r.output

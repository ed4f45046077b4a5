"""Algorithm 1 in one forward (align/onepass.py) on a tiny random Llama (GQA): the same tau per layer
and the same statistics as the existing block-wise implementation (HFBlockTarget + SoftmaxStats)
run greedily, one forward per layer with the earlier layers' taus fixed (every grid tau evaluated,
and the bisection over the grid choosing the same taus); sampled rows against an explicit softmax
in float64; no tensor beyond one query block of logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import TEXT, save_tiny  # noqa: E402

from extrapolab.align.onepass import LayerAligner, align_layers, run_pass, sample_rows  # noqa: E402
from extrapolab.align.rules import GRID, pick_tau  # noqa: E402
from extrapolab.align.temperature import SoftmaxStats  # noqa: E402
from extrapolab.hf import ATTN, HFBlockTarget, open_hf  # noqa: E402
from extrapolab.io import UserError  # noqa: E402
from extrapolab.model.reference import logits as ref_logits  # noqa: E402

L_TR = 48


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """3 layers (propagation through two), sharpened attention so the grid taus separate."""
    return save_tiny("llama", tmp_path_factory.mktemp("onepass") / "llama", seed=3, sharpen=10.0, layers=3)


def _segments(model, n, L, offset=0):
    ids = np.asarray(model.loaded.tokenizer(TEXT * 8)["input_ids"], dtype=np.int64)
    return np.stack([ids[offset + i * L: offset + (i + 1) * L] for i in range(n)])  # [n, L]


def _greedy_reference(model, train, segs, taus, mode):
    """The existing implementation: per-layer statistics from the reference path's logits sink."""
    tgt = HFBlockTarget(model, block_size=16)
    R, key = tgt.num_layers, f"per_layer_{mode}"
    sink = SoftmaxStats(R, [1.0])
    with tgt.scope(1.0, sink):
        tgt.forward(torch.as_tensor(train))
    target = sink.summary()[key][0]  # [layer]
    chosen, stats = [], []
    for r in range(R):
        sink = SoftmaxStats(R, taus)
        with tgt.scope(chosen + [1.0] * (R - r), sink):
            tgt.forward(torch.as_tensor(segs))
        per = [row[r] for row in sink.summary()[key]]  # [tau]
        chosen.append(pick_tau(target[r], list(taus), per))
        stats.append(per)
    return target, chosen, stats


@pytest.mark.parametrize("spec,mode", [(None, "pmax"), (None, "entropy"), ("rerope:6+logn", "pmax")])
def test_one_forward_equals_the_blockwise_implementation_layer_by_layer(llama, spec, mode):
    model = open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN, rope=spec)
    train, segs = _segments(model, 2, L_TR), _segments(model, 2, 2 * L_TR, offset=7)
    res = align_layers(model, train, {2 * L_TR: segs}, mode=mode, rows=0, block=16, search="grid")
    target, chosen, stats = _greedy_reference(model, train, segs, GRID, mode)
    fast = align_layers(model, train, {2 * L_TR: segs}, mode=mode, rows=0, block=16)  # bisection over the grid
    assert fast["tau"] == res["tau"] and fast["search"] == "bisect"
    evaluated = [[v for v in row if v is not None] for row in fast["stats"][str(2 * L_TR)][f"per_layer_{mode}"]]
    assert all(2 <= len(row) <= 5 for row in evaluated), evaluated  # of 11
    key = f"per_layer_{mode}"
    assert np.allclose([r[0] for r in res["train"][key]], target, atol=2e-6)
    got = res["stats"][str(2 * L_TR)]
    assert np.allclose(got[key], stats, atol=2e-5), (got[key], stats)
    assert res["tau"][str(2 * L_TR)] == chosen
    assert got["rows_per_layer"] == [2 * 4 * 2 * L_TR] * 3  # batch x heads x every query row
    assert 0.5 < min(chosen) < 1.0 and len(set(chosen)) > 1  # inside the grid, per layer


def test_sampled_rows_are_the_mean_over_those_rows(llama):
    """rows = 10: the statistics are the mean P_max / entropy over 10 evenly spaced query rows, from
    q, k captured in the same forward and an explicit float64 softmax here."""
    model = open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN)
    seg = _segments(model, 1, 80)
    got, captured = LayerAligner(3, [1.0, 0.7], rows=10), {}  # no target: every tau is evaluated

    def spy(layer, q, k, q_pos, k_pos, scheme, window):
        captured[layer] = (q.clone(), k.clone(), q_pos, k_pos, scheme)
        return got(layer, q, k, q_pos, k_pos, scheme, window)

    run_pass(model, seg, spy)
    idx = sample_rows(80, 10)
    assert idx.tolist() == [0, 9, 18, 26, 35, 44, 53, 61, 70, 79]
    s = got.summary()
    for layer, (q, k, qp, kp, scheme) in captured.items():
        lg = ref_logits(q.double(), k.double(), qp, kp, scheme, layer)[:, :, idx]  # [1, H, 10, 80]
        for i, tau in enumerate([1.0, 0.7]):
            p = torch.softmax(lg / tau, -1)
            ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)
            assert s["per_layer_pmax"][layer][i] == pytest.approx(float(p.max(-1).values.mean()), abs=1e-6)
            assert s["per_layer_entropy"][layer][i] == pytest.approx(float(ent.mean()), abs=1e-5)
    assert s["rows_per_layer"] == [4 * 10] * 3 and s["tau"] == [1.0] * 3  # no target: record only


def test_the_chosen_taus_run_the_layers(llama):
    """The forward the aligner steers equals a forward at its chosen per-layer taus."""
    from extrapolab.hf import hf_temperature

    model = open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN)
    seg = torch.as_tensor(_segments(model, 1, 96))
    seen = []
    a = LayerAligner(3, GRID, target=[0.9, 0.95, 0.99])
    from extrapolab.hf.extend import CHOOSE_KWARG

    def logits_of(chooser=None):
        kw = {CHOOSE_KWARG: chooser} if chooser else {}
        with torch.no_grad():
            return model.hf(input_ids=seg, use_cache=False, **kw).logits

    steered = logits_of(lambda *args: seen.append(a(*args)) or seen[-1])
    assert seen == a.chosen and min(seen) < 1.0
    with hf_temperature(model, a.chosen):
        assert (logits_of() - steered).abs().max() < 1e-5


def test_needs_the_extrapolab_attention(llama):
    model = open_hf(f"hf:{llama}", device="cpu", dtype="fp32")
    with pytest.raises(UserError, match=ATTN):
        run_pass(model, np.zeros((1, 8), dtype=np.int64), LayerAligner(3, [1.0]))
    with pytest.raises(UserError, match="modes"):
        LayerAligner(3, [1.0], mode="max")


def test_long_input_reads_one_query_block_at_a_time(llama):
    from test_rope_extend_hf import Largest

    model = open_hf(f"hf:{llama}", device="cpu", dtype="fp32", attn=ATTN, rope="selfextend:4,16")
    L = 2048
    ids = torch.randint(0, 300, (1, L), generator=torch.Generator().manual_seed(0)).numpy()
    a = LayerAligner(3, GRID, target=[0.5, 0.5, 0.5], rows=256, block=64)
    with Largest() as big:
        run_pass(model, ids, a)
    assert big.numel <= 4 * 64 * L * 2, big.numel  # [H, 64, L] logits (+ int64 indices)
    assert a.summary()["rows_per_layer"] == [4 * 256] * 3

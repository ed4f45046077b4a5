"""E1-E4 against hand-computed cases on fake LMs whose perplexity is known exactly."""
import math

import numpy as np
import pytest
import torch

from extrapolab.eval import (last_token, last_token_ends, nonoverlapping, positionwise,
                             positionwise_with_reference, sliding, sliding_windows)
from fakes import Bigram, ContextProbe, OOMOnBatch
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig


def _stream(n, vocab=11, seed=1):
    return np.random.RandomState(seed).randint(0, vocab, n).astype(np.uint16)


# ---- E1 nonoverlapping -------------------------------------------------------------------
def test_nonoverlapping_bigram_matches_hand_computation():
    tok, model = _stream(103), Bigram()
    r = nonoverlapping(model, tok, 10, batch_size=3)
    nll = model.stream_nll(tok)[:100]  # 10 chunks x 10 predictions: targets 1..100
    assert r["tokens"] == 100
    assert r["nll"] == pytest.approx(nll.mean(), rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    r = nonoverlapping(model, tok, 10, max_tokens=35)  # first 3 chunks
    assert r["tokens"] == 30 and r["nll"] == pytest.approx(nll[:30].mean(), rel=1e-6)


def test_nonoverlapping_contexts_follow_the_L_plus_1_convention():
    L, n = 8, 4 * 8 + 3
    probe = ContextProbe(a=np.random.RandomState(0).randn(2000))
    r = nonoverlapping(probe, np.arange(n), L, batch_size=2)
    expected = [probe.nll(k * L + i + 1, i + 1) for k in range(4) for i in range(L)]
    assert r["tokens"] == 32
    assert r["nll"] == pytest.approx(np.mean(expected), rel=1e-6)
    starts = sorted(int(x[0]) for batch in probe.inputs for x in batch)
    assert starts == [0, 8, 16, 24]


# ---- E2 sliding --------------------------------------------------------------------------
@pytest.mark.parametrize("L,S,n", [(10, 3, 60), (10, 10, 41), (7, 1, 30), (12, 5, 12 + 1)])
def test_sliding_scores_every_token_exactly_once(L, S, n):
    tok, model = _stream(n), Bigram()
    starts, score_from = sliding_windows(n, L, S)
    targets = np.concatenate([s + 1 + np.arange(f, L) for s, f in zip(starts, score_from)])
    assert np.array_equal(np.sort(targets), np.arange(1, n))  # each of 1..n-1 exactly once
    r = sliding(model, tok, L, S, batch_size=4)
    assert r["tokens"] == n - 1
    assert r["nll"] == pytest.approx(model.stream_nll(tok).mean(), rel=1e-6)


def test_sliding_context_lengths_by_hand():
    probe = ContextProbe()  # a = 0: NLL depends only on the context length c
    h = lambda c: probe.nll(0, c)  # noqa: E731
    L, S, k, r_tail = 10, 4, 5, 3
    T = L + k * S + r_tail
    res = sliding(probe, np.arange(T + 1), L, S)
    expected = (sum(h(c) for c in range(1, L + 1)) + k * sum(h(c) for c in range(L - S + 1, L + 1))
                + sum(h(c) for c in range(L - r_tail + 1, L + 1)))
    assert res["tokens"] == T
    assert res["nll"] * res["tokens"] == pytest.approx(expected, rel=1e-6)
    one = sliding(probe, np.arange(T + 1), L, 1)  # stride 1: every later token sees L tokens
    assert one["nll"] * T == pytest.approx(sum(h(c) for c in range(1, L + 1)) + (T - L) * h(L), rel=1e-6)


def test_sliding_with_stride_L_is_nonoverlapping():
    g = GPT(ModelConfig(vocab_size=11, layers=2, heads=2, dim=16, scheme="alibi", train_length=8))
    tok = _stream(8 * 6 + 1)
    a, b = sliding(g, tok, 8, 8), nonoverlapping(g, tok, 8)
    assert a["tokens"] == b["tokens"] == 48
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)


def test_sliding_bad_stride_is_one_line_error():
    with pytest.raises(UserError, match="stride"):
        sliding(Bigram(), _stream(50), 8, 9)
    with pytest.raises(UserError, match="needs at least"):
        sliding(Bigram(), _stream(5), 8, 2)


# ---- E3 last token -----------------------------------------------------------------------
def test_last_token_scores_the_same_tokens_at_every_length():
    n, lengths = 500, [4, 16, 64]
    probe = ContextProbe(a=np.random.RandomState(3).randn(2000))
    ppl = last_token(probe, np.arange(n), lengths, n=20, batch_size=7)
    ends = last_token_ends(n, 64, 20)
    assert len(ends) == 20 and len(set(ends.tolist())) == 20 and ends.min() >= 63 and ends.max() == n - 1
    assert np.all(np.diff(ends) >= (n - 64) // 20)  # spread over the stream
    for L in lengths:  # the end token y is given exactly L-1 previous tokens
        expected = np.mean([probe.nll(int(y), L - 1) for y in ends])
        assert ppl[L] == pytest.approx(math.exp(expected), rel=1e-6)
    seen = {}
    for batch in probe.inputs:
        for row in batch:
            seen.setdefault(len(row) + 1, set()).add(int(row[-1]) + 1)  # the scored (end) token
    assert set(seen) == set(lengths) and all(seen[L] == set(ends.tolist()) for L in lengths)


def test_last_token_bigram_ppl_is_the_same_at_every_length():
    tok, model = _stream(400), Bigram()
    ppl = last_token(model, tok, [2, 9, 50], n=30)
    ends = last_token_ends(400, 50, 30)
    hand = math.exp(np.mean(-model.logp.detach().double().numpy()[tok[ends - 1], tok[ends]]))
    assert all(v == pytest.approx(hand, rel=1e-6) for v in ppl.values())


def test_last_token_errors():
    with pytest.raises(UserError, match="L_ex >= 2"):
        last_token(Bigram(), _stream(50), [1, 4])
    with pytest.raises(UserError, match="needs at least 64"):
        last_token(Bigram(), _stream(50), [64])


# ---- E4 position-wise --------------------------------------------------------------------
def test_positionwise_curve_and_windowed_reference_by_hand():
    probe, L, w = ContextProbe(), 12, 5
    r = positionwise_with_reference(probe, np.arange(200), L, w, n_segments=6)
    hand = np.array([probe.nll(0, i + 1) for i in range(L)])
    hand_w = np.array([probe.nll(0, min(i + 1, w)) for i in range(L)])
    assert r["segments"] == 6 and r["window"] == w
    np.testing.assert_allclose(r["nll"], hand, rtol=1e-6)
    np.testing.assert_allclose(r["windowed_nll"], hand_w, rtol=1e-6)
    np.testing.assert_allclose(r["ppl"], np.exp(hand), rtol=1e-5)


def test_positionwise_mean_equals_nonoverlapping_on_the_same_segments():
    g = GPT(ModelConfig(vocab_size=11, layers=2, heads=2, dim=16, scheme="kerple-log", train_length=8))
    L, k = 16, 5
    tok = _stream(L * k + 1)  # evenly spaced segments = the nonoverlapping chunks
    pw = positionwise(g, tok, L, n_segments=k)
    assert pw["nll"].mean() == pytest.approx(nonoverlapping(g, tok, L)["nll"], rel=1e-6)
    wide = positionwise(g, tok, L, n_segments=k, window=L)  # window >= L changes nothing
    np.testing.assert_allclose(wide["nll"], pw["nll"], rtol=1e-5)
    narrow = positionwise(g, tok, L, n_segments=k, window=4)
    np.testing.assert_allclose(narrow["nll"][:4], pw["nll"][:4], rtol=1e-5)  # same until k >= w
    assert not np.allclose(narrow["nll"][4:], pw["nll"][4:], rtol=1e-5)


# ---- memory fallback, input errors ---------------------------------------------------------
def test_oom_retries_with_batch_one_and_gives_the_same_result():
    tok = _stream(81)
    ref = nonoverlapping(Bigram(), tok, 8, batch_size=4)
    m = OOMOnBatch(max_rows=1)
    r = nonoverlapping(m, tok, 8, batch_size=4)
    assert r["nll"] == pytest.approx(ref["nll"], rel=1e-9) and r["tokens"] == ref["tokens"] == 80
    assert all(shape[0] == 1 for shape in m.calls[1:])  # after the first failure: one row at a time
    cpu = OOMOnBatch(max_rows=1, message="[enforce fail] DefaultCPUAllocator: can't allocate memory")
    assert sliding(cpu, tok, 8, 4, batch_size=4)["nll"] == pytest.approx(sliding(Bigram(), tok, 8, 4)["nll"])


def test_oom_even_at_batch_one_is_a_one_line_user_error():
    with pytest.raises(UserError, match="batch size 1") as e:
        nonoverlapping(OOMOnBatch(max_rows=0), _stream(81), 8)
    assert "\n" not in str(e.value)


def test_other_runtime_errors_are_not_swallowed():
    with pytest.raises(RuntimeError, match="shape mismatch"):
        nonoverlapping(OOMOnBatch(max_rows=0, message="shape mismatch"), _stream(81), 8)


def test_bad_token_streams():
    with pytest.raises(UserError, match="1-D"):
        nonoverlapping(Bigram(), np.zeros((3, 40), dtype=np.int64), 8)
    with pytest.raises(UserError, match="needs at least 9"):
        nonoverlapping(Bigram(), _stream(8), 8)
    with pytest.raises(UserError, match="positive integer"):
        nonoverlapping(Bigram(), _stream(80), 0)


def test_model_training_flag_is_restored_and_no_grad_kept():
    g = GPT(ModelConfig(vocab_size=11, layers=1, heads=2, dim=8, scheme="alibi", train_length=8, dropout=0.1))
    g.train()
    tok = _stream(33)
    a, b = nonoverlapping(g, tok, 8), nonoverlapping(g, tok, 8)
    assert g.training and a["nll"] == b["nll"]  # dropout was off during evaluation
    assert torch.is_grad_enabled()

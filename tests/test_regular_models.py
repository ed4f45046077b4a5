"""RegularGPT (adaptive depth, padding, chunked = dense eq. 6.1), its kernels, and the baselines."""
import math

import numpy as np
import pytest
import torch

from extrapolab import positional
from extrapolab.io import UserError
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.regular import RegularGPT, RegularGPTConfig, build_model, chunk_attention, num_levels
from extrapolab.regular.bench import benchmark, sliding_dilated_attention


def _model(**kw):
    m = RegularGPT(RegularGPTConfig(vocab_size=3, num_classes=5, dim=32, heads=4, **kw))
    with torch.no_grad():
        m.scheme.r.normal_()  # non-trivial r so that the bias matters
    return m.eval()


def test_num_levels_is_ceil_log_C():
    for C in (2, 3, 5):
        for T in range(1, 300):
            want = max(1, math.ceil(round(math.log(T, C), 9))) if T > 1 else 1
            assert num_levels(T, C) == want, (C, T)
    assert num_levels(500, 2) == 9 and num_levels(40, 2) == 6 and num_levels(257, 2) == 9


@pytest.mark.parametrize("C", [2, 3])
def test_chunked_forward_equals_dense_eq_6_1(C):
    """pad='once': the O(T·C) chunked path == the dense eq. 6.1-masked path through attend, any T."""
    m = _model(C=C, pad="once")
    for T in (1, 2, 5, 9, 17, 28):
        idx = torch.randint(0, 3, (3, T))
        with torch.no_grad():
            assert torch.allclose(m(idx), m.forward_full(idx), atol=1e-5), T


@pytest.mark.parametrize("C", [2, 3])
def test_level_padding(C):
    """pad='level': equals dense when T = C^L (no pad needed), differs otherwise, and the pad
    vector is learned exactly when some level needs padding."""
    m = _model(C=C, pad="level")
    idx = torch.randint(0, 3, (2, C ** 3))
    with torch.no_grad():
        assert torch.allclose(m(idx), m.forward_full(idx), atol=1e-5)
        odd = torch.randint(0, 3, (2, C ** 2 + 1))  # a whole level-0 chunk of pads under pad='once'
        assert not torch.allclose(m(odd), m.forward_full(odd), atol=1e-3)
    m.train()
    m(idx).sum().backward()
    assert m.pad.grad is None or float(m.pad.grad.abs().sum()) == 0.0
    m.zero_grad()
    m(torch.randint(0, 3, (2, C ** 3 + 1))).sum().backward()
    assert float(m.pad.grad.abs().sum()) > 0


def test_levels_shrink_by_C_and_spans_partition_the_input():
    m = _model(C=2)
    T = 37
    out = m(torch.randint(0, 3, (2, T)), return_levels=True)
    sizes = [h.shape[1] for h in out["levels"]]
    assert sizes == [19, 10, 5, 3, 2, 1]  # ceil(n / 2) per level: O(T) positions in total
    assert out["logits"].shape == (2, 5)
    for (start, end), h in zip(out["spans"], out["levels"]):
        real = end > start
        assert np.all(start[real][1:] == end[real][:-1])  # contiguous, in order
        assert end[real][-1] == T
    s, e = out["spans"][-1]
    assert (s[0], e[0]) == (0, T)


def test_thickness_shares_weights_across_levels():
    m = RegularGPT(RegularGPTConfig(K=2, dim=16, heads=2))
    assert len(m.layers) == 2
    n = m.num_params()
    assert m(torch.randint(0, 2, (4, 100))).shape == (4, 2)
    assert m.num_params() == n  # depth grows with T, parameters do not


def test_chunk_attention_matches_attend():
    N, H, L, Dh = 5, 2, 3, 4
    q, k, v = (torch.randn(N, L, H, Dh) for _ in range(3))
    s = positional.build("sliding-dilated", num_heads=H, C=3)
    with torch.no_grad():
        s.r.normal_()
    pos = torch.arange(L) * 9  # level 2 chunk members
    bias = s.bias(pos, pos, layer=2)  # [H, L, L]
    ref, _ = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, pos, s, 2,
                    AttnOptions(impl="plain"))
    assert torch.allclose(chunk_attention(q, k, v, bias), ref.transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("C", [2, 3])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_sliding_dilated_kernel_matches_dense(C, level):
    B, H, T, Dh = 2, 3, 50, 4
    q, k, v = (torch.randn(B, H, T, Dh) for _ in range(3))
    s = positional.build("sliding-dilated", num_heads=H, C=C)
    with torch.no_grad():
        s.r.normal_()
    pos = torch.arange(T)
    ref, _ = attend(q, k, v, pos, pos, s, level, AttnOptions(impl="plain"))
    got = sliding_dilated_attention(q, k, v, s.r.detach(), level, C)
    assert torch.allclose(got, ref, atol=1e-5)


def test_benchmark_smoke():
    res = benchmark(lengths=(64, 128), repeats=1)
    assert [r["T"] for r in res["rows"]] == [64, 128]
    assert all(r["dilated_ms"] > 0 and r["full_ms"] > 0 for r in res["rows"])
    assert set(res["loglog_slopes"]) >= {"full_ms", "dilated_ms"}


@pytest.mark.parametrize("kind", ["regulargpt", "transformer", "lstm", "rnn"])
def test_model_shapes_and_causality(kind):
    torch.manual_seed(0)
    m = build_model(kind, 8, 5).eval()
    x = torch.randint(0, 8, (3, 45))
    with torch.no_grad():
        y = m(x)
        assert y.shape == (3, 5) and torch.isfinite(y).all()
        assert m(torch.randint(0, 8, (2, 300))).shape == (2, 5)  # far beyond training lengths


def test_build_model_errors():
    with pytest.raises(UserError, match="unknown model kind"):
        build_model("gru", 2, 2)
    with pytest.raises(UserError, match="bad option"):
        build_model("lstm", 2, 2, C=3)
    with pytest.raises(UserError):
        build_model("regulargpt", 2, 2, dim=30, heads=8)


def test_modular_arithmetic_chunks_are_whole_operator_number_steps():
    """C=2 on an odd-length expression x0 op x1 ... : the left pad fills the slot before x0, so
    every level-0 chunk is (operator or pad, number) — one whole transition of the expression's
    automaton — and every later element covers [0 or op position, number position]."""
    m = RegularGPT(RegularGPTConfig(vocab_size=8, num_classes=5, dim=16, heads=2, C=2))
    for T in (1, 3, 7, 39, 41, 255):
        out = m(torch.randint(0, 8, (1, T)), return_levels=True)
        for start, end in out["spans"]:
            real = end > start
            assert np.all((end[real] - 1) % 2 == 0), T  # every unit ends on a number
            assert start[real][0] == 0 and np.all(start[real][1:] % 2 == 1), T  # and starts at an operator


@pytest.mark.parametrize("C,norm", [(2, "post"), (3, "post"), (2, "pre")])
def test_prefix_outputs_equal_the_chunk_path_on_every_prefix(C, norm):
    """forward_prefixes (sliding eq. 6.1, one pass) at position i == forward(idx[:, :i+1]), which
    has its own depth ceil(log_C (i+1)) and level pads; the targets of supervision='prefix'."""
    m = _model(C=C, norm=norm)
    idx = torch.randint(0, 3, (3, 2 * C ** 3 + 1))
    with torch.no_grad():
        allp = m.forward_prefixes(idx)  # [B, T, classes]
        ref = torch.stack([m(idx[:, :i + 1]) for i in range(idx.shape[1])], dim=1)
    assert allp.shape == ref.shape
    assert torch.allclose(allp, ref, atol=1e-5)
    with pytest.raises(UserError, match="K=1"):
        _model(C=C, K=2).forward_prefixes(idx)


@pytest.mark.parametrize("kind", ["transformer", "lstm", "rnn"])
def test_baseline_prefix_outputs_equal_forward_on_prefixes(kind):
    torch.manual_seed(0)
    m = build_model(kind, 8, 5).eval()
    idx = torch.randint(0, 8, (2, 19))
    with torch.no_grad():
        allp = m.forward_prefixes(idx)
        for i in (0, 7, 18):
            assert torch.allclose(allp[:, i], m(idx[:, :i + 1]), atol=1e-5), i

"""Positional schemes against independent references: official code, HF transformers, papers.

Each test compares a scheme with a reference that does not share its code: the official ALiBi
slope function, Hugging Face's T5 bucketing, the Sandwich paper's appendix-E numpy code, the
papers' closed forms written out here in numpy.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from extrapolab import positional as P
from extrapolab.positional.base import SchemeError
from extrapolab.positional.kerple import EPS, _Kerple
from extrapolab.positional.registry import REGISTRY


# ---- ALiBi ----------------------------------------------------------------------------------
# Transcribed from github.com/ofirpress/attention_with_linear_biases,
# fairseq/models/transformer.py (TransformerDecoder.__init__, commit 3b7c2ec), comments dropped.
def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = (2**(-2**-(math.log2(n)-3)))
        ratio = start
        return [start*ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    else:
        closest_power_of_2 = 2**math.floor(math.log2(n))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2*closest_power_of_2)[0::2][:n-closest_power_of_2]


@pytest.mark.parametrize("heads", [1, 6, 8, 12, 16, 20])
def test_alibi_slopes_equal_official_code(heads):
    s = P.build("alibi", heads)
    k = torch.arange(300)
    expect = -torch.tensor(get_slopes(heads), dtype=torch.float64)[:, None] * k  # [H, 300]
    torch.testing.assert_close(s.distance_table(300, dtype=torch.float64), expect, rtol=0, atol=1e-12)


def test_alibi_hand_values_and_non_monotone_12_heads():
    assert P.build("alibi", 8).slopes.tolist() == [2.0**-h for h in range(1, 9)]  # 2^(-8h/H)
    s12 = P.build("alibi", 12).slopes.tolist()
    assert s12 != sorted(s12, reverse=True)  # the official list is not monotone for H = 12
    assert s12[8] == pytest.approx(2 ** -0.5) and s12[7] == pytest.approx(2.0**-8)


def test_alibi_shift_and_equal_exponent():
    shifted = P.build("alibi", 8, shift=2.0).slopes  # Sandwich §4.1: 1/2^(h+Δ)
    assert shifted.tolist() == [2.0 ** -(h + 2) for h in range(1, 9)]
    eq = P.build("alibi", 8, equal_exponent=3.0)  # Sandwich §4.2: every head 1/2^3
    assert eq.slopes.tolist() == [0.125] * 8
    assert eq.bias(torch.arange(5), torch.arange(5))[:, 4, 0].tolist() == [-0.5] * 8


# ---- T5 buckets vs Hugging Face transformers ------------------------------------------------
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (16, 64), (64, 256), (8, 20)])
def test_t5_buckets_equal_huggingface(buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    from extrapolab.positional.t5 import t5_causal_bucket

    dist = torch.arange(0, 5001)
    hf = T5Attention._relative_position_bucket(-dist, bidirectional=False, num_buckets=buckets,
                                               max_distance=max_distance)  # HF: key - query
    assert torch.equal(t5_causal_bucket(dist, buckets, max_distance), hf)

    s = P.build("t5", 3, num_buckets=buckets, max_distance=max_distance)
    with torch.no_grad():
        s.table.copy_(torch.randn(3, buckets))
    q, k = torch.arange(200, 260), torch.arange(0, 260)
    rel = k[None, :] - q[:, None]  # HF compute_bias: memory_position - context_position
    hfb = T5Attention._relative_position_bucket(rel, bidirectional=False, num_buckets=buckets,
                                                max_distance=max_distance)
    ours = s.bias(q, k)  # [3, 60, 260]
    lower = rel <= 0
    assert torch.equal(ours[:, lower], s.table[:, hfb][:, lower])
    assert torch.isinf(ours[:, ~lower]).all()


# ---- Sandwich vs the paper's appendix E ----------------------------------------------------
def appendix_e(heads, seq_len):
    # Sandwich paper appendix E, verbatim except `heads`/`seq_len` are arguments and the last
    # line: as printed, `sandwich[None, ...] / compression_ratio[None, None]` divides
    # [1, L, L] by [1, 1, H] and cannot broadcast (L != H); [:, None, None] is the evident intent.
    base = 1e4
    positions = np.arange(seq_len)[..., None]
    bar_d = 128 # This is the hyperparameter of Sandwich
    i = np.arange(bar_d // 2)

    pos_embs = np.concatenate([np.sin(positions / base ** (2 * i / bar_d)),
                               np.cos(positions / base ** (2 * i / bar_d))],
                              axis=-1)
    sandwich = np.matmul(pos_embs, pos_embs.T)
    compression_ratio = np.arange(1, heads + 1) * 8 / heads
    multi_head_sandwich = sandwich[None, ...] / compression_ratio[:, None, None]
    return multi_head_sandwich, compression_ratio


def test_sandwich_equals_appendix_e_code():
    ref, ratio = appendix_e(12, 512)  # [12, 512, 512]
    pos = torch.arange(512)
    ours = P.build("sandwich", 12).bias(pos, pos, dtype=torch.float64).numpy()  # [12, 512, 512]
    lower = np.tril(np.ones((512, 512), dtype=bool))
    # eq. 6 subtracts d̄/2 = 64 before dividing; appendix E does not (a per-head constant)
    shifted = ref - 64.0 / ratio[:, None, None]
    np.testing.assert_allclose(ours[:, lower], shifted[:, lower], rtol=0, atol=1e-9)
    assert np.isneginf(ours[:, ~lower]).all()
    # ... and the constant does not change the attention distribution of any causal row
    row = 300
    soft = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum(-1, keepdims=True)  # noqa: E731
    np.testing.assert_allclose(soft(ours[:, row, : row + 1]), soft(ref[:, row, : row + 1]), atol=1e-12)


def test_sandwich_eq6_convention_and_options():
    k = np.arange(0, 2000.0)
    i = np.arange(1, 33)  # eq. 6: i = 1..d̄/2 with d̄ = 64
    expect = (np.cos(k[:, None] / 10000 ** (2 * i / 64)).sum(-1) - 32) / np.array([1.0, 2.0, 0.5])[:, None]
    s = P.build("sandwich", 3, dbar=64, convention="eq6", ratios=[1.0, 2.0, 0.5])
    np.testing.assert_allclose(s.distance_table(2000, dtype=torch.float64).numpy(), expect, atol=1e-10)
    assert s.options()["ratios"] == [1.0, 2.0, 0.5]
    for bad, match in [(dict(dbar=127), "even"), (dict(dbar=0), "even"), (dict(base=1.0), "base"),
                       (dict(ratios=[1.0, 2.0]), "3 finite"), (dict(ratios=[1, 2, -1]), "> 0"),
                       (dict(convention="paper"), "convention")]:
        with pytest.raises(SchemeError, match=match):
            P.build("sandwich", 3, **bad)


# ---- smoothed Sandwich ---------------------------------------------------------------------
def test_smoothed_sandwich_reproduces_paper_fit():
    s = P.build("smoothed-sandwich", 8)  # head 8: c = 8·8/8 = 8, d̄ = 128, m = 8192
    a, b = s.fit_coefficients()[-1]
    # Fig. 9 / §6.2: y = -0.825·log(1+k) - 0.8. Tolerance 0.01 on both (we get -0.8316, -0.8007)
    assert abs(a + 0.825) < 0.01 and abs(b + 0.8) < 0.01
    # independent least squares (np.polyfit) on the Sandwich scheme's own c = 8 row, k = 1..8192
    y = P.build("sandwich", 8).distance_table(8193, dtype=torch.float64)[-1, 1:].numpy()
    a_ref, b_ref = np.polyfit(np.log1p(np.arange(1, 8193.0)), y, 1)
    assert a == pytest.approx(a_ref, abs=1e-9) and b == pytest.approx(b_ref, abs=1e-9)
    # per head: linear in 1/c_h with c_h = h
    for h, (ah, bh) in enumerate(s.fit_coefficients(), start=1):
        assert ah == pytest.approx(a * 8 / h) and bh == pytest.approx(b * 8 / h)
    k = torch.arange(0, 5000)
    np.testing.assert_allclose(s.distance_table(5000, dtype=torch.float64)[-1].numpy(),
                               a * np.log1p(k.numpy()) + b, atol=1e-12)


def test_smoothed_sandwich_footnote7_window_is_not_the_papers_curve():
    a, b = P.build("smoothed-sandwich", 8, fit_window=50, fit_start=0).fit_coefficients()[-1]
    assert a == pytest.approx(-1.0245, abs=1e-3) and b == pytest.approx(-0.0151, abs=1e-3)
    a6, b6 = P.build("smoothed-sandwich", 8, convention="eq6").fit_coefficients()[-1]
    assert a6 == pytest.approx(-0.8406, abs=1e-3) and b6 == pytest.approx(-0.6163, abs=1e-3)
    with pytest.raises(SchemeError, match="fit_window"):
        P.build("smoothed-sandwich", 8, fit_window=1)


# ---- KERPLE: constraints survive AdamW with huge gradients -------------------------------
KERPLE = sorted(n for n, c in REGISTRY.items() if issubclass(c, _Kerple))


def test_all_kerple_variants_are_covered():
    assert {"kerple-log", "kerple-power", "kerple-3para-log", "kerple-bias-wht", "kerple-gauss-2para-bias",
            "kerple-gauss-3para-bias", "kerple-gauss-1para-wht", "kerple-gauss-2para-wht"} <= set(KERPLE)


def _kernel_sum(s, k):
    out = s.bias_from_distance(k).sum()
    return out + s.weight_from_distance(k).sum() if s.has_weight else out


@pytest.mark.parametrize("name", KERPLE)
def test_kerple_constraints_hold_under_huge_gradients(name):
    s = P.build(name, 4)
    opt = torch.optim.AdamW(s.parameters(), lr=5.0)
    k = torch.arange(0, 4097)
    for step in range(6):
        opt.zero_grad()
        ((-1) ** step * 1e8 * _kernel_sum(s, k)).backward()
        for p in s.parameters():
            p.grad.add_(torch.randn_like(p) * 1e9)  # huge, random-signed gradients too
        opt.step()
        for fn in [s.bias_from_distance] + ([s.weight_from_distance] if s.has_weight else []):
            assert torch.isfinite(fn(k)).all()  # the forward clamp alone keeps it finite
        s.constrain_()
        for pname, (_, power) in s.PARAMS.items():
            v = getattr(s, pname).detach()
            assert (v >= EPS).all() and (not power or (v <= 2.0).all()), (pname, v)
    assert torch.isfinite(s.distance_table(4097)).all()


def test_gaussian_kernels_match_thesis_formulas():
    k = np.arange(0, 40.0)
    r1, r2, r3 = np.array([0.5, 1.5]), np.array([0.01, 0.2]), np.array([0.7, 2.0])

    def setp(s, **vals):
        with torch.no_grad():
            for n, v in vals.items():
                getattr(s, n).copy_(torch.tensor(v))
        return s

    kt = torch.arange(40)
    s = setp(P.build("kerple-gauss-2para-bias", 2), r1=r1, r2=r2)
    np.testing.assert_allclose(s.bias_from_distance(kt).detach().numpy(),
                               r1[:, None] * np.exp(-r2[:, None] * k**2), rtol=1e-6, atol=1e-7)
    s = setp(P.build("kerple-gauss-3para-bias", 2), r1=r1, r2=r2, r3=r3)
    np.testing.assert_allclose(s.bias_from_distance(kt).detach().numpy(),
                               r1[:, None] * np.exp(-r2[:, None] * k ** r3[:, None]), rtol=1e-6, atol=1e-7)
    s = setp(P.build("kerple-gauss-1para-wht", 2), r1=r2)
    np.testing.assert_allclose(s.weight_from_distance(kt).detach().numpy(), np.exp(-r2[:, None] * k**2),
                               rtol=1e-6, atol=1e-7)
    assert (s.bias_from_distance(kt) == 0).all()
    s = setp(P.build("kerple-gauss-2para-wht", 2), r1=r2, r2=r3)
    np.testing.assert_allclose(s.weight_from_distance(kt).detach().numpy(),
                               np.exp(-r2[:, None] * k ** r3[:, None]), rtol=1e-6, atol=1e-7)


def test_weight_kernel_multiplies_scaled_logits():
    from extrapolab.model.attention import AttnOptions, attend

    s = P.build("kerple-gauss-2para-wht", 2)
    q, kk, v = (torch.randn(1, 2, 7, 4) for _ in range(3))
    pos = torch.arange(7)
    out, _ = attend(q, kk, v, pos, pos, s, opts=AttnOptions(impl="plain"))
    d = (pos[:, None] - pos[None, :]).float()  # [7, 7]
    w = torch.exp(-s.p("r1")[:, None, None] * d.clamp(min=0) ** s.p("r2")[:, None, None])  # [2, 7, 7]
    logits = (q @ kk.transpose(-1, -2)) / 2.0 * w  # sqrt(d_head) = 2
    logits = logits.masked_fill(d < 0, -math.inf)
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, atol=1e-6, rtol=1e-5)


# ---- Qin et al. 2024 -------------------------------------------------------------------
QIN = {
    "qin-type1": lambda k: 1.0 / (k + 1) ** 2,
    "qin-type2": lambda k: np.exp(-np.log(k + 1) ** 2),
    "qin-example1": lambda k: 1.0 / (k + 1),
    "qin-example2": lambda k: 1.0 / ((k + 2) * np.log(k + 2)),
}


@pytest.mark.parametrize("name", sorted(QIN))
def test_qin_bias_is_log_b(name):
    k = np.arange(0, 20000.0)
    s = P.build(name, 3)
    np.testing.assert_allclose(s.distance_table(20000, dtype=torch.float64).numpy(),
                               np.broadcast_to(np.log(QIN[name](k)), (3, k.size)), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(type(s).b(k).numpy(), QIN[name](k), rtol=1e-12)


def test_qin_series_attributes_match_partial_sums():
    k = np.arange(0, 10**6, dtype=np.float64)
    t1 = P.REGISTRY["qin-type1"]
    assert t1.converges and t1.series == "p-series" and t1.series_p == 2
    assert t1.b(k).sum().item() == pytest.approx(t1.series_sum, abs=2e-6)  # tail < 1/10^6
    b1, b2 = t1.b(k), P.REGISTRY["qin-type2"].b(k)
    assert (b2[7:] < b1[7:]).all()  # exp(-ln^2 n) < 1/n^2 once ln n > 2 (n = k+1 >= 8)
    assert b2[10**5:].sum().item() < 1e-40  # Type2 converges much faster ...
    j = 1000  # ... so its normalised tail, hence its TRF, is smaller (Theorem 0.5, eq. 22)
    assert b2[j:].sum() / b2.sum() < b1[j:].sum() / b1.sum()
    e1, e2 = P.REGISTRY["qin-example1"], P.REGISTRY["qin-example2"]
    assert not e1.converges and not e2.converges and e2.series == "n-log-n"
    n = k.size
    assert e1.b(k).sum().item() > math.log(n + 1)  # paper: sum_{n=1}^k 1/n > ln(k+1)
    assert e2.b(k).sum().item() > math.log(math.log(n + 2)) - math.log(math.log(3))


# ---- user-defined callables ----------------------------------------------------------------
@pytest.fixture
def cleanup_registry():
    before = set(REGISTRY)
    yield
    for name in set(REGISTRY) - before:
        REGISTRY.pop(name)


def test_custom_callable_both_forms_and_per_head(cleanup_registry):
    P.register_callable("t-bias", lambda k: -0.3 * torch.log1p(k), summary="log decay")
    P.register_callable("t-b", lambda k: 1.0 / (k + 1) ** 2, form="b")
    P.register_callable("t-head", lambda k, h: -(h + 1) * 0.1 * k, per_head=True)
    P.register_callable("t-numpy", lambda k: -np.sqrt(np.asarray(k)))
    k = torch.arange(100)
    assert torch.allclose(P.build("t-bias", 2).distance_table(100, dtype=torch.float64),
                          -0.3 * torch.log1p(k.double()).expand(2, -1))
    assert torch.equal(P.build("t-b", 2).distance_table(100), P.build("qin-type1", 2).distance_table(100))
    assert torch.allclose(P.build("t-head", 3).distance_table(100, dtype=torch.float64),
                          -torch.tensor([[0.1], [0.2], [0.3]], dtype=torch.float64) * k)
    assert torch.allclose(P.build("t-numpy", 1).distance_table(100, dtype=torch.float64)[0], -k.double().sqrt())
    cls = REGISTRY["t-b"]
    kd = k.double()
    assert torch.allclose(cls.b(k), 1.0 / (kd + 1.0) ** 2) and torch.allclose(cls.bias_fn(k), -2 * torch.log1p(kd))
    assert REGISTRY["t-bias"].summary == "log decay" and "Qin" in cls.paper


@pytest.mark.parametrize("fn,form,per_head,match", [
    (lambda k: 1.0 - k / 500.0, "b", False, r"b\(k\) must be finite and > 0"),
    (lambda k: torch.where(k > 0, -k, torch.tensor(math.inf)), "bias", False, "bias\\(0\\) must be finite"),
    (lambda k: torch.where(k > 5, math.nan, -k), "bias", False, "NaN"),
    (lambda k: torch.zeros(3), "bias", False, "one number per distance"),
    (lambda k: undefined_name, "bias", False, "NameError"),  # noqa: F821
    (lambda k, h: -k + (0.0 if h < 2 else math.nan), "bias", True, "head 2"),
    (42, "bias", False, "must be callable"),
    (lambda k: -k, "log", False, "form must be"),
])
def test_custom_callable_errors_are_one_line(fn, form, per_head, match, cleanup_registry):
    with pytest.raises(SchemeError, match=match) as err:
        P.register_callable("t-bad", fn, form=form, per_head=per_head)
        P.build("t-bad", 4)
    assert "\n" not in str(err.value)


def test_custom_spec_strings(tmp_path, monkeypatch, cleanup_registry):
    from extrapolab.model.gpt import GPT, ModelConfig

    path = tmp_path / "my_rpe.py"
    path.write_text("import torch\n\ndef b(k):\n    return 1.0 / (k + 1) ** 2\n\n"
                    "def perhead(k, h):\n    return -(h + 1) * torch.log1p(k)\n")
    s = P.build(f"b:{path}:b", 4)
    assert torch.equal(s.distance_table(64), P.build("qin-type1", 4).distance_table(64))
    assert f"b:{path}:b" in P.names()
    monkeypatch.syspath_prepend(str(tmp_path))
    ph = P.build("bias:my_rpe:perhead", 2)  # two required parameters -> per head
    assert torch.allclose(ph.distance_table(10)[1], -2 * torch.log1p(torch.arange(10.0)))
    model = GPT(ModelConfig(vocab_size=32, layers=1, heads=2, dim=16, scheme="bias:my_rpe:perhead"))
    assert torch.isfinite(model(torch.randint(0, 32, (1, 12)))).all()
    for spec, match in [("bias:no_such_module_xyz:f", "cannot import module"),
                        ("bias:my_rpe:missing", "has no function 'missing'"),
                        (f"b:{tmp_path}/absent.py:b", "no such file"),
                        ("bais:my_rpe:b", "unknown positional scheme")]:
        with pytest.raises(SchemeError, match=match) as err:
            P.build(spec, 2)
        assert "\n" not in str(err.value)

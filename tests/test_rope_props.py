"""Properties of rotary and its context-extension schemes (rotary-pi, -ntk, -dynamic, -yarn).

Reference rotation: RoFormer eq. 34 written with complex numbers, (x_2i + i·x_2i+1)·e^{i·m·theta_i},
which shares no code with the scheme's real-arithmetic fast path.
"""
from __future__ import annotations

import math

import pytest
import torch
from decoding import decode

from extrapolab import positional as P
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.base import SchemeError

H, D = 2, 16
STATIC = [("rotary", {}), ("rotary-pi", {"factor": 4.0}), ("rotary-ntk", {"factor": 4.0}),
          ("rotary-yarn", {"factor": 4.0, "original_length": 64}), ("rotary-yarn", {"factor": 16.0, "original_length": 32})]


def _complex_rotate(x, pos, theta, f=1.0):
    """[..., L, d] float64 -> rotated by m·theta_i per pair (2i, 2i+1), times f."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())  # [..., L, d/2]
    rot = torch.exp(1j * pos[:, None].double() * theta)  # [L, d/2]
    return torch.view_as_real(z * rot * f).flatten(-2)  # [..., L, d/2, 2] -> [..., L, d]


@pytest.mark.parametrize("name,opts", STATIC)
def test_rotation_equals_complex_reference_and_is_norm_preserving(name, opts):
    s = P.build(name, H, **opts)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(3, H, 40, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.tensor([5, 0, 900, 3, 17] * 8)  # any order, repeats, far positions: the gather path
    oq, ok = s.rotate(q, k, pos, pos)
    f = s.attention_factor(40)
    torch.testing.assert_close(oq, _complex_rotate(q, pos, s.inv_freq(D, 40), f), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ok.norm(dim=-1), f * k.norm(dim=-1), rtol=1e-12, atol=0)
    arange = torch.arange(40)  # the slice path (no gather) gives the same rows
    torch.testing.assert_close(s.rotate(q, k, arange, arange)[0], _complex_rotate(q, arange, s.inv_freq(D, 40), f))


@pytest.mark.parametrize("name,opts", STATIC)
def test_qk_depends_only_on_m_minus_n_at_fixed_s(name, opts):
    s = P.build(name, H, **opts)
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, H, 1, D, generator=g, dtype=torch.float64) for _ in range(2))
    for m, n in ((7, 3), (100, 0), (50, 50)):
        ref = None
        for shift in (0, 1, 333, 4000):
            qm, _ = s.rotate(q, q, torch.tensor([m + shift]), torch.tensor([m + shift]))
            kn, _ = s.rotate(k, k, torch.tensor([n + shift]), torch.tensor([n + shift]))
            dot = (qm * kn).sum(-1)  # [1, H, 1]
            ref = dot if ref is None else ref
            torch.testing.assert_close(dot, ref, rtol=1e-9, atol=1e-9)


def _model(scheme="rotary", train_length=32, **params):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, layers=2, heads=H, dim=H * D, scheme=scheme, scheme_params=params,
                           train_length=train_length)).eval()


def _swap(model, name, **params):
    """The same weights with another rotary scheme (rotary schemes have no parameters)."""
    model.scheme = P.build(name, H, **params)
    return model


def test_dynamic_ntk_is_plain_rotary_up_to_l_tr_and_static_ntk_beyond():
    m = _model()
    idx = torch.randint(0, 50, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for L in (1, 17, 32):
            ref = _swap(m, "rotary")(idx[:, :L])
            torch.testing.assert_close(_swap(m, "rotary-dynamic", original_length=32)(idx[:, :L]), ref, rtol=0, atol=0)
        for L in (33, 64, 96):  # beyond: s = L / L_tr for the whole call
            dyn = _swap(m, "rotary-dynamic", original_length=32)(idx[:, :L])
            ntk = _swap(m, "rotary-ntk", factor=L / 32)(idx[:, :L])
            torch.testing.assert_close(dyn, ntk, rtol=1e-6, atol=1e-6)
            q = torch.randn(1, H, L, D)
            pos = torch.arange(L)
            moved = P.build("rotary-dynamic", H, original_length=32).rotate(q, q, pos, pos)[0]
            assert (moved - P.build("rotary", H).rotate(q, q, pos, pos)[0]).abs().max() > 1e-2


def test_factor_one_is_plain_rotary_and_yarn_temperature_is_f_squared():
    q, k = (torch.randn(1, H, 30, D, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(30)
    ref = P.build("rotary", H).rotate(q, k, pos, pos)
    for name in ("rotary-pi", "rotary-ntk", "rotary-yarn"):
        out = P.build(name, H, factor=1.0).rotate(q, k, pos, pos)
        torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-12)
    s = 8.0
    with_t = P.build("rotary-yarn", H, factor=s, original_length=64)
    without = P.build("rotary-yarn", H, factor=s, original_length=64, attention_factor=1.0)
    a, b = with_t.rotate(q, k, pos, pos), without.rotate(q, k, pos, pos)
    logits_t, logits_1 = a[0] @ a[1].transpose(-1, -2), b[0] @ b[1].transpose(-1, -2)  # [1, H, 30, 30]
    f = 0.1 * math.log(s) + 1
    torch.testing.assert_close(logits_t, f * f * logits_1)
    assert with_t.options()["attention_factor"] == pytest.approx(f)


@pytest.mark.parametrize("name,opts", STATIC + [("rotary-dynamic", {"original_length": 64})])
def test_kv_cache_decoding_equals_parallel_within_l_tr(name, opts):
    m = _swap(_model(train_length=64), name, **opts)
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = m(idx)
        steps = decode(m, idx, 10, KVCache(len(m.blocks)))
    torch.testing.assert_close(steps, ref, rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_kv_cache_keeps_old_scales_beyond_l_tr():
    """Documented behaviour (as in Hugging Face): cached keys keep the s they were rotated with."""
    m = _swap(_model(train_length=16), "rotary-dynamic", original_length=16)
    idx = torch.randint(0, 50, (1, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, ref16 = m(idx), m(idx[:, :16])
        cache = KVCache(len(m.blocks))
        steps = [m(idx[:, t:t + 1], torch.tensor([t]), cache=cache) for t in range(48)]
    inc = torch.cat(steps, 1)
    torch.testing.assert_close(inc[:, :16], ref16, rtol=1e-5, atol=1e-5)  # s = 1 throughout
    assert torch.allclose(inc[:, -1], ref[:, -1], atol=1e-5) is False  # past L_tr the scales differ


def test_tables_are_cached_grown_by_doubling_and_dropped_on_to():
    s = P.build("rotary-yarn", H, factor=4.0, original_length=64)
    C, S = s.tables(10, D, "cpu", torch.float32)
    assert C.shape == (256, D) and s.tables(200, D, "cpu", torch.float32)[0] is C  # reused
    C2, _ = s.tables(300, D, "cpu", torch.float32)
    assert C2.shape[0] == 512 and torch.equal(C2[:256], C)  # doubled, the old rows unchanged
    assert s.tables(10, D, "cpu", torch.float64)[0].dtype == torch.float64  # one table per dtype
    s.to(torch.float64)
    assert s._cs == {} and s._rows == [] and s._len is None
    d = P.build("rotary-dynamic", H, original_length=32)
    d.tables(10, D, "cpu", torch.float32, length=100)
    d.tables(10, D, "cpu", torch.float32, length=200)
    assert len(d._cs) == 1  # dynamic: only the current scale is kept


def test_gradients_flow_through_the_fast_path():
    s = P.build("rotary-yarn", H, factor=4.0, original_length=16)
    q = torch.randn(1, H, 12, D, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(12)
    assert torch.autograd.gradcheck(lambda x: s.rotate(x, x, pos, pos)[0], (q,))
    with torch.inference_mode():  # tables built under inference mode are rebuilt for autograd
        s2 = P.build("rotary", H)
        s2.rotate(q.detach(), q.detach(), pos, pos)
    s2.rotate(q, q, pos, pos)[0].sum().backward()


@pytest.mark.parametrize("name,opts,match", [
    ("rotary-pi", {"factor": 0.5}, "factor must be a finite number >= 1"),
    ("rotary-ntk", {"factor": "x"}, "factor must be a finite number >= 1"),
    ("rotary-yarn", {"beta_fast": 1.0, "beta_slow": 32.0}, "beta_fast > beta_slow"),
    ("rotary-yarn", {"attention_factor": 0.0}, "attention_factor must be > 0"),
    ("rotary-dynamic", {"original_length": 1}, "original_length"),
    ("rotary-yarn", {"scale": 2}, "has no option 'scale'"),
])
def test_bad_options_fail_in_one_line(name, opts, match):
    with pytest.raises(SchemeError, match=match) as err:
        P.build(name, H, **opts)
    assert "\n" not in str(err.value)


def test_gpt_fills_original_length_from_train_length():
    assert _model("rotary-yarn", train_length=48, factor=2.0).scheme.original_length == 48
    assert _model("rotary-dynamic", train_length=24, original_length=8).scheme.original_length == 8

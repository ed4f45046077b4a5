"""xpos (Sun et al. 2023 §3.2) against the paper's equations written here in complex form, against
torchscale's XPOS (its code transcribed below), relative in m - n, and causal / incremental in a GPT."""
from __future__ import annotations

import math

import pytest
import torch
from decoding import decode

from extrapolab import positional as P
from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.base import SchemeError
from extrapolab.positional.xpos import max_offset

H, D = 2, 16


def paper_xpos(x: torch.Tensor, pos: torch.Tensor, query: bool, base=10000.0, scale_base=512.0, gamma=0.4):
    """The paper's f_q / f_k on pairs (x[2i], x[2i+1]) as complex numbers z_i = x[2i] + i x[2i+1]:
    z_i e^(i n theta_i) zeta_i^(±n / scale_base), theta_i = base^(-2i/d), zeta_i = (2i/d + gamma)/(1 + gamma)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2 * i / d)  # [d/2]
    zeta = (2 * i / d + gamma) / (1 + gamma)
    n = pos.double()[:, None]  # [L, 1]
    sign = 1.0 if query else -1.0
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())  # [..., L, d/2]
    z = z * torch.polar(zeta ** (sign * n / scale_base), n * theta)  # [..., L, d/2]
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)  # [..., L, d]


def torchscale_logits(q: torch.Tensor, k: torch.Tensor, scale_base: int = 512) -> torch.Tensor:
    """q·k^T after torchscale's XPOS (xpos_relative_position.py at 4d1e0e8, offset 0: its centred
    scale exponent), transcribed for x [L, d]."""
    d = q.shape[-1]
    scale = (torch.arange(0, d, 2, dtype=torch.float64) + 0.4 * d) / (1.4 * d)

    def xpos(x, downscale):
        length = x.shape[0]
        min_pos = -length // 2
        sc = scale ** torch.arange(min_pos, length + min_pos, 1).double().div(scale_base)[:, None]  # [L, d/2]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, sc.shape[1]).double() / sc.shape[1]))
        ang = torch.einsum("i,j->ij", torch.arange(0, length).double(), inv_freq)
        sin, cos = torch.sin(ang), torch.cos(ang)
        if downscale:
            sc = 1 / sc
        sin, cos = (torch.repeat_interleave(t * sc, 2, dim=-1) for t in (sin, cos))
        rot = torch.stack((-x[:, 1::2], x[:, 0::2]), dim=-1).flatten(-2)  # rotate_every_two
        return x * cos + rot * sin

    return xpos(q.double(), False) @ xpos(k.double(), True).T


def test_rotate_is_the_papers_f_q_and_f_k():
    s = P.build("xpos", H)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, H, 40, D, generator=g, dtype=torch.float64), torch.randn(2, H, 40, D, generator=g, dtype=torch.float64)
    for pos in (torch.arange(40), torch.arange(700, 740), torch.randperm(3000, generator=g)[:40].sort().values):
        rq, rk = s.rotate(q, k, pos, pos)
        torch.testing.assert_close(rq, paper_xpos(q, pos, True), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(rk, paper_xpos(k, pos, False), rtol=1e-10, atol=1e-12)
    s2 = P.build("xpos", H, scale_base=64.0, gamma=0.8, base=500.0)
    rq, _ = s2.rotate(q, k, pos, pos)
    torch.testing.assert_close(rq, paper_xpos(q, pos, True, 500.0, 64.0, 0.8), rtol=1e-10, atol=1e-12)


def test_logits_equal_torchscales_centred_xpos():
    """torchscale centres the scale's exponent on the sequence; it cancels in q·k."""
    s = P.build("xpos", H)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 33, D, generator=g, dtype=torch.float64), torch.randn(1, 1, 33, D, generator=g, dtype=torch.float64)
    pos = torch.arange(33)
    rq, rk = s.rotate(q, k, pos, pos)
    torch.testing.assert_close(rq[0, 0] @ rk[0, 0].T, torchscale_logits(q[0, 0], k[0, 0]), rtol=1e-9, atol=1e-9)


def test_logits_depend_on_m_minus_n_only_and_decay_per_pair():
    s = P.build("xpos", H)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, H, 1, D, generator=g, dtype=torch.float64), torch.randn(1, H, 1, D, generator=g, dtype=torch.float64)
    q, k = q.expand(1, H, 30, D), k.expand(1, H, 30, D)  # the same vectors at every position

    def logits(p0):
        pos = torch.arange(p0, p0 + 30)
        rq, rk = s.rotate(q, k, pos, pos)
        return rq @ rk.transpose(-1, -2)  # [1, H, 30, 30]

    torch.testing.assert_close(logits(0), logits(5000), rtol=1e-9, atol=1e-9)  # translation: only m - n
    a = logits(0)
    torch.testing.assert_close(a[..., 1:, 1:], a[..., :-1, :-1], rtol=1e-9, atol=1e-9)  # Toeplitz
    # the scale alone: the last pair's angle is base^(-(d-2)/d) ~ 0 for a huge base, so its logit is
    # q_i k_i zeta_i^((m-n)/512) with zeta_i = ((d-2)/d + 0.4)/1.4
    flat = P.build("xpos", H, base=1e300)
    e = torch.zeros(1, 1, 2, D, dtype=torch.float64)
    e[..., D - 2] = 1.0
    rq, rk = flat.rotate(e, e, torch.tensor([0, 1000]), torch.tensor([0, 1000]))
    zeta = ((D - 2) / D + 0.4) / 1.4
    assert float(rq[0, 0, 1] @ rk[0, 0, 0]) == pytest.approx(zeta ** (1000 / 512), rel=1e-12)
    assert float(rq[0, 0, 0] @ rk[0, 0, 1]) == pytest.approx(zeta ** (-1000 / 512), rel=1e-12)  # (masked in use)


def test_center_cancels_and_the_float_range_is_refused_in_one_line():
    small = P.build("xpos", H, scale_base=4.0)
    limit = max_offset(4.0)
    assert limit == int(4.0 * math.log(1e30) / math.log(1.4 / 0.4))
    with pytest.raises(SchemeError) as err:
        small.check_length(limit + 10)
    assert "center=" in str(err.value) and "\n" not in str(err.value)
    centred = P.build("xpos", H, scale_base=4.0, center=(limit + 10) // 2)
    centred.check_length(limit + 10)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, H, 20, D, generator=g, dtype=torch.float64), torch.randn(1, H, 20, D, generator=g, dtype=torch.float64)
    pos = torch.arange(20)
    a, b = small.rotate(q, k, pos, pos), centred.rotate(q, k, pos, pos)
    torch.testing.assert_close(a[0] @ a[1].transpose(-1, -2), b[0] @ b[1].transpose(-1, -2), rtol=1e-9, atol=1e-9)


def _gpt(scheme="xpos", L=32, **params):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, layers=2, heads=H, dim=H * D, scheme=scheme, scheme_params=params,
                           train_length=L)).eval()


def test_gpt_prefix_full_and_incremental_decoding_equal_parallel():
    m = _gpt(scale_base=16.0)  # a strong decay, so a wrong sign or position would show
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx)  # [2, 40, V]
        torch.testing.assert_close(m(idx[:, :17]), full[:, :17], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(idx, opts=AttnOptions(impl="plain")), full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(decode(m, idx, 9, KVCache(2)), full, rtol=1e-5, atol=2e-5)
        moved = m(idx, positions=torch.arange(300, 340))  # relative: a shift changes nothing
        torch.testing.assert_close(moved, full, rtol=1e-4, atol=1e-4)


def test_listed_by_extrapolab_schemes():
    from extrapolab.report.schemes import scheme_rows

    row = next(r for r in scheme_rows() if r["name"] == "xpos")
    assert row["kind"] == "rotary" and "Sun et al. 2023" in row["paper"]
    assert row["options"] == {"base": 10000.0, "scale_base": 512.0, "gamma": 0.4, "center": 0}

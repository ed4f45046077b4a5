"""PoPE (Gopalakrishnan et al. 2025, arXiv 2509.10534 §3): the attention score against the paper's equation written
here, in complex numbers as lucidrains/PoPE-pytorch writes it, the fused path against the reference with the
phase bias's gradient, the KV cache of 2·d-wide keys, and its one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import positional as P
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.model.reference import logits
from extrapolab.positional.base import SchemeError

H, D = 3, 6


def _pope(seed=0):
    s = P.build("pope", H, head_dim=D)
    with torch.no_grad():
        s.delta.copy_(-2 * math.pi * torch.rand(H, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return s.double()


def test_score_is_the_papers_polar_form():
    """a_mn = Σ_c softplus(q_c)·softplus(k_c)·cos((m - n)·θ_c - δ_c) / sqrt(d), θ_c = 10000^(-c/d) (d frequencies)."""
    s = _pope()
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, H, 9, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(100, 109)
    got = logits(*s.rotate(q, k, pos, pos), pos, pos, s)  # [2, H, 9, 9], -inf above the diagonal
    theta = 10000.0 ** (-torch.arange(D, dtype=torch.float64) / D)  # [d]
    dist = (pos[:, None] - pos[None, :]).to(torch.float64)  # [9, 9]
    ang = dist[None, :, :, None] * theta - s.delta[:, None, None, :]  # [H, 9, 9, d]
    want = (F.softplus(q)[..., :, None, :] * F.softplus(k)[..., None, :, :] * torch.cos(ang)).sum(-1) / math.sqrt(D)
    low = dist >= 0
    torch.testing.assert_close(got[..., low], want[..., low], rtol=1e-12, atol=1e-12)
    assert torch.isneginf(got[..., ~low]).all()


def test_score_equals_the_complex_form_of_the_reference_implementation():
    """As lucidrains/PoPE-pytorch: q̃ = polar(softplus(q), m·θ), k̃ = polar(softplus(k), n·θ + δ) with δ clamped to
    [-2π, 0], score Re(Σ q̃·conj(k̃)) scaled by 1/sqrt(d) of the original head size."""
    s = _pope(2)
    with torch.no_grad():
        s.delta[0, 0], s.delta[1, 2] = 1.5, -9.0  # outside the range: the forward clamps, as the reference
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, H, 7, D, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(7)
    theta = 10000.0 ** (-torch.arange(D, dtype=torch.float64) / D)
    fq = pos[:, None].double() * theta  # [7, d]
    bias = s.delta.detach().clamp(-2 * math.pi, 0.0)[:, None]  # [H, 1, d]
    qc = torch.polar(F.softplus(q), fq.expand_as(q))
    kc = torch.polar(F.softplus(k), (fq + bias).expand_as(k))
    want = torch.einsum("bhid,bhjd->bhij", qc, kc.conj()).real / math.sqrt(D)
    got = logits(*s.rotate(q, k, pos, pos), pos, pos, s)
    low = pos[:, None] >= pos[None, :]
    torch.testing.assert_close(got[..., low], want[..., low], rtol=1e-12, atol=1e-12)


def test_fused_path_equals_the_reference_with_the_phase_gradient():
    s = _pope(4)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, H, 40, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pos = torch.arange(40)
    paths = {}
    fast, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(paths=paths))
    ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
    assert paths == {"causal": 1} and fast.shape == v.shape
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    gg = torch.randn_like(fast)
    a = torch.autograd.grad(fast, (q, k, v, s.delta), gg)
    b = torch.autograd.grad(ref, (q, k, v, s.delta), gg)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
    assert a[3].abs().sum() > 0


def test_kv_cache_holds_the_wide_keys_and_decoding_equals_the_parallel_forward():
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=40, layers=2, heads=H, dim=H * D, scheme="pope", train_length=16)).eval()
    idx = torch.randint(0, 40, (1, 20))
    cache = KVCache(2)
    with torch.no_grad():
        full = m(idx)
        steps = [m(idx[:, :5], positions=torch.arange(5), cache=cache)]
        steps += [m(idx[:, t:t + 1], positions=torch.tensor([t]), cache=cache) for t in range(5, 20)]
    assert cache.k[0].shape[-1] == 2 * D and cache.v[0].shape[-1] == D
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)


def test_constrain_projects_the_phase_into_its_range():
    s = _pope()
    with torch.no_grad():
        s.delta[0, 0], s.delta[2, 1] = 0.7, -7.0
    s.constrain_()
    assert s.delta.max() <= 0 and s.delta.min() >= -2 * math.pi
    assert P.build("pope", H, phase_bias=False, head_dim=D).delta is None


def test_bad_pope_options_are_one_line_errors():
    for kw, match in (({"base": 1.0}, "base must be > 1"), ({"head_dim": 0}, "head_dim >= 1")):
        with pytest.raises(SchemeError, match=match) as e:
            P.build("pope", H, **kw)
        assert "\n" not in str(e.value)
    s = P.build("pope", H, head_dim=8)
    with pytest.raises(SchemeError, match="head_dim=8") as e:
        s.rotate(torch.zeros(1, H, 3, 6), torch.zeros(1, H, 3, 6), torch.arange(3), torch.arange(3))
    assert "\n" not in str(e.value)

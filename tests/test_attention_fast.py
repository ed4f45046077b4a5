"""Fast attention paths (docs/attention.md): exactness against independent references, the fused
CPU kernel actually running, O(H·L) long-context memory, and KV-cache decoding."""
import math

import pytest
import torch
import torch.nn.functional as F
from decoding import decode
from torch.profiler import profile

from extrapolab import positional
from extrapolab.memory import PeakMemory
from extrapolab.model import toeplitz as A
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.tables import DistanceBias
from extrapolab.model.gpt import GPT, KVCache, ModelConfig

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _perturbed(name, heads=4, **kw):
    s = positional.build(name, num_heads=heads, **kw)
    with torch.no_grad():  # move learnable parameters away from their init
        for p in s.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    s.constrain_()
    return s


def _tiny(scheme, L=160):
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=scheme, train_length=L, vocab_size=50, dim=32, heads=4, layers=2))
    with torch.no_grad():
        for p in m.scheme.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    m.constrain_()
    return m


def _reference(q, k, v, scheme, scale, window=None, tau=1.0):
    """Independent dense reference: (q·k·scale [·w] + b, masked) / tau, softmax (thesis §5.4)."""
    L, Lk = q.shape[2], k.shape[2]
    dist = (torch.arange(L)[:, None] + (Lk - L)) - torch.arange(Lk)[None]  # [L, Lk]
    s = q @ k.transpose(-1, -2) * scale  # [B, H, L, Lk]
    if scheme.has_weight:
        s = s * scheme.weight_from_distance(dist.clamp(min=0)).to(s.dtype)
    if scheme.has_bias:
        s = s + scheme.bias_from_distance(dist.clamp(min=0)).to(s.dtype)
    bad = (dist < 0) | ((dist >= window) if window else torch.zeros_like(dist, dtype=torch.bool))
    s = s.masked_fill(bad, -math.inf) / tau
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("grad", [False, True])
def test_every_scheme_sdpa_plain_blocked_agree(grad):
    """The lead's sanity check: all registered schemes give the same logits on every path."""
    for name in positional.names():
        m = _tiny(name)
        idx = torch.randint(0, 50, (2, 160), generator=torch.Generator().manual_seed(2))
        with torch.set_grad_enabled(grad):
            for kw in ({}, {"window": 23}, {"temperature": 0.7}):
                outs = {impl: m(idx, opts=AttnOptions(impl=impl, block_size=32, **kw))
                        for impl in ("plain", "sdpa", "blocked", "auto")}
                for impl, o in outs.items():
                    err = (o - outs["plain"]).abs().max().item()
                    assert err < 2e-5, (name, kw, impl, err)


@pytest.mark.parametrize("name", ["kerple-log", "t5", "sliding-dilated", "kerple-3para-log", "alibi",
                                  "kerple-bias-wht", "kerple-gauss-1para-wht"])
def test_fast_path_gradients_equal_fp64_reference(name):
    """HankelSDPA (learnable tables, wht kernels) and the flash path: output and gradients w.r.t.
    q, k, v and the scheme's parameters equal autograd through an explicit fp64 softmax."""
    s = _perturbed(name).double()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 70, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    go = torch.randn(2, 4, 70, 8, generator=g, dtype=torch.float64)
    pos = torch.arange(70)
    params = [q, k, v, *s.parameters()]
    for impl, bs, window, tau in (("sdpa", 1024, None, 1.0), ("blocked", 16, None, 1.0), ("sdpa", 1024, 20, 0.8)):
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl=impl, block_size=bs, window=window,
                                                              temperature=tau))
        got = torch.autograd.grad(out, params, go)
        ref = _reference(q, k, v, s, 1 / math.sqrt(8), window, tau)
        want = torch.autograd.grad(ref, params, go)
        assert (out - ref).abs().max() < 1e-12
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-10, (name, impl, (a - b).abs().max())


def test_learnable_model_gradients_fast_equal_plain_fp32():
    for name in ("kerple-log", "t5", "kerple-bias-wht"):
        m = _tiny(name)
        idx = torch.randint(0, 50, (2, 160), generator=torch.Generator().manual_seed(2))
        grads = {}
        for impl in ("plain", "sdpa"):
            m.zero_grad()
            m(idx, opts=AttnOptions(impl=impl)).square().mean().backward()
            grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters()}
        for n, g in grads["plain"].items():
            assert torch.allclose(grads["sdpa"][n], g, rtol=1e-4, atol=1e-6), (name, n)


def test_antidiagonal_sums_match_loop():
    m = torch.randn(3, 5, 7)
    want = torch.zeros(3, 11)
    for u in range(5):
        for w in range(7):
            want[:, u + w] += m[:, u, w]
    assert torch.allclose(A.antidiag_sums(m), want, atol=1e-6)


def _ops(fn):
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("name", ["alibi", "sandwich", "windowed", "qin-type1", "smoothed-sandwich"])
def test_parameter_free_training_runs_fused_flash_kernel(name):
    """Guards the 4-D mask layout: a 3-D or grad-requiring mask would silently take the math path."""
    m = _tiny(name, L=128)
    idx = torch.randint(0, 50, (2, 128), generator=torch.Generator().manual_seed(2))
    ops = _ops(lambda: m(idx, opts=AttnOptions(impl="sdpa")).sum().backward())
    assert FLASH in ops and FLASH + "_backward" in ops and MATH not in ops, sorted(o for o in ops if "dot" in o)


def test_learnable_training_uses_flash_forward_not_math():
    m = _tiny("kerple-log", L=128)
    idx = torch.randint(0, 50, (2, 128), generator=torch.Generator().manual_seed(2))
    ops = _ops(lambda: m(idx).sum().backward())
    assert FLASH in ops and MATH not in ops and "HankelSDPABackward" in ops


def test_wht_training_uses_tiled_kernel_not_dense_softmax():
    m = _tiny("kerple-bias-wht", L=128)
    idx = torch.randint(0, 50, (2, 128), generator=torch.Generator().manual_seed(2))
    ops = _ops(lambda: m(idx).sum().backward())
    assert "HankelSDPABackward" in ops and "aten::_softmax" not in ops and MATH not in ops


def test_bias_tables_built_once_per_forward_and_shared():
    """Parameter-free: the Hankel vector is cached across forwards; learnable: one table per forward."""
    m = _tiny("kerple-log", L=64)
    calls = []
    orig = m.scheme.bias_from_distance
    m.scheme.bias_from_distance = lambda d, layer=0: calls.append(d.numel()) or orig(d, layer)
    m(torch.zeros(1, 64, dtype=torch.long)).sum().backward()
    assert calls == [64]  # O(L) distances once, not per layer, never L x L
    s = positional.build("alibi", num_heads=4)
    db1, db2 = DistanceBias(s), DistanceBias(s)
    e1, _ = db1.hankel(0, 99, 199, None, 1.0, torch.float32)
    e2, _ = db2.hankel(0, 99, 199, None, 1.0, torch.float32)
    assert e1.data_ptr() == e2.data_ptr() and e1[:, 99].abs().max() == 0  # distance 0 at x = dmax


def test_eval_cache_follows_parameter_updates():
    m = _tiny("kerple-log", L=64).eval()
    idx = torch.randint(0, 50, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        m(idx)
        m.scheme.r1.data.mul_(3.0)  # .data: no version bump, the value key still sees it
        fast, plain = m(idx), m(idx, opts=AttnOptions(impl="plain"))
    assert (fast - plain).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["alibi", "kerple-power", "windowed", "kerple-bias-wht"])
def test_long_blocked_exact_and_never_materialises_LxL(name):
    s = _perturbed(name)
    g = torch.Generator().manual_seed(7)
    L = 1536
    q, k, v = (torch.randn(1, 4, L, 16, generator=g) for _ in range(3))
    pos = torch.arange(L)
    with torch.no_grad():
        fast, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="auto"))
        ref = _reference(q, k, v, s, 0.25)
    assert (fast - ref).abs().max() < 1e-5
    L = 8192  # one [H, L, L] fp32 score tensor would be 1 GiB
    q, k, v = (torch.randn(1, 4, L, 16, generator=g) for _ in range(3))
    pos = torch.arange(L)
    with torch.no_grad(), PeakMemory() as mem:
        attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="auto"))
    assert mem.mib < 96, mem.mib


@pytest.mark.parametrize("name", ["none", "alibi", "rotary", "kerple-log", "t5", "sinusoidal", "learned",
                                  "windowed", "kerple-bias-wht", "sliding-dilated"])
def test_cached_decoding_equals_full_recompute(name):
    """No eviction (window >= length): token-by-token decoding with the cache = one full forward."""
    m = _tiny(name, L=48).eval()
    idx = torch.randint(0, 50, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(idx)  # [2, 48, V]
        for window in (None, 48):
            steps = decode(m, idx, 10, KVCache(2, window=window))
            assert (steps - full).abs().max() < 2e-5, (name, window)


def test_windowed_cache_keeps_last_w_in_order_with_fixed_storage():
    w, cache, seen, t = 5, KVCache(1, window=5), [], 0
    for L in (3, 1, 1, 4, 1, 7, 1, 2, 1, 1):
        k = torch.randn(1, 2, L, 4)
        seen.append(k)
        kk, vv, pp = cache.extend(0, k, k + 1, torch.arange(t, t + L))
        t += L
        want = torch.cat(seen, 2)[:, :, -w:]
        assert torch.equal(kk, want) and torch.equal(vv, want + 1)
        assert torch.equal(pp, torch.arange(max(0, t - w), t))
    buf = cache._buf[0][0]
    assert buf.shape[2] == 2 * w and kk.data_ptr() >= buf.data_ptr()  # a view into the ring


def test_windowed_cache_decoding_equals_recomputed_window_for_one_layer():
    """With one layer the cache holds exactly the last w tokens' K/V: same as re-encoding them."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="alibi", vocab_size=50, dim=32, heads=4, layers=1)).eval()
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(2))
    w = 8
    with torch.no_grad():
        cache = KVCache(1, window=w)
        m(idx[:, :w], positions=torch.arange(w), cache=cache)
        for t in range(w, 40):
            got = m(idx[:, t:t + 1], positions=torch.tensor([t]), cache=cache)[:, -1]
            want = m(idx[:, t - w + 1:t + 1], positions=torch.arange(t - w + 1, t + 1))[:, -1]
            assert (got - want).abs().max() < 2e-5


def test_rotary_decoding_uses_absolute_positions():
    torch.manual_seed(0)  # large weights: sharp attention, so a wrong rotation shows clearly
    m = GPT(ModelConfig(scheme="rotary", vocab_size=50, dim=32, heads=4, layers=2, init_std=0.3)).eval()
    idx = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = KVCache(2)
        m(idx[:, :29], positions=torch.arange(29), cache=cache)
        step = m(idx[:, 29:], positions=torch.tensor([29]), cache=cache)[:, -1]
        wrong = KVCache(2)
        m(idx[:, :29], positions=torch.arange(29), cache=wrong)
        shifted = m(idx[:, 29:], positions=torch.tensor([40]), cache=wrong)[:, -1]
        full = m(idx)[:, -1]
    assert (step - full).abs().max() < 2e-5 and (shifted - full).abs().max() > 1e-4


def test_hankel_mask_probe_and_view_layout():
    assert A.hankel_ok(torch.device("cpu"))
    ext = torch.arange(10.0)[None]
    view = A.hankel_view(ext, 2, 3, 4)  # [1, 1, 3, 4]
    assert torch.equal(view[0, 0], torch.tensor([[2.0, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7]]))
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v, attn_mask=view),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=view.contiguous()), atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "blocked", "plain"])
@pytest.mark.parametrize("scheme", ["alibi", "windowed", "kerple-log"])
def test_tables_cached_under_inference_mode_do_not_break_a_later_backward(scheme, impl):
    """An evaluation (inference_mode) fills the scheme's table cache; input gradients afterwards
    (ERF) must neither fail nor change: the inference-mode entries are rebuilt, not reused."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50, layers=2, heads=2, dim=16, scheme=scheme, train_length=16)).eval()
    idx = torch.randint(0, 50, (1, 40))
    opts = AttnOptions(impl=impl, block_size=8)
    with torch.inference_mode():
        ref = model(idx, opts=opts)
    out = model(idx, opts=opts)
    out[0, -1].logsumexp(-1).backward()  # fails on inference tensors without the rebuild
    assert torch.allclose(out.detach(), ref)
    assert all(p.grad is not None for p in model.blocks[0].parameters() if p.requires_grad)

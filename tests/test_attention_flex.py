"""FlexAttention path (model/flex.py, docs/attention.md): its score_mod / mask_mod / block mask
against the reference path for every registered bias scheme (CPU forward, eager), the gradient to
learnable tables, when attend() picks it, and on CUDA (`-m gpu`) forward and gradients of a whole
model in fp32 and bf16 against the plain path."""
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.io import UserError
from extrapolab.model import flex, folded as folded_mod
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, ModelConfig
from flexspy import eager_dense_calls, gathers_per_tensor, grad_mismatches, launch_spy, stub_kernel

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention")
BIAS_SCHEMES = [n for n in positional.names()  # score-level schemes (DAPE) never take FlexAttention
                if positional.build(n, num_heads=1).has_bias and not positional.build(n, num_heads=1).reference_only]


def _scheme(name, heads=3, seed=3):
    s = positional.build(name, num_heads=heads)
    with torch.no_grad():  # learnable parameters away from their (often zero) init
        for p in s.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    s.constrain_()
    return s


def _qkv(B, H, Lq, Lk, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Lq, D, generator=g, dtype=dtype),
            *(torch.randn(B, H, Lk, D, generator=g, dtype=dtype) for _ in range(2)))


@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_flex_forward_on_cpu_equals_reference_for_every_scheme(name):
    """Score and mask functions of the CUDA path, run by eager FlexAttention on the CPU: several
    128-blocks, queries after a cached prefix, window, temperature, every sliding-dilated level."""
    s = _scheme(name)
    levels = range(4) if s.layer_dependent else [0]
    with torch.no_grad():
        for Lq, Lk in ((300, 300), (130, 200)):
            q, k, v = _qkv(1, 3, Lq, Lk, 16)
            k_pos = torch.arange(Lk) + 5
            q_pos = k_pos[-Lq:]  # the newest Lq positions (a chunk after a KV cache)
            for layer in levels:
                for kw in ({}, {"window": 37}, {"temperature": 0.6}):
                    ref, _ = attend(q, k, v, q_pos, k_pos, s, layer, AttnOptions(impl="plain", **kw))
                    got, _ = attend(q, k, v, q_pos, k_pos, s, layer, AttnOptions(impl="flex", **kw))
                    err = (got - ref).abs().max().item()
                    assert err < 2e-5, (name, Lq, Lk, layer, kw, err)


@pytest.mark.parametrize("name", ["kerple-log", "t5", "sliding-dilated", "kerple-bias-wht"])
def test_flex_learnable_tables_receive_the_reference_gradient(name):
    """Captured tables of the score_mod get gradients (on CPU FlexAttention allows it while q, k,
    v need none); equal to autograd through the reference path."""
    s = _scheme(name)
    q, k, v = _qkv(2, 3, 200, 200, 16)
    pos = torch.arange(200)
    go = torch.randn(2, 3, 200, 16, generator=torch.Generator().manual_seed(1))
    grads = {}
    for impl in ("plain", "flex"):
        out, _ = attend(q, k, v, pos, pos, s, 1, AttnOptions(impl=impl, temperature=0.8))
        grads[impl] = torch.autograd.grad(out, list(s.parameters()), go)
    for a, b in zip(grads["flex"], grads["plain"]):
        assert a.abs().max() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, (a - b).abs().max())


def _dense_blocks(num, idx, KB):
    out = torch.zeros(num.shape[-1], KB, dtype=torch.bool)  # [QB, KB]
    for r in range(num.shape[-1]):
        out[r, idx[0, 0, r, :num[0, 0, r]].long()] = True
    return out


@pytest.mark.parametrize("Lq,Lk,off,block", [(300, 300, 0, 128), (70, 260, 190, 32), (257, 257, 0, 64)])
def test_block_mask_from_prefix_sums_equals_create_block_mask(Lq, Lk, off, block):
    """The analytic BlockMask (no Lq x Lk tensor) has the same partial and full blocks as torch's
    create_block_mask, which evaluates the mask_mod at every (query, key)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = off + Lq
    d = torch.arange(n)
    for finite in (torch.ones(n, dtype=torch.bool), d < 45, (d % 16 == 0) & (d < 64)):  # causal, window, dilation
        mine = flex.block_mask(finite, Lq, Lk, off, block)
        ref = create_block_mask(flex.mask_mod_for(finite, torch.tensor(off)), None, None, Lq, Lk,
                                device="cpu", BLOCK_SIZE=block)
        KB = math.ceil(Lk / block)
        for a, b in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            got = _dense_blocks(getattr(mine, a), getattr(mine, b), KB)
            want = _dense_blocks(getattr(ref, a), getattr(ref, b), KB)
            assert torch.equal(got, want), (a, finite[:20])


def test_block_mask_is_cached_per_shape_and_window():
    s = _scheme("alibi")
    q, k, v = _qkv(1, 3, 150, 150, 16)
    pos = torch.arange(150)
    with torch.no_grad():
        for window in (None, None, 40):
            attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex", window=window))
    keys = [key for key in s._table_cache if key[0] == "flexmask"]
    assert len(keys) == 2 and {key[5] for key in keys} == {None, 40}


def test_flex_selection_rules():
    """attend() picks FlexAttention on CUDA for bias schemes of a full forward, never on CPU; two-pass
    schemes take their own path on both."""
    kw = dict(same_pos=True, starts=(0, 0), dense_bias=False, grad=True)
    L = flex.MIN_LENGTH
    for name in positional.names():
        s = positional.build(name, num_heads=4)
        folded = s.has_content or s.alibi_slopes() is not None  # what attend() finds at increasing positions
        # FIRE: queries at positions <= its L see the distance table; here all of them (its rows beyond L:
        # tests/test_fire_flex.py)
        split = None if s.toeplitz_rows() is None else L
        for dev in ("cpu", "cuda"):
            path, _ = select_path(dev, s, AttnOptions(), (2, 4, L, 64), L, folded=folded, split=split, **kw)
            biased = s.has_bias or s.has_weight
            # training (grad=True) a learnable table takes the dense mask's path (flex.AUTO_TABLE_GRAD is off)
            flexed = dev == "cuda" and flex.supported("cuda", 64, torch.float32) and not s.learnable
            want = ("flex" if flexed else "toeplitz") \
                if biased else "twopass" if s.second_pass() is not None else "causal"  # Self-Extend / ReRoPE
            want = "reference" if s.reference_only else "folded" if s.has_content else want
            assert path == want, (name, dev, path)
            if dev == "cuda" and biased and not s.reference_only and not s.has_content:  # evaluation: flex
                path, _ = select_path(dev, s, AttnOptions(), (2, 4, L, 64), L, folded=folded, split=split,
                                      **{**kw, "grad": False})
                want = "flex" if flex.supported("cuda", 64, torch.float32) else "toeplitz"
                if s.alibi_slopes() is not None and folded_mod.LONG_EVAL:  # ALiBi's form: flash with extra columns
                    want = "folded"
                assert path == want, (name, path)
    alibi = positional.build("alibi", num_heads=4)
    cases = [
        (dict(opts=AttnOptions(), q=(1, 4, 1, 64), Lk=600, starts=(599, 0), same_pos=False), "toeplitz"),  # decoding
        (dict(opts=AttnOptions(need_probs=True)), "reference"),
        (dict(opts=AttnOptions(logits_sink=lambda *a: None)), "reference"),
        (dict(opts=AttnOptions(), starts=(None, 0)), "fallback"),  # non-contiguous positions
        (dict(opts=AttnOptions(), q=(2, 4, L, 8)), "toeplitz"),  # head size FlexAttention does not tile
        (dict(opts=AttnOptions(impl="sdpa")), "toeplitz"),
    ]
    for case, want in cases:
        c = {"q": (2, 4, L, 64), "Lk": L, **kw, **case}
        path, _ = select_path("cuda", alibi, c.pop("opts"), c.pop("q"), c.pop("Lk"), **c)
        assert path == want, (case, path)
    # below MIN_LENGTH the dense mask's path (faster on an H100 at 16 x 512: Qin 1.11x NoPE's step, flex 1.54x)
    for grad in (True, False):
        path, _ = select_path("cuda", alibi, AttnOptions(), (2, 4, L // 2, 64), L // 2, **{**kw, "grad": grad})
        assert path == "toeplitz", (grad, path)


@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_score_mods_index_each_gradient_requiring_capture_once(name, monkeypatch):
    """FlexAttention's compiled backward takes one index per captured tensor that requires a gradient (on an
    H100 FIRE's flex rows failed to compile: "multiple indexing operations on the same tensor that requires
    gradients"). Every score_mod a training forward hands the kernel -- distance tables, FIRE's own term
    beyond L -- traced as FlexAttention traces it, indexes each such tensor at most once."""
    seen = []

    def kernel(q, k, v, score_mod=None, block_mask=None, scale=None, gather=True, **kw):
        seen.append(gathers_per_tensor(score_mod))
        return stub_kernel(q, k, v, score_mod, block_mask, scale, gather, **kw)

    monkeypatch.setattr(flex, "kernel", lambda device: kernel)
    monkeypatch.setattr(flex.table_grad, "attach", lambda out, *a, **kw: out)  # CPU: no gradient into layer 2's q
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=64, heads=4, layers=2, train_length=32))
    for n, p in m.named_parameters():  # CPU FlexAttention: scheme gradients only, q/k/v need none
        p.requires_grad_(n.startswith("scheme."))
    m(torch.randint(0, 64, (1, 96)), opts=AttnOptions(impl="flex"))  # FIRE: L = 32, most rows beyond it
    assert seen and all(c <= 1 for counts in seen for c in counts.values()), (name, seen)
    # the spy saw the learnable captures; a learnable table (no weight kernel) is read detached, its gradient
    # from model/table_grad.py: no capture needs one (FIRE's rows beyond L still capture its MLP)
    detached = flex.tracks_table(m.scheme) and not m.scheme.has_flex_bias
    assert any(seen) == (m.scheme.learnable and not detached), (name, seen)


def test_gather_spy_sees_a_second_index_of_one_tensor():
    t = torch.zeros(4, 8, requires_grad=True)
    assert list(gathers_per_tensor(lambda s, b, h, q, kv: s + t[h, q] + t[h, kv]).values()) == [2]
    assert gathers_per_tensor(lambda s, b, h, q, kv: s + t.detach()[h, q]) == {}


def test_alibi_windowed_and_closed_forms_gather_nothing_in_the_kernel(monkeypatch):
    """ALiBi's score_mod is closed form (a per-head slope times the distance), KERPLE's and Qin's too (their
    ``closed_form``: a log1p per score, flex.CLOSED_FORM), and windowed attention's is the mask alone: no [M, N]
    gather from a captured table, so torch's default tiles fit; other tables keep the gather, and so do KERPLE and
    Qin with flex.CLOSED_FORM off. The values are checked against the reference for every scheme by
    test_flex_forward_on_cpu_equals_reference_for_every_scheme (and tests/test_closed_form.py)."""
    seen = {}

    def kernel(q, k, v, score_mod=None, block_mask=None, scale=None, gather=True):
        seen[name] = gather
        return torch.zeros_like(q)

    monkeypatch.setattr(flex, "kernel", lambda device: kernel)
    for closed in (True, False):
        monkeypatch.setattr(flex, "CLOSED_FORM", closed)
        seen.clear()
        for name in ("alibi", "windowed", "kerple-log", "qin-type1", "sandwich", "t5"):
            q, k, v = _qkv(1, 2, 40, 40, 16)
            with torch.no_grad():
                attend(q, k, v, torch.arange(40), torch.arange(40), _scheme(name, heads=2), 0, AttnOptions(impl="flex"))
        assert seen == {"alibi": False, "windowed": False, "kerple-log": not closed, "qin-type1": not closed,
                        "sandwich": True, "t5": True}, closed


def test_gradient_comparison_floors_noise_but_not_real_errors():
    """The GPU tests' comparison: rounding noise on a parameter whose exact gradient is 0 (FIRE's b2 on the
    H100: 2.9e-10 vs 6.5e-11, relative error 0.97) passes; a 1% error on a parameter that matters does not."""
    want = {"w": torch.tensor([0.5, -0.25, 1.0]), "b2": torch.tensor([6.5e-11, -1.0e-10])}
    noisy = {"w": want["w"].clone(), "b2": torch.tensor([2.9e-10, 7.3e-11])}
    assert grad_mismatches(noisy, want, 1e-4, torch.float32) == []
    wrong = {"w": want["w"] * 1.01, "b2": want["b2"]}
    assert [n for n, *_ in grad_mismatches(wrong, want, 1e-4, torch.float32)] == ["w"]


def test_flex_on_cpu_with_input_gradients_is_a_one_line_error():
    s = positional.build("alibi", num_heads=2)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 20, 20, 16))
    with pytest.raises(UserError, match="impl='auto'") as err:
        attend(q, k, v, torch.arange(20), torch.arange(20), s, 0, AttnOptions(impl="flex"))
    assert "\n" not in str(err.value)


# ---- CUDA: the path training and evaluation take there ------------------------------------------
# head_dim 64 as the demo presets; lengths on both sides of FlexAttention's 128-block; each test
# also asserts that torch's eager dense FlexAttention never ran and the compiled kernel has room.
def _gpt(name, heads=4, head_dim=64):
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=heads * head_dim, heads=heads, layers=2,
                        train_length=1024)).cuda()
    with torch.no_grad():
        for p in m.scheme.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)).cuda() * 0.5)
    m.constrain_()
    return m


def _run(m, idx, impl, dtype):
    m.zero_grad()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = m(idx, opts=AttnOptions(impl=impl))
    out.float().square().mean().backward()
    return out.float().detach(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _flex_calls(monkeypatch) -> list:
    calls, real = [], flex.flex_attention_path
    monkeypatch.setattr(flex, "flex_attention_path", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_cuda_flex_forward_and_gradients_equal_plain(name, dtype, monkeypatch):
    """A training step through the compiled FlexAttention kernel matches the plain path at head_dim
    64, below and above the 128-block: in fp32 to fp32 rounding; in bf16 within twice the plain
    path's own bf16 error against fp32 (plus 1e-3). fp32 at 300 tokens only (whole blocks and a partial one):
    each length is a cold compile, and the fp32 half of this matrix took 80-120 s a test on an H200
    (docs/results/gpu-h200-2026-11-27.md), most of the GPU check's pytest stage."""
    dense = eager_dense_calls(monkeypatch)
    calls = _flex_calls(monkeypatch)
    launched = launch_spy(monkeypatch, flex.table_grad)  # a learnable table's gradient: the kernel, never atomics
    m = _gpt(name)
    for L in ((300,) if dtype == torch.float32 else (100, 300)):
        idx = torch.randint(0, 64, (2, L), device="cuda", generator=torch.Generator("cuda").manual_seed(L))
        o_ref, g_ref = _run(m, idx, "plain", torch.float32)
        calls.clear()
        o, g = _run(m, idx, "flex", dtype)
        assert len(calls) == 2, "the flex path did not run"  # one per layer
        assert g.keys() == g_ref.keys() and any("scheme" in n for n in g) == m.scheme.learnable
        if dtype == torch.float32:
            assert _rel(o, o_ref) < 1e-5, (name, L)
            bad = grad_mismatches(g, g_ref, 1e-4, dtype)
            assert not bad, (name, L, bad)
        else:
            o_low, g_low = _run(m, idx, "plain", dtype)
            assert _rel(o, o_ref) <= 2 * _rel(o_low, o_ref) + 1e-3, (name, L)
            bad = grad_mismatches(g, g_ref, 1e-3, dtype, g_low)
            assert not bad, (name, L, bad)
    assert dense == [], "torch's eager dense FlexAttention ran"
    assert not flex.kernel("cuda").full
    if flex.tracks_table(m.scheme) and not m.scheme.has_flex_bias:
        assert launched and not flex.table_grad._FAILED, name


@pytest.mark.gpu
def test_cuda_auto_takes_flex_from_min_length_only(monkeypatch):
    dense = eager_dense_calls(monkeypatch)
    calls = _flex_calls(monkeypatch)
    m = _gpt("alibi")
    for L, want in ((64, 0), (flex.MIN_LENGTH, 2)):
        calls.clear()
        _run(m, torch.randint(0, 64, (2, L), device="cuda"), "auto", torch.bfloat16)
        assert len(calls) == want, (L, len(calls))
    assert dense == []


@pytest.mark.gpu
def test_cuda_auto_takes_flex_and_long_forward_has_no_LxL_tensor(monkeypatch):
    dense = eager_dense_calls(monkeypatch)
    assert flex.supported("cuda", 64, torch.bfloat16)
    s = positional.build("kerple-log", num_heads=4).cuda()
    L = 32768  # one [H, L, L] bf16 score tensor would be 8 GiB
    q, k, v = (torch.randn(1, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pos = torch.arange(L, device="cuda")
    with torch.no_grad():
        attend(q, k, v, pos, pos, s, 0, AttnOptions())  # compile and cache
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attend(q, k, v, pos, pos, s, 0, AttnOptions())
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 256 * 2**20
    assert len(flex._COMPILED) == 1 and dense == []


@pytest.mark.slow
def test_compiled_flex_equals_reference_without_recompiling(monkeypatch):
    """The compiled kernel CUDA uses, run here on the CPU (forward; inductor's CPU template): equal
    to the reference, and new temperatures, layers, offsets or schemes of the same form reuse the
    compiled graph (captured 0-d tensors, not constants). Compiling takes minutes on a small CPU."""
    from torch._dynamo.utils import counters

    compiled = flex.Compiled()
    monkeypatch.setattr(flex, "kernel", lambda device: compiled)
    graphs = []
    for name in ("alibi", "sliding-dilated", "kerple-bias-wht"):
        s = _scheme(name, heads=2)
        q, k, v = _qkv(1, 2, 256, 256, 16)
        pos = torch.arange(256)
        with torch.no_grad():
            for layer, tau in ((0, 1.0), (1, 0.7), (0, 0.5)):
                got, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="flex", temperature=tau))
                ref, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="plain", temperature=tau))
                assert (got - ref).abs().max() < 2e-5, (name, layer, tau)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0] + 1  # the wht form is a second graph

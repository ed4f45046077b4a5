"""The contract every registered positional scheme keeps (docs/architecture.md), run over ``names()``.

A scheme is exempted from a check only through an attribute that says why: ``has_bias`` (no
additive bias), ``relative`` (Toeplitz), ``layer_dependent`` (checked per layer),
``isinstance(RelativeBias)`` (distance table), and a learnable absolute table (kind "absolute"
with parameters: it cannot encode positions it never saw, so it must refuse them).
Tiny models (dim 32, 2 layers, 4 heads) keep the whole file to a few seconds.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from decoding import decode

from extrapolab import positional as P
from extrapolab.memory import PeakMemory
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.base import RelativeBias, SchemeError
from extrapolab.positional.registry import REGISTRY

H, DIM, LAYERS, VOCAB = 4, 32, 2, 61
OPTION_VARIANTS = [
    ("alibi", {"shift": 1.0}),
    ("alibi", {"equal_exponent": 3.0}),
    ("windowed", {"window": 5}),
    ("t5", {"num_buckets": 8, "max_distance": 20}),
    ("sandwich", {"dbar": 16, "convention": "eq6"}),
    ("sandwich", {"ratios": [0.5, 1.0, 2.0, 4.0]}),
    ("smoothed-sandwich", {"fit_window": 50, "fit_start": 0}),
    ("sliding-dilated", {"C": 3}),
    ("rotary", {"base": 500.0}),
    ("rotary-yarn", {"mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),  # DeepSeek / gpt-oss variants
    ("rotary-longrope", {"short_factor": [1.0, 1.1, 1.2, 1.5], "long_factor": [1.0, 2.0, 6.0, 9.0]}),  # d_head 8
    ("rotary-proportional", {"p": 0.5, "factor": 2.0}),
    ("fire", {"shared": True}),  # FIRE-Shared: one f_θ for every layer, dense rows beyond L built once per forward
    ("dape-alibi", {"kernel": 3}),  # DAPE V2: a 1×3 convolution over keys (future keys enter as zeros)
    ("stick-breaking", {"attend_current": True}),
    ("pope", {"phase_bias": False}),
    ("selective", {"base": "alibi", "head": 1}),  # selection on ALiBi's logits (bias included), another head
]
USER = "contract-user-b-per-head"  # a user callable, registered only while its case runs


def _user_b(k, h):
    return 1.0 / (k + 1.0) ** (1.0 + 0.5 * h)


CASES = [pytest.param(n, {}, id=n) for n in P.names()]
CASES += [pytest.param(n, o, id=f"{n}-{'-'.join(map(str, o))}") for n, o in OPTION_VARIANTS if n in REGISTRY]
CASES += [pytest.param(USER, {}, id="user-callable")]


@contextlib.contextmanager
def registered(name):
    added = name == USER and name not in REGISTRY
    if added:
        P.register_callable(USER, _user_b, form="b", per_head=True)
    try:
        yield
    finally:
        if added:
            REGISTRY.pop(USER)


def _randomize_(scheme):
    """Learned parameters start at constants (T5, RegularGPT zeros): randomise so checks bite."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in scheme.parameters():
            p.copy_(torch.rand(p.shape, generator=g) * 1.4 + 0.1)
    scheme.constrain_()
    return scheme


def _scheme(name, opts):
    params = dict(opts)
    accepted = P.scheme_params(REGISTRY[name])
    sizes = {"dim": DIM, "layers": 3, "head_dim": DIM // H}  # learned APE's width, per-layer parameters
    params.update({k: v for k, v in sizes.items() if k in accepted and k not in params})
    return _randomize_(P.build(name, H, **params))


def long_inputs(s, L: int = 8192, seed: int = 5):
    """q, k, v [1, H, L, D], positions [L], content positions (for schemes with positions from content) and
    the generator that drew them: the long-attention memory tests' inputs."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, L, DIM // H, generator=g) for _ in range(3))
    content = None
    if s.has_content:
        p = torch.rand(1, H, L, generator=g, dtype=torch.float64).cumsum(-1)  # [1, H, L]
        content = (p, p)
    return q, k, v, torch.arange(L), content, g


def _model(name, opts, train_length):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, layers=LAYERS, heads=H, dim=DIM, scheme=name,
                      scheme_params=dict(opts), train_length=train_length)
    model = GPT(cfg)
    _randomize_(model.scheme)
    return model


def _layers(scheme):
    return range(3) if scheme.layer_dependent else (0,)


@pytest.mark.parametrize("name,opts", CASES)
def test_metadata_and_options_roundtrip(name, opts):
    with registered(name):
        cls = REGISTRY[name]
        assert cls.paper.strip() and cls.summary.strip(), "paper and summary must be filled in"
        assert cls.kind in ("none", "absolute", "rotary", "bias", "content", "score", "hybrid")
        s = _scheme(name, opts)
        again = P.build(name, H, **{k: v for k, v in s.options().items()})
        assert again.options() == s.options()


@pytest.mark.parametrize("name,opts", CASES)
def test_bias_causal_toeplitz_finite_diagonal(name, opts):
    with registered(name):
        s = _scheme(name, opts)
        pos = torch.arange(40)
        if not s.has_bias:
            assert s.bias(pos, pos) is None
            return
        for layer in _layers(s):
            b = s.bias(pos, pos, layer).detach()  # [H, 40, 40]
            assert b.shape == (H, 40, 40)
            upper = torch.triu(torch.ones(40, 40, dtype=torch.bool), 1)
            assert torch.isneginf(b[:, upper]).all(), "future keys must be -inf"
            assert torch.isfinite(torch.diagonal(b, dim1=1, dim2=2)).all(), "bias(0) must be finite"
            assert not torch.isnan(b).any() and not (b == math.inf).any()
            if s.relative:
                assert torch.equal(b[:, 1:, 1:], b[:, :-1, :-1]), "relative bias must be Toeplitz"


@pytest.mark.parametrize("name,opts", CASES)
def test_any_block_equals_slice_of_full_matrix(name, opts):
    with registered(name):
        s = _scheme(name, opts)
        if not s.has_bias:
            pytest.skip("no additive bias (has_bias is False)")
        g = torch.Generator().manual_seed(2)
        off, n = 1000, 96
        full_pos = torch.arange(off, off + n)
        for layer in _layers(s):
            full = s.bias(full_pos, full_pos, layer).detach()  # [H, n, n]
            for _ in range(3):
                qi = torch.randperm(n, generator=g)[:17].sort().values  # non-contiguous queries
                ki = torch.randperm(n, generator=g)[:29]  # keys, any order
                block = s.bias(full_pos[qi], full_pos[ki], layer).detach()  # [H, 17, 29]
                torch.testing.assert_close(block, full[:, qi][:, :, ki], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,opts", CASES)
def test_distance_table_agrees_with_bias(name, opts):
    with registered(name):
        s = _scheme(name, opts)
        if not isinstance(s, RelativeBias):
            pytest.skip("not a RelativeBias: no distance table")
        n = 70
        pos = torch.arange(n)
        dist = pos[:, None] - pos[None, :]
        for layer in _layers(s):
            table = s.distance_table(n, layer).detach()  # [H, n]
            b = s.bias(pos, pos, layer).detach()  # [H, n, n]
            lower = dist >= 0
            torch.testing.assert_close(b[:, lower], table[:, dist[lower]], rtol=1e-6, atol=1e-6)
            longer = s.distance_table(3 * n, layer).detach()  # a longer table extends the shorter
            torch.testing.assert_close(longer[:, :n], table, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,opts", CASES)
def test_flex_bias_agrees_with_bias(name, opts):
    """A scheme's FlexAttention term (``flex_bias``, pointwise, so it broadcasts over a grid of indices) equals
    ``bias`` at every visible (query, key), for queries after a cached prefix."""
    with registered(name):
        s = _scheme(name, opts)
        if not s.has_flex_bias:
            pytest.skip("no flex_bias: FlexAttention reads the distance table, if any")
        a, c, Lq = 13, 5, 50  # queries at 13..62 over keys at 5..62
        q_pos, k_pos = torch.arange(a, a + Lq), torch.arange(c, a + Lq)
        h, qi, ki = torch.arange(H)[:, None, None], torch.arange(Lq)[None, :, None], torch.arange(len(k_pos))[None, None]
        visible = q_pos[:, None] >= k_pos[None]  # [Lq, Lk]
        for layer in _layers(s):
            with torch.no_grad():
                got = s.flex_bias(layer, a, c, Lq, a + Lq - c)(h, qi, ki)  # [H, Lq, Lk]
                want = s.bias(q_pos, k_pos, layer)
            torch.testing.assert_close(got.expand_as(want)[:, visible], want[:, visible], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,opts", CASES)
def test_learnable_flag_matches_parameters_and_gradients(name, opts):
    with registered(name):
        model = _model(name, opts, train_length=24)
        s = model.scheme
        params = [p for p in s.parameters() if p.requires_grad]
        assert s.learnable == bool(params)
        idx = torch.randint(0, VOCAB, (2, 24))
        if not params:  # parameter-free: its bias carries no graph (keeps SDPA's fused kernel)
            b = s.bias(torch.arange(24), torch.arange(24))
            assert b is None or not b.requires_grad
            return
        model.loss(idx[:, :-1], idx[:, 1:]).backward()
        for p in params:
            assert p.grad is not None and p.grad.abs().sum() > 0, "a learnable parameter gets no gradient"


@pytest.mark.parametrize("name,opts", CASES)
def test_gpt_trains_5_steps_and_runs_16x_longer(name, opts):
    with registered(name):
        L = 16
        model = _model(name, opts, train_length=L)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            idx = torch.randint(0, VOCAB, (4, L + 1), generator=g)
            loss = model.loss(idx[:, :-1], idx[:, 1:])
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.constrain_()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        long_idx = torch.randint(0, VOCAB, (1, 16 * L), generator=g)
        s = model.scheme
        with torch.no_grad():
            if s.kind == "absolute" and s.learnable:  # a learned table has no row for unseen positions
                with pytest.raises(SchemeError) as err:
                    model(long_idx)
                assert str(L) in str(err.value) and "\n" not in str(err.value)
            else:
                logits = model(long_idx)
                assert logits.shape == (1, 16 * L, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name,opts", CASES)
def test_sdpa_plain_blocked_paths_agree_and_prefix_is_causal(name, opts):
    with registered(name):
        L = 48
        model = _model(name, opts, train_length=L).eval()
        idx = torch.randint(0, VOCAB, (2, L))
        with torch.no_grad():
            ref = model(idx, opts=AttnOptions(impl="sdpa"))
            for impl, bs in (("plain", 1024), ("blocked", 7), ("blocked", 16), ("auto", 1024)):
                out = model(idx, opts=AttnOptions(impl=impl, block_size=bs))
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{impl}/{bs}")
            prefix = model(idx[:, :19], opts=AttnOptions(impl="sdpa"))
            torch.testing.assert_close(prefix, ref[:, :19], rtol=1e-5, atol=1e-5)
            if model.scheme.relative:  # translation invariance: only m - n matters
                moved = model(idx, positions=torch.arange(1000, 1000 + L),
                              opts=AttnOptions(impl="blocked", block_size=9))
                torch.testing.assert_close(moved, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,opts", CASES)
def test_cached_decoding_equals_the_parallel_forward(name, opts):
    """Causal decoding with a KV cache (a 7-token prompt, then one token at a time) gives the parallel
    forward's outputs: rotated keys, positions from content and per-layer schemes are cached right."""
    with registered(name):
        model = _model(name, opts, train_length=32).eval()
        idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            full = model(idx)
            steps = decode(model, idx, 7, KVCache(LAYERS))
        torch.testing.assert_close(steps, full, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name,opts", CASES)
def test_long_attention_never_builds_an_L_by_L_tensor(name, opts):
    """8,192 tokens through attend(): one [H, L, L] fp32 tensor would be 1 GiB; every scheme stays
    far below (score-level schemes hold one block of 64 query rows at a time, ~8 MiB a tensor)."""
    with registered(name):
        s = _scheme(name, opts)
        q, k, v, pos, content, _ = long_inputs(s)
        for layer in _layers(s):
            with torch.no_grad(), PeakMemory() as mem:
                out, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(), content=content)
            assert torch.isfinite(out).all() and mem.mib < 256, (layer, mem.mib)


@pytest.mark.parametrize("name,opts", CASES)
def test_every_masked_sdpa_call_gets_a_mask_in_q_dtype(name, opts, monkeypatch):
    """Under bf16 autocast a bias computed in fp32 must reach SDPA as bf16: cuDNN on the H100 reads a float mask
    of another dtype as q's, silently wrong (pytorch#191612). Every path, every scheme, a whole model (a window,
    blocks, a chunk after a KV cache); and on CUDA such a call never takes cuDNN (model/sdpa.py)."""
    import torch.nn.functional as F

    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.is_floating_point():
            seen.append((attn_mask.dtype, q.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with registered(name):
        m = _model(name, opts, 48 if REGISTRY[name].kind == "absolute" else 16)  # learned APE: positions < L_tr
        idx = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for o in (AttnOptions(), AttnOptions(impl="blocked", block_size=16), AttnOptions(window=8)):
                m(idx, opts=o)
            cache = KVCache(LAYERS)  # a chunk after a cached prefix (queries after keys)
            m(idx[:, :40], positions=torch.arange(40), cache=cache)
            m(idx[:, 40:], positions=torch.arange(40, 48), cache=cache)
    assert all(mask == q for mask, q in seen), (name, sorted(set(seen)))
    s = m.scheme
    if s.has_bias and not s.reference_only and not s.has_weight:  # wht kernels: tiled softmax, no SDPA
        assert seen, "no masked SDPA call was seen: the spy is blind"


def test_masked_sdpa_casts_the_mask_and_leaves_out_cudnn(monkeypatch):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from extrapolab.model.sdpa import masked_backends, sdpa

    seen, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, attn_mask=None, **kw: seen.append(attn_mask.dtype) or real(q, k, v, attn_mask, **kw))
    q = torch.randn(1, 2, 5, 8).bfloat16()
    out = sdpa(q, q, q, torch.zeros(1, 2, 5, 5))  # an fp32 bias with bf16 q
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16

    assert SDPBackend.CUDNN_ATTENTION not in masked_backends()
    assert SDPBackend.EFFICIENT_ATTENTION in masked_backends()  # takes any float mask, returns its gradient

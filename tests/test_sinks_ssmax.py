"""Attention sinks (gpt-oss) and SSMax (Nakanishi 2025) through attend(): every path that carries them against
the papers' equations written here (fp64, outputs and gradients), both fused sink forms, the path each call
takes, and gpt-oss's reference attention in transformers."""
import math

import pytest
import torch

from extrapolab import positional as P
from extrapolab.io import UserError
from extrapolab.model import attention as attn_mod
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.reference import keys_seen
from extrapolab.model.sinks import column_form, sink_sdpa

H, D = 3, 8


def _qkv(B=2, L=30, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))


def _dense(q, k, v, q_pos, k_pos, scheme, *, sinks=None, ssmax=None, window=None, tau=1.0, content=None):
    """The equations: l = rotate(q)·rotate(k)/sqrt(d) + b(m, n) - s_h·(p_m - p_n), masked; SSMax (Nakanishi 2025,
    eq. 2) multiplies the whole logit by s_h·log n_m, n_m the keys query m sees; the sink (gpt-oss ``sdpa``) is
    one more column s_h of the softmax (after the same temperatures), dropped before p·v."""
    q, k = scheme.rotate(q, k, q_pos, k_pos)
    lg = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Lq, Lk]
    if scheme.has_bias:
        lg = lg + scheme.bias(q_pos, k_pos, 0).to(lg.dtype)
    if content is not None:
        lg = lg - scheme.alibi_slopes(0).view(1, -1, 1, 1) * (content[0][..., :, None] - content[1][..., None, :])
    dist = q_pos[:, None] - k_pos[None, :]
    vis = (dist >= 0) if window is None else (dist >= 0) & (dist < window)
    beta = torch.ones(1, H, len(q_pos), dtype=lg.dtype)
    if ssmax is not None:
        n = vis.sum(-1).to(lg.dtype)  # [Lq] keys seen
        beta = ssmax.view(1, -1, 1) * torch.log(n)[None, None]  # [1, H, Lq]
    lg = (torch.where(vis, lg, 0.0) * beta[..., None] / tau).masked_fill(~vis, -math.inf)  # (no inf·0 in the graph)
    if sinks is not None:
        col = (sinks.view(1, -1, 1, 1) * beta[..., None] / tau).expand(*lg.shape[:-1], 1)
        p = torch.softmax(torch.cat([lg, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(lg, -1)
    return p @ v


def _spy(monkeypatch):
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)[0]) or real(*a, **kw))
    return seen


def _check(name, opts, paths, monkeypatch, *, positions=None, sinks=True, ssmax=False, content=False, window=None,
           tau=1.0, q_from=0, tol=1e-10):
    scheme = P.build(name, H, **({"layers": 1} if name == "fox" else {}))
    q, k, v = _qkv()
    L = q.shape[2]
    pos = torch.arange(L) if positions is None else positions
    s = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True) if sinks else None
    a = torch.tensor([0.4, 0.25, 0.7], dtype=torch.float64, requires_grad=True) if ssmax else None
    cont = None
    if content:
        p = torch.rand(2, H, L, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).cumsum(-1)
        cont = (p[..., q_from:], p)
    seen = _spy(monkeypatch)
    qs = q[:, :, q_from:]
    got, _ = attend(qs, k, v, pos[q_from:], pos, scheme, 0, AttnOptions(**opts, temperature=tau, window=window),
                    content=cont, sinks=s, ssmax=a)
    want = _dense(qs, k, v, pos[q_from:], pos, scheme, sinks=s, ssmax=a, window=window, tau=tau, content=cont)
    assert seen and set(seen) == {paths}, seen
    torch.testing.assert_close(got, want, rtol=10 * tol, atol=tol)
    g = torch.randn_like(got)
    params = [t for t in (q, k, v, s, a) if t is not None]
    for x, y in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(x, y, rtol=100 * tol, atol=10 * tol)


@pytest.mark.parametrize("name,opts,path,kw", [
    ("none", {}, "causal", {}),
    ("rotary", {}, "causal", {"ssmax": True}),
    ("none", {}, "causal", {"sinks": False, "ssmax": True}),
    ("alibi", {}, "folded", {}),  # contiguous ALiBi folds when it has sinks
    ("alibi", {}, "folded", {"ssmax": True, "tau": 1.3}),
    ("alibi", {}, "folded", {"positions": torch.tensor([0, 3, 4, 9, 10, 11, 15, 20, 22, 23, 30, 31, 40, 41, 42, 50,
                                                         51, 52, 60, 63, 64, 70, 71, 72, 80, 85, 86, 90, 91, 99])}),
    ("alibi", {"impl": "blocked", "block_size": 7}, "folded", {"window": 9}),
    ("fox", {}, "folded", {"content": True, "ssmax": True}),
    ("t5", {}, "fallback", {}),  # the Toeplitz kernels carry no sink: each block's mask with the sink key
    # (the fallback's bias is KERPLE's fp32 table, divided by the temperature in fp32: 1e-7)
    ("kerple-log", {"impl": "blocked", "block_size": 8}, "fallback", {"ssmax": True, "tol": 1e-7}),
    ("rotary", {}, "fallback", {"window": 6}),  # a window takes the Toeplitz path, without sinks: fallback
    ("none", {"impl": "plain"}, "reference", {"ssmax": True}),
    ("rotary-selfextend", {}, "reference", {}),  # the two-pass merge has no sink column
    ("rotary", {}, "fallback", {"q_from": 20}),  # a chunk after a KV cache
    ("none", {}, "fallback", {"sinks": False, "ssmax": True, "window": 5}),  # n counts the keys in the window
])
def test_every_path_equals_the_equations_with_gradients(name, opts, path, kw, monkeypatch):
    _check(name, opts, path, monkeypatch, **kw)


def test_cope_and_stick_breaking_with_sinks(monkeypatch):
    """A score-level scheme runs the reference path with the sink column; a scheme whose weights are not a
    softmax refuses sinks in one line."""
    scheme = P.build("cope", H, head_dim=D, layers=1)
    q, k, v = _qkv(L=12)
    pos = torch.arange(12)
    s = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    plain, _ = attend(q, k, v, pos, pos, scheme, 0, AttnOptions(need_probs=True), sinks=s)
    none, probs = attend(q, k, v, pos, pos, scheme, 0, AttnOptions(need_probs=True), sinks=None)
    assert not torch.allclose(plain, none)
    with_sink = attend(q, k, v, pos, pos, scheme, 0, AttnOptions(need_probs=True), sinks=s)[1]
    assert (with_sink.sum(-1) < 1 - 1e-6).all() and torch.allclose(probs.sum(-1), torch.ones(()).double())
    with pytest.raises(UserError, match="stick-breaking") as e:
        attend(q, k, v, pos, pos, P.build("stick-breaking", H), 0, AttnOptions(), sinks=s)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_fused_sink_forms_equal_the_softmax_with_one_more_column(causal, dtype):
    """The lse form (CPU flash kernel, out·exp(lse - lse'), its backward given out' and lse') and the key-column
    form (a key with a zero value) against softmax(cat([l, s])) written out, with gradients to q, k, v, s."""
    g = torch.Generator().manual_seed(1)
    B, L = 2, 11
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    rows = torch.randn(1, H, L, generator=g, dtype=dtype).requires_grad_()
    mask = None if causal else (torch.rand(1, 1, L, L, generator=g) > 0.4) | torch.eye(L, dtype=torch.bool)
    lg = q @ k.transpose(-1, -2) * 0.6
    vis = torch.ones(L, L, dtype=torch.bool).tril() if causal else mask
    lg = lg.masked_fill(~vis, -math.inf)
    want = torch.softmax(torch.cat([lg, rows[..., None].expand(B, H, L, 1)], -1), -1)[..., :-1] @ v
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for form in (sink_sdpa, column_form):
        got = form(q, k, v, rows, mask, is_causal=causal, scale=0.6)
        torch.testing.assert_close(got, want, **tol)
        gg = torch.randn_like(got)
        for x, y in zip(torch.autograd.grad(got, (q, k, v, rows), gg),
                        torch.autograd.grad(want, (q, k, v, rows), gg, retain_graph=True)):
            torch.testing.assert_close(x, y, **tol)


def test_column_form_keeps_a_bf16_sink_to_16_more_bits():
    """Under bf16 autocast the key-column form splits s / scale into hi + lo columns: the sink's weight matches
    the fp32 formula far better than one bf16 column would allow (bf16 keeps 8 bits)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 16, D, generator=g) for _ in range(3))
    rows = torch.full((1, H, 16), 3.3371)
    want = column_form(q, k, v, rows, is_causal=True, scale=0.35)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = column_form(q, k, v, rows, is_causal=True, scale=0.35)
    assert (got.float() - want).abs().max() < 0.05


def test_sinks_match_gpt_oss_reference_attention():
    """transformers' gpt-oss eager attention (cat([q·k·scale + mask, sinks]) -> softmax -> drop the sink) equals
    attend() with the same sinks: on the fused causal path and on the reference path."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v = _qkv(L=17)
    s = torch.tensor([0.3, -2.0, 1.1], dtype=torch.float64)
    L = q.shape[2]
    mask = torch.zeros(1, 1, L, L, dtype=torch.float64).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = torch.nn.Parameter(s.clone()), 1, False
    want, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)  # [B, L, H, D]
    pos = torch.arange(L)
    for impl in ("auto", "plain"):
        got, _ = attend(q, k, v, pos, pos, P.build("none", H), 0, AttnOptions(impl=impl), sinks=s)
        torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-10, atol=1e-12)


def test_a_gpt_oss_model_through_our_attention_equals_its_eager_forward():
    """A tiny gpt-oss (transformers' GptOssForCausalLM: sinks in every layer, a sliding and a full layer, GQA) run
    with our registered attention function (hf/extend.py) gives its eager forward's logits: the sinks are passed
    on, where they were dropped before (0.07 apart)."""
    transformers = pytest.importorskip("transformers")
    from extrapolab.hf.extend import register

    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
                                    layer_types=["sliding_attention", "full_attention"],
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    m = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_()
    idx = torch.randint(0, 64, (1, 20))
    m.set_attn_implementation("eager")
    with torch.no_grad():
        want = m(idx).logits
        m.set_attn_implementation(register())
        got = m(idx).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ssmax_is_the_papers_scalable_softmax_and_n_counts_the_keys_seen():
    """SSMax(z)_i = n^(s z_i) / Σ_j n^(s z_j) (Nakanishi 2025, eq. 2) for each query row, n its visible keys;
    n = m + 1 from position 0, min(m + 1, w) in a window, the cached keys included after a KV cache."""
    q, k, v = _qkv(B=1, L=9)
    pos = torch.arange(9)
    s = torch.tensor([0.3, 0.6, 1.2], dtype=torch.float64)
    _, p = attend(q, k, v, pos, pos, P.build("none", H), 0, AttnOptions(need_probs=True), ssmax=s)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # [1, H, 9, 9]
    for m in range(9):
        n = m + 1
        w = n ** (s.view(-1, 1) * z[0, :, m, :n])  # [H, n]
        torch.testing.assert_close(p[0, :, m, :n], w / w.sum(-1, keepdim=True))
    assert torch.equal(keys_seen(pos, pos), pos + 1)
    assert torch.equal(keys_seen(pos, pos, window=4), torch.clamp(pos + 1, max=4))
    assert torch.equal(keys_seen(torch.tensor([20]), torch.arange(5, 21)), torch.tensor([16]))


def test_ssmax_gradient_is_finite_at_the_first_query():
    """s·log 1 = 0: the first query's temperature is +inf (logits 0) and s still gets a finite gradient."""
    q, k, v = _qkv(B=1, L=6)
    pos = torch.arange(6)
    s = torch.tensor([0.3, 0.6, 1.2], dtype=torch.float64, requires_grad=True)
    sk = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
    for impl in ("auto", "plain"):
        out, _ = attend(q, k, v, pos, pos, P.build("none", H), 0, AttnOptions(impl=impl), ssmax=s, sinks=sk)
        gs, gk = torch.autograd.grad(out.sum(), (s, sk))
        assert torch.isfinite(gs).all() and torch.isfinite(gk).all() and gs.abs().sum() > 0
        # the first query: z·0 for its key and its sink, so half of its weight on the sink
        torch.testing.assert_close(out[0, :, 0], 0.5 * v[0, :, 0])


def test_bad_sinks_are_one_line_errors():
    q, k, v = _qkv(L=8)
    pos = torch.arange(8)
    for bad, opts, match in ((torch.zeros(4, dtype=torch.float64), AttnOptions(), "one logit per head"),
                             (torch.zeros(H, dtype=torch.float64), AttnOptions(logits_sink=lambda *a: None),
                              "temperature alignment"),
                             (torch.zeros(H, dtype=torch.float64), AttnOptions(impl="flex"), "flex")):
        with pytest.raises(UserError, match=match) as e:
            attend(q.detach(), k.detach(), v.detach(), pos, pos, P.build("alibi", H), 0, opts, sinks=bad)
        assert "\n" not in str(e.value)

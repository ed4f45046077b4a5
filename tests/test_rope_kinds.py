"""Llama 3.1's scaling, LongRoPE, p-RoPE ("proportional") and YaRN's attention-factor variants against
transformers 5.23 (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``: inverse frequencies and attention factor
for the same parameters; ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``: the whole rotation, with
LongRoPE's switch of factor sets decided by transformers itself, call by call under a KV cache).

Hugging Face rotates halves (i, i + d/2), we rotate interleaved pairs (2i, 2i+1): frequencies are compared
per pair, rotations after mapping its layout onto ours. Transformers computes in float32 (tolerances).
"""
from __future__ import annotations

import math

import pytest
import torch
from decoding import decode

from extrapolab import positional as P
from extrapolab.model.gpt import GPT, KVCache, ModelConfig

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

HEADS = 2


def _config(d_head, params, max_pos=None):
    params = {"rope_theta": 10000.0, **params}
    return LlamaConfig(hidden_size=HEADS * d_head, num_attention_heads=HEADS, head_dim=d_head,
                       max_position_embeddings=max_pos or params.get("original_max_position_embeddings", 4096),
                       rope_parameters=params)


def _hf(cfg, seq_len=None):
    inv, attn = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu", seq_len=seq_len)
    return inv.double(), float(attn)


def _factors(n, seed, lo=1.0, hi=8.0):
    g = torch.Generator().manual_seed(seed)
    return (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).sort().values.tolist()


# ---- llama3 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d_head", [16, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 8.0, 32.0])
@pytest.mark.parametrize("low,high,original,base", [(1.0, 4.0, 8192, 500000.0), (1.0, 4.0, 128, 10000.0),
                                                     (2.0, 8.0, 1024, 10000.0), (0.5, 1.5, 2048, 1e6)])
def test_llama3_equals_transformers(d_head, factor, low, high, original, base):
    cfg = _config(d_head, {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                           "original_max_position_embeddings": original, "rope_theta": base}, max_pos=16 * original)
    inv, attn = _hf(cfg)
    s = P.build("rotary-llama3", HEADS, factor=factor, low_freq_factor=low, high_freq_factor=high,
                original_length=original, base=base)
    ours = s.inv_freq(d_head, 1)  # [d/2]
    torch.testing.assert_close(ours, inv, rtol=2e-6, atol=0)
    assert s.attention_factor(1) == attn == 1.0


def test_llama3_has_all_three_bands_at_llama_3_1_settings():
    """Llama 3.1 (d 128, theta 500000, L 8192, 8 / 1 / 4): some pairs kept, some / 8, some in between."""
    s = P.build("rotary-llama3", HEADS, factor=8.0, original_length=8192, base=500000.0)
    ratio = P.build("rotary", HEADS, base=500000.0).inv_freq(128, 1) / s.inv_freq(128, 1)  # [64]
    kept, pi = (torch.isclose(ratio, torch.full_like(ratio, v)) for v in (1.0, 8.0))
    assert kept[:10].all() and pi[-10:].all() and (~kept & ~pi).sum() >= 3
    assert (ratio[1:] >= ratio[:-1] - 1e-12).all()  # more interpolation the lower the frequency


# ---- LongRoPE -------------------------------------------------------------------------------------
LONGROPE = [  # (transformers' fields beside the lists, its max_position_embeddings, our options)
    ({"factor": 4.0}, None, {"factor": 4.0}),
    ({"factor": 32.0}, None, {"factor": 32.0}),
    ({}, "32x", {"factor": 32.0}),  # Phi-3 style: no factor, s = max_position_embeddings / original
    ({"factor": 8.0, "attention_factor": 1.3}, None, {"factor": 8.0, "attention_factor": 1.3}),
]


@pytest.mark.parametrize("d_head", [16, 64, 96])
@pytest.mark.parametrize("original", [64, 4096])
@pytest.mark.parametrize("fields,max_pos,opts", LONGROPE)
def test_longrope_equals_transformers_on_both_sides_of_l_tr(d_head, original, fields, max_pos, opts):
    short, long = _factors(d_head // 2, d_head, 1.0, 1.3), _factors(d_head // 2, d_head + 1, 1.0, 40.0)
    cfg = _config(d_head, {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                           "original_max_position_embeddings": original, **fields},
                  max_pos=32 * original if max_pos else original)
    s = P.build("rotary-longrope", HEADS, short_factor=short, long_factor=long, original_length=original, **opts)
    for seq_len, length in ((None, 1), (original, original), (original + 1, original + 1), (8 * original,) * 2):
        inv, attn = _hf(cfg, seq_len)
        torch.testing.assert_close(s.inv_freq(d_head, length), inv, rtol=2e-6, atol=0)
        assert s.attention_factor(length) == pytest.approx(attn, rel=1e-12)
    if "attention_factor" not in fields:  # Phi-3: sqrt(1 + ln s / ln L_orig)
        assert s.attention_factor(1) == pytest.approx(math.sqrt(1 + math.log(opts["factor"]) / math.log(original)))


# ---- proportional (p-RoPE) ------------------------------------------------------------------------
@pytest.mark.parametrize("d_head", [16, 64, 256])
@pytest.mark.parametrize("p", [0.0, 0.25, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("factor,base", [(1.0, 10000.0), (2.0, 1e6)])
def test_proportional_equals_transformers(d_head, p, factor, base):
    fields = {"rope_type": "proportional", "partial_rotary_factor": p, "rope_theta": base}
    if factor != 1.0:
        fields["factor"] = factor
    inv, attn = _hf(_config(d_head, fields))
    s = P.build("rotary-proportional", HEADS, p=p, factor=factor, base=base)
    ours = s.inv_freq(d_head, 1)
    torch.testing.assert_close(ours, inv, rtol=2e-6, atol=0)
    assert s.attention_factor(1) == attn == 1.0
    r = int(p * d_head // 2)
    full = P.build("rotary", HEADS, base=base).inv_freq(d_head, 1) / factor
    assert torch.equal(ours[:r], full[:r]) and not ours[r:].any()  # denominator d: full RoPE's top frequencies
    if 0 < r < d_head // 2:  # not transformers' partial_rotary_factor of default RoPE (denominator p·d)
        partial = base ** (-torch.arange(0, 2 * r, 2, dtype=torch.float64) / (2 * r))
        assert not torch.allclose(ours[:r] * factor, partial)


def test_proportional_nope_dimensions_pass_unchanged():
    d, p = 32, 0.25
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, HEADS, 7, d, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.tensor([0, 3, 100, 1000, 4095, 70000, 123456])
    oq, ok = P.build("rotary-proportional", HEADS, p=p).rotate(q, k, pos, pos)
    fq, _ = P.build("rotary", HEADS).rotate(q, k, pos, pos)
    r = int(p * d // 2)
    assert torch.equal(oq[..., 2 * r:], q[..., 2 * r:]) and torch.equal(ok[..., 2 * r:], k[..., 2 * r:])
    torch.testing.assert_close(oq[..., :2 * r], fq[..., :2 * r], rtol=0, atol=1e-12)


# ---- YaRN's attention-factor variants -------------------------------------------------------------
YARN = [
    {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2: f = 1 from the rope, the scale in its attention
    {"mscale": 1.0, "mscale_all_dim": 0.5},
    {"mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.0},  # explicit, agreeing
    {"truncate": False},  # gpt-oss
    {"truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    {"attention_factor": 0.8, "beta_fast": 64.0},
]


@pytest.mark.parametrize("d_head", [16, 64, 128])
@pytest.mark.parametrize("factor", [4.0, 40.0])
@pytest.mark.parametrize("original", [128, 4096])
@pytest.mark.parametrize("fields", YARN)
def test_yarn_variants_equal_transformers(d_head, factor, original, fields):
    cfg = _config(d_head, {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                           **fields}, max_pos=int(factor * original))
    inv, attn = _hf(cfg)
    s = P.build("rotary-yarn", HEADS, factor=factor, original_length=original, **fields)
    # transformers' ramp gamma is float32: its rounding (~6e-8) is multiplied by up to s = 40 in
    # gamma·theta + (1 - gamma)·theta/s, relative to theta' (the ramp's unrounded ends make it bite)
    torch.testing.assert_close(s.inv_freq(d_head, 1), inv, rtol=5e-6, atol=0)
    assert s.attention_factor(1) == pytest.approx(attn, rel=1e-12)
    if "mscale" in fields and "attention_factor" not in fields:
        m = lambda a: 0.1 * a * math.log(factor) + 1  # noqa: E731
        assert s.attention_factor(1) == pytest.approx(m(fields["mscale"]) / m(fields["mscale_all_dim"]))


def test_yarn_truncate_false_moves_only_the_ramp_ends():
    a = P.build("rotary-yarn", HEADS, factor=16.0, original_length=2048).inv_freq(64, 1)
    b = P.build("rotary-yarn", HEADS, factor=16.0, original_length=2048, truncate=False).inv_freq(64, 1)
    plain = P.build("rotary", HEADS).inv_freq(64, 1)
    assert not torch.allclose(a, b) and torch.equal(a[0], b[0]) and torch.equal(a[0], plain[0])
    torch.testing.assert_close(a[-1], b[-1])
    torch.testing.assert_close(a[-1], plain[-1] / 16)


# ---- the whole rotation, through transformers' rotary embedding -----------------------------------
def _to_ours(x):
    """HF layout (halves) -> ours (pairs): ours[2i] = hf[i], ours[2i+1] = hf[i + d/2]."""
    d = x.shape[-1]
    return torch.stack((x[..., : d // 2], x[..., d // 2:]), dim=-1).flatten(-2)  # [..., d/2, 2] -> [..., d]


D, ORIG = 32, 64
ROTATIONS = [  # (our scheme and options, transformers' rope_parameters)
    ("rotary-llama3", {"factor": 8.0, "original_length": ORIG},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("rotary-longrope", {"short_factor": _factors(D // 2, 1, 1.0, 1.2), "long_factor": _factors(D // 2, 2, 1.0, 9.0),
                         "factor": 8.0, "original_length": ORIG},
     {"rope_type": "longrope", "short_factor": _factors(D // 2, 1, 1.0, 1.2),
      "long_factor": _factors(D // 2, 2, 1.0, 9.0), "factor": 8.0}),
    ("rotary-proportional", {"p": 0.25}, {"rope_type": "proportional", "partial_rotary_factor": 0.25}),
    ("rotary-yarn", {"factor": 8.0, "original_length": ORIG, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
     {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}),
]


def _hf_rotary(fields):
    return LlamaRotaryEmbedding(_config(D, {"original_max_position_embeddings": ORIG, **fields}, max_pos=8 * ORIG))


def _hf_rotate(rotary, q, k, pos):
    cos, sin = rotary(q.float(), pos[None])  # [1, L, D] each, float32, the attention factor inside
    return apply_rotary_pos_emb(q, k, cos.double(), sin.double())


@pytest.mark.parametrize("L", [ORIG, 200])
@pytest.mark.parametrize("name,opts,fields", ROTATIONS, ids=[r[0] for r in ROTATIONS])
def test_full_rotation_equals_transformers_rotary_embedding(name, opts, fields, L):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, HEADS, L, D, generator=g, dtype=torch.float64) for _ in range(2))  # HF layout
    pos = torch.arange(L)
    hq, hk = _hf_rotate(_hf_rotary(fields), q, k, pos)
    oq, ok = P.build(name, HEADS, **opts).rotate(_to_ours(q), _to_ours(k), pos, pos)
    torch.testing.assert_close(oq, _to_ours(hq), rtol=0, atol=1e-4)  # float32 angles up to 200 rad
    torch.testing.assert_close(ok, _to_ours(hk), rtol=0, atol=1e-4)
    logits = oq @ ok.transpose(-1, -2)  # q·k is what attention sees: layout-free
    torch.testing.assert_close(logits, hq @ hk.transpose(-1, -2), rtol=0, atol=2e-3)


# ---- LongRoPE under a KV cache --------------------------------------------------------------------
def test_longrope_cached_decoding_equals_transformers_cached_rotation():
    """A 20-token prefill, then one token at a time past L_tr = 64: each call's q, k rotated with the set its own
    largest position selects, cached keys kept: the logits of every call equal transformers' rotary embedding
    called the same way (it mixes short-factor keys with long-factor ones too)."""
    name, opts, fields = ROTATIONS[1]
    scheme, rotary = P.build(name, HEADS, **opts), _hf_rotary(fields)
    L, prefill = 90, 20
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, HEADS, L, D, generator=g, dtype=torch.float64) for _ in range(2))  # HF layout
    calls = [torch.arange(prefill)] + [torch.tensor([t]) for t in range(prefill, L)]
    ours_k, hf_k, crossed = [], [], None
    for pos in calls:
        hq, hk = _hf_rotate(rotary, q[..., pos, :], k[..., pos, :], pos)
        oq, ok = scheme.rotate(_to_ours(q[..., pos, :]), _to_ours(k[..., pos, :]), pos, pos)
        hf_k.append(hk)
        ours_k.append(ok)
        got, want = oq @ torch.cat(ours_k, 2).transpose(-1, -2), hq @ torch.cat(hf_k, 2).transpose(-1, -2)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
        if crossed is None and int(pos[-1]) + 1 > ORIG:
            crossed = int(pos[-1])
    assert crossed == ORIG  # the switch happened at position L_tr (length L_tr + 1), inside the decode
    full_q, full_k = scheme.rotate(_to_ours(q), _to_ours(k), torch.arange(L), torch.arange(L))
    mixed = got[0, :, -1]  # the last query against the cache: keys 0..63 short, 64..89 long
    assert not torch.allclose(mixed, (full_q @ full_k.transpose(-1, -2))[0, :, -1], atol=1e-3)


def test_longrope_gpt_decoding_and_the_phi3_reencode():
    """Our GPT with a KV cache: equal to the parallel forward up to L_tr; past it the cache mixes the sets (not
    the parallel forward); re-encoding the prefix at the crossing (Phi-3's generate) gives the parallel forward."""
    Ltr, L = 16, 40
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, layers=2, heads=4, dim=32, scheme="rotary-longrope", train_length=Ltr,
                      scheme_params={"long_factor": _factors(4, 3, 2.0, 12.0), "factor": 8.0})
    model = GPT(cfg).eval()
    idx = torch.randint(0, 61, (2, L), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for b in model.blocks:  # peaky attention (random init is near uniform), so positions matter
            b.qkv.weight.mul_(10.0)
        full = model(idx)
        short = model(idx[:, :Ltr])
        steps = decode(model, idx, 7, KVCache(2))
        cache = KVCache(2)
        head = decode(model, idx[:, :Ltr], 7, cache)
        again = KVCache(2)  # the crossing: the first call longer than L_tr re-encodes the whole prefix
        tail = [model(idx[:, :Ltr + 1], positions=torch.arange(Ltr + 1), cache=again)[:, -1:]]
        tail += [model(idx[:, t:t + 1], positions=torch.tensor([t]), cache=again) for t in range(Ltr + 1, L)]
    torch.testing.assert_close(steps[:, :Ltr], short, rtol=1e-4, atol=2e-5)  # all short: as the prefix forward
    assert (steps[:, Ltr:] - full[:, Ltr:]).abs().max() > 50 * 2e-5  # mixed sets after the crossing
    torch.testing.assert_close(head, short, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(torch.cat(tail, 1), full[:, Ltr:], rtol=1e-4, atol=2e-5)
    assert (full[:, :Ltr] - short).abs().max() > 50 * 2e-5  # one forward past L_tr is long everywhere

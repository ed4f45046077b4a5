"""The RoPE context-extension schemes against Hugging Face's own implementation.

``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (linear = position interpolation, dynamic,
yarn) gives inverse frequencies and the attention factor for a config; Llama's
``apply_rotary_pos_emb`` rotates q, k. HF rotates halves (i, i + d/2), we rotate interleaved pairs
(2i, 2i+1): frequencies are compared per pair, full rotations after permuting the layout.
"""
from __future__ import annotations

import pytest
import torch

from extrapolab import positional as P
from extrapolab.positional.rotary_ntk import ntk_base

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

HEADS = 2


def _config(d_head, rope_type, factor, original, base=10000.0):
    params = {"rope_type": rope_type, "factor": factor, "rope_theta": base}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = original
    return LlamaConfig(hidden_size=HEADS * d_head, num_attention_heads=HEADS, max_position_embeddings=original,
                       rope_parameters=params)


def _hf(d_head, rope_type, factor, original, base=10000.0, seq_len=None):
    inv, attn = ROPE_INIT_FUNCTIONS[rope_type](_config(d_head, rope_type, factor, original, base), "cpu",
                                                seq_len=seq_len)
    return inv.double(), float(attn)


CASES = [  # (our scheme + options, HF rope type + factor, HF seq_len)
    ("rotary-pi", {"factor": 4.0}, "linear", 4.0, None),
    ("rotary-pi", {"factor": 2.5}, "linear", 2.5, None),
    ("rotary-yarn", {"factor": 4.0}, "yarn", 4.0, None),
    ("rotary-yarn", {"factor": 16.0}, "yarn", 16.0, None),
    ("rotary-yarn", {"factor": 8.0, "base": 500000.0}, "yarn", 8.0, None),
]


@pytest.mark.parametrize("d_head", [16, 64, 128])
@pytest.mark.parametrize("original", [128, 4096])
@pytest.mark.parametrize("name,opts,hf_type,hf_factor,seq_len", CASES)
def test_inverse_frequencies_and_attention_factor_equal_hf(name, opts, hf_type, hf_factor, seq_len, d_head, original):
    s = P.build(name, HEADS, **opts, **({"original_length": original} if "original_length" in P.scheme_params(
        P.REGISTRY[name]) else {}))
    base = opts.get("base", 10000.0)
    inv, attn = _hf(d_head, hf_type, hf_factor, original, base, seq_len)
    ours = s.inv_freq(d_head, original)  # [d/2], pair i <-> HF's (i, i + d/2)
    torch.testing.assert_close(ours, inv, rtol=2e-6, atol=0)  # HF computes in float32
    assert s.attention_factor(original) == pytest.approx(attn, rel=1e-12)


@pytest.mark.parametrize("d_head", [16, 64])
@pytest.mark.parametrize("length", [64, 128, 129, 300, 1024, 2048])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_dynamic_ntk_equals_hf_at_every_length(d_head, length, alpha):
    original = 128
    s = P.build("rotary-dynamic", HEADS, original_length=original, factor=alpha)
    inv, attn = _hf(d_head, "dynamic", alpha, original, seq_len=length)
    torch.testing.assert_close(s.inv_freq(d_head, length), inv, rtol=2e-6, atol=0)
    assert s.attention_factor(length) == attn == 1.0


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_static_ntk_is_hf_dynamic_frozen_at_s_times_l_tr(factor):
    """HF has no static NTK type: its dynamic type at seq_len = s·L_orig (alpha 1) is b·s^(d/(d-2))."""
    d_head, original = 32, 256
    inv, _ = _hf(d_head, "dynamic", 1.0, original, seq_len=int(factor * original))
    s = P.build("rotary-ntk", HEADS, factor=factor)
    torch.testing.assert_close(s.inv_freq(d_head, 1), inv, rtol=2e-6, atol=0)
    # the lowest frequency is interpolated by exactly s, the highest kept
    plain = P.build("rotary", HEADS).inv_freq(d_head, 1)
    assert float(s.inv_freq(d_head, 1)[-1]) == pytest.approx(float(plain[-1]) / factor, rel=1e-12)
    assert s.inv_freq(d_head, 1)[0] == 1.0
    assert ntk_base(10000.0, factor, d_head) == pytest.approx(10000.0 * factor ** (32 / 30))


def _to_ours(x):
    """HF layout (halves) -> ours (pairs): ours[2i] = hf[i], ours[2i+1] = hf[i + d/2]."""
    d = x.shape[-1]
    return torch.stack((x[..., : d // 2], x[..., d // 2:]), dim=-1).flatten(-2)  # [..., d/2, 2] -> [..., d]


@pytest.mark.parametrize("name,opts,hf_type,hf_factor,seq_len", [
    ("rotary", {}, "default", None, None),
    ("rotary-pi", {"factor": 4.0}, "linear", 4.0, None),
    ("rotary-yarn", {"factor": 8.0}, "yarn", 8.0, None),
    ("rotary-dynamic", {}, "dynamic", 1.0, "L"),
    ("rotary-ntk", {"factor": 3.0}, "dynamic", 1.0, 3 * 64),
])
def test_full_rotation_equals_hf_apply_rotary_pos_emb(name, opts, hf_type, hf_factor, seq_len):
    d_head, original, L = 32, 64, 200
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, HEADS, L, d_head, generator=g, dtype=torch.float64) for _ in range(2))  # HF layout
    pos = torch.arange(L)
    extra = {"original_length": original} if "original_length" in P.scheme_params(P.REGISTRY[name]) else {}
    s = P.build(name, HEADS, **opts, **extra)
    if hf_type == "default":
        inv = 1.0 / (10000.0 ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head))
        attn = 1.0
    else:
        inv, attn = _hf(d_head, hf_type, hf_factor, original, seq_len=L if seq_len == "L" else seq_len)
    freqs = pos[:, None].double() * inv  # [L, d/2]; as LlamaRotaryEmbedding.forward, in float64
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, d]
    hq, hk = apply_rotary_pos_emb(q, k, emb.cos()[None] * attn, emb.sin()[None] * attn)
    oq, ok = s.rotate(_to_ours(q), _to_ours(k), pos, pos)
    # HF's inverse frequencies are float32: angles up to 200 rad carry ~4e-5 of rounding
    torch.testing.assert_close(oq, _to_ours(hq), rtol=0, atol=1e-4)
    torch.testing.assert_close(ok, _to_ours(hk), rtol=0, atol=1e-4)
    assert (oq - _to_ours(hq))[..., :50, :].abs().max() < 1e-5  # short positions: exact to fp32

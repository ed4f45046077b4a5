"""QK-norm and the output gate (model/attn_extras.py): the equations written here, transformers' Qwen3 RMSNorm,
Qwen3 and OLMo 2 attention (QK-norm per head and over all heads), Llama 4's L2 norm and Qwen3-Next's gated
attention as independent references, the order of QK-norm before the rotation, and the attention options'
one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import config as C
from extrapolab.io import UserError
from extrapolab.model.attn_extras import AttnExtras, qk_form, rms_normalize
from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.model.regular_lm import RegularLM

H, DIM = 4, 32
D = DIM // H


def _model(scheme="none", **opts):
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=50, layers=1, heads=H, dim=DIM, scheme=scheme, train_length=16, **opts)).double()
    with torch.no_grad():
        for p in m.blocks[0].extras.parameters():  # away from the initial values, so every scale matters
            p.add_(torch.randn_like(p) * 0.3)
    return m


def test_rms_normalize_is_the_l2_normalisation_times_the_learned_scale():
    """w ⊙ q / sqrt(mean(q²) + eps) = w ⊙ sqrt(d)·q/|q| (up to eps): Henry et al.'s L2 normalisation with a learned
    scale, and transformers' Qwen3RMSNorm bit for bit."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    x = torch.randn(2, H, 7, D)
    w = torch.rand(D) + 0.5
    got = rms_normalize(x, w)
    torch.testing.assert_close(got, w * math.sqrt(D) * x / x.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-5)
    ref = qwen3.Qwen3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    torch.testing.assert_close(got, ref(x), rtol=0, atol=0)


def test_block_normalises_q_and_k_before_the_rotation_and_gates_the_output():
    """The block with model.qk_norm and model.gate equals the equations: q, k RMS-normalised per head (their own
    scales), then rotated by RoPE (Qwen3 / Gemma 3 / OLMo 2 order), causal softmax, then y ⊙ σ(h W_θ) (Qiu et al.
    2025, position G1: h the attention input after the pre-norm) before the output projection."""
    m = _model("rotary", qk_norm=True, gate=True)
    blk = m.blocks[0]
    with torch.no_grad():
        blk.mlp[2].weight.zero_()
        blk.mlp[2].bias.zero_()  # the block is then x + attention(x)
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    pos = torch.arange(11)
    got = blk(x, pos, m.scheme, m.attn_opts)[0] - x
    h = blk.ln1(x)
    q, k, v = blk.qkv(h).view(2, 11, 3, H, D).permute(2, 0, 3, 1, 4)
    ex = blk.extras
    q = ex.q_norm * q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    k = ex.k_norm * k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
    q, k = m.scheme.rotate(q, k, pos, pos)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 11, DIM)
    want = blk.proj(y * torch.sigmoid(h @ ex.gate.weight.T))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # rotating first would differ where the learned scales act (a rotation keeps only the norm)
    q2, k2, _ = blk.qkv(h).view(2, 11, 3, H, D).permute(2, 0, 3, 1, 4)
    q2, k2 = m.scheme.rotate(q2, k2, pos, pos)
    assert not torch.allclose(ex.normalize(q2, k2)[0], q)


def test_qk_norm_and_gate_equal_qwen3_next_gated_attention():
    """transformers' Qwen3NextAttention (q_proj giving query and gate per head, q_norm / k_norm as (1 + w) RMSNorm,
    output times σ(gate) before o_proj), with the rotation turned off (cos = 1, sin = 0), equals our block's
    attention with model.qk_norm, model.gate and NoPE, on the same weights."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    m = _model("none", qk_norm=True, gate=True)
    blk = m.blocks[0]
    cfg = Qwen3NextConfig(hidden_size=DIM, num_attention_heads=H, num_key_value_heads=H, head_dim=D,
                          attention_bias=False, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    ref = qn.Qwen3NextAttention(cfg, 3).double().eval()
    with torch.no_grad():
        blk.qkv.bias.zero_()
        blk.proj.bias.zero_()
        blk.mlp[2].weight.zero_()
        blk.mlp[2].bias.zero_()
        wq, wk, wv = blk.qkv.weight.view(3, H, D, DIM)
        ref.q_proj.weight.copy_(torch.cat([wq, blk.extras.gate.weight.view(H, D, DIM)], 1).reshape(2 * DIM, DIM))
        ref.k_proj.weight.copy_(wk.reshape(DIM, DIM))
        ref.v_proj.weight.copy_(wv.reshape(DIM, DIM))
        ref.o_proj.weight.copy_(blk.proj.weight)
        ref.q_norm.weight.copy_(blk.extras.q_norm - 1)  # Qwen3-Next scales by (1 + w)
        ref.k_norm.weight.copy_(blk.extras.k_norm - 1)
    L = 13
    x = torch.randn(2, L, DIM, dtype=torch.float64)
    got = blk(x, torch.arange(L), m.scheme, m.attn_opts)[0] - x
    mask = torch.zeros(1, 1, L, L, dtype=torch.float64).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    rot = (torch.ones(1, L, D, dtype=torch.float64), torch.zeros(1, L, D, dtype=torch.float64))
    want, _ = ref(blk.ln1(x), rot, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)  # Qwen3NextRMSNorm normalises in fp32


def _causal_mask(L):
    future = torch.ones(L, L, dtype=torch.bool).triu(1)  # [L, L]
    return torch.zeros(1, 1, L, L, dtype=torch.float64).masked_fill(future, -math.inf)  # [1, 1, L, L]


def _hf_attention_out(blk, ref, L=13):
    """Our block's attention (NoPE, MLP off) and transformers' attention module ``ref`` on the same q, k, v, o
    weights and biases, the rotation turned off (cos = 1, sin = 0): (ours, theirs), each [2, L, DIM]."""
    with torch.no_grad():
        blk.mlp[2].weight.zero_()
        blk.mlp[2].bias.zero_()
        for proj, w, b in zip((ref.q_proj, ref.k_proj, ref.v_proj), blk.qkv.weight.view(3, DIM, DIM),
                              blk.qkv.bias.view(3, DIM)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ref.o_proj.weight.copy_(blk.proj.weight)
        ref.o_proj.bias.copy_(blk.proj.bias)
        ref.q_norm.weight.copy_(blk.extras.q_norm)
        ref.k_norm.weight.copy_(blk.extras.k_norm)
    x = torch.randn(2, L, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = blk(x, torch.arange(L), _model().scheme, AttnOptions())[0] - x
    rot = (torch.ones(1, L, D, dtype=torch.float64), torch.zeros(1, L, D, dtype=torch.float64))
    return got, ref(blk.ln1(x), rot, _causal_mask(L))[0]


def test_qk_norm_all_equals_olmo2_attention_and_head_equals_qwen3_attention():
    """model.qk_norm=all is OLMo 2's QK-norm (transformers' Olmo2Attention: Olmo2RMSNorm over the whole H·D
    projection, before the head split), model.qk_norm=head (and true) Qwen3's (Qwen3Attention: Qwen3RMSNorm over
    each head's D), each with its eps as model.qk_norm_eps (1e-5 here, transformers' OLMo 2 default; 1e-6 for
    Qwen3), on the same weights; the two forms give different outputs."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers.models.olmo2.configuration_olmo2 import Olmo2Config
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    outs = {}
    for form, mod, cfg, eps in (
            ("all", olmo2.Olmo2Attention, Olmo2Config, 1e-5), ("head", qwen3.Qwen3Attention, Qwen3Config, 1e-6),
            (True, qwen3.Qwen3Attention, Qwen3Config, 1e-6)):
        hf = cfg(hidden_size=DIM, num_attention_heads=H, num_key_value_heads=H, head_dim=D, attention_bias=True,
                 rms_norm_eps=eps, num_hidden_layers=1)
        hf._attn_implementation = "eager"
        ref = mod(hf, 0).double().eval()
        blk = _model("none", qk_norm=form, qk_norm_eps=eps).blocks[0]
        assert blk.extras.q_norm.shape == ref.q_norm.weight.shape == ((DIM,) if form == "all" else (D,))
        got, want = _hf_attention_out(blk, ref)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)  # transformers normalises in fp32
        outs[form] = got
    torch.testing.assert_close(outs["head"], outs[True], rtol=0, atol=0)  # true is head
    assert (outs["all"] - outs["head"]).abs().max() > 1e-3  # the two forms are different models


def test_qk_norm_eps_is_the_field_and_head_at_unit_scales_is_llama4_l2_norm():
    """model.qk_norm_eps is the eps the norm adds: with w = 1 the head form is transformers' Llama4TextL2Norm
    (eps 1e-5, no weight) on q of an RMS near sqrt(eps), where the eps moves the result; Llama 4 applies it after
    the rotation, we before: without a w the two orders agree (a rotation keeps each head's norm)."""
    llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    q = torch.randn(2, H, 9, D, dtype=torch.float64) * 3e-3  # mean(q²) ~ 1e-5: eps matters
    k = torch.randn(2, H, 9, D, dtype=torch.float64) * 3e-3
    ex = AttnExtras(heads=H, head_dim=D, dim=DIM, train_length=16, qk_norm="head", qk_eps=1e-5).double()
    ref = llama4.Llama4TextL2Norm(1e-5)
    got = ex.normalize(q, k)
    torch.testing.assert_close(got[0], ref(q), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], ref(k), rtol=1e-6, atol=1e-7)
    other = AttnExtras(heads=H, head_dim=D, dim=DIM, train_length=16, qk_norm="head").double()  # eps 1e-6
    assert (other.normalize(q, k)[0] - got[0]).abs().max() > 0.1
    rotary = _model("rotary").scheme
    pos = torch.arange(9)
    before = rotary.rotate(*got, pos, pos)
    after = [ref(x) for x in rotary.rotate(q, k, pos, pos)]
    torch.testing.assert_close(before[0], after[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(before[1], after[1], rtol=1e-6, atol=1e-7)


def test_qk_norm_forms_read_from_the_config():
    """false / off / "" are off, true and head per head, all over all heads; anything else one line."""
    assert [qk_form(v) for v in (False, None, "", "off", "false", True, "true", "head", "all", "ALL")] == \
        ["", "", "", "", "", "head", "head", "head", "all", "all"]
    assert C.resolve(overrides=["model.qk_norm=all", "model.qk_norm_eps=1e-5"]).model.qk_norm == "all"
    with pytest.raises(C.ConfigError, match="head .* all") as e:
        C.resolve(overrides=["model.qk_norm=heads"])
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match="qk_norm_eps must be a number > 0") as e:
        C.resolve(overrides=["model.qk_norm=head", "model.qk_norm_eps=-1e-6"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="model.qk_norm"):
        AttnExtras(heads=H, head_dim=D, dim=DIM, train_length=16, qk_norm="both")


def test_options_off_add_no_parameters_and_on_add_theirs():
    base = sum(p.numel() for p in _model().parameters())
    adds = {"sinks": H, "ssmax": H, "qk_norm": 2 * D, "gate": DIM * DIM}
    for name, n in adds.items():
        assert sum(p.numel() for p in _model(**{name: True}).parameters()) == base + n, name
    assert sum(p.numel() for p in _model(qk_norm="all").parameters()) == base + 2 * DIM  # w over all heads
    assert sum(p.numel() for p in _model(qk_norm="off").parameters()) == base
    ex = AttnExtras(heads=H, head_dim=D, dim=DIM, train_length=512, ssmax=True)
    torch.testing.assert_close(ex.ssmax, torch.full((H,), 1 / math.log(512)))  # softmax at L_tr at the start


def test_attention_options_train_and_every_parameter_gets_a_gradient():
    m = _model("rotary", sinks=True, ssmax=True, qk_norm=True, gate=True).float()
    idx = torch.randint(0, 50, (2, 17))
    m.loss(idx[:, :-1], idx[:, 1:]).backward()
    for name, p in m.blocks[0].extras.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bad_attention_options_are_one_line_errors():
    with pytest.raises(C.ConfigError, match="true/false") as e:
        C.resolve(overrides=["model.sinks=maybe"])
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match="did you mean config.model.sinks") as e:
        C.resolve(overrides=["model.sink=true"])
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match="model.gate") as e:
        C.validate(C.resolve(overrides=["model.arch=regulargpt", "model.gate=true"]))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="model.sinks"):
        RegularLM(ModelConfig(vocab_size=20, heads=2, dim=8, C=2, K=1, train_length=8, sinks=True))

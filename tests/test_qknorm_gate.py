"""QK-norm and the output gate (model/attn_extras.py): the equations written here, transformers' Qwen3 RMSNorm and
Qwen3-Next's gated attention as independent references, the order of QK-norm before the rotation, and the
attention options' one-line errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import config as C
from extrapolab.io import UserError
from extrapolab.model.attn_extras import AttnExtras, rms_normalize
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


def test_options_off_add_no_parameters_and_on_add_theirs():
    base = sum(p.numel() for p in _model().parameters())
    adds = {"sinks": H, "ssmax": H, "qk_norm": 2 * D, "gate": DIM * DIM}
    for name, n in adds.items():
        assert sum(p.numel() for p in _model(**{name: True}).parameters()) == base + n, name
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

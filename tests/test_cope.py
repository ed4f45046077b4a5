"""CoPE (positional/cope.py) against the official ContextPosSelfAttn.forward written out here
(facebookresearch/RAM projects/cope, default options: gates σ(q·k/√d)·mask, positions by reverse
cumulative sum clipped at npos - 1, q·pos_emb interpolated between ⌊p⌋ and ⌈p⌉, added before the
division by √d), gradients included; KV-cache decoding equals the parallel forward; never fused."""
import math

import pytest
import torch
from decoding import decode

from extrapolab import positional
from extrapolab.model.attention import SCORE_BLOCK, AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, KVCache, ModelConfig


def _official(query, key, val, pos_emb, npos):
    """RAM's ContextPosSelfAttn.forward (cope_sep_key/val_gates/nodiv off, no dropout): query, key,
    val [B·H, L, D] (heads folded into the batch as split_heads does), pos_emb [1, D, npos]."""
    B, L, D = key.size()
    attn_mask = torch.ones(L, L, dtype=query.dtype).tril()[None]  # [1, L, L] causal, 0/1
    gate_logits = torch.bmm(query, key.transpose(-1, -2))  # [B, L, L]
    gates = torch.sigmoid(gate_logits / math.sqrt(D)) * attn_mask
    positions = gates.flip(-1).cumsum(dim=-1).flip(-1).clamp(max=npos - 1)
    pos_logits_fixed = torch.matmul(query, pos_emb)  # [B, L, npos]
    ceil, floor = positions.ceil().long(), positions.floor().long()
    w = positions - floor
    pos_logits = pos_logits_fixed.gather(-1, ceil) * w + pos_logits_fixed.gather(-1, floor) * (1 - w)
    attn_logits = (gate_logits + pos_logits) / math.sqrt(D) + attn_mask.log()
    return torch.bmm(torch.softmax(attn_logits, dim=-1), val)


@pytest.mark.parametrize("npos", [6, 41])
def test_cope_equals_the_official_forward_and_gradients(npos):
    """npos 6 clips most positions, npos 41 > L keeps them all (fractional positions interpolate)."""
    B, H, L, D = 2, 3, 30, 8
    s = positional.build("cope", num_heads=H, layers=2, head_dim=D, npos_max=npos).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        s.emb.copy_(torch.randn(s.emb.shape, generator=g, dtype=torch.float64))
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pos = torch.arange(L)
    want = _official(q.reshape(B * H, L, D), k.reshape(B * H, L, D), v.reshape(B * H, L, D),
                     s.emb[1][None], npos).reshape(B, H, L, D)
    go = torch.randn_like(want)
    ref_grads = torch.autograd.grad(want, (q, k, v, s.emb), go)
    for impl, bs in (("auto", 1024), ("blocked", 7)):
        out, _ = attend(q, k, v, pos, pos, s, 1, AttnOptions(impl=impl, block_size=bs))
        assert (out - want).abs().max() < 1e-12, impl
        for a, b in zip(torch.autograd.grad(out, (q, k, v, s.emb), go), ref_grads):
            assert (a - b).abs().max() < 1e-10, impl


def test_cope_model_decodes_with_the_cache_and_never_takes_a_fused_path():
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="cope", vocab_size=50, dim=32, heads=4, layers=2, train_length=24)).eval()
    with torch.no_grad():
        m.scheme.emb.normal_(0, 1.0)
    assert m.scheme.npos == 25 and m.scheme.emb.shape == (2, 8, 25)  # L_tr + 1, as block_size + 1
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(idx)
        steps = decode(m, idx, 6, KVCache(2))
    assert (steps - full).abs().max() < 2e-5
    for impl in ("auto", "sdpa", "blocked"):
        path, block = select_path("cuda", m.scheme, AttnOptions(impl=impl, block_size=256), (2, 4, 4096, 64), 4096,
                                  same_pos=True, starts=(0, 0), dense_bias=False, grad=True)
        assert (path, block) == ("reference", min(256, SCORE_BLOCK))
    assert "whole row" in m.scheme.reference_only


def test_cope_positions_in_bf16_stay_within_a_tenth_at_2048_keys():
    """CoPE's positions are a reverse cumulative sum of gates. Computed as total - prefix + g in bf16 (what CPU
    autocast keeps in bf16) they were off by up to 5.5 positions at 2,048 keys; computed directly in fp32 from
    the same bf16 logits they agree with fp64 to < 0.1 position -- at least 30x better than the difference
    of running sums, which the test computes too so that it is seen to fail."""
    from extrapolab.positional.cope import positions

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 4, 8, 2048, generator=g) * 3).bfloat16()  # [B, H, bq, bk]
    npos = 4096  # no clipping: every position is compared
    _, ref = positions(logits.double(), npos)
    _, got = positions(logits, npos)
    assert got.dtype == torch.float32
    err = (got.double() - ref).abs().max().item()
    gates = torch.sigmoid(logits)  # bf16, as under CPU autocast
    old = (gates.sum(-1, keepdim=True) - gates.cumsum(-1) + gates).double()
    old_err = (old - ref).abs().max().item()
    assert err < 0.1 and old_err > 30 * err, (err, old_err)


def test_cope_logits_from_bf16_gates_match_fp64():
    """The term q·e[p_ij]/√d a layer adds, from bf16 gate logits (what the reference path holds under bf16
    autocast) at 2,048 keys: within 0.05 of the fp64 computation on the same inputs (e varies by ~1 per
    position, so a position off by 5 would show as ~5)."""
    from extrapolab.positional.cope import CoPELogits

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 2, 4, 2048, generator=g) * 3).bfloat16()  # [B, H, bq, bk]
    e = torch.randn(1, 2, 4, 2049, generator=g).cumsum(-1).bfloat16()  # [B, H, bq, npos] smooth in p
    want = CoPELogits.apply(logits.double(), e.double(), 2049)
    got = CoPELogits.apply(logits, e, 2049)
    assert (got.double() - want).abs().max().item() < 0.05

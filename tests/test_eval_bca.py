"""Blockwise causal attention at test time (xPos §3.3, eval/bca.py) against the same model run in
parallel with the BCA mask in every layer, on the reference path."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from extrapolab.eval import evaluate
from extrapolab.eval.bca import BlockwiseCausal, bca_mask, block_size
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.model.reference import dense_attention

H, D, V = 2, 8, 40


def _gpt(scheme, L=16):
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=V, layers=3, heads=H, dim=H * D, scheme=scheme, train_length=L))
    with torch.no_grad():  # learned tables start at constants: randomise so the bias matters
        for p in m.scheme.parameters():
            p.uniform_(0.1, 1.5)
    return m.eval()


def dense_forward(model, idx, allowed):
    """The GPT's forward written out, every layer's logits masked by ``allowed`` [L, L] (and the
    scheme's bias), through the reference attention (plain matmul-softmax)."""
    L = idx.shape[1]
    pos = torch.arange(L)
    s = model.scheme
    mask = torch.zeros(L, L).masked_fill(~allowed, -math.inf)  # [L, L]
    x = model.embed(idx, pos)  # [B, L, C]
    for blk in model.blocks:
        B, _, C = x.shape
        q, k, v = blk.qkv(blk.ln1(x)).view(B, L, 3, H, C // H).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        q, k = s.rotate(q, k, pos, pos)
        bias = s.bias(pos, pos, blk.index) if s.has_bias else torch.zeros(1, L, L)  # [H|1, L, L]
        p = s.content_positions(blk.ln1(x), blk.index) if s.has_content else None  # FoX: [B, H, L]
        out, _ = dense_attention(q, k, v, pos, pos, s, blk.index, bias=(bias + mask).expand(H, L, L),
                                 content=None if p is None else (p, p))
        x = x + blk.proj(out.transpose(1, 2).reshape(B, L, C))
        x = x + blk.mlp(blk.ln2(x))
    return model.head(model.ln_f(x))  # [B, L, V]


def test_bca_mask_by_hand():
    allowed = bca_mask(torch.arange(7), 2)
    # query 5 (block 2) sees keys 2, 3 (block 1) and 4, 5 (its own block, causally)
    assert allowed[5].tolist() == [False, False, True, True, True, True, False]
    assert allowed[1].tolist() == [True, True] + [False] * 5
    assert block_size(0, 512) == 256 and block_size(7, 512) == 7
    with pytest.raises(UserError, match="bca_block"):
        block_size(0, 1)


@pytest.mark.parametrize("scheme", ["xpos", "rotary", "alibi", "kerple-log", "t5", "none", "kerple-bias-wht", "fox"])
def test_blockwise_equals_the_dense_bca_mask_on_the_reference_path(scheme):
    m = _gpt(scheme)
    idx = torch.randint(0, V, (2, 53), generator=torch.Generator().manual_seed(1))  # 53: a last partial block
    with torch.no_grad():
        causal = torch.ones(53, 53).tril().bool()
        torch.testing.assert_close(dense_forward(m, idx, causal), m(idx), rtol=1e-5, atol=1e-5)  # the writing-out is right
        for block in (5, 8):
            want = dense_forward(m, idx, bca_mask(torch.arange(53), block))
            got = BlockwiseCausal(m, block)(idx)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
            assert (got - m(idx)).abs().max() > 1e-3  # and it is not plain causal attention
        short = idx[:, :16]  # L <= 2 x block: BCA is causal attention
        torch.testing.assert_close(BlockwiseCausal(m, 8)(short), m(short), rtol=1e-6, atol=1e-6)


def test_bca_refuses_selective_attention_in_one_line():
    m = _gpt("selective")
    with pytest.raises(UserError, match="without eval.bca") as e:
        BlockwiseCausal(m, 8)(torch.zeros(1, 40, dtype=torch.long))
    assert "\n" not in str(e.value)


def test_evaluate_with_bca_records_block_and_refuses_e5():
    m = _gpt("xpos")
    tok = np.random.default_rng(0).integers(0, V, 4000)
    res = evaluate(m, tok, train_length=16, protocols=["nonoverlapping", "cached"], lengths=[16, 64],
                   num_tokens=512, bca=True)
    plain = evaluate(m, tok, train_length=16, protocols=["nonoverlapping"], lengths=[16, 64], num_tokens=512)
    assert res["settings"]["bca_block"] == 8 and plain["settings"]["bca_block"] is None
    assert res["nonoverlapping"]["16"]["ppl"] == pytest.approx(plain["nonoverlapping"]["16"]["ppl"], rel=1e-6)
    assert res["nonoverlapping"]["64"]["ppl"] != pytest.approx(plain["nonoverlapping"]["64"]["ppl"], rel=1e-6)
    assert "without eval.bca" in res["cached"]["64"]["error"]

"""Stick-breaking attention (Tan et al. 2025) against the explicit product formula in fp64 (output and
gradients by autograd through the product), against the official reference ``sb_ref.py`` as its tests
call it, numerically stable at large logits, and never on a fused path."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import positional
from extrapolab.model import attention as attn_mod
from extrapolab.model.attention import AttnOptions, attend


def _product_formula(q, k, v, attend_current, tau=1.0):
    """A_ij = β_ij Π_{j<k<i} (1 − β_ik) (k <= i with attend_current), β = σ(q·k/√d/τ), loops over the product;
    o_i = Σ_j A_ij v_j + (1 − Σ_j A_ij) v_i."""
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) / tau)  # [B, H, L, L]
    L, last = beta.shape[-1], (1 if attend_current else 0)
    rows = []
    for i in range(L):
        cols = []
        for j in range(L):
            if j >= i + last:
                cols.append(torch.zeros_like(beta[..., 0, 0]))
                continue
            a = beta[..., i, j]
            for kk in range(j + 1, i + last):
                a = a * (1 - beta[..., i, kk])
            cols.append(a)
        rows.append(torch.stack(cols, -1))
    A = torch.stack(rows, -2)
    return A @ v + (1 - A.sum(-1))[..., None] * v


def _sb_ref(q, k, v, attend_current):
    """shawntan/stickbreaking-attention: sb_ref.stickbreaking + tests/test_attn.py ref_fwd (rem added to v)."""
    L = q.shape[2]
    cum_weight = torch.ones(L, L).tril(-1).to(q)
    mask = torch.ones(L, L).triu(1 if attend_current else 0).bool()
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    log_z = F.logsigmoid(logits).masked_fill(mask, -1e5)
    log_beta = F.logsigmoid(-logits).masked_fill(mask, 0)
    att = (log_z + torch.einsum("bhij,jk->bhik", log_beta, cum_weight)).exp()
    return att @ v + (1 - att.sum(-1))[..., None] * v


def _qkv(L=12, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple((scale * torch.randn(2, 3, L, 8, generator=g, dtype=torch.float64)).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_equals_the_product_formula_and_its_gradients(attend_current):
    s = positional.build("stick-breaking", 3, attend_current=attend_current)
    q, k, v = _qkv()
    pos = torch.arange(12)
    for opts, tau in [(AttnOptions(block_size=5), 1.0), (AttnOptions(impl="blocked", block_size=4, temperature=0.7), 0.7)]:
        out, _ = attend(q, k, v, pos, pos, s, 0, opts)
        ref = _product_formula(q, k, v, attend_current, tau)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        go = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    torch.testing.assert_close(attend(q, k, v, pos, pos, s, 0)[0], _sb_ref(q, k, v, attend_current), rtol=0, atol=1e-12)


def test_weights_are_stable_at_large_logits_and_sum_to_one():
    """Logits of ±400: products of 1 − σ underflow if taken directly; in log space the weights stay finite,
    >= 0, sum to 1 per row (the remainder on the query's own key), and agree with the official reference."""
    s = positional.build("stick-breaking", 3)
    q, k, v = _qkv(L=40, seed=1, scale=8.0)
    pos = torch.arange(40)
    out, probs = attend(q.float(), k.float(), v.float(), pos, pos, s, 0, AttnOptions(need_probs=True))
    assert torch.isfinite(out).all() and (probs >= -1e-6).all()  # the remainder 1 - ΣA only rounds below 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 40), rtol=0, atol=1e-5)
    assert (probs.triu(1) == 0).all()
    torch.testing.assert_close(out.double(), _sb_ref(q, k, v, False), rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_reference_path_only_in_small_query_blocks(monkeypatch):
    s = positional.build("stick-breaking", 3)
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)) or real(*a, **kw))
    q, k, v = _qkv(L=12)
    for impl in ("auto", "sdpa", "blocked"):
        attend(q, k, v, torch.arange(12), torch.arange(12), s, 0, AttnOptions(impl=impl))
    assert seen == [("reference", attn_mod.SCORE_BLOCK)] * 3
    assert "softmax" in s.reference_only and s.options() == {"attend_current": False}

"""The head-scale step for NoPE models (align/head_scale.py, Wang et al. 2024): conversion keeps the
outputs, the uniform search picks the grid value of lowest loss (each loss checked by hand), and the
tuning moves only the λ, keeps them >= 1 and lowers the loss at the target length."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extrapolab.align.head_scale import tune_head_scale, uniform_scale_search, with_head_scale
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig

TOKENS = np.random.default_rng(0).integers(0, 30, 4000)
TOKENS[1::2] = TOKENS[::2][: TOKENS[1::2].size]  # every odd token repeats the one before: learnable


def _nope():
    torch.manual_seed(0)
    return GPT(ModelConfig(scheme="none", vocab_size=30, dim=32, heads=4, layers=2, train_length=16, init_std=0.2))


def test_conversion_keeps_the_outputs_and_refuses_other_schemes():
    m = _nope().eval()
    hs = with_head_scale(m)
    idx = torch.as_tensor(TOKENS[:40])[None]
    with torch.no_grad():
        assert (hs(idx) - m(idx)).abs().max() < 1e-6
    assert hs.cfg.scheme == "nope-headscale" and hs.scheme.scale.shape == (2, 4) and m.cfg.scheme == "none"
    torch.manual_seed(0)
    with pytest.raises(UserError, match="NoPE models"):
        with_head_scale(GPT(ModelConfig(scheme="alibi", vocab_size=30, dim=32, heads=4, layers=2)))


def test_uniform_search_picks_the_lowest_loss_and_restores_the_scales():
    hs = with_head_scale(_nope()).eval()
    res = uniform_scale_search(hs, TOKENS, 64, grid=(0.5, 1.0, 2.0), segments=2)
    assert torch.equal(hs.scheme.scale, torch.ones(2, 4))
    seg = torch.as_tensor(np.stack([TOKENS[s:s + 65] for s in np.random.default_rng(0).integers(0, 4000 - 64, 2)]))
    for lam, loss in zip(res["grid"], res["loss"]):
        m = with_head_scale(_nope(), scale=lam, min_scale=None).eval()
        with torch.no_grad():
            want = np.mean([F.cross_entropy(m(seg[i:i + 1, :-1])[0], seg[i, 1:]).item() for i in range(2)])
        assert abs(loss - want) < 1e-5
    assert res["best"] == res["grid"][int(np.argmin(res["loss"]))]


def test_tuning_moves_only_the_scales_clamps_them_and_lowers_the_loss():
    """One 65-token text: every step sees the same segment, so the loss it reports must fall."""
    hs = with_head_scale(_nope())
    before = {n: p.detach().clone() for n, p in hs.named_parameters() if n != "scheme.scale"}
    res = tune_head_scale(hs, TOKENS[:65], 64, steps=20, lr=0.05, init=1.5, min_scale=1.0, batch_size=2)
    assert all(torch.equal(p, before[n]) for n, p in hs.named_parameters() if n != "scheme.scale")
    lam = torch.tensor(res["scale"])
    assert lam.shape == (2, 4) and bool((lam >= 1.0).all()) and not torch.allclose(lam, torch.full((2, 4), 1.5))
    assert res["loss_after"] < res["loss_before"]
    assert all(p.requires_grad for p in hs.parameters())  # frozen only while tuning

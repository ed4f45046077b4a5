"""Sliding-dilated bias (thesis eq. 6.1) against a brute-force loop, and its options."""
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional.base import SchemeError


def brute_mask(r: torch.Tensor, C: int, level: int, L: int) -> torch.Tensor:
    """Eq. 6.1 written out with Python loops: [H, L, L]."""
    H = r.shape[0]
    out = torch.full((H, L, L), -math.inf)
    for h in range(H):
        for m in range(L):
            for n in range(L):
                d = m - n
                if d >= 0 and d % (C ** level) == 0 and d // (C ** level) < C:
                    out[h, m, n] = r[h, d // (C ** level)]
    return out


@pytest.mark.parametrize("C", [2, 3])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_mask_matches_eq_6_1(C, level):
    s = positional.build("sliding-dilated", num_heads=3, C=C)
    with torch.no_grad():
        s.r.copy_(torch.randn(3, C))
    L = 60
    pos = torch.arange(L)
    got = s.bias(pos, pos, layer=level).detach()  # K=1: layer index == level
    want = brute_mask(s.r.detach(), C, level, L)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = ~torch.isinf(want)
    assert torch.allclose(got[fin], want[fin])
    # every query keeps at least itself, and at most C keys
    assert int(fin.sum(-1).min()) >= 1 and int(fin.sum(-1).max()) == min(C, 1 + (L - 1) // C ** level)


def test_block_of_positions_and_level_mapping():
    s = positional.build("sliding-dilated", num_heads=2, C=2, K=3)
    with torch.no_grad():
        s.r.copy_(torch.tensor([[0.5, -1.0], [2.0, 3.0]]))
    q, k = torch.arange(100, 110), torch.arange(90, 110)
    # layers 3, 4, 5 are level 1 with thickness 3; a block of positions equals the slice of the full mask
    full = brute_mask(s.r.detach(), 2, 1, 110)[:, 100:110, 90:110]
    for layer in (3, 4, 5):
        b = s.bias(q, k, layer).detach()
        assert torch.equal(torch.isinf(b), torch.isinf(full))
        assert torch.allclose(b[~torch.isinf(b)], full[~torch.isinf(full)])
    pinned = positional.build("sliding-dilated", num_heads=2, C=2, level=2)
    assert pinned.level_of(0) == pinned.level_of(7) == 2
    assert s.level_of(2) == 0 and s.level_of(6) == 2


def test_params_and_registry():
    assert "sliding-dilated" in positional.names()
    s = positional.build("sliding-dilated", num_heads=8, C=3)
    assert sum(p.numel() for p in s.parameters()) == 3 * 8  # C·H
    assert s.layer_dependent and s.learnable
    assert s.options() == {"C": 3, "K": 1, "level": None}
    # a huge level never overflows: only the query itself remains
    b = s.bias_from_distance(torch.arange(5), layer=60)
    assert torch.isfinite(b[:, 0]).all() and torch.isinf(b[:, 1:]).all()


@pytest.mark.parametrize("bad", [{"C": 1}, {"C": 0}, {"C": "2"}, {"C": 2.0}, {"K": 0}, {"level": -1}])
def test_bad_options_raise_one_line(bad):
    with pytest.raises(SchemeError) as e:
        positional.build("sliding-dilated", num_heads=2, **bad)
    assert "\n" not in str(e.value)


def test_gradient_reaches_r_and_gpt_layers_dilate():
    cfg = ModelConfig(vocab_size=11, layers=3, heads=2, dim=16, scheme="sliding-dilated",
                      scheme_params={"C": 2})
    model = GPT(cfg)
    idx = torch.randint(0, 11, (2, 12))
    out = model(idx, return_probs=True)
    out["logits"].sum().backward()
    assert model.scheme.r.grad is not None and model.scheme.r.grad.abs().sum() > 0
    for layer, p in enumerate(out["probs"]):  # layer l attends only to distances 0 and 2^l
        m, n = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
        allowed = (m == n) | (m - n == 2 ** layer)
        assert float(p.detach()[..., ~allowed].abs().max()) == 0.0
        assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)))

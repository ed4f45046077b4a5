"""DAPE and DAPE V2 (Zheng et al. 2024) against the official modules' forward written here as
chuanyang-Zheng/DAPE computes it (``x + a + mlp2(cat(x, tile(a)))`` on the scaled scores before the
mask; V2: the same with a two-layer 1×3 convolution on ``tril`` of them), output and gradients, on
ALiBi, KERPLE-log, FIRE and a bias-free base."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import positional
from extrapolab.model import attention as attn_mod
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.positional.base import SchemeError


def _official(s, q, k, v, layer):
    """softmax(x + a + mlp2(cat(x, a))) v with the causal mask after, as the official module and
    ``scale_mask_softmax``; mlp2 = Linear-LeakyReLU-Linear (V1) or Conv2d(1×3)-LeakyReLU-Conv2d(1×3) on
    ``torch.tril`` (V2), with s's weights of ``layer`` (so gradients reach them)."""
    L = q.shape[2]
    pos = torch.arange(L)
    x = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, L, L] attention_scores
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    a = s.base.bias(pos, pos, layer, dtype=torch.float64).masked_fill(future, 0.0) if s.base.has_bias else None
    w1, b1, w2, b2 = s.w1[layer], s.b1[layer], s.w2[layer], s.b2[layer]
    xa = x if a is None else torch.cat((x, torch.tile(a, (x.shape[0], 1, 1, 1))), dim=1)
    if s.kernel == 1:  # permute(0, 2, 3, 1) -> nn.Linear -> nn.LeakyReLU -> nn.Linear -> permute back
        h = F.leaky_relu(F.linear(xa.permute(0, 2, 3, 1), w1[:, :, 0, 0], b1))
        y = F.linear(h, w2[:, :, 0, 0], b2).permute(0, 3, 1, 2)
    else:  # nn.Conv2d(C, W, (1, 3), (1, 1), (0, 1)) -> LeakyReLU -> nn.Conv2d(W, H, (1, 3), (1, 1), (0, 1)) on tril
        y = F.conv2d(F.leaky_relu(F.conv2d(torch.tril(xa), w1, b1, padding=(0, 1))), w2, b2, padding=(0, 1))
    lg = (x + (0 if a is None else a) + y).masked_fill(future, -math.inf)
    return torch.softmax(lg, -1) @ v


CASES = [("dape-alibi", {}), ("dape-kerple", {}), ("dape-fire", {"original_length": 10}),
         ("dape", {"base": "rotary"}), ("dape-alibi", {"kernel": 3}), ("dape-fire", {"kernel": 3, "original_length": 10}),
         ("dape", {"base": "none", "kernel": 3})]


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{o.get('kernel', 1)}-{o.get('base', '')}" for n, o in CASES])
def test_dape_equals_the_official_forward_and_gradients(name, opts, monkeypatch):
    """V1 exactly; V2 on the rows whose keys the official tensor holds on both sides (the official pads its
    hidden layer with zeros at the tensor's edge, which moves the last row: we compare the first L rows of an
    L + 1 token input, where the official code and ours see the same zeros beyond each row's last key)."""
    torch.manual_seed(0)
    s = positional.build(name, 4, layers=2, width=6, **opts).double()
    g = torch.Generator().manual_seed(1)
    L = 21
    q, k, v = (torch.randn(2, 4, L + 1, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pos = torch.arange(L)
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)[0]) or real(*a, **kw))
    qr, kr = s.rotate(q, k, torch.arange(L + 1), torch.arange(L + 1))  # the base's rotation (RoPE), as attend does
    ref = _official(s, qr, kr, v, 1)[:, :, :L]
    params = [q, k, v, *s.parameters()]
    for impl in ("auto", "blocked"):
        out, _ = attend(q[:, :, :L], k[:, :, :L], v[:, :, :L], pos, pos, s, 1, AttnOptions(impl=impl, block_size=6))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        go = torch.randn_like(ref)
        got = torch.autograd.grad(out, params, go, allow_unused=True)
        want = torch.autograd.grad(ref, params, go, allow_unused=True, retain_graph=True)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert set(seen) == {"reference"}


def test_dape_layout_and_bad_bases():
    s = positional.build("dape-kerple", 4, layers=3)
    assert s.w1.shape == (3, 32, 8, 1, 1) and s.w2.shape == (3, 4, 32, 1, 1)  # per layer, width 32, [z; B] in
    assert s.base.name == "kerple-log" and s.relative and s.has_bias
    assert positional.build("dape", 4, base="rotary").w1.shape[2] == 4  # no bias: z alone (the official DAPEV1)
    v2 = positional.build("dape-fire", 4, kernel=3, original_length=64)
    assert v2.w1.shape[-1] == 3 and v2.base.original_length == 64 and not v2.relative
    assert "MLP" in s.reference_only
    for bad in ({"base": "cope"}, {"base": "fox"}, {"base": "learned"}, {"base": "kerple-bias-wht"},
                {"base": "rotary-selfextend"}, {"kernel": 2}):
        with pytest.raises(SchemeError) as err:
            positional.build("dape", 4, **bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("kernel", [1, 3])
def test_keys_in_chunks_give_the_same_scores(kernel, monkeypatch):
    """Long rows go through the MLP in chunks of keys (V2 with its halo of neighbouring keys): the same
    logits and gradients as one chunk."""
    from extrapolab.positional import dape as D

    s = positional.build("dape-alibi", 4, layers=1, width=6, kernel=kernel).double()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 30, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pos = torch.arange(30)
    whole, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(block_size=8))
    gw = torch.autograd.grad(whole.sum(), [q, *s.parameters()])
    for keys in (1, 4, 7):
        monkeypatch.setattr(D, "HIDDEN_ELEMS", 2 * 8 * 6 * keys)  # B·bq·width·keys: chunks of `keys` keys
        part, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(block_size=8))
        torch.testing.assert_close(part, whole, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad(part.sum(), [q, *s.parameters()]), gw):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)

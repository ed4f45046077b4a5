"""FoX, the Forgetting Transformer's gate (positional/fox.py): a block against the paper's equations
written out here (Lin et al. 2025 §2: f_t = σ(w·x_t + b), D_ij = Σ_{l=j+1..i} log f_l, softmax(QK^T/√d
+ D)V), the official code's initialisation, KV-cache and chunked decoding against the parallel
forward, and the fused (folded) path's gradients against the reference path's."""
import math

import torch

from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, KVCache, ModelConfig


def _model(layers=2, L=64, seed=0, init_std=0.02):
    torch.manual_seed(seed)
    return GPT(ModelConfig(scheme="fox", vocab_size=50, dim=32, heads=4, layers=layers, train_length=L,
                           init_std=init_std))


def _paper_block(blk, scheme, x, layer):
    """One pre-LN block with Forgetting Attention, by the paper's equations and explicit loops."""
    B, L, C = x.shape
    H, D = 4, C // 4
    h = blk.ln1(x)
    q, k, v = blk.qkv(h).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # [B, H, L, D]
    f = torch.sigmoid(h @ scheme.w[layer].T + scheme.b[layer])  # [B, L, H] forget gates
    logf = torch.log(f).double()
    Dm = torch.full((B, H, L, L), -math.inf, dtype=torch.float64)
    for i in range(L):
        for j in range(i + 1):
            Dm[:, :, i, j] = logf[:, j + 1:i + 1].sum(1)  # Σ_{l=j+1..i} log f_l  (0 when j = i)
    att = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(D) + Dm, -1)  # [B, H, L, L]
    o = (att @ v.double()).float().transpose(1, 2).reshape(B, L, C)
    x = x + blk.proj(o)
    return x + blk.mlp(blk.ln2(x))


def test_fox_block_equals_the_papers_equations():
    m = _model(init_std=0.3)  # large gate weights: gates far from 0.5 and different per token
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20)
    with torch.no_grad():
        for layer, blk in enumerate(m.blocks):
            for impl in ("auto", "plain", "blocked"):
                got, _ = blk(x, pos, m.scheme, AttnOptions(impl=impl, block_size=6))
                want = _paper_block(blk, m.scheme, x, layer)
                assert (got - want).abs().max() < 2e-5, (layer, impl)


def test_fox_starts_as_the_official_code():
    """fgate_proj = nn.Linear(hidden, H, bias=True), weight N(0, 0.02), bias 0: f ≈ 0.5 at the start."""
    m = _model(layers=4)
    w, b = m.scheme.w.detach(), m.scheme.b.detach()
    assert w.shape == (4, 4, 32) and b.shape == (4, 4) and torch.equal(b, torch.zeros(4, 4))
    assert abs(w.std().item() - 0.02) < 0.003 and abs(w.mean().item()) < 0.003
    x = torch.randn(3, 50, 32)
    f = m.scheme.gate(m.blocks[0].ln1(x), 0)  # [B, H, L]
    assert f.shape == (3, 4, 50) and abs(f.mean().item() - 0.5) < 0.01


def test_fox_decoding_with_the_cache_equals_the_parallel_forward():
    """The cache carries p = -cumsum(log f) of its keys: token-by-token, in chunks of 7, and with a
    window that never evicts, decoding equals one forward; the positions continue across calls."""
    m = _model().eval()
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(idx)
        for window, step in ((None, 1), (40, 1), (None, 7)):
            cache = KVCache(2, window=window)
            outs = [m(idx[:, :5], positions=torch.arange(5), cache=cache)]
            for t in range(5, 40, step):
                e = min(40, t + step)
                outs.append(m(idx[:, t:e], positions=torch.arange(t, e), cache=cache))
            assert (torch.cat(outs, 1) - full).abs().max() < 2e-5, (window, step)
            assert cache.content[0].shape == (2, 4, 40) and cache.content[0].dtype == torch.float64
            assert bool((cache.content[0].diff(dim=-1) > 0).all())  # -log f > 0: p increases


def test_fox_fused_training_gradients_equal_the_reference_path():
    m = _model(init_std=0.1)
    idx = torch.randint(0, 50, (2, 48), generator=torch.Generator().manual_seed(3))
    grads = {}
    for impl in ("plain", "auto"):
        m.zero_grad()
        m(idx, opts=AttnOptions(impl=impl)).float().square().mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert grads["auto"]["scheme.w"].abs().sum() > 0
    for n, g in grads["plain"].items():
        assert torch.allclose(grads["auto"][n], g, rtol=1e-4, atol=1e-7), n

"""Selective attention (Leviathan et al., ICLR 2025, arXiv 2410.02703 §3.2): the paper's listing written here
(dense, fp64) against attend() in query blocks of any size, with gradients; the selection state kept per key
across blocks and in the KV cache (a window's ring included); attention rows for analyses; one-line errors."""
import math

import pytest
import torch

from extrapolab import positional as P
from extrapolab.analysis.attn import attention_rows, capture_qkv
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.cache import KVCache
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional.base import SchemeError

H, D = 3, 8


def _listing(q, k, v, pos, base, head=0):
    """The paper's listing: logits (base scheme's rotation and bias, causal mask); S = ReLU(logits[head]);
    S[..., 0] = 0 (<BOS>); S = (1 - I)·S (not itself); S = roll(S, 1, rows), S[0] = 0 (strictly the future);
    F = cumsum(S, rows); logits -= F for every head; softmax."""
    q, k = base.rotate(q, k, pos, pos)
    L = q.shape[2]
    lg = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if base.has_bias:
        lg = lg + base.bias(pos, pos, 0).to(lg.dtype)
    lg = lg.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
    S = torch.relu(lg[:, head])  # [B, L, L]
    S = S.clone()
    S[..., 0] = 0
    S = (1 - torch.eye(L, dtype=S.dtype)) * S
    S = torch.roll(S, 1, -2)
    S[..., 0, :] = 0
    Fm = torch.cumsum(S, -2)
    lg = lg - Fm[:, None]
    return torch.softmax(lg, -1) @ v


@pytest.mark.parametrize("base", ["none", "rotary", "alibi"])
def test_attend_equals_the_papers_listing_in_any_blocks_with_gradients(base):
    s = P.build("selective", H, base=base, head_dim=D)
    b = P.build(base, H)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 45, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    pos = torch.arange(45)
    want = _listing(q, k, v, pos, b)
    gg = torch.randn_like(want)
    wg = torch.autograd.grad(want, (q, k, v), gg)
    for opts in (AttnOptions(), AttnOptions(impl="plain"), AttnOptions(impl="blocked", block_size=7)):
        content = (torch.zeros(2, H, 45, dtype=torch.float64),) * 2
        paths = {}
        opts.paths = paths
        got, _ = attend(q, k, v, pos, pos, s, 0, opts, content=content)
        assert set(paths) == {"reference"}
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for x, y in zip(torch.autograd.grad(got, (q, k, v), gg), wg):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
        # the keys' state after the call: F of the next query, Σ over every query of S
        assert content[1][0, 0, 0] == 0 and content[1][:, 0, -1].abs().sum() == 0  # <BOS>; the last key: no later query


def test_cached_decoding_and_a_prefix_equal_the_parallel_forward():
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=40, layers=2, heads=H, dim=H * D, scheme="selective", train_length=16)).double().eval()
    idx = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        full = m(idx, opts=AttnOptions(impl="blocked", block_size=4))
        cache = KVCache(2)
        steps = [m(idx[:, :6], positions=torch.arange(6), cache=cache)]
        steps += [m(idx[:, t:t + 3], positions=torch.arange(t, t + 3), cache=cache) for t in range(6, 30, 3)]
        pre = m(idx[:, :11])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pre, full[:, :11], rtol=1e-10, atol=1e-12)


def test_a_windowed_cache_keeps_both_ring_copies_of_an_updated_state():
    """Attention updates the keys' state in place (selective attention); the ring keeps each token twice, so
    every append first copies the view it returned onto its other half: what later views read is the update."""
    w, B = 4, 1
    cache = KVCache(1, window=w)
    state = {}
    for t in range(11):
        k = torch.zeros(B, H, 1, D)
        cache.extend(0, k, k, torch.tensor([t]), torch.zeros(B, H, 1, dtype=torch.float64))
        view = cache.content[0]  # [B, H, <= w] the cached keys' state, time-ordered
        pos = cache.pos[0].tolist()
        assert [state.get(p, 0.0) for p in pos] == view[0, 0].tolist()
        view += 1.0  # what the reference path does: each key gains this step's selection
        for p in pos:
            state[p] = state.get(p, 0.0) + 1.0


def test_attention_rows_of_a_subset_equal_the_full_rows():
    """Analyses recompute chosen rows (analysis/attn.py): for selective attention each row needs the queries
    before it, so the rows are streamed from the first query; they equal the model's own probabilities."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=40, layers=1, heads=H, dim=H * D, scheme="selective", train_length=16,
                        sinks=True)).double().eval()
    idx = torch.randint(0, 40, (1, 150))
    with torch.no_grad():
        probs = m(idx, return_probs=True)["probs"][0]  # [1, H, 150, 150]
        cap = capture_qkv(m, idx)
        rows = torch.tensor([0, 7, 70, 149, 71])
        got = attention_rows(m, cap[0], 0, rows, torch.arange(150))
    torch.testing.assert_close(got.double(), probs[:, :, rows], rtol=1e-5, atol=1e-7)


def test_bad_selective_options_are_one_line_errors():
    for kw, match in (({"base": "fox"}, "base='fox'"), ({"base": "nope"}, "base='nope'"), ({"head": 3}, "0..2"),
                      ({"base": "rotary-rerope"}, "second pass")):
        with pytest.raises(SchemeError, match=match) as e:
            P.build("selective", H, **kw)
        assert "\n" not in str(e.value)

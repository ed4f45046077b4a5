"""The scheme contract (tests/test_schemes_contract.py) with every attention option on (model.sinks, ssmax,
qk_norm, gate: docs/attention.md, "Model options"), over the whole registry: the paths agree, a prefix equals the
whole, cached decoding equals the parallel forward; and with sinks and SSMax no path builds an L x L tensor. QK-norm
takes its two forms in turn over the registry (per head, as true means, and over all heads)."""
from __future__ import annotations

import pytest
import torch
from decoding import decode
from test_schemes_contract import CASES, DIM, H, LAYERS, VOCAB, _randomize_, _scheme, long_inputs, registered

from extrapolab.memory import PeakMemory
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.registry import REGISTRY

ALL = {"sinks": True, "ssmax": True, "qk_norm": True, "gate": True}


def _model(name, opts, train_length, **extra):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, layers=LAYERS, heads=H, dim=DIM, scheme=name, scheme_params=dict(opts),
                      train_length=train_length, **extra)
    model = GPT(cfg)
    _randomize_(model.scheme)
    with torch.no_grad():
        for b in model.blocks:
            if b.extras.sinks is not None:  # sinks start at 0; SSMax at 1 / log L_tr; scales at 1: move them all
                b.extras.sinks.normal_()
            b.extras.ssmax.uniform_(0.2, 0.8)
            b.extras.q_norm.uniform_(0.5, 1.5)
            b.extras.k_norm.uniform_(0.5, 1.5)
    return model


def _options_for(name):
    """Every option, except sinks on a scheme whose weights are not a softmax (refused: test_sinks_ssmax.py);
    QK-norm per head (true) on every other registered name, over all heads on the rest."""
    names = sorted(REGISTRY)
    all_heads = name in names and names.index(name) % 2 == 1
    return {**ALL, "sinks": not REGISTRY[name].replaces_softmax, "qk_norm": "all" if all_heads else True}


@pytest.mark.parametrize("name,opts", CASES)
def test_paths_agree_and_prefix_is_causal_with_every_option(name, opts):
    with registered(name):
        L = 40
        model = _model(name, opts, L, **_options_for(name)).eval()
        idx = torch.randint(0, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(idx, opts=AttnOptions(impl="plain"))
            for impl, bs in (("sdpa", 1024), ("blocked", 7), ("auto", 1024)):
                out = model(idx, opts=AttnOptions(impl=impl, block_size=bs))
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"{impl}/{bs}")
            prefix = model(idx[:, :17])
            torch.testing.assert_close(prefix, ref[:, :17], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,opts", CASES)
def test_cached_decoding_equals_the_parallel_forward_with_every_option(name, opts):
    with registered(name):
        model = _model(name, opts, 32, **_options_for(name)).eval()
        idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            full = model(idx)
            steps = decode(model, idx, 7, KVCache(LAYERS))
        torch.testing.assert_close(steps, full, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["none", "pope", "alibi", "t5", "fox"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("fire", "selective", "rotary-selfextend")])  # ~4 s each
def test_long_attention_with_sinks_and_ssmax_never_builds_an_L_by_L_tensor(name):
    """8,192 tokens through attend() with sinks and SSMax on each path that carries them (causal, folded, the
    fallback for Toeplitz biases, within its memory budget, the reference path): far below one [H, L, L] fp32
    tensor (1 GiB)."""
    s = _scheme(name, {})
    q, k, v, pos, content, g = long_inputs(s)
    sinks, ssmax = torch.randn(H, generator=g), torch.rand(H, generator=g)
    paths = {}
    with torch.no_grad(), PeakMemory() as mem:
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(paths=paths, memory_budget_mb=64, block_size=128), content=content, sinks=sinks, ssmax=ssmax)
    assert torch.isfinite(out).all() and mem.mib < 256, (paths, mem.mib)

"""Per-layer schemes (positional/hybrid.py, the ``for_layer`` hook) and NoPE with a learned scale per
head (positional/headscale.py): the layer rule of SmolLM3 / Llama 4, a hybrid model equal to its
blocks run one by one with the per-layer schemes, KV-cache decoding, the window on the RoPE layers,
one distance table per sub-scheme per forward, and the head scale as softmax(λ_h·q·k/√d)."""
import math

import pytest
import torch
from decoding import decode

from extrapolab import positional
from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional import SchemeError


def _model(params, layers=4, L=64, scheme="hybrid", seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(scheme=scheme, scheme_params=params, vocab_size=50, dim=32, heads=4, layers=layers,
                           train_length=L, init_std=0.2)).eval()


def test_nope_every_kth_layer_as_smollm3_and_llama4_build_it():
    """no_rope_layers = [(l + 1) % interval != 0]: NoPE at layers 3, 7 for every = 4."""
    s = positional.build("hybrid", num_heads=4, layers=8, every=4)
    assert [s.for_layer(i).name for i in range(8)] == ["rotary"] * 3 + ["none"] + ["rotary"] * 3 + ["none"]
    s = positional.build("hybrid", num_heads=4, layers=4, nope_layers=[0, 2], rope_window=16)
    assert [s.for_layer(i).name for i in range(4)] == ["none", "rotary+window16", "none", "rotary+window16"]
    assert s.for_layer(1).for_layer(1) is s.for_layer(1)  # resolved once: a sub-scheme is its own layer scheme


@pytest.mark.parametrize("params", [{"every": 2}, {"every": 2, "rope_window": 7}, {"nope_layers": [1], "nope": "alibi"}])
def test_hybrid_model_equals_its_blocks_with_each_layers_scheme(params):
    m = _model(params)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40)
    with torch.no_grad():
        got = m(idx)
        x = m.embed(idx, pos)
        for i, blk in enumerate(m.blocks):
            x, _ = blk(x, pos, m.scheme.for_layer(i), AttnOptions(impl="plain"))
        assert (got - m.head(m.ln_f(x))).abs().max() < 2e-5
        if params.get("rope_window"):  # a window of 7 keys really masks the RoPE layers
            wide = GPT(m.cfg).eval()
            wide.load_state_dict(m.state_dict())
            wide.scheme.rope.window = 10**6
            wide.scheme._table_cache.clear()
            wide.scheme.rope._table_cache.clear()
            assert (wide(idx) - got).abs().max() > 1e-3


@pytest.mark.parametrize("params", [{"every": 2}, {"every": 3, "rope_window": 9}])
def test_hybrid_cached_decoding_equals_the_parallel_forward(params):
    m = _model(params)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(idx)
        steps = decode(m, idx, 8, KVCache(4))
    assert (steps - full).abs().max() < 2e-5


def test_each_sub_scheme_builds_its_tables_once_per_forward():
    m = _model({"every": 2, "rope_window": 9, "rope": "rotary"})
    win = m.scheme.rope
    calls = []
    real = win.bias_from_distance
    win.bias_from_distance = lambda d, layer=0: calls.append(d.numel()) or real(d, layer)
    with torch.no_grad():
        m(torch.randint(0, 50, (1, 30)))
        m(torch.randint(0, 50, (1, 30)))
    assert len(calls) == 1  # parameter-free window table: built once, cached, shared by both RoPE layers


def test_hybrid_refuses_an_absolute_scheme_per_layer_in_one_line():
    for bad, match in (({"rope": "sinusoidal"}, "absolute scheme"), ({"nope": "nope-x"}, "not a registered"),
                       ({"nope_layers": [9]}, "nope_layers must lie in 0..3"), ({"rope_window": 0}, "rope_window")):
        with pytest.raises(SchemeError, match=match) as err:
            positional.build("hybrid", num_heads=4, layers=4, **bad)
        assert "\n" not in str(err.value)


def test_head_scale_is_lambda_times_the_scaled_logits_per_layer_and_head():
    """softmax(λ_h·q·k/√d) (HeadScale's query_scale), λ per layer and head, on the fused path; the
    focus constraint clamps λ >= min_scale after a step."""
    m = _model({"scale": 1.0, "min_scale": 1.0}, layers=2, scheme="nope-headscale")
    lam = torch.tensor([[0.5, 1.0, 1.6, 3.0], [1.2, 0.8, 2.0, 1.0]])
    with torch.no_grad():
        m.scheme.scale.copy_(lam)
    blk = m.blocks[1]
    x = torch.randn(2, 30, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, _ = blk(x, torch.arange(30), m.scheme, AttnOptions())
        h = blk.ln1(x)
        q, k, v = blk.qkv(h).view(2, 30, 3, 4, 8).permute(2, 0, 3, 1, 4)  # [B, H, L, D]
        lg = lam[1].view(1, 4, 1, 1) * (q @ k.transpose(-1, -2)) / math.sqrt(8)
        lg = lg.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), -math.inf)
        o = (torch.softmax(lg, -1) @ v).transpose(1, 2).reshape(2, 30, 32)
        y = x + blk.proj(o)
        assert (got - (y + blk.mlp(blk.ln2(y)))).abs().max() < 2e-5
    m.constrain_()
    assert m.scheme.scale.detach().min().item() == 1.0  # λ >= 1, the paper's focus constraint (scale_lb 1)

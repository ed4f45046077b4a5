"""Layer types (positional/layout.py, positional/layouts.py, model/chunked.py): every published layout equals
its attention written out from the definitions (rotation, window n > m - w, chunk floor(n/c) = floor(m/c),
Llama 4's temperature), cached decoding equals the parallel forward with a cache bounded by the window /
chunk, no L x L tensor at 8k, the chunk mask equals transformers' own, the Llama 4 temperature equals
transformers' Llama 4 attention, and a checkpoint of the old hybrid scheme loads as it is."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from decoding import decode

from extrapolab import config as C
from extrapolab import positional as P
from extrapolab.memory import PeakMemory
from extrapolab.model.attention import AttnOptions
from extrapolab.model.chunked import attend_layer
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.layout import Chunked, LayerType, SlidingWindow, expand_types

LAYOUTS = {"gemma3": 6, "rnope-swa": 4, "irope": 4, "smollm3": 4}
DATA = Path(__file__).parent / "data"


def _model(layout=None, layers=4, L=32, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, layers=layers, heads=4, dim=32, train_length=L, layout=layout or "",
                      init_std=0.3, **kw)
    return GPT(cfg).eval()


def _explicit_layer(blk, x, pos, spec):
    """One block with its attention written out: rotary by the type's base (or none), logits q·k/√d, the
    type's mask from its definition, Llama 4's q scale on its NoPE layers, softmax, p·v."""
    B, L, Cd = x.shape
    h = blk.ln1(x)
    q, k, v = blk.qkv(h).view(B, L, 3, blk.heads, Cd // blk.heads).permute(2, 0, 3, 1, 4)  # [B, H, L, D]
    if spec.scheme.startswith("rotary"):
        rot = P.build("rotary", 4, **spec.scheme_params)
        q, k = rot.rotate(q, k, pos, pos)
    if spec.scheme == "nope-llama4":
        beta, c = spec.scheme_params["beta"], spec.scheme_params["floor"]
        q = q * (1 + beta * torch.log(1 + torch.floor((pos.double() + 1) / c))).float()[:, None]
    m, n = pos[:, None], pos[None, :]
    ok = n <= m
    if spec.window:
        ok &= n > m - spec.window
    if spec.chunk:
        ok &= n // spec.chunk == m // spec.chunk
    att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~ok, -math.inf).softmax(-1)
    y = blk.proj((att @ v).transpose(1, 2).reshape(B, L, Cd))
    x = x + y
    return x + blk.mlp(blk.ln2(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layout_equals_its_attention_written_out(layout):
    m = _model(layout, LAYOUTS[layout])
    types = m.scheme.options()["types"]
    idx = torch.randint(0, 50, (2, 100), generator=torch.Generator().manual_seed(1))  # 3x L_tr: windows slide
    pos = torch.arange(100)
    with torch.no_grad():
        got = m(idx)
        x = m.embed(idx, pos)
        for i, blk in enumerate(m.blocks):
            x = _explicit_layer(blk, x, pos, LayerType(**types[m.scheme.type_of(i)]))
        want = m.head(m.ln_f(x))
        for impl in ("plain", "blocked"):
            assert (m(idx, opts=AttnOptions(impl=impl, block_size=16)) - got).abs().max() < 3e-5, impl
    assert (got - want).abs().max() < 3e-5
    kinds = [m.scheme.type_of(i) for i in range(LAYOUTS[layout])]
    assert kinds == {"gemma3": ["sliding"] * 5 + ["full"], "rnope-swa": ["sliding"] * 3 + ["full"],
                     "irope": ["chunked"] * 3 + ["full"], "smollm3": ["rope"] * 3 + ["nope"]}[layout]


def test_layer_types_list_pattern_and_per_type_options():
    assert expand_types(["a", "b"], 6) == ["a", "b"] * 3
    m = _model(layer_types=["local", "local", "global"], layers=6,
               types={"local": LayerType("alibi", window=8), "global": {"scheme": "rotary", "scheme_params": {"base": 500.0}}})
    names = [m.scheme.for_layer(i).name for i in range(6)]
    assert names == ["alibi+window8", "alibi+window8", "rotary"] * 2
    assert m.scheme.for_layer(2).base == 500.0 and m.scheme.for_layer(0) is m.scheme.for_layer(3)  # one per type
    cfg = C.resolve(None, ["model.layers=6", "model.layout=gemma3", "model.types.sliding.window=5"])
    s = GPT(cfg.model).scheme  # a field given replaces the layout's, the rest stays
    assert s.for_layer(0).window == 5 and s.for_layer(0).inner.base == 10_000.0 and s.for_layer(5).base == 1e6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt", [5, 37])
def test_cached_decoding_equals_parallel_and_keeps_only_the_window(layout, prompt):
    m = _model(layout, LAYOUTS[layout])
    idx = torch.randint(0, 50, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(idx)
        cache = KVCache(len(m.blocks))
        assert (decode(m, idx, prompt, cache) - full).abs().max() < 3e-5
        chunks = KVCache(len(m.blocks))  # blocks of 7 tokens after the prompt (several chunks per call)
        outs = [m(idx[:, a:a + 7], positions=torch.arange(a, min(90, a + 7)), cache=chunks) for a in range(0, 90, 7)]
        assert (torch.cat(outs, 1) - full).abs().max() < 3e-5
    for i in range(len(m.blocks)):
        s = m.scheme.for_layer(i)
        bound = getattr(s, "window", None) or getattr(s, "chunk", None)
        stored = cache._buf[i][0].shape[2]
        if bound:  # a ring of 2 * bound slots, never more keys than the layer can see
            assert stored == 2 * bound and cache.k[i].shape[2] == bound and chunks.k[i].shape[2] == bound
        else:
            assert cache.k[i].shape[2] == 90


def test_cache_with_gradients_keeps_the_window_too():
    m = _model("rnope-swa").train()
    idx = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(3))
    full = m(idx)
    cache = KVCache(4)
    got = torch.cat([m(idx[:, :20], cache=cache), m(idx[:, 20:], positions=torch.arange(20, 40), cache=cache)], 1)
    assert (got - full).abs().max() < 3e-5 and cache.k[0].shape[2] == 8 and got.requires_grad


@pytest.mark.parametrize("kind", ["window", "chunk"])
def test_long_layers_never_build_an_L_by_L_tensor(kind):
    """8,192 tokens: one [4, L, L] fp32 tensor would be 1 GiB."""
    inner = P.build("rotary", 4)
    s = SlidingWindow(4, inner, 256) if kind == "window" else Chunked(4, inner, 256)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 8192, 8, generator=g) for _ in range(3))
    pos = torch.arange(8192)
    with torch.no_grad(), PeakMemory() as mem:
        out, _ = attend_layer(q, k, v, pos, pos, s, 0, AttnOptions())
    assert torch.isfinite(out).all() and mem.mib < 256, mem.mib
    rows = slice(8000, 8010)  # a few rows against their dense reference
    qr, kr = inner.rotate(q, k, pos, pos)
    ref = F.scaled_dot_product_attention(qr[:, :, rows], kr, v, attn_mask=s.bias(pos[rows], pos)[None].float())
    assert (out[:, :, rows] - ref).abs().max() < 1e-5


def test_chunk_mask_is_transformers_chunked_overlay_and_probabilities_are_zero_outside():
    from transformers.masking_utils import causal_mask_function, chunked_overlay

    c, L = 5, 23
    s = Chunked(2, P.build("none", 2), c)
    pos = torch.arange(L)
    over, causal = chunked_overlay(c, torch.zeros(1, dtype=torch.long)), causal_mask_function
    want = torch.tensor([[bool(over(0, 0, i, j)) and bool(causal(0, 0, i, j)) for j in range(L)] for i in range(L)])
    assert torch.equal(torch.isfinite(s.bias(pos, pos)[0]), want)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 4, generator=g) for _ in range(3))
    seen = []
    opts = AttnOptions(need_probs=True, logits_sink=lambda layer, lg, n: seen.append((lg.shape[-1], n)))
    out, probs = attend_layer(q, k, v, pos, pos, s, 0, opts)
    assert torch.equal(probs[0, 0] > 0, want) and torch.allclose(probs.sum(-1), torch.ones(1, 2, L))
    assert all(n == L for _, n in seen)  # the sink's columns start at key 0
    assert (out - attend_layer(q, k, v, pos, pos, s, 0, AttnOptions())[0]).abs().max() < 1e-5


def test_llama4_temperature_equals_transformers_llama4_attention():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    cfg = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                           num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], floor_scale=5, attn_scale=0.1,
                           intermediate_size=64, intermediate_size_mlp=64, vocab_size=50)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    att = Llama4TextAttention(cfg, layer_idx=3).eval()
    assert not att.use_rope
    x = torch.randn(2, 40, 32)
    with torch.no_grad():
        want = att(x, None, None)[0]
        q, k, v = (p(x).view(2, 40, 4, 8).transpose(1, 2) for p in (att.q_proj, att.k_proj, att.v_proj))
        s = P.build("nope-llama4", 4, beta=0.1, floor=5)
        out, _ = attend_layer(q, k, v, torch.arange(40), torch.arange(40), s, 0)
        assert (att.o_proj(out.transpose(1, 2).reshape(2, 40, 32)) - want).abs().max() < 1e-5


def test_a_checkpoint_of_the_old_hybrid_scheme_loads_and_gives_its_logits(tmp_path):
    """tests/data/hybrid-0ed921b: written by the hybrid scheme before it became a layout (commit 0ed921b;
    NoPE head scale on every 2nd layer, a RoPE window of 7), with its logits on a fixed input."""
    from extrapolab.train import load_model

    run = tmp_path / "run"
    shutil.copytree(DATA / "hybrid-0ed921b", run)
    model, cfg = load_model(run, which="last")
    ref = torch.load(run / "logits.pt")
    assert cfg.model.scheme == "hybrid" and model.scheme.for_layer(0).name == "rotary+window7"
    with torch.no_grad():
        assert (model(ref["idx"]) - ref["logits"]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["gemma3", "irope"])
def test_layouts_take_the_attention_options(layout):
    """Sinks, SSMax, QK-norm and the gate on a layout: every impl agrees, cached == parallel; chunk by chunk
    equals the chunk mask on the reference path with the same sink logits and SSMax scales."""
    m = _model(layout, LAYOUTS[layout], sinks=True, ssmax=True, qk_norm=True, gate=True)
    with torch.no_grad():
        for blk in m.blocks:  # away from their initial values, so that each option bites
            for p in blk.extras.parameters():
                p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    idx = torch.randint(0, 50, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx)
        assert (m(idx, opts=AttnOptions(impl="plain")) - full).abs().max() < 3e-5
        assert (decode(m, idx, 9, KVCache(len(m.blocks))) - full).abs().max() < 3e-5
    s = Chunked(4, P.build("rotary", 4), 16)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 70, 8, generator=g) for _ in range(3))
    pos, ex = torch.arange(70), {"sinks": torch.randn(4, generator=g), "ssmax": torch.rand(4, generator=g) + 0.5}
    from extrapolab.model.attention import attend

    sink_only = {"sinks": ex["sinks"]}
    got, _ = attend_layer(q, k, v, pos, pos, s, 0, AttnOptions(), **sink_only)
    want, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"), **sink_only)  # the dense chunk mask
    assert (got - want).abs().max() < 1e-5
    # with SSMax, n is the number of keys the query sees: its chunk's up to it (written out, gpt-oss's sink column
    # scaled with the logits, as attend scales it)
    got, _ = attend_layer(q, k, v, pos, pos, s, 0, AttnOptions(), **ex)
    qr, kr = s.inner.rotate(q, k, pos, pos)
    m, n = pos[:, None], pos[None, :]
    vis = (n <= m) & (n // 16 == m // 16)  # [70, 70]
    beta = ex["ssmax"][:, None] * torch.log((m % 16 + 1).double().T.float())  # [H, 70]: s_h log n_m
    lg = (qr @ kr.transpose(-1, -2) / math.sqrt(8)) * beta[None, :, :, None]  # [1, H, 70, 70]
    lg = torch.cat([lg.masked_fill(~vis, -math.inf), (ex["sinks"][:, None] * beta)[None, :, :, None]], -1)
    want = lg.softmax(-1)[..., :-1] @ v  # the sink column has no value
    assert (got - want).abs().max() < 1e-5

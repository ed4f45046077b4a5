"""RegularGPT as an LM (thesis §6.2 eq. 6.1, §6.2.2): the blocked sliding-dilated path against a
dense eq. 6.1 reference, causality across depth changes, depth = ceil(log_C T), the pipeline."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extrapolab.config import ConfigError, resolve
from extrapolab.data import TokenData
from extrapolab.io import UserError
from extrapolab.model import AttnOptions, ModelConfig, RegularLM, build_model
from extrapolab.positional.base import SchemeError

V = 37


def eq61_mask(r: torch.Tensor, C: int, level: int, T: int, window=None) -> torch.Tensor:
    """Eq. 6.1 written out for one level: [H, T, T], r_{(m-n)/C^l} or -inf (explicit T x T)."""
    m = torch.arange(T)[:, None]
    n = torch.arange(T)[None, :]
    d = m - n
    step = C ** level
    j = torch.div(d, step, rounding_mode="floor")
    ok = (d >= 0) & (d % step == 0) & (j < C)
    if window is not None:
        ok = ok & (d < window)
    return r[:, j.clamp(0, C - 1)].masked_fill(~ok, -math.inf)


def dense_reference(model: RegularLM, idx: torch.Tensor, window=None, tau=1.0) -> torch.Tensor:
    """The same weights, every level's attention through the dense eq. 6.1 mask; position m read
    out after ceil(log_C (m+1)) levels (at least 1), or every position after ceil(log_C T) levels
    with model.depth=sequence; ``tau`` one temperature or a list, tau[k] for shared sub-layer k at
    every level (RegularLM's doc). Returns logits [B, T, V]."""
    B, T = idx.shape
    C, r = model.cfg.C, model.scheme.r
    x = model.embed(idx, torch.arange(T))
    depth = [max(1, math.ceil(round(math.log(t, C), 9))) if t > 1 else 1 for t in range(1, T + 1)]
    if model.cfg.depth == "sequence":
        depth = [max(depth)] * T
    out = torch.zeros_like(x)
    for level in range(max(depth)):
        mask = eq61_mask(r, C, level, T, window)  # [H, T, T]
        for kk, blk in enumerate(model.blocks):
            D = x.shape[-1]
            t = tau[kk] if isinstance(tau, list) else tau
            q, k, v = blk.qkv(blk.ln1(x)).view(B, T, 3, blk.heads, -1).permute(2, 0, 3, 1, 4)  # [B, H, T, Dh]
            s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask) / t  # [B, H, T, T]
            a = torch.softmax(s, -1) @ v  # [B, H, T, Dh]
            x = x + blk.proj(a.transpose(1, 2).reshape(B, T, D))
            x = x + blk.mlp(blk.ln2(x))
        sel = torch.tensor([d == level + 1 for d in depth])
        out[:, sel] = x[:, sel]
    return model.head(model.ln_f(out))


def make(C=2, K=1, seed=0, **kw) -> RegularLM:
    torch.manual_seed(seed)
    m = build_model(ModelConfig(arch="regulargpt", C=C, K=K, vocab_size=V, dim=24, heads=3, train_length=16, **kw))
    with torch.no_grad():
        m.scheme.r.copy_(torch.randn_like(m.scheme.r))  # distinct r_j per head, not the zero init
    return m.double().eval()


@pytest.mark.parametrize("C,K,T", [(2, 1, 17), (3, 2, 30), (4, 1, 70), (5, 2, 26), (8, 1, 9)])
def test_blocked_path_equals_dense_eq61(C, K, T):
    m = make(C, K)
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        got, want = m(idx), dense_reference(m, idx)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-9)


def test_window_and_temperature_match_dense():
    m = make(3, 1)
    idx = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        got = m(idx, opts=AttnOptions(window=10, temperature=0.7))
        want = dense_reference(m, idx, window=10, tau=0.7)
    assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("depth", ["position", "sequence"])
def test_per_layer_temperature_is_per_shared_sublayer(depth):
    """One tau per shared sub-layer, used at every level: equal taus == the scalar exactly, mixed
    taus == the dense eq. 6.1 reference with tau[k] in sub-layer k, wrong length -> one line."""
    m = make(3, 2, depth=depth)
    idx = torch.randint(0, V, (2, 30))  # 4 levels of 2 sub-layers: 8 applied, 2 per-layer values
    with torch.no_grad():
        scalar = m(idx, opts=AttnOptions(temperature=0.7))
        assert torch.equal(m(idx, opts=AttnOptions(temperature=(0.7, 0.7))), scalar)
        mixed = m(idx, opts=AttnOptions(temperature=[0.6, 1.5]))
        want = dense_reference(m, idx, tau=[0.6, 1.5])
    assert torch.allclose(mixed, want, atol=1e-10)
    assert not torch.allclose(mixed, scalar, atol=1e-4)
    for taus in ([0.7], [0.7] * 3, [0.7] * m.levels(30) * 2):  # short, long, one per applied sub-layer
        with pytest.raises(UserError) as e:
            m(idx, opts=AttnOptions(temperature=taus))
        assert "\n" not in str(e.value) and "K=2 shared sub-layers" in str(e.value)


@pytest.mark.parametrize("C,lengths", [(2, (7, 9, 17, 33)), (3, (8, 10, 28, 82))])
def test_prefix_outputs_equal_full_outputs_across_depths(C, lengths):
    m = make(C, 2)
    idx = torch.randint(0, V, (2, max(lengths)))
    depths = {m.levels(t) for t in lengths}
    assert len(depths) == len(lengths)  # every length runs a different number of levels
    with torch.no_grad():
        full = m(idx)
        for t in lengths:
            assert torch.allclose(m(idx[:, :t]), full[:, :t], atol=1e-12)
    # and a later token changes nothing before it (gradient of an early logit w.r.t. later embeds is 0)
    e = m.embed(idx, torch.arange(idx.shape[1])).detach().requires_grad_(True)
    m(idx, inputs_embeds=e)[:, 5].sum().backward()
    assert float(e.grad[:, 6:].abs().max()) == 0.0 and float(e.grad[:, :6].abs().max()) > 0


@pytest.mark.parametrize("C,K,T", [(2, 1, 17), (3, 2, 30), (8, 1, 9)])
def test_sequence_depth_equals_dense_and_agrees_on_the_last_token(C, K, T):
    """model.depth=sequence (the thesis' readout): every position after ceil(log_C T) levels; the
    last position equals the default per-position readout, earlier ones at a smaller depth do not."""
    seq, pos = make(C, K, depth="sequence"), make(C, K)
    idx = torch.randint(0, V, (2, T))
    with torch.no_grad():
        got = seq(idx)
        assert torch.allclose(got, dense_reference(seq, idx), atol=1e-10, rtol=1e-9)
        want = pos(idx)
        assert torch.allclose(got[:, -1], want[:, -1], atol=1e-12)
        assert not torch.allclose(got[:, 0], want[:, 0], atol=1e-6)  # position 0: 1 level vs all of them
        # a prefix run at its own, smaller depth differs from the full input's outputs at the same positions
        short = next(t for t in range(T, 0, -1) if seq.levels(t) < seq.levels(T))
        assert not torch.allclose(seq(idx[:, :short]), got[:, :short], atol=1e-6)
        same = next(t for t in range(1, T + 1) if seq.levels(t) == seq.levels(T))
        assert torch.allclose(seq(idx[:, :same]), got[:, :same], atol=1e-12)  # same depth: causal


@pytest.mark.parametrize("C", [2, 3, 4, 32])
def test_depth_is_ceil_log_C_T(C):
    m = make(C, 1)
    for T in [1, 2, 3, 4, 5, 8, 9, 16, 17, 27, 28, 64, 65, 1024, 1025]:
        want = max(1, math.ceil(math.log(T) / math.log(C) - 1e-12)) if T > 1 else 1
        assert m.levels(T) == want, (C, T)
    calls = []
    hook = m.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        m(torch.randint(0, V, (1, 9)))
    hook.remove()
    assert len(calls) == m.levels(9)  # the shared sub-layer runs once per level


def test_no_dense_tensor_and_shared_weights():
    m = make(4, 3)
    assert len(m.blocks) == 3 and m.cfg.layers == 3  # K sub-layers, whatever the depth
    assert m.scheme.r.shape == (3, 4)
    m2 = build_model(ModelConfig(arch="regulargpt", C=4, K=3, vocab_size=V, dim=24, heads=3, train_length=1024))
    assert sum(p.numel() for p in m2.parameters()) == sum(p.numel() for p in m.parameters())


def test_refusals_are_one_line():
    m = make(2, 1)
    idx = torch.randint(0, V, (1, 8))
    from extrapolab.model import KVCache
    sink = AttnOptions(logits_sink=lambda *a, **k: None)
    for kw in ({"cache": KVCache(1)}, {"return_probs": True}, {"positions": torch.arange(3, 11)}, {"opts": sink}):
        with pytest.raises(UserError) as e:
            m(idx, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(SchemeError):
        build_model(ModelConfig(arch="regulargpt", C=1))
    with pytest.raises(UserError):
        build_model(ModelConfig(arch="rnn"))


@pytest.mark.parametrize("sets,needle", [
    (["model.arch=regulargpt", "model.C=1"], "model.C >= 2"),
    (["model.arch=regulargpt", "model.K=0"], "model.K >= 1"),
    (["model.arch=transformer"], "model.arch"),
    (["model.arch=regulargpt", "model.scheme=alibi"], "sliding-dilated"),
    (["model.arch=regulargpt", "model.depth=layer"], "model.depth must be position or sequence"),
])
def test_bad_config_one_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve("default", sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_preset_scheme_is_replaced_and_gpt_unchanged():
    cfg = resolve("default", ["model.arch=regulargpt", "model.C=4", "model.K=2"])
    assert cfg.model.scheme == "sliding-dilated" and (cfg.model.C, cfg.model.K) == (4, 2)
    assert resolve("default", []).model.arch == "gpt"


def markov(n=6000, seed=0) -> TokenData:
    rng = np.random.default_rng(seed)
    x = np.empty(n, dtype=np.uint16)
    x[0] = 1
    for i in range(1, n):
        x[i] = rng.integers(0, V) if rng.random() < 0.2 else (x[i - 1] * 3 + 1) % V
    a, b = int(n * 0.8), int(n * 0.9)
    return TokenData.from_arrays(x[:a], x[a:b], x[b:], vocab_size=V, eot_id=0)


def test_train_eval_erf_through_the_normal_apis(tmp_path):
    from extrapolab.analysis.erf import attention_erf, measure_erf
    from extrapolab.eval import evaluate
    from extrapolab.train import load_model, train

    cfg = resolve(None, ["model.arch=regulargpt", "model.C=4", "model.K=2", "model.heads=2", "model.dim=16",
                         "model.train_length=16", "train.steps=6", "train.batch_size=4", "train.warmup_steps=2",
                         "train.eval_every=3", "train.checkpoint_every=3", "train.eval_batches=2",
                         "train.precision=fp32", "train.lr=3e-3"])
    data = markov()
    s = train(cfg, tmp_path / "run", data=data, progress=False)
    assert s["finished"] if "finished" in s else True
    model, rcfg = load_model(tmp_path / "run")
    assert isinstance(model, RegularLM) and rcfg.model.arch == "regulargpt" and model.scheme.name == "sliding-dilated"
    test = data.split("test")
    res = evaluate(model, test, train_length=16, protocols=["nonoverlapping", "last_token", "positionwise", "cached"],
                   lengths=[16, 64, 128], num_tokens=512, last_token_n=4, position_segments=2)
    for L in ("16", "64", "128"):  # depth 2, 3, 4 levels
        assert math.isfinite(res["nonoverlapping"][L]["ppl"]) and math.isfinite(res["last_token"][L]["ppl"])
        assert "KV cache" in res["cached"][L]["error"]
    assert len(res["positionwise"]["nll"]) == 128
    segs = torch.from_numpy(np.stack([test[i:i + 65].astype(np.int64) for i in (0, 100)]))
    e = measure_erf(model, segs)
    assert e["c"][0] == pytest.approx(1.0) and 0 < e["erf_tokens"] <= 64
    assert math.isnan(attention_erf(model, segs)["mean"])
    with torch.no_grad():  # the loaded model equals the trained one's forward on any prefix
        x = torch.from_numpy(test[:40].astype(np.int64))[None]
        assert torch.allclose(model(x)[:, :20], model(x[:, :20]), atol=1e-5)
    logits = model(torch.from_numpy(test[:17].astype(np.int64))[None, :-1])
    assert F.cross_entropy(logits[0], torch.from_numpy(test[1:17].astype(np.int64))).item() < math.log(V) + 1

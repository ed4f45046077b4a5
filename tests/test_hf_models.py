"""Hugging Face causal LMs through hf:PATH: perplexity parity with HF's own loss, length refusal,
per-layer temperature vs independent computations, RoPE overrides vs transformers' rope init,
the ERF and our corpora in the model's tokenizer. Tiny random models built from configs."""
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import FAMILIES, MAXPOS, ROPE_FAMILIES, TEXT, save_tiny  # noqa: E402

from extrapolab.config import DataConfig  # noqa: E402
from extrapolab.eval import nonoverlapping, sliding  # noqa: E402
from extrapolab.hf import HFTarget, attention_modules, hf_measure_erf, hf_split, hf_temperature, open_hf  # noqa: E402
from extrapolab.io import UserError  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny(f, root / f) for f in FAMILIES}


def _load(folders, family, **kw):
    return open_hf(f"hf:{folders[family]}", device="cpu", dtype="fp32", **kw)


def _stream(model):
    return np.asarray(model.loaded.tokenizer(TEXT)["input_ids"], dtype=np.int64)


@pytest.mark.parametrize("family", FAMILIES)
def test_e1_perplexity_equals_hf_loss(folders, family):
    """E1 at L over two windows == exp(mean of HF's model(ids, labels=ids).loss on each window's
    L+1 tokens) (L+1 = the model's maximum, so GPT-2 can run it too)."""
    m = _load(folders, family)
    tok = _stream(m)
    L = MAXPOS - 1
    x = torch.from_numpy(tok[:2 * L + 1])[None]
    with torch.no_grad():
        losses = [float(m.hf(input_ids=x[:, s:s + L + 1], labels=x[:, s:s + L + 1]).loss) for s in (0, L)]
    res = nonoverlapping(m, tok[:2 * L + 1], L)
    assert res["tokens"] == 2 * L
    assert res["ppl"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bloom"])
def test_e1_single_window_is_hf_labels_loss(folders, family):
    """One window: E1 at L and E2 (any stride) on L+1 tokens both score each token once with the
    context HF's loss gives it."""
    m = _load(folders, family)
    ids = torch.from_numpy(_stream(m)[:MAXPOS])
    with torch.no_grad():
        ref = math.exp(float(m.hf(input_ids=ids[None], labels=ids[None]).loss))
    assert nonoverlapping(m, ids.numpy(), MAXPOS - 1)["ppl"] == pytest.approx(ref, rel=1e-5)
    assert sliding(m, ids.numpy(), MAXPOS - 1, 8)["ppl"] == pytest.approx(ref, rel=1e-5)


def test_learned_positions_refuse_longer_lengths(folders):
    m = _load(folders, "gpt2")
    with pytest.raises(UserError) as e:
        nonoverlapping(m, _stream(m), MAXPOS + 1)
    assert "\n" not in str(e.value) and f"<= {MAXPOS}" in str(e.value)
    for family in ("llama", "gpt_neox", "bloom", "mpt"):  # RoPE and ALiBi take any length
        r = _load(folders, family)
        assert math.isfinite(nonoverlapping(r, _stream(r), 3 * MAXPOS)["ppl"])


def _layer_probs(model, taus):
    """Attention probabilities [B, H, L, L] of every layer at per-layer ``taus`` (eager)."""
    got = []
    hooks = [a.register_forward_hook(lambda m, i, o: got.append(o[1].double()))
             for a in attention_modules(model)[1]]
    try:
        with hf_temperature(model, taus), torch.no_grad():
            model(torch.from_numpy(_stream(model)[:40])[None])
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_temperature_is_softmax_of_logits_over_tau(folders, family):
    """softmax(l / tau) = p^(1/tau) / sum p^(1/tau): layer k at tau (others at 1) equals the tau=1
    probabilities of layer k raised to 1/tau and renormalised, whatever the family's bias."""
    m = _load(folders, family, attn="eager")
    p1 = _layer_probs(m, 1.0)
    for k in range(len(p1)):
        taus = [1.0] * len(p1)
        taus[k] = 0.5
        pk = _layer_probs(m, taus)
        want = p1[k] ** 2 / (p1[k] ** 2).sum(-1, keepdim=True)
        assert torch.allclose(pk[k], want, atol=2e-6), (family, k, (pk[k] - want).abs().max())
        for j in range(k):  # earlier layers are untouched
            assert torch.allclose(pk[j], p1[j], atol=1e-7)
        assert not torch.allclose(pk[k], p1[k], atol=1e-3)  # the sharpened softmax differs


def test_temperature_equals_doubled_query_weights(folders):
    """Llama (RoPE): tau = 0.5 in every layer == the same model with q_proj weights x 2."""
    m = _load(folders, "llama")
    ids = torch.from_numpy(_stream(m)[:40])[None]
    with torch.no_grad(), hf_temperature(m, 0.5):
        hot = m(ids)
    with torch.no_grad():
        base = m(ids)
        for mod in m.hf.modules():
            if hasattr(mod, "q_proj"):
                mod.q_proj.weight.mul_(2.0)
        doubled = m(ids)
    assert torch.allclose(hot, doubled, atol=1e-5)
    assert not torch.allclose(hot, base, atol=1e-3)
    assert all(a.scaling == pytest.approx(8 ** -0.5) for a in attention_modules(m)[1])  # restored


def test_target_stats_and_unsupported_family(folders):
    from extrapolab.align import collect_logit_stats

    m = _load(folders, "mpt", attn="eager")
    segs = _stream(m)[:64].reshape(2, 32)
    s = collect_logit_stats(HFTarget(m), segs, [1.0, 0.5])
    assert s["softmaxes"] == 2 * 2 * 4 * 32  # batch x layers x heads x queries
    assert s["pmax"][1] > s["pmax"][0] and s["entropy"][1] < s["entropy"][0]
    sdpa = _load(folders, "llama")
    with pytest.raises(UserError, match="eager"):
        collect_logit_stats(HFTarget(sdpa), segs, [1.0])


def _rotary(model):
    return next(mod for mod in model.hf.modules() if hasattr(mod, "inv_freq"))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "ntk", "llama3"])
def test_rope_override_uses_transformers_rope(folders, family, kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = _load(folders, family)
    m = _load(folders, family, rope=f"{kind}:4")
    rp = m.hf.config.rope_parameters
    theta, rot = rp["rope_theta"], _rotary(m)
    inv0 = _rotary(base).inv_freq.double()
    dim = 2 * inv0.numel()
    if kind == "ntk":  # static NTK-aware: HF's default RoPE at base x s^(d/(d-2))
        want = 1.0 / (_rotary(base).config.rope_parameters["rope_theta"] * 4 ** (dim / (dim - 2))) ** (
            torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        assert torch.allclose(rot.inv_freq.double(), want, rtol=1e-6)
        return
    inv, factor = ROPE_INIT_FUNCTIONS[kind](m.hf.config, "cpu")
    assert torch.allclose(rot.inv_freq.double(), inv.double()) and rot.attention_scaling == pytest.approx(factor)
    if kind == "linear":  # position interpolation: every frequency / s
        assert torch.allclose(rot.inv_freq.double(), inv0 / 4, rtol=1e-6)
    if kind == "yarn":  # YaRN attention factor 0.1 ln s + 1; highest frequency kept, lowest / s
        assert factor == pytest.approx(0.1 * math.log(4) + 1)
        assert rot.inv_freq[0] == pytest.approx(float(inv0[0]), rel=1e-6)
        assert rot.inv_freq[-1] == pytest.approx(float(inv0[-1]) / 4, rel=1e-6)
    if kind == "dynamic":  # s recomputed from the input length once it passes L_tr
        L = 4 * MAXPOS
        with torch.no_grad():
            m(torch.from_numpy(_stream(m)[:L])[None])
        want = 1.0 / (theta * (4 * L / MAXPOS - 3) ** (dim / (dim - 2))) ** (
            torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        assert torch.allclose(rot.inv_freq.double(), want, rtol=1e-5)


def test_rope_override_bad_input(folders):
    with pytest.raises(UserError, match="RoPE models"):
        _load(folders, "gpt2", rope="linear:4")
    for bad in ("pi:4", "linear:x", "yarn:0.5"):
        with pytest.raises(UserError, match="KIND:FACTOR"):
            _load(folders, "llama", rope=bad)


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "bloom"])
def test_erf_through_input_embeddings(folders, family):
    m = _load(folders, family)
    segs = _stream(m)[:2 * 33].reshape(2, 33)
    e = hf_measure_erf(m, segs)
    c = np.asarray(e["c"])
    assert c[0] == pytest.approx(1.0) and c[-1] == 0.0 and np.all(np.diff(c) <= 1e-12)
    assert 1 <= e["erf_tokens"] <= 32
    assert all(p.requires_grad for p in m.parameters())  # unfrozen after
    if family == "gpt2":
        with pytest.raises(UserError):
            hf_measure_erf(m, _stream(m)[:MAXPOS + 2][None])


def test_corpus_split_in_model_tokenizer(folders, tmp_path):
    from extrapolab.data import read_corpus
    from extrapolab.data.corpus import assign_splits

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i:02d}.py").write_text(f"# file {i}\n" + TEXT[: 200 + 37 * i])
    cfg = DataConfig(corpus=f"path:{docs}", cache_dir=str(tmp_path / "cache"), valid_percent=20, test_percent=40)
    m = _load(folders, "llama")
    tok = m.loaded.tokenizer
    got = hf_split(cfg, tok, "test")
    want = [i for d in assign_splits(read_corpus(cfg.corpus).documents, 20, 40)["test"]
            for i in tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert len(want) and got.tolist() == want
    assert isinstance(hf_split(cfg, tok, "test"), np.memmap)  # cached
    assert len(list((tmp_path / "cache" / "data").glob("hf-*/test.bin"))) == 1


def test_not_a_model_folder(tmp_path):
    with pytest.raises(UserError) as e:
        open_hf(f"hf:{tmp_path}")
    assert "save_pretrained" in str(e.value) and "\n" not in str(e.value)


def test_evaluate_hf_positionwise_only_and_unsupported_protocols(folders):
    from extrapolab.config import EvalConfig
    from extrapolab.eval import positionwise
    from extrapolab.hf import evaluate_hf

    m = _load(folders, "bloom")
    tok = _stream(m)
    res = evaluate_hf(m, tok, EvalConfig(protocols=["positionwise"], lengths=[64], position_segments=2), MAXPOS)
    assert res["protocols"] == ["positionwise"] and res["ppl"] == {}
    want = positionwise(m, tok, 64, n_segments=2)["nll"]
    assert np.allclose(res["positionwise"]["nll"], want) and res["positionwise"]["window"] is None
    with pytest.raises(UserError, match="not available for HF"):
        evaluate_hf(m, tok, EvalConfig(protocols=["cached"]), MAXPOS)


def test_adapter_takes_a_per_layer_temperature(folders):
    """opts.temperature as one tau per layer reaches the HF model (it used to be float()-ed):
    the same tau in every layer == the scalar, a per-layer list == hf_temperature with that list."""
    from extrapolab.model.attention import AttnOptions

    m = _load(folders, "llama")
    ids = torch.from_numpy(_stream(m)[:40])[None]
    n = len(attention_modules(m)[1])
    taus = [0.5 + 0.5 * i for i in range(n)]
    with torch.no_grad():
        scalar = m(ids, opts=AttnOptions(temperature=0.5))
        assert torch.equal(m(ids, opts=AttnOptions(temperature=(0.5,) * n)), scalar)
        with hf_temperature(m, taus):
            want = m(ids)
        assert torch.equal(m(ids, opts=AttnOptions(temperature=taus)), want)
        assert not torch.allclose(want, scalar, atol=1e-4)
    with pytest.raises(UserError, match=f"{n + 1} per-layer temperatures"):
        m(ids, opts=AttnOptions(temperature=[0.5] * (n + 1)))

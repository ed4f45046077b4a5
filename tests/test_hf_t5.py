"""HF T5 temperature adapter (thesis ch. 5 on T5): same Softmax_tau(l) as our AttnOptions hook."""
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import extrapolab.align as A  # noqa: E402
from extrapolab.align import hf_t5 as H  # noqa: E402
from extrapolab.io import UserError  # noqa: E402

HEADS, DKV, LE, LD = 4, 8, 12, 5


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=DKV, num_heads=HEADS, num_layers=3,
                                num_decoder_layers=2, d_ff=64, relative_attention_num_buckets=8,
                                relative_attention_max_distance=16, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)  # large enough that q·k and the bucket bias both matter
    path = tmp_path_factory.mktemp("t5")
    m.save_pretrained(path)
    return path


def _run(model, ids, mask, dec, tau, parts):
    """Forward with the adapter; capture each attention's input and probabilities."""
    caps, hs = {}, []
    for part in H.PARTS:
        for i, a in enumerate(H.attention_modules(model, part)):
            def pre(mod, args, kwargs, key=(part, i)):
                caps[key] = {"h": args[0], "kv": kwargs.get("key_value_states")}

            def post(mod, args, out, key=(part, i)):
                caps[key]["p"] = out[2]
            hs += [a.register_forward_pre_hook(pre, with_kwargs=True), a.register_forward_hook(post)]
    with H.t5_temperature(model, tau, parts), torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    for h in hs:
        h.remove()
    return caps, logits


def _reference_logits(model, part, i, cap, mask):
    """tau=1 scores from the weights alone: q·k^T + bucket bias (no 1/sqrt(d)), masked with -inf."""
    a = H.attention_modules(model, part)[i]
    h, kv = cap["h"], cap["kv"] if cap["kv"] is not None else cap["h"]
    q = a.q(h).view(h.shape[0], -1, HEADS, DKV).transpose(1, 2)  # [B, H, Lq, D]
    k = a.k(kv).view(kv.shape[0], -1, HEADS, DKV).transpose(1, 2)  # [B, H, Lk, D]
    lg = q @ k.transpose(-1, -2)  # [B, H, Lq, Lk]
    if part == "encoder":
        lg = lg + H.attention_modules(model, "encoder")[0].compute_bias(LE, LE)
    elif part == "decoder":
        lg = lg + H.attention_modules(model, "decoder")[0].compute_bias(LD, LD)
        return lg.masked_fill(torch.ones(LD, LD).triu(1).bool(), -math.inf)
    return lg.masked_fill(mask[:, None, None, :] == 0, -math.inf)


@pytest.mark.parametrize("tau", [0.6, 1.7, "per-layer"])
def test_adapter_equals_softmax_l_over_tau_in_every_layer(t5_dir, tau):
    model = H.load_t5(t5_dir)
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(1, 64, (2, LE), generator=g), torch.randint(1, 64, (2, LD), generator=g)
    mask = torch.ones(2, LE, dtype=torch.long)
    mask[1, 9:] = 0  # padding keys stay masked under any tau
    _, base = _run(model, ids, mask, dec, 1.0, H.PARTS)
    per = {"encoder": [0.5, 1.0, 0.8], "decoder": [0.7, 1.3], "cross": [0.9, 0.6]}
    caps, out = _run(model, ids, mask, dec, tau if tau != "per-layer" else 1.0, ())
    assert torch.equal(out, base)  # no parts hooked: unchanged
    for part in H.PARTS:
        t = per[part] if tau == "per-layer" else tau
        caps, out = _run(model, ids, mask, dec, t, (part,))
        assert not torch.allclose(out, base)
        for i in range(len(H.attention_modules(model, part))):
            ti = t[i] if isinstance(t, list) else t
            ref = torch.softmax(_reference_logits(model, part, i, caps[(part, i)], mask) / ti, -1)
            torch.testing.assert_close(caps[(part, i)]["p"], ref, atol=3e-6, rtol=1e-5)
    _, after = _run(model, ids, mask, dec, 1.0, H.PARTS)
    assert torch.equal(after, base)  # hooks removed


def test_t5_target_statistics_match_exact_logits(t5_dir):
    model = H.load_t5(t5_dir)
    ids = torch.randint(1, 64, (2, LE), generator=torch.Generator().manual_seed(2))
    got = A.collect_logit_stats(model, ids.numpy(), A.GRID, propagate=False, layer0=True, batch_size=2)
    caps, _ = _run(model, ids, torch.ones(2, LE, dtype=torch.long), ids[:, :LD], 1.0, ())
    sink = A.SoftmaxStats(3, A.GRID, layer0=True)
    for i in range(3):
        sink.add(i, _reference_logits(model, "encoder", i, caps[("encoder", i)], torch.ones(2, LE)))
    want = sink.summary()
    np.testing.assert_allclose(got["pmax"], want["pmax"], rtol=1e-5)
    np.testing.assert_allclose(got["entropy"], want["entropy"], rtol=1e-4)
    assert got["layer0"]["sigma"] == pytest.approx(want["layer0"]["sigma"], rel=1e-4)
    assert got["layer0"]["length"] == pytest.approx(LE)  # encoder rows are full rows
    prop = A.collect_logit_stats(model, ids.numpy(), [1.0, 0.7], batch_size=2)  # Algorithm 1, propagated
    assert prop["pmax"][0] == pytest.approx(got["pmax"][0], rel=1e-5)
    assert prop["pmax"][1] > prop["pmax"][0]  # a lower temperature sharpens


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="config.json missing"):
        H.load_t5(tmp_path)
    with pytest.raises(UserError, match="no decoder"):
        H.attention_modules(torch.nn.Module(), "decoder")


def test_t5_shares_the_hf_hook_mechanics(t5_dir):
    """T5Target is the same ProbsTarget as the causal LMs' HFTarget (hf/hooks.py) and its tau list
    comes from the one per-layer helper: wrong length or a non-finite tau is one line, hooks gone."""
    from extrapolab.hf import HFTarget
    from extrapolab.hf.hooks import ProbsTarget

    assert issubclass(H.T5Target, ProbsTarget) and issubclass(HFTarget, ProbsTarget)
    model = H.load_t5(t5_dir)
    target = H.T5Target(model)
    for bad, needle in (([0.5, 1.0], "2 per-layer temperatures for 3 T5 encoder layers"),
                        ([1.0, float("inf"), 1.0], "positive and finite")):
        with pytest.raises(UserError) as e:
            with target.scope(bad):
                pass
        assert "\n" not in str(e.value) and needle in str(e.value)
    mods = H.attention_modules(model, "encoder")
    assert not any(a._forward_hooks or a._forward_pre_hooks or a.q._forward_hooks for a in mods)

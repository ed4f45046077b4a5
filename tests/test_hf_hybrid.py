"""The Hugging Face bridge on RoPE families with layer types, NoPE layers, chunked or soft-capped attention and
shipped RoPE scaling: Cohere2, Llama 4, SmolLM3, gpt-oss, Gemma 2 and a Gemma 3 4B-style model (issue 45).

References are stock transformers with nothing of ours in them: the same weights built from ``rope_parameters``
written natively, their own sdpa / eager attention (Llama 4's chunked mask materialised by transformers, Gemma
2's eager soft-cap), ``model(ids, labels=ids).loss``; the frequencies against our own rotary schemes
(positional/); the NoPE layers against the config fields that say so (Llama 4's and SmolLM3's
``no_rope_layers``, Cohere2's full layers). Each tiny model is built here (tests/hf_tiny.py, init std 0.1 so the
attention pattern matters: before these fixes Llama 4's E1 through our attention was off by up to 0.19 nats and
Gemma 2's perplexity moved 364.9 -> 395.8 under an identity --rope).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import CHUNK, HYBRID_FAMILIES, MAXPOS, TEXT, save_tiny  # noqa: E402

from extrapolab import positional as P  # noqa: E402
from extrapolab.eval import nonoverlapping  # noqa: E402
from extrapolab.hf import open_hf  # noqa: E402
from extrapolab.hf.evaluate import model_block  # noqa: E402
from extrapolab.hf.extend import OPTS_KWARG  # noqa: E402
from extrapolab.io import UserError  # noqa: E402
from extrapolab.model.attention import AttnOptions  # noqa: E402

#: family -> (the layers that do not rotate, as its config says; the pairs it rotates)
NOPE = {"cohere2": (lambda c: [i for i, t in enumerate(c.layer_types) if t == "full_attention"], "(2i, 2i + 1)"),
        "llama4_text": (lambda c: [i for i, r in enumerate(c.no_rope_layers) if not r], "(2i, 2i + 1)"),
        "smollm3": (lambda c: [i for i, r in enumerate(c.no_rope_layers) if not r], "(i, i + d/2)"),
        "gpt_oss": (lambda c: [], "(i, i + d/2)"), "gemma2": (lambda c: [], "(i, i + d/2)")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {f: save_tiny(f, root / f) for f in HYBRID_FAMILIES}
    out.update({f + "1": save_tiny(f, root / (f + "1"), layers=1) for f in ("llama4_text", "gemma2", "gpt_oss",
                                                                            "cohere2")})
    out["gemma3_linear"] = save_tiny("gemma3_linear", root / "gemma3_linear")
    out["gpt2"] = save_tiny("gpt2", root / "gpt2")
    out["bloom"] = save_tiny("bloom", root / "bloom")
    return out


def _open(folder, **kw):
    return open_hf(f"hf:{folder}", device="cpu", dtype="fp32", **kw)


def _native(folder, rope_parameters=None, **fields):
    """The same weights, transformers' own eager attention, ``rope_parameters`` (and other fields) written natively."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    for k, v in fields.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _ids(model, n):
    return np.asarray(model.loaded.tokenizer(TEXT * 4)["input_ids"][:n], dtype=np.int64)


def _loss(hf, ids):
    x = torch.from_numpy(ids)[None]
    with torch.no_grad():
        return float(hf(input_ids=x, labels=x).loss)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_rope_is_read_from_the_config_and_each_layers_rotation_measured(folders, family):
    """positions "rope" in the run record; --rope loads; the measured NoPE layers and pairs are the config's."""
    m = _open(folders[family], rope="logn+rerope:40")
    assert m.loaded.positions == "rope" and model_block(m)["positions"] == "rope"
    nope, pairs = NOPE[family]
    want = nope(m.hf.config)
    got = m.loaded.info["rotary_layers"]
    assert got == {"nope_layers": want, "rope_layers": [i for i in range(m.hf.config.num_hidden_layers)
                                                          if i not in want], "pairs": [pairs]}
    rot = m.hf.config.extrapolab_rope["rotations"]
    inv = P.build("rotary", 1, base=m.hf.config.rope_parameters["rope_theta"]).inv_freq(8, MAXPOS)
    if family == "gpt_oss":  # shipped YaRN x4 from 12 tokens, truncate=false
        inv = P.build("rotary-yarn", 1, base=150000.0, factor=4.0, original_length=MAXPOS // 4,
                      truncate=False).inv_freq(8, 0)
    torch.testing.assert_close(torch.tensor(rot[str(got["rope_layers"][0])]["inv_freq"], dtype=torch.float64), inv,
                               rtol=2e-6, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "bloom"])
def test_a_model_without_rope_stays_one(folders, family):
    m = _open(folders[family])
    assert m.loaded.positions == {"gpt2": "learned", "bloom": "alibi"}[family]
    with pytest.raises(UserError, match="has no rope_parameters"):
        _open(folders[family], rope="yarn:2")
    with pytest.raises(UserError, match="without RoPE"):
        m.new_cache(8, 2)


CASES = [  # family, --rope, the native rope_parameters, our scheme of its frequencies
    ("cohere2", "yarn:4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAXPOS,
                           "rope_theta": 10_000.0},
     P.build("rotary-yarn", 1, base=10_000.0, factor=4.0, original_length=MAXPOS)),
    ("llama4_text", "llama3:8", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": MAXPOS, "rope_theta": 500_000.0},
     P.build("rotary-llama3", 1, base=500_000.0, factor=8.0, original_length=MAXPOS)),
    ("smollm3", "yarn:2", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": MAXPOS,
                           "rope_theta": 2_000_000.0},
     P.build("rotary-yarn", 1, base=2_000_000.0, factor=2.0, original_length=MAXPOS)),
    ("gpt_oss", "yarn:8,replace=true", {"rope_type": "yarn", "factor": 8.0, "rope_theta": 150_000.0,
                                        "original_max_position_embeddings": MAXPOS // 4},  # the shipped original
     P.build("rotary-yarn", 1, base=150_000.0, factor=8.0, original_length=MAXPOS // 4)),
    ("gemma2", "yarn:4", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAXPOS,
                          "rope_theta": 10_000.0},
     P.build("rotary-yarn", 1, base=10_000.0, factor=4.0, original_length=MAXPOS)),
]


@pytest.mark.parametrize("family,spec,native,scheme", CASES, ids=[c[0] for c in CASES])
def test_rope_rewrite_equals_transformers_native_and_keeps_nope_layers(folders, family, spec, native, scheme):
    ours = _open(folders[family], rope=spec, attn="eager")
    ref = _native(folders[family], native)
    x = torch.from_numpy(_ids(ours, 2 * MAXPOS))[None]
    with torch.no_grad():
        torch.testing.assert_close(ours.hf(x).logits, ref(x).logits, rtol=0, atol=0)
    assert ours.loaded.info["rope_parameters_before"] == _native(folders[family]).config.rope_parameters
    m = _open(folders[family], rope=spec + "+rerope:40")  # the rotations each layer has after the rewrite
    got = m.loaded.info["rotary_layers"]
    assert got["nope_layers"] == NOPE[family][0](m.hf.config)
    rot = m.hf.config.extrapolab_rope["rotations"][str(got["rope_layers"][0])]
    torch.testing.assert_close(torch.tensor(rot["inv_freq"], dtype=torch.float64), scheme.inv_freq(8, 0), rtol=2e-6,
                               atol=0)


@pytest.mark.parametrize("family", [*HYBRID_FAMILIES, "gemma3_linear"])
def test_cached_window_first_step_equals_the_models_own_forward(folders, family):
    """E5's cache (keys before rotation, rotated by us at their cache slots in each layer's measured layout and
    frequencies -- Gemma 3's two bases, its full layers linear x8; NoPE layers left alone; Llama 4's chunks, the
    sliding windows and Gemma 2's soft-cap by slot) on every layer at once: its first call of 4 sinks + 32 tokens
    (past the chunk of 16 and the window of 8) == the model's own forward."""
    m, ref = _open(folders[family]), _open(folders[family])
    x = torch.from_numpy(_ids(m, 40))[None]
    cache = m.new_cache(32, 4)
    with torch.no_grad():
        torch.testing.assert_close(m(x[:, :36], cache=cache), ref(x[:, :36]), rtol=0, atol=2e-5)
    nope = NOPE[family][0](m.hf.config) if family in NOPE else []
    assert m.loaded.info["rotary_layers"]["nope_layers"] == nope


@pytest.mark.parametrize("family", ["llama4_text1", "gemma21", "gpt_oss1", "cohere21"])
def test_rolling_cache_equals_the_kept_tokens_re_encoded(folders, family):
    """One layer (the re-encoding is then exact): interleaved pairs + chunks (Llama 4), soft-cap + window (Gemma
    2), sinks + YaRN + window (gpt-oss), interleaved pairs + window (Cohere2), over every step past the window."""
    m, ref = _open(folders[family]), _open(folders[family])
    x = torch.from_numpy(_ids(m, 40))[None]
    sinks, window = 3, 20  # keep + window = 23 > the chunk of 16: the chunk boundary falls inside the cache
    cache = m.new_cache(window, sinks)
    with torch.no_grad():
        m(x[:, :sinks + window], cache=cache)
        for t in range(sinks + window, 40):
            got = m(x[:, t:t + 1], cache=cache)[:, -1]  # [1, V]
            kept = torch.cat([x[:, :sinks], x[:, t - window + 1:t + 1]], 1)  # no window prefix in this tokenizer
            want = ref.hf(input_ids=kept, use_cache=False).logits[:, -1]
            assert (got - want).abs().max() < 2e-5, t


@pytest.mark.parametrize("rope", [None, "logn:100000", "rerope:47", "selfextend:4,47"])
def test_llama4_chunked_e1_through_our_attention_equals_its_own_loss(folders, rope):
    """Chunks of 16 in a 48-token window: E1 through the extrapolab attention (plain, and under --rope methods that
    are an identity at this length) == model(ids, labels=ids).loss with transformers' own sdpa attention."""
    own = _open(folders["llama4_text"])
    ours = _open(folders["llama4_text"], attn="extrapolab", rope=rope)
    ids = _ids(own, MAXPOS)
    ref = _loss(own.hf, ids)
    assert math.log(nonoverlapping(ours, ids, MAXPOS - 1)["ppl"]) == pytest.approx(ref, abs=2e-6)
    assert CHUNK < MAXPOS - 1 and abs(_loss(_native(folders["llama4_text"], attention_chunk_size=MAXPOS), ids)
                                      - ref) > 1e-2  # the chunks matter here


def test_alignment_cannot_honour_chunks_and_says_so(folders):
    from extrapolab.align.onepass import LayerAligner, run_pass

    m = _open(folders["llama4_text"], attn="extrapolab")
    ids = _ids(m, 40)
    with pytest.raises(UserError, match="attends within chunks of 16 tokens"):
        run_pass(m, ids[None], LayerAligner(m.hf.config.num_hidden_layers, rows=4))
    with pytest.raises(UserError, match="align a model without chunked attention"), torch.no_grad():
        m.hf(input_ids=torch.from_numpy(ids)[None], use_cache=False,
             **{OPTS_KWARG: AttnOptions(logits_sink=lambda *a: None)})


@pytest.mark.parametrize("rope,attn", [(None, "extrapolab"), ("logn:100000", None), ("rerope:47", None)])
def test_gemma2_softcap_under_our_attention_equals_its_eager_loss(folders, rope, attn):
    own = _open(folders["gemma2"])
    assert own.loaded.attn_implementation == "eager"  # Gemma 2 has no sdpa kernel: the soft-cap needs the logits
    ours = _open(folders["gemma2"], rope=rope, **({"attn": attn} if attn else {}))
    ids = _ids(own, MAXPOS)
    ref = _loss(own.hf, ids)
    assert math.log(nonoverlapping(ours, ids, MAXPOS - 1)["ppl"]) == pytest.approx(ref, abs=2e-6)
    assert abs(_loss(_native(folders["gemma2"], attn_logit_softcapping=None), ids) - ref) > 1e-2  # it bites


GEMMA3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}


def test_rope_over_a_scaled_type_is_refused_naming_both(folders):
    with pytest.raises(UserError) as e:
        _open(folders["gemma3_linear"], rope="yarn:4@full")
    msg = str(e.value)
    assert "full_attention's rope_parameters already scale RoPE (linear, factor 8)" in msg
    assert "yarn over linear has no published definition" in msg and "--rope yarn:4,replace=true@full" in msg
    with pytest.raises(UserError, match="give it: yarn:...,original=N"):
        _open(folders["gemma3_linear"], rope="yarn:4,replace=true@full")
    with pytest.raises(UserError, match=r"this gpt_oss model's rope_parameters already scale RoPE \(yarn, factor 4, "
                                        r"original 12\)"):
        _open(folders["gpt_oss"], rope="yarn:8")


@pytest.mark.parametrize("spec,full,sliding", [
    ("yarn:4,replace=true,original=24@full", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                              "original_max_position_embeddings": 24}, None),
    ("linear:2@sliding", None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}),  # unscaled: no replace
])
def test_rope_replace_and_the_run_record_before_after(folders, spec, full, sliding):
    ours = _open(folders["gemma3_linear"], rope=spec, attn="eager")
    want = {"sliding_attention": sliding or GEMMA3["sliding_attention"], "full_attention": full or
            GEMMA3["full_attention"]}
    ref = _native(folders["gemma3_linear"], want)
    x = torch.from_numpy(_ids(ours, 2 * MAXPOS))[None]
    with torch.no_grad():
        torch.testing.assert_close(ours.hf(x).logits, ref(x).logits, rtol=0, atol=0)
    block = model_block(ours)  # what eval.json's "model" holds
    assert block["rope_parameters_before"] == GEMMA3
    assert {k: block["rope_parameters"][k] for k in GEMMA3} == want


def test_cli_eval_records_rope_before_after_and_the_rotating_layers(folders, tmp_path):
    """The user path: ``extrapolab eval hf:LLAMA4 --rope ...`` with the cached protocol writes positions "rope",
    the rope_parameters before and after, the measured rotating / NoPE layers and finite E1 and E5."""
    import json

    from typer.testing import CliRunner

    from extrapolab.cli.main import app

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i:02d}.txt").write_text(f"doc {i}\n" + TEXT[i * 40:] + TEXT[: i * 40])
    out = tmp_path / "out"
    args = ["eval", f"hf:{folders['llama4_text']}", "--rope", "yarn:2+rerope:20", "--lengths", "64", "--protocol",
            "nonoverlapping", "--protocol", "cached", "--out", out, "--device", "cpu", "--dtype", "fp32",
            "--set", f"data.corpus=path:{docs}", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set",
            "data.test_percent=40", "--set", "data.valid_percent=10", "--set", "eval.num_tokens=200", "--set",
            "eval.sinks=2"]
    r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "eval-rope-yarn2-rerope20.json").read_text())
    model = res["model"]
    assert model["positions"] == "rope" and model["family"] == "llama4_text"
    assert model["rope_parameters_before"] == {"rope_type": "default", "rope_theta": 500_000.0}
    assert model["rope_parameters"]["rope_type"] == "yarn" and model["rope_parameters"]["factor"] == 2.0
    assert model["rotary_layers"] == {"rope_layers": [0, 1, 2], "nope_layers": [3], "pairs": ["(2i, 2i + 1)"]}
    for proto in ("nonoverlapping", "cached"):
        assert res["ppl"][proto] and all(math.isfinite(v) for v in res["ppl"][proto].values()), res["ppl"]


def test_the_registered_mask_function_reads_the_mask_transformers_builds():
    """causal and sliding -> None (the attention applies them by position), chunked -> its chunks, any other
    mask (bidirectional, a custom overlay: use_vmap) and padding -> one line; chunk spans by index."""
    from transformers import masking_utils as mu

    from extrapolab.hf.masks import ChunkMask, chunk_spans, model_mask

    zeros = torch.zeros(1, dtype=torch.long)
    assert model_mask(mask_function=mu.causal_mask_function) is None
    assert model_mask(mask_function=mu.sliding_window_causal_mask_function(8), local_size=8) is None
    got = model_mask(mask_function=mu.chunked_causal_mask_function(16, zeros), local_size=16, q_offset=35)
    assert got == ChunkMask(16, 35, 0)
    for bad in ({"mask_function": mu.bidirectional_mask_function},
                {"mask_function": mu.causal_mask_function, "use_vmap": True},
                {"mask_function": mu.chunked_causal_mask_function(16, zeros), "local_size": 8}):
        with pytest.raises(UserError, match="takes causal, sliding-window and chunked attention masks"):
            model_mask(**bad)
    with pytest.raises(UserError, match="padded batches"):
        model_mask(mask_function=mu.causal_mask_function, attention_mask=torch.tensor([[0, 1, 1]]))
    # 40 queries from index 0 over 40 keys: chunks [0, 16), [16, 32), [32, 40); one query at index 35 of 36 keys
    assert chunk_spans(40, 40, ChunkMask(16)) == [(0, 16, 0, 16), (16, 32, 16, 32), (32, 40, 32, 40)]
    assert chunk_spans(1, 36, ChunkMask(16, 35, 0)) == [(0, 1, 32, 36)]

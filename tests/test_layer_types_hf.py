"""Layer types on ``hf:`` models (hf/layer_types.py): a tiny random Gemma 3 (a sliding layer, θ 10k, window 8;
a full layer, θ 1M) loaded with ``--rope KIND:ARGS@TYPE`` gives exactly transformers' own forward of the same
weights built from ``rope_parameters`` written natively per layer type, each type's rotary embedding holding
our scheme's frequencies (the other type's untouched), and our attention function (``extrapolab``) gives the
model's own logits with its per-layer sliding windows."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, save_tiny  # noqa: E402

from extrapolab import positional as P  # noqa: E402
from extrapolab.hf import open_hf, parse_rope  # noqa: E402

LOCAL, GLOBAL = 10_000.0, 1_000_000.0  # Gemma 3's default bases


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return save_tiny("gemma3_text", tmp_path_factory.mktemp("gemma3") / "g")


def _native(folder, per_type: dict, top: dict | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    rp = {"sliding_attention": {"rope_type": "default", "rope_theta": LOCAL},
          "full_attention": {"rope_type": "default", "rope_theta": GLOBAL}}
    for key, fields in per_type.items():
        rp[key] = {"rope_theta": rp[key]["rope_theta"], **fields}
    cfg.rope_parameters = {**rp, **(top or {})}
    return AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def _yarn(base, **kw):
    return P.build("rotary-yarn", 1, base=base, factor=4.0, **{"original_length": MAXPOS, **kw})


CASES = [  # (--rope, native per-type fields, native top-level fields, {type: our scheme or None = plain RoPE})
    ("yarn:4@full", {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAXPOS}},
     None, {"sliding_attention": None, "full_attention": _yarn(GLOBAL)}),
    ("yarn:4,truncate=false,original=2000@full_attention",  # an L_tr where truncating the ramp changes it
     {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2000,
                         "truncate": False}}, {"truncate": False},  # the top level: where transformers reads it
     {"sliding_attention": None, "full_attention": _yarn(GLOBAL, truncate=False, original_length=2000)}),
    ("llama3:8@sliding", {"sliding_attention": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": MAXPOS}},
     None, {"sliding_attention": P.build("rotary-llama3", 1, base=LOCAL, factor=8.0, original_length=MAXPOS),
            "full_attention": None}),
    ("yarn:4", {k: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAXPOS}
                for k in ("sliding_attention", "full_attention")}, None,
     {"sliding_attention": _yarn(LOCAL), "full_attention": _yarn(GLOBAL)}),
]


@pytest.mark.parametrize("spec,per_type,top,ours", CASES, ids=[c[0] for c in CASES])
def test_rope_per_layer_type_equals_transformers_native_config(gemma, spec, per_type, top, ours):
    m = open_hf(f"hf:{gemma}", device="cpu", dtype="fp32", rope=spec)
    native = _native(gemma, per_type, top)
    ids = torch.randint(0, native.config.vocab_size, (1, 3 * MAXPOS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m.hf(ids).logits, native(ids).logits, rtol=0, atol=0)
    rot = m.hf.model.rotary_emb
    for key, scheme in ours.items():
        base = LOCAL if key == "sliding_attention" else GLOBAL
        want = P.build("rotary", 1, base=base).inv_freq(8, 3 * MAXPOS) if scheme is None else scheme.inv_freq(8, 0)
        torch.testing.assert_close(getattr(rot, f"{key}_inv_freq").double(), want, rtol=2e-6, atol=0)
        factor = 1.0 if scheme is None else scheme.attention_factor(3 * MAXPOS)
        assert getattr(rot, f"{key}_attention_scaling") == pytest.approx(factor, rel=1e-12)
    lt = m.loaded.info["layer_types"]
    assert lt["counts"] == {"sliding_attention": 1, "full_attention": 1} and lt["sliding_window"] == 8


def test_our_attention_function_keeps_each_layers_window(gemma):
    """attn_implementation="extrapolab": the sliding layer's window reaches attend() as its own window."""
    ids = torch.randint(0, 300, (1, 3 * MAXPOS), generator=torch.Generator().manual_seed(1))
    ours = open_hf(f"hf:{gemma}", device="cpu", dtype="fp32", attn="extrapolab", rope="yarn:4@full")
    theirs = open_hf(f"hf:{gemma}", device="cpu", dtype="fp32", rope="yarn:4@full")
    with torch.no_grad():
        a, b = ours.hf(ids).logits, theirs.hf(ids).logits
    assert ours.loaded.attn_implementation == "extrapolab"
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_at_type_parses_and_flat_models_keep_their_rewrite():
    s = parse_rope("yarn:4,beta_fast=16@full+logn")
    assert s.rewrite == ("yarn", 4.0) and s.layer_type == "full" and s.logn == 0
    assert s.rewrite_params == {"beta_fast": 16.0}
    assert parse_rope("longrope:8,long=[1,2,3,4]@full").rewrite_params == {"long_factor": [1.0, 2.0, 3.0, 4.0]}
    assert parse_rope("yarn:4").layer_type is None


def test_default_out_folder_names_the_layer_type(gemma):
    from extrapolab.hf import default_out

    m = open_hf(f"hf:{gemma}", device="cpu", dtype="fp32", rope="yarn:4@full")
    assert default_out(m.loaded).name == "hf-g-yarn4-full"

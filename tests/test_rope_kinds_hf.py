"""``--rope llama3 / longrope / proportional / yarn`` (with DeepSeek's mscale, truncate) on an ``hf:`` model:
a tiny random Llama loaded with the spec gives exactly transformers' own forward of the same weights built
from a config whose ``rope_parameters`` were written natively; its rotary embedding holds our schemes'
frequencies and attention factor (positional/rotary_*.py), on both sides of L_tr for LongRoPE."""
from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, save_tiny  # noqa: E402

from extrapolab import positional as P  # noqa: E402
from extrapolab.hf import open_hf, parse_rope  # noqa: E402
from extrapolab.io import UserError  # noqa: E402

SHORT, LONG = [1.0, 1.05, 1.1, 1.3], [1.0, 2.5, 6.0, 11.0]  # head_dim 8: 4 frequency pairs
CASES = [  # (--rope, native rope_parameters besides rope_theta, max_position_embeddings, our scheme + options)
    ("llama3:8", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": MAXPOS}, None,
     ("rotary-llama3", {"factor": 8.0, "original_length": MAXPOS})),
    ("llama3:4,low=2,high=8,original=32", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                           "high_freq_factor": 8.0, "original_max_position_embeddings": 32}, None,
     ("rotary-llama3", {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_length": 32})),
    ("yarn:4,mscale=1,mscale_all_dim=0.5,truncate=false",
     {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
      "original_max_position_embeddings": MAXPOS}, None,
     ("rotary-yarn", {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False,
                      "original_length": MAXPOS})),
    (f"longrope:8,long={json.dumps(LONG)},short={json.dumps(SHORT)}".replace(" ", ""),
     {"rope_type": "longrope", "factor": 8.0, "short_factor": SHORT, "long_factor": LONG,
      "original_max_position_embeddings": MAXPOS}, None,
     ("rotary-longrope", {"factor": 8.0, "short_factor": SHORT, "long_factor": LONG, "original_length": MAXPOS})),
    ("longrope:FILE", {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,  # Phi-3 style: no factor
                       "original_max_position_embeddings": MAXPOS}, 16 * MAXPOS,
     ("rotary-longrope", {"factor": 16.0, "short_factor": SHORT, "long_factor": LONG, "original_length": MAXPOS})),
    ("proportional:0.5", {"rope_type": "proportional", "partial_rotary_factor": 0.5}, None,
     ("rotary-proportional", {"p": 0.5})),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    folder = save_tiny("llama", root / "llama")
    (root / "phi3-config.json").write_text(json.dumps({  # the fields a Phi-3 config.json has
        "max_position_embeddings": 16 * MAXPOS, "original_max_position_embeddings": MAXPOS,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}))
    return folder, root / "phi3-config.json"


def _native(folder, fields, max_pos):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    cfg.rope_parameters = {"rope_theta": cfg.rope_parameters["rope_theta"], **fields}
    if max_pos:
        cfg.max_position_embeddings = max_pos
    return AutoModelForCausalLM.from_pretrained(str(folder), config=cfg, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def _rotary(model):
    return next(mod for mod in model.modules() if hasattr(mod, "inv_freq"))


@pytest.mark.parametrize("spec,fields,max_pos,ours", CASES, ids=[c[0].split(",long")[0] for c in CASES])
def test_rope_kind_equals_transformers_native_config(llama, spec, fields, max_pos, ours):
    folder, phi3 = llama
    spec = spec.replace("FILE", str(phi3))
    m = open_hf(f"hf:{folder}", device="cpu", dtype="fp32", rope=spec)
    native = _native(folder, fields, max_pos)
    scheme = P.build(ours[0], 1, **ours[1])
    g = torch.Generator().manual_seed(0)
    for L in (MAXPOS // 2, MAXPOS, 3 * MAXPOS):  # LongRoPE: short, short, long
        ids = torch.randint(0, native.config.vocab_size, (1, L), generator=g)
        with torch.no_grad():
            got, want = m.hf(ids).logits, native(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same computation, not just close
        rot = _rotary(m.hf)
        torch.testing.assert_close(rot.inv_freq.double(), scheme.inv_freq(8, L), rtol=2e-6, atol=0)
        assert rot.attention_scaling == pytest.approx(scheme.attention_factor(L), rel=1e-12)
    assert m.loaded.info["rope_parameters"]["rope_type"] == fields["rope_type"]


def test_rope_kind_specs_parse_lists_keys_and_files(llama):
    s = parse_rope("longrope:16,long=[1,2,3,4],attention_factor=1.2+logn")
    assert s.rewrite == ("longrope", 16.0) and s.logn == 0
    assert s.rewrite_params == {"long_factor": [1.0, 2.0, 3.0, 4.0], "attention_factor": 1.2}
    s = parse_rope("yarn:32,beta_fast=32,mscale_all_dim=1,mscale=1,truncate=false")
    assert s.rewrite_params == {"beta_fast": 32.0, "mscale_all_dim": 1.0, "mscale": 1.0, "truncate": False}
    assert parse_rope("llama3:8,low_freq_factor=1,high=4").rewrite_params == {"low_freq_factor": 1.0,
                                                                             "high_freq_factor": 4.0}
    s = parse_rope(f"longrope:{llama[1]},short=[1,1,1,1]")  # inline keys win over the file
    assert s.rewrite_params == {"short_factor": [1.0] * 4, "long_factor": LONG, "original_max_position_embeddings":
                                MAXPOS, "factor": 16.0}
    assert parse_rope("proportional:0.25").rewrite == ("proportional", 0.25)
    for bad, needle in (("longrope:8,long=[1,2,3,4],long_factor=[1,1,1,1]", "long_factor twice"),
                        ("yarn:4,truncate=maybe", "true or false"), ("longrope:8,long=[1,x]", "in brackets"),
                        ("llama3:8,original=12.5", "whole number"), ("linear:x", "KIND:FACTOR")):
        with pytest.raises(UserError, match=re.escape(needle)):
            parse_rope(bad)

"""evaluate(): runs the chosen protocols and returns strict-JSON results that agree with them."""
import json

import numpy as np
import pytest
import torch

from extrapolab.config import EvalConfig
from extrapolab.eval import PROTOCOLS, evaluate, evaluate_config, last_token, nonoverlapping
from fakes import Bigram
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig


def _gpt(scheme):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=17, layers=2, heads=2, dim=16, scheme=scheme, train_length=8))


def _stream(n=400):
    return np.random.RandomState(5).randint(0, 17, n)


def test_evaluate_all_protocols_json_round_trip():
    g, tok = _gpt("alibi"), _stream()
    r = evaluate(g, tok, train_length=8, protocols=PROTOCOLS, lengths=[16, 32], num_tokens=64,
                 last_token_n=10, position_segments=3)
    back = json.loads(json.dumps(r, allow_nan=False))
    assert back == r and r["lengths"] == [8, 16, 32]  # train_length added as the verdict reference (32 > 16)
    assert set(r["ppl"]) == {"nonoverlapping", "sliding", "last_token", "cached", "recomputed"}
    assert r["nonoverlapping"]["16"]["ppl"] == pytest.approx(nonoverlapping(g, tok, 16, max_tokens=64)["ppl"])
    assert r["last_token"]["32"]["ppl"] == pytest.approx(last_token(g, tok, [8, 16, 32], n=10)[32])
    assert r["sliding"]["8"]["stride"] == 4 and r["settings"]["cache_window"] == 16
    pw = r["positionwise"]
    assert pw["length"] == 32 and pw["window"] == 8 and len(pw["nll"]) == len(pw["windowed_nll"]) == 32
    assert pw["nll"][:8] == pytest.approx(pw["windowed_nll"][:8], rel=1e-5)
    # window 16 >= L 16: cached decoding is exact nonoverlapping
    assert r["cached"]["16"]["nll"] == pytest.approx(r["nonoverlapping"]["16"]["nll"], rel=1e-6)
    for p, v in r["verdict"].items():
        ratios = [abs(r["ppl"][p][L] - r["ppl"][p]["8"]) / r["ppl"][p]["8"] for L in ("16", "32")]
        assert v["worst_ratio"] == pytest.approx(max(ratios))
        assert v["extrapolates"] == (max(ratios) < 0.1)


def test_learned_ape_past_train_length_is_recorded_not_raised():
    r = evaluate(_gpt("learned"), _stream(), train_length=8, protocols=["nonoverlapping", "last_token"],
                 lengths=[8, 16], last_token_n=5)
    assert r["nonoverlapping"]["8"]["ppl"] > 0 and r["ppl"]["nonoverlapping"]["16"] is None
    assert "error" in r["nonoverlapping"]["16"] and "\n" not in r["nonoverlapping"]["16"]["error"]
    assert "error" in r["last_token"]["16"]
    assert r["verdict"]["nonoverlapping"]["extrapolates"] is False


def test_too_short_stream_recorded_per_length():
    r = evaluate(Bigram(vocab=17), _stream(40), train_length=8, protocols=["nonoverlapping"],
                 lengths=[16, 64])
    assert r["nonoverlapping"]["16"]["tokens"] == 32
    assert "needs at least 65" in r["nonoverlapping"]["64"]["error"]


def test_evaluate_config_and_bad_input():
    cfg = EvalConfig(protocols=["nonoverlapping", "sliding"], lengths=[8, 16], num_tokens=48, batch_size=2)
    r = evaluate_config(_gpt("rotary"), _stream(), cfg, train_length=8)
    assert r["settings"]["batch_size"] == 2 and r["nonoverlapping"]["16"]["tokens"] == 48
    with pytest.raises(UserError, match="unknown evaluation protocol 'perplexity'"):
        evaluate(_gpt("alibi"), _stream(), train_length=8, protocols=["perplexity"])
    with pytest.raises(UserError, match="vocabulary has 17"):
        evaluate(_gpt("alibi"), np.arange(40), train_length=8, protocols=["nonoverlapping"], lengths=[8])


def test_attention_temperature_is_applied():
    g, tok = _gpt("alibi"), _stream()
    kw = dict(train_length=8, protocols=["nonoverlapping"], lengths=[16], num_tokens=64)
    a, b = evaluate(g, tok, **kw), evaluate(g, tok, temperature=0.5, **kw)
    assert b["settings"]["temperature"] == 0.5
    assert a["nonoverlapping"]["16"]["nll"] != pytest.approx(b["nonoverlapping"]["16"]["nll"], rel=1e-7)


@pytest.mark.parametrize("impl", ["blocked", "plain", "sdpa"])
def test_eval_attention_is_the_path_every_protocol_runs_on(impl, monkeypatch):
    """``eval.attention`` reaches every forward of E1 and E3 (e.g. `blocked` for a GPU demo: no FlexAttention
    compile per scheme and length) and scores what `auto` scores; the results record it."""
    g, tok = _gpt("t5"), _stream()
    seen, real = [], type(g).forward

    def spy(self, *a, opts=None, **kw):
        seen.append(opts.impl if opts is not None else None)
        return real(self, *a, opts=opts, **kw)

    monkeypatch.setattr(type(g), "forward", spy)
    kw = dict(protocols=["nonoverlapping", "last_token"], lengths=[8, 32], num_tokens=64, last_token_n=6)
    base = evaluate_config(g, tok, EvalConfig(**kw), train_length=8)
    assert set(seen) == {"auto"} and base["settings"]["attention"] == "auto"
    seen.clear()
    r = evaluate_config(g, tok, EvalConfig(attention=impl, **kw), train_length=8)
    assert seen and set(seen) == {impl} and r["settings"]["attention"] == impl
    for p in kw["protocols"]:
        for L in ("8", "32"):
            assert r["ppl"][p][L] == pytest.approx(base["ppl"][p][L], rel=1e-5)

"""A per-layer softmax temperature (AttnOptions.temperature as one tau per layer, thesis ch. 5
Algorithm 1) through evaluation, sharpness and our GPT: results record it as given (JSON-safe),
the same tau at every layer equals the scalar, and a list of the wrong length fails with one line.
One helper turns a temperature into its per-layer list; every adapter uses it."""
import json

import numpy as np
import pytest
import torch

from extrapolab.analysis import attention_sharpness
from extrapolab.eval import evaluate
from extrapolab.io import UserError
from extrapolab.model.attention import AttnOptions, layer_temperatures, temperature_record
from extrapolab.model.gpt import GPT, ModelConfig


def _gpt(layers=2):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=17, layers=layers, heads=2, dim=16, scheme="alibi", train_length=8))


def _stream(n=400):
    return np.random.RandomState(5).randint(0, 17, n)


def _one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_one_helper_for_the_per_layer_list():
    assert layer_temperatures(0.5, 3) == [0.5, 0.5, 0.5]
    assert layer_temperatures(np.float32(2.0), 2) == [2.0, 2.0]  # numpy scalars are one tau too
    assert layer_temperatures((0.5, 2), 2) == [0.5, 2.0]
    with pytest.raises(UserError) as e:
        layer_temperatures([0.5, 1.0, 2.0], 2)
    _one_line(e, "3 per-layer temperatures", "2-layer", "one per layer")
    for bad in (0.0, -1.0, float("inf"), [1.0, float("nan")]):
        with pytest.raises(UserError) as e:
            layer_temperatures(bad, 2)
        _one_line(e, "positive and finite")
    assert temperature_record(0.5) == 0.5 and temperature_record((0.5, np.float64(2))) == [0.5, 2.0]
    assert json.dumps(temperature_record(np.array([0.5, 2.0]))) == "[0.5, 2.0]"


def test_evaluate_records_a_per_layer_temperature():
    g, tok = _gpt(), _stream()
    kw = dict(train_length=8, protocols=["nonoverlapping", "last_token"], lengths=[16], num_tokens=64,
              last_token_n=8)
    scalar = evaluate(g, tok, temperature=0.5, **kw)
    same = evaluate(g, tok, temperature=(0.5, 0.5), **kw)
    mixed = evaluate(g, tok, temperature=[0.5, 2.0], **kw)
    assert same["settings"]["temperature"] == [0.5, 0.5] and mixed["settings"]["temperature"] == [0.5, 2.0]
    assert json.loads(json.dumps(mixed, allow_nan=False)) == mixed
    assert same["nonoverlapping"]["16"]["nll"] == pytest.approx(scalar["nonoverlapping"]["16"]["nll"], rel=1e-12)
    assert same["ppl"] == scalar["ppl"]
    assert mixed["nonoverlapping"]["16"]["nll"] != pytest.approx(scalar["nonoverlapping"]["16"]["nll"], rel=1e-6)
    opts = evaluate(g, tok, opts=AttnOptions(temperature=(0.5, 2.0)), **kw)  # given through the options
    assert opts["settings"]["temperature"] == [0.5, 2.0]
    assert opts["nonoverlapping"]["16"]["nll"] == mixed["nonoverlapping"]["16"]["nll"]


def test_mismatched_per_layer_temperature_fails_once_with_one_line():
    g, tok = _gpt(), _stream()
    for taus in ([0.5], [0.5, 1.0, 2.0]):  # too short, and too long (its tail was ignored before)
        with pytest.raises(UserError) as e:
            evaluate(g, tok, train_length=8, protocols=["nonoverlapping"], lengths=[16], temperature=taus)
        _one_line(e, f"{len(taus)} per-layer temperatures", "2-layer")
        with pytest.raises(UserError) as e:
            g(torch.from_numpy(tok[:16])[None], opts=AttnOptions(temperature=taus))
        _one_line(e, "one per layer")


def test_sharpness_records_a_per_layer_temperature():
    m = _gpt()
    seg = torch.randint(0, 17, (2, 24))
    scalar = attention_sharpness(m, seg, [24], opts=AttnOptions(temperature=0.5))
    same = attention_sharpness(m, seg, [24], opts=AttnOptions(temperature=(0.5, 0.5)))
    mixed = attention_sharpness(m, seg, [24], opts=AttnOptions(temperature=(0.5, 2.0)))
    assert same["temperature"] == [0.5, 0.5] and scalar["temperature"] == 0.5
    assert json.loads(json.dumps(mixed))["temperature"] == [0.5, 2.0]
    np.testing.assert_allclose(same["per_length"][24]["entropy"], scalar["per_length"][24]["entropy"], rtol=1e-12)
    assert mixed["per_length"][24]["entropy"][0] == pytest.approx(scalar["per_length"][24]["entropy"][0])
    assert mixed["per_length"][24]["entropy"][1] > scalar["per_length"][24]["entropy"][1]  # tau 2 flattens layer 1

"""The two embedding conventions of the GPT (docs/results/sinusoidal-failure.md).

Default (``model.embed_scale=1``): GPT-2 token embeddings (std init_std), sinusoids scaled by
sqrt(2)·init_std and learned APE at std init_std, so token and position rms match at init.
``model.embed_scale=0``: fairseq ``transformer_lm`` (Vaswani et al. §3.4): token embeddings std
d^-0.5 times sqrt(d) on input, unscaled sinusoids, learned APE std d^-0.5 (fairseq
``PositionalEmbedding``).
"""
import math

import pytest
import torch

from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional import build
from extrapolab.positional.base import SchemeError
from extrapolab.positional.sinusoidal import sinusoidal_table


def _rms(t):
    return t.float().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("embed_scale", [1.0, 0.0])
def test_token_and_position_rms_match_at_init(embed_scale):
    d = 256
    torch.manual_seed(0)
    sin = GPT(ModelConfig(vocab_size=512, layers=1, heads=4, dim=d, scheme="sinusoidal", embed_scale=embed_scale))
    lrn = GPT(ModelConfig(vocab_size=512, layers=1, heads=4, dim=d, scheme="learned", train_length=512,
                          embed_scale=embed_scale))
    pos = torch.arange(512)
    tokens = sin.embed(torch.arange(512)[None], pos) - sin.scheme.embed(pos, d)[None]  # token part only
    want_tok = 1.0 if embed_scale == 0 else 0.02
    assert _rms(tokens) == pytest.approx(want_tok, rel=0.05)
    want_sin = 1.0 if embed_scale == 0 else math.sqrt(2) * 0.02
    torch.testing.assert_close(sin.scheme.embed(pos, d), want_sin * sinusoidal_table(pos, d))
    assert _rms(sin.scheme.embed(pos, d)) == pytest.approx(want_sin / math.sqrt(2), rel=0.01)
    want_lrn = d ** -0.5 if embed_scale == 0 else 0.02
    assert _rms(lrn.scheme.embed(pos, d)) == pytest.approx(want_lrn, rel=0.05)


def test_learned_std_option_and_bad_value():
    s = build("learned", num_heads=2, max_length=64, dim=32, std=0.5)
    assert s.options()["std"] == 0.5 and _rms(s.table) == pytest.approx(0.5, rel=0.15)
    with pytest.raises(SchemeError, match="std must be > 0"):
        build("learned", num_heads=2, max_length=64, dim=32, std=0)

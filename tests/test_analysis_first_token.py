"""A6 (analysis/first_token.py): the attention mass on token 0 per layer equals the mean of the model's own
full probabilities p(m, 0) over heads, segments and queries m >= 1 (return_probs: the L x L reference),
also for a layout whose sliding and chunked layers cannot see token 0 from afar; uniform rows give the
harmonic mean the module names."""
import torch

from extrapolab.analysis.first_token import first_token_mass
from extrapolab.model.gpt import GPT, ModelConfig


def _model(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, heads=4, dim=32, train_length=32, init_std=0.3, **kw)).eval()


def test_mass_on_token_zero_equals_the_full_probabilities_per_layer():
    segs = torch.randint(0, 50, (3, 40), generator=torch.Generator().manual_seed(1))
    for m in (_model(layers=2, scheme="alibi"), _model(layers=4, layout="irope"), _model(layers=6, layout="gemma3")):
        got = first_token_mass(m, segs, block=16)  # row blocks of 16: three per layer
        with torch.no_grad():
            probs = m(segs, return_probs=True)["probs"]  # per layer [3, H, 40, 40]
        want = [float(p[:, :, 1:, 0].double().mean()) for p in probs]
        assert got["length"] == 40 and len(got["per_layer"]) == len(m.blocks)
        assert max(abs(a - b) for a, b in zip(got["per_layer"], want)) < 1e-6
    kinds = [m.scheme.type_of(i) for i in range(6)]
    local = got["per_layer"][kinds.index("sliding")]
    assert local < got["per_layer"][kinds.index("full")]  # a window of 8: token 0 only for the first queries


def test_uniform_attention_gives_the_mean_of_one_over_m_plus_one():
    m = _model(layers=1, scheme="none")
    with torch.no_grad():
        m.blocks[0].qkv.weight[:64].zero_()  # q = k = 0 up to the bias (zero): uniform causal attention
    got = first_token_mass(m, torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(2)))
    assert abs(got["per_layer"][0] - got["uniform"]) < 1e-7  # fp32 softmax
    assert abs(got["uniform"] - sum(1 / (k + 1) for k in range(1, 30)) / 29) < 1e-12

"""Thesis §6.6.4 / Fig. 6.4a: the cumulative gradient of a regular-language classifier."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.regular import build_model
from extrapolab.regular.erf import cumulative_gradient, regular_erf
from extrapolab.regular.tasks import make_task
from extrapolab.regular.train import RegularRunConfig, run


@pytest.mark.parametrize("kind", ["regulargpt", "transformer", "lstm"])
def test_cumulative_gradient_matches_a_direct_computation(kind):
    """The hook-based curve == gradients taken against an explicit leaf embedding tensor."""
    torch.manual_seed(0)
    task = make_task("parity")
    model = build_model(kind, task.vocab_size, task.num_classes).eval()
    x, y = task.sample(np.random.default_rng(0), 5, 37)
    c = cumulative_gradient(model, x, y, batch=2)  # [5, 38]
    emb = model.tok if kind == "regulargpt" else (model.emb if kind == "lstm" else model.gpt.tok)
    e = emb(torch.from_numpy(x)).detach().requires_grad_(True)  # [5, 37, D]
    handle = emb.register_forward_hook(lambda m, i, o: e)
    try:
        loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum")
        (g,) = torch.autograd.grad(loss, e)
    finally:
        handle.remove()
    n = g.double().norm(dim=-1)
    s = n / n.sum(-1, keepdim=True)
    want = np.concatenate([s.flip(-1).cumsum(-1).flip(-1).numpy(), np.zeros((5, 1))], 1)
    assert np.allclose(c, want, atol=1e-9)
    assert np.allclose(c[:, 0], 1.0) and (np.diff(c, axis=1) <= 1e-12).all()


def test_memoryless_model_puts_all_gradient_on_the_last_token(tmp_path):
    """An Elman RNN with a zero recurrent matrix sees only the last token: ERF 1 token, 0% beyond L_tr."""
    cfg = RegularRunConfig.from_dict(dict(task="parity", model="rnn", model_options={"hidden": 8}, steps=1,
                                          batch_size=4, eval_every=1, val_samples=4, test_min=41,
                                          test_max=41, test_samples=4))
    run(cfg, tmp_path / "rnn", progress=False)
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "rnn" / "model.safetensors"))
    state["rnn.weight_hh_l0"].zero_()
    save_file(state, str(tmp_path / "rnn" / "model.safetensors"))
    res = regular_erf([tmp_path / "rnn"], tmp_path / "erf", length=60, samples=4)
    row = res["runs"][0]
    assert row["erf_tokens"] == 1 and row["share_beyond_train"] == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(row["c"][:60], 1.0) and row["c"][60] == 0.0
    assert (tmp_path / "erf" / "erf.json").is_file() and (tmp_path / "erf" / "erf.png").is_file()


def test_erf_errors_and_cli(tmp_path):
    base = dict(steps=1, batch_size=4, eval_every=1, val_samples=4, test_min=41, test_max=41, test_samples=4)
    run(RegularRunConfig.from_dict({**base, "task": "parity", "model": "lstm", "model_options": {"hidden": 8}}),
        tmp_path / "p", progress=False)
    run(RegularRunConfig.from_dict({**base, "task": "even_pairs", "model": "lstm", "model_options": {"hidden": 8},
                                    "val_lengths": [80]}), tmp_path / "e", progress=False)
    with pytest.raises(UserError, match="different tasks"):
        regular_erf([tmp_path / "p", tmp_path / "e"], tmp_path / "o")
    with pytest.raises(UserError, match="missing"):
        regular_erf([tmp_path / "nope"], tmp_path / "o")
    r = CliRunner().invoke(app, ["erf", str(tmp_path / "p"), "--out", str(tmp_path / "o"), "--length", "50",
                                 "--samples", "2"])
    assert r.exit_code == 0, r.output
    assert "tokens hold 99% of the gradient" in r.output and (tmp_path / "o" / "erf.json").is_file()
    r = CliRunner().invoke(app, ["erf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "missing" in r.output

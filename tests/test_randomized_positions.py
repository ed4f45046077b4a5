"""Randomized positions (Ruoss et al. 2023; positional/randomized.py): the sampler, the config checks,
training at random positions (equal to the reference path on the same positions, resumable bit for
bit), evaluation at random positions, and the regular-language transformer columns."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extrapolab.config import ConfigError, eval_positions, resolve
from extrapolab.eval import evaluate
from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional import randomized
from extrapolab.positional.randomized import STREAM_EVAL, STREAM_VALID, PositionSampler
from extrapolab.train import forward_backward, load_model, train
from extrapolab.train.records import read_rows, read_summary
from extrapolab.train.sampler import valid_windows

from test_train import L, V, markov_data, strip, tiny_cfg


def test_sampler_draws_sorted_distinct_positions_in_range_reproducibly():
    a, b = PositionSampler(100, seed=3), PositionSampler(100, seed=3)
    draws = [a.draw(30) for _ in range(20)]
    for d in draws:
        assert d.dtype == torch.int64 and d.shape == (30,)
        assert bool((d[1:] > d[:-1]).all()) and int(d.min()) >= 0 and int(d.max()) < 100  # sorted, unique, range
    assert all(torch.equal(d, b.draw(30)) for d in draws)  # seeded
    assert not torch.equal(PositionSampler(100, seed=4).draw(30), draws[0])
    assert not torch.equal(PositionSampler(100, seed=3, stream=STREAM_VALID).draw(30), draws[0])
    assert torch.equal(PositionSampler(30).draw(30), torch.arange(30))  # L_max = L: the only subset
    hits = torch.zeros(100)
    for d in draws:
        hits[d] += 1
    assert (hits > 0).sum() > 90  # the whole range is used, not just a prefix
    c = PositionSampler(100, seed=3)
    c.draw(30)
    state = c.state_dict()
    want = [c.draw(30) for _ in range(3)]
    d = PositionSampler(100, seed=99)
    d.load_state_dict(state)  # resume: the same draws as an uninterrupted sampler
    assert all(torch.equal(w, d.draw(30)) for w in want)


def test_bad_settings_are_one_line_config_errors():
    base = ["model.train_length=64", "train.steps=2"]
    for over, needle in (
        ("train.positions=random:32", "L_MAX must be >= 64"),
        ("train.positions=random", "'contiguous' or 'random:L_MAX'"),
        ("train.positions=shuffled", "'contiguous' or 'random:L_MAX'"),
        ("eval.positions=random:x", "eval.positions must be"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve(None, base + [over])
        assert needle in str(err.value) and "\n" not in str(err.value), over
    with pytest.raises(ConfigError) as err:
        resolve(None, base + ["model.scheme=learned", "train.positions=random:256"])
    assert "model.scheme_params.max_length=256" in str(err.value)
    resolve(None, base + ["model.scheme=learned", "train.positions=random:256", "model.scheme_params.max_length=256"])
    with pytest.raises(ConfigError, match="model.arch=gpt"):
        resolve(None, base + ["model.arch=regulargpt", "train.positions=random:256"])
    cfg = resolve(None, base + ["train.positions=random:256"])
    assert eval_positions(cfg) == "random:256"  # "train": as the run trained
    cfg.eval.positions = "contiguous"
    assert eval_positions(cfg) == "contiguous"


@pytest.mark.parametrize("scheme", ["rotary", "alibi", "xpos", "kerple-log"])
def test_training_steps_at_random_positions_equal_the_reference_path(scheme):
    """The training path (causal SDPA for rotary, the dense-mask fallback for biases at positions with
    gaps) gives the loss and gradients of the plain matmul-softmax reference on the same positions."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, layers=2, heads=2, dim=16, scheme=scheme, train_length=L)
    model = GPT(cfg)
    ref = GPT(cfg)
    ref.load_state_dict(model.state_dict())
    ref.attn_opts = AttnOptions(impl="plain")
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, ref)]
    sampler = PositionSampler(8 * L, seed=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [torch.randint(0, V, (4, L + 1), generator=g) for _ in range(2)]
        pos = [sampler.draw(L) for _ in batches]  # one draw per micro-batch, as Ruoss et al.'s code per batch
        assert any(int(p[-1]) > L for p in pos)  # positions beyond the training length are used
        losses = [forward_backward(m, batches, positions=pos) for m in (model, ref)]
        assert math.isfinite(losses[0].item())
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
        for o in opts:
            o.step()
            o.zero_grad()
    with torch.no_grad():  # and the positions matter: 0..L-1 gives other logits
        x = batches[0][:, :-1]
        assert (model(x, pos[0]) - model(x)).abs().max() > 1e-5


@pytest.fixture(scope="module")
def data():
    return markov_data()


def test_trainer_at_random_positions_records_it_validates_there_and_resumes_exactly(tmp_path, data):
    over = ["model.scheme=alibi", "train.positions=random:64"]
    full = tmp_path / "full"
    summary = train(tiny_cfg(*over), full, data=data, progress=False)
    assert summary["positions"] == "random:64" and "positions: random:64" in (full / "config.yaml").read_text()
    run = tmp_path / "killed"
    train(tiny_cfg(*over), run, data=data, progress=False, stop_after=10)
    train(tiny_cfg(*over), run, data=data, progress=False)  # resumes from step 8: the position sampler too
    assert strip(read_rows(run)) == strip(read_rows(full))
    # the final validation loss, recomputed at the validation stream's draws (and not at 0..L-1)
    model, _ = load_model(full, "last")
    x = torch.from_numpy(valid_windows(data.split("valid"), L + 1, 2 * 4))  # [8, L+1]: two batches of 4
    draws = PositionSampler(64, seed=0, stream=STREAM_VALID)
    with torch.no_grad():
        nll = sum(F.cross_entropy(model(b[:, :-1], draws.draw(L)).reshape(-1, V), b[:, 1:].reshape(-1),
                                  reduction="sum") for b in x.split(4))
        plain = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    final = read_summary(full)["final_valid_loss"]
    assert (nll / x[:, 1:].numel()).item() == pytest.approx(final, rel=1e-5)
    assert plain.item() != pytest.approx(final, rel=1e-4)
    with pytest.raises(Exception, match="train.positions"):  # resuming with another setting is refused
        train(tiny_cfg("model.scheme=alibi", "train.steps=20"), full, data=data, progress=False)


def test_evaluation_at_random_positions_follows_the_draws():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=V, layers=2, heads=2, dim=16, scheme="alibi", train_length=L)).eval()
    tok = np.random.default_rng(0).integers(0, V, 3000)
    res = evaluate(model, tok, train_length=L, protocols=["nonoverlapping", "positionwise", "cached"],
                   lengths=[L, 32, 128], num_tokens=256, batch_size=4, positions="random:64")
    assert res["settings"]["positions"] == "random:64"
    assert "64" in res["nonoverlapping"]["128"]["error"]  # 128 distinct positions cannot come from [0, 64)
    assert "eval.positions=contiguous" in res["positionwise"]["error"]
    assert "eval.positions=contiguous" in res["cached"]["32"]["error"]
    # E1 at L = 32 by hand: 8 chunks, batches of 4, one draw per batch from the length's own stream
    draws = PositionSampler(64, seed=32, stream=STREAM_EVAL)
    chunks = torch.from_numpy(np.stack([tok[s:s + 33] for s in range(0, 256, 32)]))  # [8, 33]
    with torch.no_grad():
        nll = torch.cat([F.cross_entropy(model(c[:, :-1], draws.draw(32)).reshape(-1, V), c[:, 1:].reshape(-1),
                                         reduction="none") for c in chunks.split(4)])
    assert res["nonoverlapping"]["32"]["ppl"] == pytest.approx(math.exp(nll.double().mean().item()), rel=1e-6)
    again = evaluate(model, tok, train_length=L, protocols=["nonoverlapping"], lengths=[32], num_tokens=256,
                     positions="random:64")
    assert again["nonoverlapping"]["32"]["ppl"] == res["nonoverlapping"]["32"]["ppl"]  # reproducible
    contiguous = evaluate(model, tok, train_length=L, protocols=["nonoverlapping"], lengths=[32], num_tokens=256)
    assert contiguous["nonoverlapping"]["32"]["ppl"] != pytest.approx(res["nonoverlapping"]["32"]["ppl"], rel=1e-6)


def test_regular_transformer_at_random_positions():
    from extrapolab.regular import table as T
    from extrapolab.regular.train import RegularRunConfig, accuracy_at, fit, _rng
    from extrapolab.regular.tasks import make_task
    from extrapolab.io import UserError

    tiny = dict(task="parity", model="transformer", steps=4, batch_size=8, eval_every=2, val_samples=8,
                test_min=41, test_max=45, test_samples=8, train_max=8, val_lengths=[12],
                model_options={"dim": 16, "heads": 2, "layers": 1, "scheme": "alibi"}, positions="random:64")
    cfg = RegularRunConfig.from_dict(tiny).resolved()
    model, history, _ = fit(cfg, progress=False)
    assert all(math.isfinite(h["loss"]) for h in history)
    task = make_task("parity")
    a = accuracy_at(model, task, 40, 16, _rng(1, 2, 40), max_position=64)
    assert a == accuracy_at(model, task, 40, 16, _rng(1, 2, 40), max_position=64)  # strings and draws seeded
    x, _ = task.sample(_rng(1, 2, 40), 16, 40)
    pos = torch.from_numpy(randomized.draw(_rng(1, 2, 40), 64, 40))  # [40] sorted from [0, 64)
    with torch.no_grad():  # the classifier takes them (ALiBi: -slope x (p_m - p_n))
        assert (model(torch.from_numpy(x), pos) - model(torch.from_numpy(x))).abs().max() > 1e-6
    for bad, needle in (({"model": "lstm", "model_options": {}}, "model=transformer"),
                        ({"positions": "random:20"}, "random:2048")):
        with pytest.raises(UserError, match=needle):
            RegularRunConfig.from_dict({**tiny, **bad}).resolved()
    for col in T.RANDOM_COLUMNS:  # the `regular table --models` columns resolve on both task families
        for task_name in ("parity", "d2"):
            c = T.run_config(task_name, col, 0, "quick").resolved()
            assert c.positions == "random:2048" and c.model == "transformer"
        assert T.run_config("parity", col, 0, "quick").test_stride == 5


def test_a_sweep_entry_sets_train_positions_for_its_runs():
    from extrapolab.io import UserError
    from extrapolab.sweep.sweep import SweepSpec, entry_config

    spec = SweepSpec.from_dict({"schemes": ["rotary", {"name": "rotary", "train": {"positions": "random:512"}}]})
    assert [s.label for s in spec.schemes] == ["rotary", "rotary(positions=random:512)"]
    base = resolve(None, ["model.train_length=64"])
    plain, rand = (entry_config(base, s) for s in spec.schemes)
    assert plain.train.positions == "contiguous" and rand.train.positions == "random:512"
    assert base.train.positions == "contiguous"  # a copy: the base is untouched
    with pytest.raises(ConfigError, match="L_MAX must be >= 64"):
        entry_config(base, SweepSpec.from_dict({"schemes": [{"name": "alibi", "train": {"positions": "random:8"}}]}).schemes[0])
    with pytest.raises(UserError, match="sweep.seeds"):
        SweepSpec.from_dict({"schemes": [{"name": "alibi", "train": {"seed": 3}}]})

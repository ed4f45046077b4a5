"""Training/evaluation of the regular-language benchmark: tiny smoke runs, determinism, runs on
disk, the table/sweep/pca/CLI plumbing; the Parity >= 99% check is `slow`."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.regular import table as table_mod
from extrapolab.regular.pca import level_outputs, nearest_centroid_accuracy, pca_2d, pca_figure
from extrapolab.regular.tasks import make_task
from extrapolab.regular.train import RegularRunConfig, evaluate_lengths, fit, load_run, run
from flexspy import CountSyncs

TINY = dict(steps=4, batch_size=8, eval_every=2, val_samples=8, test_min=41, test_max=45,
            test_samples=8, train_max=8, val_lengths=[12])


def tiny(task="parity", model="regulargpt", **kw):
    return RegularRunConfig.from_dict({**TINY, "task": task, "model": model,
                                       "model_options": {"dim": 16, "heads": 2} if model == "regulargpt" else {},
                                       **kw})


def test_run_writes_and_reloads(tmp_path):
    res = run(tiny(), tmp_path / "r", progress=False)
    for f in ("config.json", "model.safetensors", "result.json"):
        assert (tmp_path / "r" / f).is_file()
    saved = json.loads((tmp_path / "r" / "result.json").read_text())
    assert saved["test_lengths"] == {"min": 41, "max": 45, "stride": 1, "count": 5, "samples_per_length": 8}
    assert sorted(saved["per_length"]) == ["41", "42", "43", "44", "45"]
    assert saved["mean_test"] == pytest.approx(np.mean(list(saved["per_length"].values())))
    model, cfg, _ = load_run(tmp_path / "r")
    x = torch.randint(0, 2, (4, 30))
    with torch.no_grad():
        assert torch.equal(model(x), res["model"].eval()(x))


def test_training_is_deterministic_by_seed():
    cfg = tiny().resolved()
    a, ha, _ = fit(cfg, progress=False)
    b, hb, _ = fit(cfg, progress=False)
    assert [h["loss"] for h in ha] == [h["loss"] for h in hb]
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    c, _, _ = fit(tiny(seed=1).resolved(), progress=False)
    assert not torch.equal(a.head.weight, c.head.weight)


@pytest.mark.parametrize("kw", [{}, {"supervision": "prefix"},
                                {"model": "transformer", "model_options": {"dim": 16, "heads": 2, "layers": 1}}])
def test_a_train_step_reads_nothing_back(kw):
    """A training step of the regular study leaves its loss on the device (fit reads the losses once per validation
    round) and copies nothing from host data into a tensor beyond its batch (a prefix model's level depths are
    computed on the device; the batch goes through pinned memory on a GPU): on a GPU each read, and each copy from
    pageable memory, makes the host wait for the queued kernels. (Random positions, positions passed in, are read
    once per forward, as in the LM.)"""
    from extrapolab.regular.baselines import build_model
    from extrapolab.regular.train import _rng, run_placement, train_step

    cfg = tiny(**kw).resolved()
    task = make_task(cfg.task, **cfg.task_options)
    place = run_placement(cfg)
    model = place.put(build_model(cfg.model, task.vocab_size, task.num_classes, **cfg.model_options))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)  # (Adam reads its step count, a host tensor on a GPU too)
    rng, lengths = _rng(1, 0), task.lengths(cfg.train_min, cfg.train_max)
    train_step(model, opt, task, rng, lengths, cfg, place)  # first step: the model's constants built
    with CountSyncs() as c:
        loss = train_step(model, opt, task, rng, lengths, cfg, place)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    assert c.calls == ["lift_fresh"] * 2, c.calls  # the strings and their labels: numpy arrays made tensors


@pytest.mark.parametrize("model", ["transformer", "lstm", "rnn"])
def test_baselines_train_a_few_steps(model):
    cfg = tiny("cycle_navigation", model, model_options={"dim": 16, "heads": 2, "layers": 1}
               if model == "transformer" else {"hidden": 16})
    res = run(cfg, None, progress=False)
    assert 0.0 <= res["mean_test"] <= 1.0 and res["steps_run"] == 4


def test_eval_per_length_is_independent_of_the_length_set():
    task = make_task("parity")
    model = run(tiny(), None, progress=False)["model"]
    one = evaluate_lengths(model, task, [50], samples=16)
    many = evaluate_lengths(model, task, [41, 50, 60], samples=16)
    assert one[50] == many[50]


def test_config_errors_are_one_line():
    with pytest.raises(UserError, match="unknown run option"):
        RegularRunConfig.from_dict({"stepz": 3})
    with pytest.raises(UserError, match="valid length"):
        tiny("d2", val_lengths=[13]).resolved()
    with pytest.raises(UserError, match="steps"):
        tiny(steps=0).resolved()


def test_table_resumes_and_writes_markdown(tmp_path, monkeypatch):
    over = dict(steps=2, eval_every=1, val_samples=4, test_samples=4, test_max=44, train_max=6)
    monkeypatch.setitem(table_mod.MODEL_SPECS, "regulargpt-C2",
                        {"model": "regulargpt", "model_options": {"C": 2, "dim": 16, "heads": 2}})
    monkeypatch.setitem(table_mod.MODEL_SPECS, "rnn", {"model": "rnn", "model_options": {"hidden": 8}})
    t = table_mod.regular_table(tmp_path, "parity", "rnn,regulargpt-C2", seeds=2, progress=False, **over)
    e = t["tasks"]["parity"]["regulargpt-C2"]
    assert e["max"] == max(e["per_seed"]) and e["avg"] == pytest.approx(np.mean(e["per_seed"]))
    assert e["thesis"] == (100.0, 100.0)
    md = (tmp_path / "table.md").read_text()
    assert "| parity |" in md and "100.0 / 100.0" in md
    assert (tmp_path / "plots" / "per_length_parity.png").is_file()
    assert (tmp_path / "plots" / "per_length_parity.svg").is_file()
    erf = t["erf"]["parity"]  # Fig. 6.4a on the seed-0 runs, at the longest test length
    assert erf["length"] == 44 and set(erf["columns"]) == {"rnn", "regulargpt-C2"}
    assert all(0.0 <= c["share_beyond_train"] <= 1.0 and 1 <= c["erf_tokens"] <= 44 for c in erf["columns"].values())
    assert "## Receptive field" in md and (tmp_path / "erf" / "parity" / "erf.png").is_file()

    def boom(*a, **k):
        raise AssertionError("finished runs must be reused")
    monkeypatch.setattr(table_mod, "run", boom)
    again = table_mod.regular_table(tmp_path, "parity", "rnn,regulargpt-C2", seeds=2, progress=False, **over)
    assert again["tasks"]["parity"]["rnn"]["per_seed"] == t["tasks"]["parity"]["rnn"]["per_seed"]
    part = table_mod.regular_table(tmp_path, "parity,d2", "rnn,lstm", seeds=2, progress=False,
                                   skip_missing=True, **over)  # tabulate what exists, train nothing
    assert list(part["tasks"]) == ["parity"] and "rnn" in part["tasks"]["parity"]
    assert "lstm" not in part["tasks"]["parity"]
    assert "| parity |" in (tmp_path / "table.md").read_text()
    with pytest.raises(UserError, match="unknown table model"):
        table_mod.regular_table(tmp_path, "parity", "gpt9", seeds=1, progress=False)


def test_sweep_p_smoke(tmp_path, monkeypatch):
    monkeypatch.setitem(table_mod.MODEL_SPECS, "rnn", {"model": "rnn", "model_options": {"hidden": 8}})
    over = dict(steps=2, eval_every=1, val_samples=4, test_samples=4, test_max=60, train_max=6)
    res = table_mod.sweep_p(tmp_path, "rnn", seeds=1, ps="0.1,0.9", progress=False,
                            eval_stride=10, eval_samples=8, **over)
    assert res["p"] == [0.1, 0.9] and len(res["same"]["rnn"]) == len(res["extrapolation"]["rnn"]) == 2
    assert res["lengths"] == {"min": 41, "max": 51, "stride": 10, "count": 2, "samples_per_length": 8,
                              "same_length": 6}
    assert "| same | rnn (ours) |" in (tmp_path / "sweep_p.md").read_text()


def test_pca_helpers_and_figure(tmp_path):
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.normal(0, 0.1, (50, 6)), rng.normal(3, 0.1, (50, 6))])
    lab = np.repeat([0, 1], 50)
    p2, ratio = pca_2d(pts)
    assert p2.shape == (100, 2) and ratio[0] > 0.9
    assert nearest_centroid_accuracy(pts, lab) == 1.0
    assert nearest_centroid_accuracy(pts, rng.permutation(lab)) < 0.8
    run(tiny(), tmp_path / "r", progress=False)
    model, _, _ = load_run(tmp_path / "r")
    feats, labels, levels = level_outputs(model, make_task("parity"), length=20, batch=2)
    assert feats.shape[0] == labels.shape[0] == levels.shape[0] == 2 * (10 + 5 + 3 + 2 + 1)
    res = pca_figure(tmp_path / "r", tmp_path / "pca", length=20, batch=2)
    assert res["classes"] == 2 and (tmp_path / "pca" / "pca_parity.png").is_file()


def test_cli_commands(tmp_path):
    r = CliRunner()
    res = r.invoke(app, ["lemma", "--out", str(tmp_path), "--samples", "200"])
    assert res.exit_code == 0 and "mismatches 0" in res.output
    res = r.invoke(app, ["bench", "--lengths", "32,64", "--repeats", "1"])
    assert res.exit_code == 0 and "full_over_dilated" in res.output
    res = r.invoke(app, ["train", "--task", "parity", "--out", str(tmp_path / "t"), "--steps", "2",
                         "--opt", "dim=16", "--opt", "heads=2", "--test-stride", "100", "--test-samples", "4",
                         "--no-progress"])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["eval", str(tmp_path / "t"), "--min", "41", "--max", "43", "--samples", "4",
                         "--p", "0.9", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0 and (tmp_path / "e" / "eval.json").is_file()
    for bad in (["train", "--task", "nope", "--out", str(tmp_path / "x")],
                ["eval", str(tmp_path / "missing")],
                ["train", "--out", str(tmp_path / "y"), "--opt", "C"]):
        res = r.invoke(app, bad)
        assert res.exit_code == 2 and res.output.strip().count("\n") == 0, res.output


@pytest.mark.slow
def test_regulargpt_parity_extrapolates_and_transformer_does_not():
    """Done criterion: C=2 >= 99% mean over lengths 41..500 in >= 2 of 3 seeds; vanilla ~50%."""
    means = []
    for seed in range(3):
        cfg = RegularRunConfig(task="parity", model="regulargpt", seed=seed, steps=3000,
                               test_stride=7, test_samples=64)
        means.append(run(cfg, None, progress=False)["mean_test"])
    assert sum(m >= 0.99 for m in means) >= 2, means
    cfg = RegularRunConfig(task="parity", model="transformer", model_options={"scheme": "t5"},
                           lr=3e-4, steps=600, test_stride=25, test_samples=64)
    assert abs(run(cfg, None, progress=False)["mean_test"] - 0.5) < 0.06


@pytest.mark.parametrize("model", ["regulargpt", "lstm"])
def test_prefix_supervision_trains_and_checks_its_options(model):
    res = run(tiny("modular_arithmetic", model, supervision="prefix", val_lengths=[13]), None, progress=False)
    assert res["steps_run"] == 4 and 0.0 <= res["mean_test"] <= 1.0
    assert res["config"]["supervision"] == "prefix"
    with pytest.raises(UserError, match="supervision must be"):
        tiny(supervision="all").resolved()
    with pytest.raises(UserError, match="K=1"):
        tiny(supervision="prefix", model_options={"dim": 16, "heads": 2, "K": 2}).resolved()


def test_prefix_supervision_loss_averages_every_labelled_prefix():
    from extrapolab.regular.baselines import build_model
    from extrapolab.regular.train import _loss

    task = make_task("modular_arithmetic")
    torch.manual_seed(0)
    m = build_model("regulargpt", task.vocab_size, task.num_classes, dim=16, heads=2)
    x, y = task.sample(np.random.default_rng(0), 4, 7)
    with torch.no_grad():
        per = [torch.nn.functional.cross_entropy(m(torch.from_numpy(x[:, :t])), torch.from_numpy(task.label(x[:, :t])))
               for t in (1, 3, 5, 7)]  # the odd prefixes are the labelled ones
        assert torch.allclose(_loss(m, task, x, y, "prefix"), torch.stack(per).mean(), atol=1e-5)
        assert torch.allclose(_loss(m, task, x, y, "last"), per[-1], atol=1e-6)

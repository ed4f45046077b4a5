"""`extrapolab align head-scale RUN --length L` end to end on a tiny NoPE run: the tuned model is a run
folder the `eval` verb reads, its recorded perplexities are what `eval` measures on it and on the source
run, the same command reuses the result, and bad input is one line."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extrapolab.cli.main import app
from extrapolab.config import resolve, save
from extrapolab.sweep.runs import eval_run
from extrapolab.train import load_model, train


@pytest.fixture(scope="module")
def nope_run(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    for i in range(30):
        (docs / f"d{i:02d}.txt").write_text(" ".join(rng.choice(words, 120)) + "\n")
    cfg = resolve(None, [f"data.corpus=path:{docs}", "data.tokenizer=bytes",
                         f"data.cache_dir={tmp_path_factory.mktemp('cache')}", "data.valid_percent=20",
                         "data.test_percent=30", "model.scheme=none", "model.layers=2", "model.heads=2",
                         "model.dim=16", "model.train_length=16", "train.steps=4", "train.batch_size=4",
                         "train.warmup_steps=1", "train.eval_every=4", "train.checkpoint_every=4",
                         "train.eval_batches=1", "train.precision=fp32", "eval.batch_size=2"])
    path = tmp_path_factory.mktemp("runs") / "nope"
    train(cfg, path, progress=False)
    return path


ARGS = ["--length", "64", "--steps", "3", "--segments", "1", "--grid", "1.0,1.5,2.0", "--tokens", "256"]


def _e1(run, L):
    res = eval_run(run, protocols=["nonoverlapping"], lengths=str(L), overrides=["eval.num_tokens=256"])
    return res["result"]["nonoverlapping"][str(L)]["ppl"]


def test_head_scale_verb_writes_a_run_the_eval_verb_reads(nope_run, tmp_path):
    out = tmp_path / "hs"
    r = CliRunner().invoke(app, ["align", "head-scale", str(nope_run), *ARGS, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "| NoPE |" in r.output and "| head scale" in r.output and f"wrote {out}" in r.output
    res = json.loads((out / "head-scale.json").read_text())
    assert res["length"] == 64 and res["train_length"] == 16 and res["search"]["grid"] == [1.0, 1.5, 2.0]
    assert res["search"]["best"] == res["search"]["grid"][int(np.argmin(res["search"]["loss"]))]
    model, cfg = load_model(out)
    assert cfg.model.scheme == "nope-headscale" and cfg.model.scheme_params["scale"] == res["search"]["best"]
    lam = model.scheme.scale.detach()
    assert lam.shape == (2, 2) and bool((lam >= 1.0).all()) and torch.allclose(lam, torch.tensor(res["tune"]["scale"]))
    src, _ = load_model(nope_run)  # every other weight is the source run's
    hs_state = model.state_dict()
    assert all(torch.equal(v, hs_state[k]) for k, v in src.state_dict().items())
    # what it recorded is what `extrapolab eval` measures on the two folders
    assert _e1(out, 64) == pytest.approx(res["ppl_after"]["length"], rel=1e-5)
    assert _e1(nope_run, 64) == pytest.approx(res["ppl_before"]["length"], rel=1e-5)
    assert _e1(out, 16) == pytest.approx(res["ppl_after"]["train_length"], rel=1e-5)
    # the same command reuses the folder; other settings tune again
    stamp = (out / "head-scale.json").stat().st_mtime_ns
    r = CliRunner().invoke(app, ["align", "head-scale", str(nope_run), *ARGS, "--out", str(out)])
    assert r.exit_code == 0 and f"reused {out}" in r.output
    assert (out / "head-scale.json").stat().st_mtime_ns == stamp
    r = CliRunner().invoke(app, ["align", "head-scale", str(nope_run), *ARGS[:-2], "--tokens", "128",
                                 "--out", str(out)])
    assert r.exit_code == 0 and f"wrote {out}" in r.output
    assert not list(tmp_path.glob(".hs.*"))  # no temporary or old folder left beside it


def test_head_scale_bad_input_is_one_line(nope_run, tmp_path):
    cases = [([str(nope_run), "--length", "16"], "must exceed the run's training length 16"),
             ([str(tmp_path / "missing"), "--length", "64"], "not a run folder")]
    other = tmp_path / "alibi"
    other.mkdir()
    cfg = resolve(None, ["model.scheme=alibi", "model.train_length=16"])
    save(cfg, other / "config.yaml")
    cases.append(([str(other), "--length", "64"], "is not a NoPE run (model.scheme=alibi)"))
    cases.append(([str(nope_run), "--length", "64", "--grid", "0,1"], "grid must be positive"))
    for args, needle in cases:
        r = CliRunner().invoke(app, ["align", "head-scale", *args, "--out", str(tmp_path / "x")])
        assert r.exit_code == 2, r.output
        assert needle in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()

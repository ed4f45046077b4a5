"""`extrapolab eval RUN --rope TEXT` on a run trained with plain rotary: the extension is applied (the
mapping `align rope` uses, align/rope_methods.py), written beside the plain eval.json, refused in one
line for other runs and unknown kinds; and `eval` runs L_tr only when some length exceeds it, saying
before it starts which lengths run and why."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from extrapolab import config as C
from extrapolab import positional
from extrapolab.align.rope_methods import method_setup, rope_scheme
from extrapolab.cli.main import app
from extrapolab.data import prepare, provenance
from extrapolab.eval import eval_lengths, evaluate, nonoverlapping
from extrapolab.io import UserError
from extrapolab.train import load_model, train

L_TR = 16


@pytest.fixture(scope="module")
def rotary(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrope")
    corpus = root / "corpus"
    corpus.mkdir()
    for j in range(40):
        (corpus / f"m{j:02d}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {i} + {j % 7}\n"
                                                     for i in range(40)))
    over = [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={root / 'cache'}",
            "model.layers=1", "model.heads=2", "model.dim=16", f"model.train_length={L_TR}", "model.scheme=rotary",
            "model.scheme_params={base: 5000}", "train.steps=40", "train.batch_size=8", "train.checkpoint_every=20",
            "train.eval_every=20", "train.eval_batches=1", "train.precision=fp32", "train.threads=1", "train.lr=0.01",
            "eval.lengths=[16,64]", "eval.num_tokens=256", "eval.protocols=[nonoverlapping]"]
    cfg = C.resolve(None, over)
    data = prepare(cfg.data, progress=False)
    train(cfg, root / "run", data=data, progress=False)
    return SimpleNamespace(root=root, run=root / "run", data=data)


def _eval(*args):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


@pytest.mark.parametrize("text, name, options", [
    ("linear:2", "rotary-pi", {"factor": 2.0}),
    ("ntk:3", "rotary-ntk", {"factor": 3.0}),
    ("dynamic:2", "rotary-dynamic", {"factor": 2.0, "original_length": L_TR}),
    ("yarn:4", "rotary-yarn", {"factor": 4.0, "original_length": L_TR}),
    ("yarn:4+logn", "rotary-yarn", {"factor": 4.0, "logn": True, "original_length": L_TR}),
    ("selfextend:3,4", "rotary-selfextend", {"G": 3, "w": 4}),
    ("selfextend:3", "rotary-selfextend", {"G": 3, "w": L_TR // 4}),
    ("rerope:4+logn", "rotary-rerope", {"w": 4, "logn": True}),
    ("rerope-leaky:4,8", "rotary-rerope-leaky", {"w": 4, "k": 8.0}),
    ("logn", "rotary", {"logn": True, "original_length": L_TR}),
    ("logn:32", "rotary", {"logn": True, "original_length": 32}),
    ("yarn:4,original=8,beta_fast=16", "rotary-yarn", {"factor": 4.0, "original_length": 8, "beta_fast": 16.0}),
    ("llama3:8", "rotary-llama3", {"factor": 8.0, "original_length": L_TR}),
    ("llama3:8,low=2,high=8", "rotary-llama3", {"low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    ("proportional:0.5", "rotary-proportional", {"p": 0.5}),
    ("longrope:4,long=[1,2,3,4]", "rotary-longrope", {"factor": 4.0, "long_factor": [1.0, 2.0, 3.0, 4.0]}),
    ("dca:12,2", "rotary-dca", {"original_length": L_TR}),
    ("streaming:2,6", "rotary-streaming", {"original_length": L_TR}),
])
def test_rope_text_builds_the_rotary_scheme_align_rope_uses(text, name, options):
    s = rope_scheme(text, 2, L_TR, {"base": 5000.0})
    opts = s.options()
    assert s.name == name and opts["base"] == 5000.0  # the run's own rotary base is kept
    assert {k: opts[k] for k in options} == options
    if text == "yarn:4":  # the same scheme `align rope` swaps in for YaRN at 4x L_tr (one mapping)
        ref, _ = method_setup("yarn", L_TR, 4 * L_TR, 2, {})
        assert ref.options() == {**opts, "base": 10000.0}
    if text.startswith(("dca", "streaming")):  # C, w / K, W given, the rest as `align rope` builds them
        ref = positional.build(name, 2, original_length=L_TR, base=5000.0,
                               **({"chunk": 12, "w": 2} if name == "rotary-dca" else {"sinks": 2, "w": 6}))
        assert opts == ref.options()


@pytest.mark.parametrize("text, needle", [
    ("longrope:long=[1,2,3,4]", "needs its factor S"),
    ("yarn:2+selfextend:2", "not both"),
    ("llama9:2", "--rope takes"),
    ("yarn:0.5", "FACTOR >= 1"),
])
def test_rope_text_refused_in_one_line(text, needle):
    with pytest.raises(UserError, match=needle.replace("+", r"\+")):
        rope_scheme(text, 2, L_TR)


def test_eval_run_applies_rope_and_keeps_the_plain_results(rotary, tmp_path):
    r = _eval(rotary.run, "--lengths", "64", "--device", "cpu")
    assert r.exit_code == 0, r.output
    plain = (rotary.run / "eval.json").read_bytes()
    r = _eval(rotary.run, "--lengths", "64", "--rope", "yarn:4", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert (rotary.run / "eval.json").read_bytes() == plain  # not overwritten
    got = json.loads((rotary.run / "eval-rope-yarn4.json").read_text())
    assert got["rope"]["scheme"] == "rotary-yarn" and got["rope"]["options"]["factor"] == 4.0
    assert "rotary-yarn" in r.stderr and "evaluating lengths 64 and L_tr = 16" in r.stderr
    model, _ = load_model(rotary.run, which="best", device="cpu")  # the reference: the scheme built by name
    model.eval()
    model.scheme = positional.build("rotary-yarn", 2, factor=4.0, original_length=L_TR, base=5000.0)
    test = np.asarray(rotary.data.split("test"))
    for L in (16, 64):
        want = nonoverlapping(model, test, L, max_tokens=256)["ppl"]
        assert got["ppl"]["nonoverlapping"][str(L)] == pytest.approx(want, rel=1e-9)
    base = json.loads(plain)["ppl"]["nonoverlapping"]  # a tiny model: positions move its ppl a little
    assert got["ppl"]["nonoverlapping"]["64"] != pytest.approx(base["64"], rel=1e-6)  # the extension ran
    r = _eval(rotary.run, "--lengths", "64", "--rope", "selfextend:2,4+logn", "--temperature", "0.9",
              "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert (rotary.run / "eval-rope-selfextend2_4-logn-temperature-0.9.json").is_file()


def test_eval_run_refuses_unknown_kinds_before_any_work(rotary, tmp_path):
    before = sorted(p.name for p in rotary.run.iterdir())
    for text, needle in (("llama9:2", "--rope takes"), ("longrope:long=[1,1,1,1]", "needs its factor")):
        r = _eval(rotary.run, "--rope", text)
        assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in rotary.run.iterdir()) == before


def test_lengths_below_l_tr_run_without_it(rotary):
    assert eval_lengths([1024, 4096], 32768) == ([1024, 4096], eval_lengths([4096, 1024], 32768)[1])
    assert "none exceeds L_tr = 32,768" in eval_lengths([1024, 4096], 32768)[1]
    assert eval_lengths([1024, 65536], 32768)[0] == [1024, 32768, 65536]
    assert eval_lengths([], 512)[0] == [512]
    test = np.asarray(rotary.data.split("test"))
    model, _ = load_model(rotary.run, which="best", device="cpu")
    res = evaluate(model.eval(), test, train_length=L_TR, protocols=["nonoverlapping"], lengths=[8], num_tokens=64)
    assert res["lengths"] == [8] and list(res["ppl"]["nonoverlapping"]) == ["8"]
    assert "skipped" in res["verdict"]["nonoverlapping"]
    r = _eval(rotary.run, "--lengths", "8", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "lengths 8 only: none exceeds L_tr = 16" in r.stderr
    res = json.loads((rotary.run / "eval.json").read_text())
    assert res["lengths"] == [8]
    assert res["data"] == provenance(rotary.data) and len(res["data"]["corpus_hash"]) == 64  # the text it measured
    assert f"corpus path:{rotary.root / 'corpus'}: sha256 {res['data']['corpus_hash'][:12]}" in r.stdout


def test_hf_eval_below_its_context_runs_no_context_length(tmp_path):
    pytest.importorskip("transformers")
    from hf_tiny import MAXPOS, TEXT, save_tiny

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i:02d}.txt").write_text(f"doc {i}\n" + TEXT[i * 40:] + TEXT[: i * 40])
    llama = save_tiny("llama", tmp_path / "llama")
    sets = [x for kv in (f"data.corpus=path:{docs}", f"data.cache_dir={tmp_path / 'cache'}",
                         "data.test_percent=50", "data.valid_percent=10", "eval.num_tokens=200")
            for x in ("--set", kv)]
    out = tmp_path / "out"
    r = _eval(f"hf:{llama}", "--lengths", "16", "--protocol", "nonoverlapping", "--out", out, "--device", "cpu",
              *sets)
    assert r.exit_code == 0, r.output
    assert f"none exceeds L_tr = {MAXPOS}" in r.stderr
    assert json.loads((out / "eval.json").read_text())["lengths"] == [16]
    r = _eval(f"hf:{llama}", "--lengths", "16", "--protocol", "nonoverlapping", "--rope", "yarn:2", "--out", out,
              "--device", "cpu", *sets)
    assert r.exit_code == 0, r.output
    assert (out / "eval-rope-yarn2.json").is_file() and json.loads((out / "eval.json").read_text())["lengths"] == [16]

"""--device / --dtype on every verb that runs a model (extrapolab.train.placement), checked on the CPU:
the options resolve by the training rules, reach the library call (bf16 autocast changes the numbers a
little, fp32 == the default path exactly), bad values give one line naming the option. The same calls
on CUDA are in test_device_gpu.py (marked gpu)."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extrapolab.cli.main import app
from extrapolab.config import resolve
from extrapolab.io import UserError
from extrapolab.sweep.runs import eval_run
from extrapolab.train import placement, placement_overrides, train

runner = CliRunner()


def test_placement_follows_the_training_rules():
    p = placement()
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert p.device.type == want and p.precision == ("fp32" if want == "cpu" else p.precision)
    assert placement("cpu", "bf16").precision == "bf16" and placement("cpu", "auto").precision == "fp32"
    with placement("cpu", "bf16").autocast():
        y = torch.nn.Linear(4, 4)(torch.ones(2, 4))
    assert y.dtype == torch.bfloat16
    with placement("cpu", "fp32").autocast():
        assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.float32
    assert placement_overrides() == [] and placement_overrides("cpu", "bf16") == [
        "train.device=cpu", "train.precision=bf16"]


@pytest.mark.parametrize("device,dtype,match", [
    ("tpu", "auto", r"unknown --device 'tpu'; use auto, cpu, cuda or cuda:N"),
    ("cpu", "int8", r"unknown --dtype 'int8'; use auto, fp32, bf16 or fp16"),
    ("cpu", "fp16", r"--dtype fp16 needs a CUDA device; use --dtype bf16 or fp32 on CPU"),
])
def test_bad_placement_is_one_line_naming_the_option(device, dtype, match):
    with pytest.raises(UserError, match=match) as e:
        placement(device, dtype)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(UserError, match=r"--device cuda but no CUDA device is visible; use --device cpu"):
        placement("cuda")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny trained run on a bytes corpus folder (so `eval RUN` can re-prepare its data)."""
    tmp = tmp_path_factory.mktemp("dev")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (corpus / f"d{i:02d}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef", "gh"], 300)) + "\n")
    cfg = resolve(None, [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={tmp / 'cache'}",
                         "data.valid_percent=10", "data.test_percent=20", "model.layers=1", "model.heads=2",
                         "model.dim=16", "model.train_length=16", "model.scheme=alibi", "name=r",
                         f"out_dir={tmp}", "train.steps=4", "train.batch_size=4", "train.warmup_steps=1",
                         "train.eval_batches=1", "train.device=cpu", "eval.lengths=[16,32]",
                         "eval.protocols=[nonoverlapping]", "eval.num_tokens=256"])
    train(cfg, tmp / "r", progress=False)
    return tmp / "r"


def test_eval_run_places_the_model_and_records_it(run):
    base = eval_run(run, device="cpu", dtype="fp32")["result"]
    again = eval_run(run)["result"]  # auto on a CPU machine: fp32, the same numbers
    bf16 = eval_run(run, device="cpu", dtype="bf16")["result"]
    assert base["placement"] == {"device": "cpu", "precision": "fp32"}
    assert bf16["placement"] == {"device": "cpu", "precision": "bf16"}
    if not torch.cuda.is_available():
        assert again["ppl"] == base["ppl"]
    for L in ("16", "32"):
        a, b = base["ppl"]["nonoverlapping"][L], bf16["ppl"]["nonoverlapping"][L]
        assert a != b and abs(a - b) / a < 0.05  # autocast really ran, and changed the numbers only a little


def test_cli_verbs_take_device_and_dtype(run, tmp_path):
    res = runner.invoke(app, ["eval", str(run), "--device", "cpu", "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "eval.json").read_text())["placement"]["precision"] == "bf16"
    res = runner.invoke(app, ["eval", str(run), "--device", "tpu"])
    assert res.exit_code == 2 and "unknown --device 'tpu'" in res.output
    res = runner.invoke(app, ["analyze", "sharpness", str(run), "--lengths", "8,16", "--segments", "1", "--out",
                              str(tmp_path), "--dtype", "fp16", "--device", "cpu"])
    assert res.exit_code == 2 and "--dtype fp16 needs a CUDA device" in res.output


@pytest.mark.slow
def test_analysis_and_align_verbs_run_under_bf16_autocast(run, tmp_path):
    out, place = str(tmp_path / "an"), ["--device", "cpu", "--dtype", "bf16"]
    for argv in (["analyze", "sharpness", str(run), "--lengths", "8,16", "--segments", "1", "--out", out],
                 ["analyze", "erf", str(run), "--length", "32", "--segments", "1", "--out", out],
                 ["analyze", "nope-variance", "--dim", "8", "--heads", "2", "--length", "8", "--samples", "2",
                  "--no-sweep", "--out", out],
                 ["analyze", "all", str(run), "--length", "32", "--segments", "1"],
                 ["align", str(run), "--lengths", "32", "--segments", "1"]):
        res = runner.invoke(app, argv + place)
        assert res.exit_code == 0, (argv, res.output)
    assert json.loads((run / "analysis" / "analysis.json").read_text())["placement"]["precision"] == "bf16"
    assert json.loads((run / "temperature.json").read_text())["placement"]["precision"] == "bf16"

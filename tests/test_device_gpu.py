"""The --device/--dtype paths on CUDA (marked gpu: skipped without a CUDA device; run `pytest -m gpu`).
Each compares with the CPU path of test_device.py / test_device_regular.py on the same inputs."""
import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import numpy as np

from extrapolab.config import resolve
from extrapolab.model import flex
from extrapolab.regular.plan import probe_run
from extrapolab.regular import train as regular_train
from extrapolab.regular.train import RegularRunConfig, load_run
from extrapolab.sweep.runs import eval_run
from extrapolab.sweep.sweep import run_sweep
from extrapolab.train import placement

from extrapolab.train import train
from flexspy import eager_dense_calls
from test_device import run as run  # noqa: F401  (the tiny trained run fixture)

pytestmark = pytest.mark.gpu


def test_auto_is_cuda_with_bf16():
    p = placement()
    assert p.device.type == "cuda" and p.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    with p.autocast():
        y = torch.nn.Linear(8, 8).to(p.device)(torch.ones(2, 8, device=p.device))
    assert y.dtype in (torch.bfloat16, torch.float16)


def test_eval_on_cuda_matches_cpu(run):  # noqa: F811
    cpu = eval_run(run, device="cpu", dtype="fp32")["result"]
    gpu = eval_run(run, device="cuda", dtype="fp32")["result"]
    bf16 = eval_run(run, device="cuda", dtype="bf16")["result"]
    assert gpu["placement"]["device"].startswith("cuda")
    for L, v in cpu["ppl"]["nonoverlapping"].items():
        assert gpu["ppl"]["nonoverlapping"][L] == pytest.approx(v, rel=1e-3)
        assert bf16["ppl"]["nonoverlapping"][L] == pytest.approx(v, rel=5e-2)


def test_regular_run_trains_and_saves_from_cuda(tmp_path):
    cfg = RegularRunConfig(task="parity", model="regulargpt", model_options={"dim": 16, "heads": 2}, steps=3,
                           eval_every=1, val_samples=4, test_samples=4, test_max=44, train_max=6)
    cpu = regular_train.run(cfg, progress=False)
    gpu = regular_train.run(replace(cfg, device="cuda", precision="fp32"), tmp_path / "r", progress=False)
    assert gpu["placement"]["device"].startswith("cuda")
    assert gpu["history"][0]["loss"] == pytest.approx(cpu["history"][0]["loss"], rel=1e-4)  # same init, same batch
    model, saved, _ = load_run(tmp_path / "r")  # weights were moved to the CPU to be saved
    assert saved.device == "cuda" and next(model.parameters()).device.type == "cpu"
    bf16 = regular_train.run(replace(cfg, device="cuda", precision="bf16"), progress=False)
    assert bf16["placement"]["precision"] == "bf16"
    p = probe_run(replace(cfg, device="cuda", steps=100), steps=3, warmup=1)
    assert p["device"].startswith("cuda") and p["projected_s"] > 0


def test_smoke_sweep_trains_and_evaluates_on_cuda(tmp_path):
    res = run_sweep("demo-smoke", out=tmp_path / "out", progress=False,
                    overrides=[f"data.cache_dir={tmp_path / 'cache'}", "train.device=cuda", "sweep.seeds=[0]"])
    con = sqlite3.connect(res["out"] / "results.sqlite")
    assert con.execute("SELECT COUNT(*) FROM runs WHERE status='done'").fetchone()[0] == 3
    for (rd,) in con.execute("SELECT run_dir FROM runs"):
        summary = json.loads((Path(rd) / "summary.json").read_text())
        assert summary["device"].startswith("cuda")


@pytest.fixture(scope="module", params=["alibi", "kerple-log"])
def flex_run(request, tmp_path_factory):
    """A tiny run at head_dim 64 whose evaluation lengths (>= flex.MIN_LENGTH) take FlexAttention on
    CUDA (a learnable table), or the folded path (ALiBi's form: folded.LONG_EVAL)."""
    tmp = tmp_path_factory.mktemp("flexrun")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(60):
        (corpus / f"d{i:02d}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef", "gh"], 600)) + "\n")
    L = flex.MIN_LENGTH
    cfg = resolve(None, [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={tmp / 'cache'}",
                         "data.valid_percent=10", "data.test_percent=30", "model.layers=2", "model.heads=2",
                         "model.dim=128", "model.train_length=128", f"model.scheme={request.param}", "name=r",
                         f"out_dir={tmp}", "train.steps=4", "train.batch_size=4", "train.warmup_steps=1",
                         "train.eval_batches=1", "train.device=cpu", f"eval.lengths=[{L},{2 * L}]",
                         "eval.protocols=[nonoverlapping,last_token]", f"eval.num_tokens={4 * L}",
                         "eval.last_token_n=4"])
    train(cfg, tmp / "r", progress=False)
    return tmp / "r", request.param


def test_flex_eval_on_cuda_matches_cpu_on_the_same_checkpoint(flex_run, monkeypatch):
    """E1 and E3 on CUDA (fp32, bf16) through the path `auto` takes there -- FlexAttention for KERPLE's table,
    the folded flash path for ALiBi -- against the CPU's Toeplitz path."""
    from extrapolab.model import attention as attn_mod

    run, name = flex_run
    dense = eager_dense_calls(monkeypatch)
    calls, real = [], flex.flex_attention_path
    monkeypatch.setattr(flex, "flex_attention_path", lambda *a, **kw: calls.append("flex") or real(*a, **kw))
    real_fold = attn_mod.folded_attention
    monkeypatch.setattr(attn_mod, "folded_attention", lambda *a, **kw: calls.append("folded") or real_fold(*a, **kw))
    cpu = eval_run(run, device="cpu", dtype="fp32")["result"]
    assert not calls
    gpu = eval_run(run, device="cuda", dtype="fp32")["result"]
    assert set(calls) == {"folded" if name == "alibi" else "flex"}, (name, set(calls))
    bf16 = eval_run(run, device="cuda", dtype="bf16")["result"]
    for proto in ("nonoverlapping", "last_token"):
        for L, v in cpu["ppl"][proto].items():
            assert gpu["ppl"][proto][L] == pytest.approx(v, rel=1e-3), (proto, L)
            assert bf16["ppl"][proto][L] == pytest.approx(v, rel=5e-2), (proto, L)
    assert dense == [] and not flex.kernel("cuda").full

"""torchrun data parallel on CPU (gloo): 2 ranks stay identical and match a 1-process run."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from extrapolab.config import resolve
from extrapolab.train import load_model, train
from extrapolab.train.records import read_rows

WORDS = "alpha beta gamma delta def return class import self value index length window token".split()


def make_corpus(folder, files=40, words=400):
    rng = np.random.default_rng(0)
    folder.mkdir()
    for i in range(files):
        text = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), words))
        (folder / f"doc{i:03d}.txt").write_text(text + "\n")
    return folder


def settings(tmp_path, *extra):
    corpus = make_corpus(tmp_path / "corpus")
    return [
        f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}",
        "data.valid_percent=20", "data.test_percent=10",
        "model.layers=2", "model.heads=2", "model.dim=16", "model.train_length=16", "model.scheme=kerple-log",
        "train.steps=4", "train.batch_size=4", "train.grad_accum=2", "train.warmup_steps=2", "train.lr=3e-3",
        "train.eval_every=2", "train.checkpoint_every=2", "train.log_every=1", "train.eval_batches=2",
        "train.device=cpu", "train.threads=1", *extra,
    ]


def torchrun(run_dir, sets, *extra_args, nproc: int = 2):
    env = {**os.environ, "EXTRAPOLAB_RANK_CHECKSUMS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "extrapolab.train", "--run-dir", str(run_dir), "--no-progress", *extra_args]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return [json.loads((run_dir / f"rank{r}.checksum.json").read_text()) for r in range(nproc)]


def params_hash(model) -> str:  # the same digest the ranks write
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def losses(run):
    rows = read_rows(run)
    return [r["loss"] for r in rows if "loss" in r], [r["valid_loss"] for r in rows if "valid_loss" in r]


def check_against_single(tmp_path, ranks, run, single):
    assert ranks[0]["world"] == 2 and ranks[0]["step"] == ranks[1]["step"] == 4
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # replicas in lock-step
    la, va = losses(run)
    lb, vb = losses(single)
    assert len(la) == 4 and len(va) == 2
    np.testing.assert_allclose(la, lb, rtol=1e-5)  # same global batch, gradients all-reduced
    np.testing.assert_allclose(va, vb, rtol=1e-5)
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 4 and s["backend"] == "gloo"
    a, _ = load_model(run, "last")
    b, _ = load_model(single, "last")
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(ta, tb, rtol=1e-3, atol=1e-4, msg=name)
    return a


def test_torchrun_two_ranks_ddp(tmp_path):
    sets = settings(tmp_path)
    single = tmp_path / "single"
    train(resolve(None, sets), single, progress=False)  # also builds the data cache the ranks reuse
    run = tmp_path / "ddp"
    ranks = torchrun(run, sets)
    assert ranks[0]["first_batch_sha256"] != ranks[1]["first_batch_sha256"]  # different shards
    model = check_against_single(tmp_path, ranks, run, single)
    assert params_hash(model) == ranks[0]["params_sha256"]  # rank 0's checkpoint is what it trained


def test_torchrun_one_process_runs_the_distributed_path(tmp_path):
    """torchrun at world size 1 joins a process group (gloo here, NCCL on CUDA: the GPU check's run) and wraps the
    model in DDP -- the multi-GPU path's code -- and trains exactly as a plain single process does."""
    sets = settings(tmp_path)
    single = tmp_path / "single"
    train(resolve(None, sets), single, progress=False)
    run = tmp_path / "one"
    ranks = torchrun(run, sets, nproc=1)
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 1 and s["backend"] == "gloo" and ranks[0]["world"] == 1
    assert json.loads((single / "summary.json").read_text())["backend"] is None  # no torchrun: no group
    np.testing.assert_allclose(losses(run)[0], losses(single)[0], rtol=1e-5)


@pytest.mark.slow
def test_torchrun_two_ranks_fsdp_with_resume(tmp_path):
    sets = settings(tmp_path, "train.strategy=fsdp")
    single = tmp_path / "single"
    train(resolve(None, sets), single, progress=False)
    run = tmp_path / "fsdp"
    torchrun(run, sets, "--stop-after", "3")  # killed after step 3: resumes from step 2
    ranks = torchrun(run, sets)
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2
    check_against_single(tmp_path, ranks, run, single)

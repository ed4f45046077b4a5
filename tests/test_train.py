"""Trainer: LR schedule, decay groups, accumulation, exact resume, checkpoint safety, summary."""
from __future__ import annotations

import json
import math
import shutil
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extrapolab.config import TrainConfig, resolve
from extrapolab.data import TokenData
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.train import forward_backward, load_checkpoint, load_model, lr_at, param_groups, train
from extrapolab.train.checkpoint import checkpoint_path, save_checkpoint
from extrapolab.train.records import read_rows
from extrapolab.train.sampler import valid_windows

V, L = 32, 16
TIMING = ("sec_per_step", "tokens_per_s")


def markov_data(n: int = 12000, seed: int = 0) -> TokenData:
    """Tokens of a noisy deterministic chain x' = 3x+1 mod V (learnable, so losses fall)."""
    rng = np.random.default_rng(seed)
    x = np.empty(n, dtype=np.uint16)
    x[0] = 1
    noise = rng.random(n) < 0.2
    rand = rng.integers(0, V, n)
    for i in range(1, n):
        x[i] = rand[i] if noise[i] else (x[i - 1] * 3 + 1) % V
    a, b = int(n * 0.8), int(n * 0.9)
    return TokenData.from_arrays(x[:a], x[a:b], x[b:], vocab_size=V, eot_id=0)


def tiny_cfg(*extra: str):
    return resolve(None, [
        "model.layers=2", "model.heads=2", "model.dim=16", f"model.train_length={L}", "model.scheme=kerple-log",
        "model.dropout=0.1", "train.steps=12", "train.batch_size=4", "train.grad_accum=2", "train.warmup_steps=3",
        "train.eval_every=5", "train.checkpoint_every=4", "train.log_every=1", "train.lr=3e-3",
        "train.eval_batches=2", "train.precision=fp32", *extra,
    ])


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _copy(run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


@pytest.fixture(scope="module")
def data():
    return markov_data()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """One uninterrupted 12-step run shared by the read-only tests."""
    run = tmp_path_factory.mktemp("runs") / "full"
    summary = train(tiny_cfg(), run, data=data, progress=False)
    return run, summary


def test_lr_schedule_hand_values():
    c = TrainConfig(lr=1e-3, warmup_steps=4, steps=14, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(2.5e-4)  # (0+1)/4 of the peak
    assert lr_at(2, c) == pytest.approx(7.5e-4)
    assert lr_at(3, c) == pytest.approx(1e-3)  # end of warmup: the peak
    assert lr_at(4, c) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(9, c) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way: cos(pi/2) = 0
    assert lr_at(14, c) == pytest.approx(1e-4)  # the floor min_lr_ratio * lr
    assert lr_at(0, TrainConfig(lr=2e-3, warmup_steps=0, steps=10)) == pytest.approx(2e-3)
    lrs = [lr_at(s, c) for s in range(4, 14)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly decaying after warmup


@pytest.mark.parametrize("tie", [True, False])
def test_weight_decay_groups(tie):
    model = GPT(ModelConfig(vocab_size=V, layers=1, heads=2, dim=16, train_length=L, scheme="kerple-log", tie_weights=tie))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1)
    dec = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    expected = {"blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.weight"}
    assert dec == (expected if tie else expected | {"head.weight"})
    nodec = {names[id(p)] for p in no_decay["params"]}
    assert {"scheme.r1", "scheme.r2", "tok.weight", "ln_f.weight", "blocks.0.qkv.bias"} <= nodec
    assert len(dec) + len(nodec) == len(list(model.parameters()))  # every parameter exactly once


def test_grad_accumulation_matches_full_batch():
    model = GPT(ModelConfig(vocab_size=V, layers=2, heads=2, dim=16, train_length=L, scheme="alibi"))
    x = torch.from_numpy(markov_data().split("train")[: 8 * (L + 1)].astype(np.int64)).view(8, L + 1)  # [8, L+1]
    loss_full = forward_backward(model, [x])
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_acc = forward_backward(model, [x[:4], x[4:]])
    # independent reference for the loss value: plain cross entropy over all 8·L targets
    ref = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    assert loss_acc.item() == pytest.approx(loss_full.item(), rel=1e-6)
    assert loss_full.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, p in zip(g_full, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_accumulation_split_does_not_change_training(tmp_path, data):
    """batch 8 × accum 1 and batch 4 × accum 2 see the same windows per step: same losses."""
    common = ("train.steps=3", "model.dropout=0.0", "train.eval_every=0")
    train(tiny_cfg(*common, "train.batch_size=8", "train.grad_accum=1"), tmp_path / "a", data=data, progress=False)
    train(tiny_cfg(*common, "train.batch_size=4", "train.grad_accum=2"), tmp_path / "b", data=data, progress=False)
    la = [r["loss"] for r in read_rows(tmp_path / "a") if "loss" in r]
    lb = [r["loss"] for r in read_rows(tmp_path / "b") if "loss" in r]
    assert len(la) == 3 and la[-1] < la[0]
    np.testing.assert_allclose(la, lb, rtol=1e-4)


def test_train_attention_option_reaches_every_layer_and_is_checked(tmp_path, data, monkeypatch):
    """train.attention=blocked runs the training forward on the blocked path (the same losses as auto, which takes
    the Toeplitz path here); an unknown value fails in one line before any work."""
    from extrapolab.config import ConfigError, validate
    from extrapolab.model import attention as A

    seen = []
    real = A.select_path
    monkeypatch.setattr(A, "select_path", lambda *a, **kw: seen.append(a[2].impl) or real(*a, **kw))
    common = ("train.steps=2", "model.dropout=0.0", "train.eval_every=0")
    train(tiny_cfg(*common), tmp_path / "a", data=data, progress=False)
    auto = set(seen)
    seen.clear()
    train(tiny_cfg(*common, "train.attention=blocked"), tmp_path / "b", data=data, progress=False)
    assert auto == {"auto"} and "blocked" in seen
    la = [r["loss"] for r in read_rows(tmp_path / "a") if "loss" in r]
    lb = [r["loss"] for r in read_rows(tmp_path / "b") if "loss" in r]
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    with pytest.raises(ConfigError, match="train.attention must be one of auto, .*got 'fast'"):
        validate(tiny_cfg("train.attention=fast"))


def test_resume_is_bit_exact(tmp_path, data, finished):
    full, _ = finished
    run = tmp_path / "killed"
    out = train(tiny_cfg(), run, data=data, progress=False, stop_after=10)  # "killed" at step 10
    assert out == {"finished": False, "step": 10, "run_dir": str(run)}
    assert max(r["step"] for r in read_rows(run)) == 10 and not (run / "summary.json").exists()
    summary = train(tiny_cfg(), run, data=data, progress=False)  # resumes from step 8
    assert summary["resumed_from"] == 8 and summary["steps"] == 12
    rows_full, rows_resumed = strip(read_rows(full)), strip(read_rows(run))
    assert [r["step"] for r in rows_resumed if "loss" in r] == list(range(1, 13))  # 9, 10 re-done once
    assert rows_resumed == rows_full  # loss, lr, tokens, valid loss: identical floats
    a, _ = load_model(full, "last")
    b, _ = load_model(run, "last")
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name


def test_finished_run_is_not_retrained(finished, data, monkeypatch):
    run, summary = finished
    before = (run / "metrics.jsonl").read_bytes(), (run / "summary.json").read_bytes()

    def boom(*a, **k):
        raise AssertionError("a finished run must not build a model again")

    monkeypatch.setattr("extrapolab.train.loop.build_model", boom)
    again = train(tiny_cfg(), run, data=data, progress=False)
    assert again == summary
    assert ((run / "metrics.jsonl").read_bytes(), (run / "summary.json").read_bytes()) == before


def test_resume_false_starts_over(finished, tmp_path, data):
    run = _copy(finished[0], tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 0.0}\n')  # a marker that a real retrain must drop
    s = train(tiny_cfg(), run, data=data, progress=False, resume=False)
    assert s["resumed_from"] is None and s["steps"] == 12
    assert strip(read_rows(run)) == strip(read_rows(finished[0]))  # same seed: same run again


def test_summary_fields_match_records(finished, data):
    run, s = finished
    rows = read_rows(run)
    valid = [r for r in rows if "valid_loss" in r]
    assert [r["step"] for r in valid] == [5, 10, 12]
    assert s["finished"] and s["steps"] == 12 and s["world_size"] == 1 and s["precision"] == "fp32"
    assert s["params"] == GPT(load_model(run)[1].model).num_params()
    assert s["tokens"] == 12 * 4 * 2 * L and s["tokens_per_step"] == 4 * 2 * L
    assert s["final_valid_loss"] == valid[-1]["valid_loss"]
    assert s["final_valid_ppl"] == pytest.approx(math.exp(s["final_valid_loss"]))
    assert s["best_valid_loss"] == min(r["valid_loss"] for r in valid)
    assert s["median_sec_per_step"] == statistics.median(r["sec_per_step"] for r in rows if "loss" in r)
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["median_sec_per_step"])
    assert s["peak_memory_mb"] > 10 and s["peak_memory_kind"] == "cpu_max_rss"
    assert 0 < s["train_seconds"] <= s["wall_seconds"]
    assert json.loads((run / "summary.json").read_text()) == s
    assert valid[-1]["valid_loss"] < math.log(V)  # learned something beyond uniform


def test_valid_loss_agrees_with_independent_recomputation(finished, data):
    run, s = finished
    model, cfg = load_model(run, "last")
    x = torch.from_numpy(valid_windows(data.split("valid"), L + 1, 2 * 4))  # [8, L+1]
    with torch.no_grad():
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(s["final_valid_loss"], rel=1e-5)
    assert cfg.model.vocab_size == V  # vocab comes from the data, not the config default
    best, _ = load_model(run, "best")
    assert best.head.weight is best.tok.weight  # tied weights restored as one tensor


def test_checkpoint_files(finished):
    run, _ = finished
    ck = load_checkpoint(run / "checkpoints" / "last")
    assert ck.step == 12 and ck.state["finished"] and "head.weight" not in ck.weights  # tied: stored once
    assert load_checkpoint(run).path == ck.path  # a run dir means its last checkpoint
    assert not list((run / "checkpoints").glob(".*"))  # no temp / old folders left


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_damaged_checkpoint_is_refused(finished, tmp_path, data, damage):
    run = _copy(finished[0], tmp_path)
    last = run / "checkpoints" / "last"
    if damage == "truncate":
        w = last / "model.safetensors"
        w.write_bytes(w.read_bytes()[:-100])
        word = "truncated"
    elif damage == "flip":
        s = bytearray((last / "state.pt").read_bytes())
        s[len(s) // 2] ^= 0xFF
        (last / "state.pt").write_bytes(bytes(s))
        word = "sha256"
    else:
        (last / "manifest.json").unlink()
        word = "not completely written"
    with pytest.raises(UserError, match=word) as e:
        load_checkpoint(last)
    assert "\n" not in str(e.value) and "delete" in str(e.value)
    (run / "summary.json").unlink()
    with pytest.raises(UserError, match=word):  # resuming does not silently start over
        train(tiny_cfg(), run, data=data, progress=False)


def test_wrong_architecture_is_refused(finished, data):
    run, _ = finished
    for override, key in (("model.dim=32", "model.dim"), ("model.scheme=alibi", "model.scheme")):
        cfg = tiny_cfg(override)
        with pytest.raises(UserError, match=key) as e:
            load_checkpoint(run / "checkpoints" / "last", cfg)
        assert "\n" not in str(e.value) and "--name" in str(e.value)
        with pytest.raises(UserError, match=key):
            train(cfg, run, data=data, progress=False)


def test_interrupted_swap_recovers_old_copy(finished, tmp_path, data):
    """A crash between 'last -> .last.old' and 'tmp -> last' leaves only .last.old: it is used."""
    run = _copy(finished[0], tmp_path)
    (run / "checkpoints" / "last").rename(run / "checkpoints" / ".last.old")
    assert checkpoint_path(run, "last").name == ".last.old"
    assert load_checkpoint(checkpoint_path(run, "last")).step == 12


def test_failed_write_keeps_previous_checkpoint(finished, tmp_path):
    run = _copy(finished[0], tmp_path)
    last = run / "checkpoints" / "last"
    before = (last / "model.safetensors").read_bytes()
    ck = load_checkpoint(last)
    bad = {"x": torch.zeros(2), "y": "not a tensor"}  # save_file raises part-way
    with pytest.raises(Exception):
        save_checkpoint(last, bad, ck.config, {"step": 99})
    assert (last / "model.safetensors").read_bytes() == before and load_checkpoint(last).step == 12
    assert not list((run / "checkpoints").glob(".*"))


def test_bad_input_errors(tmp_path, data, finished):
    short = TokenData.from_arrays(np.arange(10) % V, np.arange(40) % V, np.arange(40) % V, V, 0)
    with pytest.raises(UserError, match="model.train_length"):
        train(tiny_cfg(), tmp_path / "short", data=short, progress=False)
    with pytest.raises(UserError, match="fp16 needs a CUDA"):
        train(tiny_cfg("train.precision=fp16"), tmp_path / "fp16", data=data, progress=False)
    zero = tiny_cfg()
    zero.train.steps = 0  # past config validation: train() checks it again
    with pytest.raises(UserError, match="train.steps"):
        train(zero, tmp_path / "zero", data=data, progress=False)
    with pytest.raises(UserError, match="no 'best' checkpoint"):
        load_model(tmp_path / "nothing")


def test_module_entry_reports_one_line_errors(capsys):
    from extrapolab.train.__main__ import main

    assert main(["--set", "train.steps=0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.steps must be >= 1") and err.count("\n") == 1
    assert main(["--set", "train.strategy=zero3", "--no-progress"]) == 2
    assert "unknown train.strategy 'zero3'" in capsys.readouterr().err


def test_pos_lr_scale_gives_the_scheme_its_own_learning_rate():
    from extrapolab.config import TrainConfig
    from extrapolab.train.optim import build_optimizer, set_lr

    model = GPT(ModelConfig(vocab_size=64, layers=1, heads=2, dim=16, scheme="t5", train_length=16))
    opt = build_optimizer(model, TrainConfig(lr=1e-3, pos_lr_scale=20.0))
    set_lr(opt, 5e-4)
    pos = [g for g in opt.param_groups if g.get("lr_scale")]
    assert len(pos) == 1 and pos[0]["params"] == [model.scheme.table] and pos[0]["weight_decay"] == 0.0
    assert pos[0]["lr"] == pytest.approx(1e-2) and {g["lr"] for g in opt.param_groups if g is not pos[0]} == {5e-4}
    # default: no separate group, every parameter at the schedule's rate
    plain = build_optimizer(model, TrainConfig(lr=1e-3))
    assert len(plain.param_groups) == 2
    ape = GPT(ModelConfig(vocab_size=64, layers=1, heads=2, dim=16, scheme="learned", train_length=16))
    assert len(build_optimizer(ape, TrainConfig(pos_lr_scale=20.0)).param_groups) == 2  # an embedding: model rate
    with pytest.raises(UserError, match="pos_lr_scale must be > 0"):
        build_optimizer(model, TrainConfig(pos_lr_scale=0.0))

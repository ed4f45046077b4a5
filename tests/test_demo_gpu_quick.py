"""`extrapolab demo --preset gpu-quick`: the preset states a short-GPU-slot setting (GPT-2-small shape at
L_tr = 512 on the node's own stdlib, seven schemes, E1/E3 to 16x L_tr), and sweep.time_budget_s makes
a sweep stop between runs and resume across separate commands (checked on the CPU, shrunk)."""
import sqlite3

import pytest

from extrapolab.config import load_preset
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.sweep.sweep import load_sweep, run_sweep

SCHEMES = ["none", "sinusoidal", "rotary", "alibi", "t5", "kerple-log", "sandwich"]


def test_gpu_quick_preset_is_gpt2_small_at_512_on_the_stdlib():
    cfg, spec = load_sweep("demo-gpu-quick")
    m = cfg.model
    assert (m.layers, m.dim, m.heads, m.train_length) == (12, 768, 12, 512) and m.dim // m.heads == 64
    assert cfg.data.corpus == "stdlib" and spec.datasets == ["stdlib"]  # nothing to download on the node
    assert [s.label for s in spec.schemes] == SCHEMES
    assert max(cfg.eval.lengths) == 8192 and {"nonoverlapping", "last_token"} <= set(cfg.eval.protocols)
    assert 0 < spec.time_budget_s < 600  # each command fits a 10-minute job
    # the levers of an 8-minute demo: every run at once on the one GPU, evaluation without FlexAttention compiles
    assert spec.engine.runs_per_device == len(SCHEMES) and cfg.eval.attention == "sdpa"
    assert cfg.train.device == "cuda"  # a GPU preset: without a GPU, one line unless --device cpu
    budget = load_preset("demo-gpu-quick")["sweep"]["budget"]
    tokens = cfg.train.batch_size * cfg.train.grad_accum * m.train_length
    params = GPT(ModelConfig(**{**m.to_dict(), "vocab_size": cfg.data.vocab_size, "scheme": "none"})).num_params()
    assert f"{params / 1e6:.1f}M parameters" in budget and f"{tokens:,} tokens" in budget
    assert f"{tokens * cfg.train.steps / 1e6:.1f}M tokens per run" in budget and "not measured" in budget


@pytest.mark.parametrize("workers", [1, 2])
def test_time_budget_stops_between_runs_and_the_same_command_resumes(tmp_path, workers):
    """A budget shorter than one run: each invocation trains exactly one run (never none; with parallel
    workers too: no run is handed out that would end past the budget), writes a report of what is done,
    and the last one completes the sweep with its cost section."""
    over = [f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer=bytes", "data.max_bytes=200000",
            "model.layers=1", "model.heads=2", "model.dim=32", "model.train_length=32", "model.dropout=0",
            "train.steps=2", "train.batch_size=2", "train.warmup_steps=1", "train.eval_every=2",
            "train.eval_batches=1", "train.checkpoint_every=2", "train.device=cpu", "train.threads=1",
            "eval.lengths=[32,64]", "eval.num_tokens=256", "eval.last_token_n=2", "sweep.cost_rounds=1",
            "sweep.schemes=[none,alibi]", "sweep.reference=alibi", "sweep.time_budget_s=0.001",
            f"sweep.workers={workers}"]
    out = tmp_path / "out"
    first = run_sweep("demo-gpu-quick", out=out, overrides=over, progress=False)
    con = sqlite3.connect(out / "results.sqlite")
    assert first["runs_left"] == 1 and (out / "report.html").is_file()
    assert con.execute("SELECT COUNT(*) FROM runs WHERE status='done'").fetchone()[0] == 1
    second = run_sweep("demo-gpu-quick", out=out, overrides=over, progress=False)
    assert second["runs_left"] == 0
    assert con.execute("SELECT COUNT(*) FROM runs WHERE status='done'").fetchone()[0] == 2
    assert "cost_bench" in {k for (k,) in con.execute("SELECT key FROM meta")}

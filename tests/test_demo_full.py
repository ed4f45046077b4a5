"""`extrapolab demo --preset full` (alias paper): the preset states the papers' setting, validates without
its corpus installed, and runs end to end on the CPU when shrunk (a synthetic Linux tarball, 2 steps)."""
import sqlite3

import pytest
import yaml
from typer.testing import CliRunner

from extrapolab.cli.main import app
from extrapolab.config import load_preset, preset_names, resolve
from extrapolab.sweep.sweep import load_sweep

from test_data_linux import EXTRA, _files, _tarball

SCHEMES = ["none", "sinusoidal", "rotary", "t5", "alibi", "kerple-log", "sandwich"]


def test_full_preset_is_the_papers_setting():
    cfg, spec = load_sweep("demo-full")
    m = cfg.model
    assert (m.layers, m.dim, m.heads, m.train_length) == (12, 768, 12, 512)
    assert [s.label for s in spec.schemes] == SCHEMES and spec.datasets == ["linux"]
    assert max(cfg.eval.lengths) == 16 * m.train_length and {"nonoverlapping", "last_token"} <= set(cfg.eval.protocols)
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * m.train_length
    budget = load_preset("demo-full")["sweep"]["budget"]
    assert f"{tokens_per_step:,} tokens" in budget and f"{cfg.train.steps} steps" in budget
    assert f"{tokens_per_step * cfg.train.steps / 1e6:.0f}M tokens" in budget and "not measured" in budget


@pytest.mark.slow
def test_shrunk_full_demo_runs_end_to_end_on_cpu(tmp_path):
    tar = _tarball(tmp_path / "linux-source-6.1.tar.xz", {**_files(80), **EXTRA})
    over = ["train.steps=2", "train.warmup_steps=1", "train.eval_every=1", "train.eval_batches=1",
            "train.checkpoint_every=2", "train.batch_size=2", "train.grad_accum=2", "train.threads=1",
            "model.layers=1", "model.heads=2", "model.dim=16", "model.train_length=16",
            "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}", f"sweep.datasets=[linux:{tar}]",
            "eval.lengths=[16,32,64,128,256]", "eval.num_tokens=512", "eval.last_token_n=2",
            "eval.erf_length=64", "eval.erf_segments=1"]
    argv = ["demo", "--preset", "paper", "--out", str(tmp_path / "out"), "--device", "cpu", "--dtype", "fp32"]
    res = CliRunner().invoke(app, argv + [x for o in over for x in ("--set", o)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    con = sqlite3.connect(out / "results.sqlite")
    assert sorted(r for (r,) in con.execute("SELECT label FROM runs WHERE status='done'")) == sorted(SCHEMES)
    ppl = con.execute("SELECT COUNT(DISTINCT length) FROM results WHERE protocol='last_token' AND metric='ppl'")
    assert ppl.fetchone()[0] == 5
    saved = yaml.safe_load((out / "sweep-config.yaml").read_text())
    assert saved["train"]["device"] == "cpu" and saved["train"]["precision"] == "fp32"
    assert (out / "report.html").is_file()


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    raw = load_preset(name)
    if "sweep" in raw:
        load_sweep(name)
    elif "align" in raw:
        from extrapolab.align.experiment import load_align_preset

        load_align_preset(name)
    elif "rope" in raw:
        from extrapolab.align.rope_study import load_rope_preset

        load_rope_preset(name)
    elif "ruler" in raw:
        from extrapolab.tasks.ruler.run import load_spec

        spec, _ = load_spec(name, [])
        assert spec.budget and spec.n >= 1
    elif "extend" in raw:
        from extrapolab.extend.spec import load_extend_preset

        load_extend_preset(name)
    else:
        resolve(name)

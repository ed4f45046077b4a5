"""Config resolution, CLI errors and the scheme listing."""
import json
import re
import subprocess
import sys

import pytest

from extrapolab import config as C
from extrapolab.positional import REGISTRY

CLI = [sys.executable, "-m", "extrapolab.cli.main"]


def run_cli(*args, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def test_overrides_are_typed():
    cfg = C.resolve("demo-smoke", ["train.steps=5", "eval.lengths=[32,64]", "model.scheme=windowed", "model.scheme_params={window: 7}",
                                   "train.betas=[0.8,0.9]", "train.compile=false"])
    assert cfg.train.steps == 5 and cfg.eval.lengths == [32, 64]
    assert cfg.model.scheme_params == {"window": 7} and cfg.train.betas == (0.8, 0.9)
    assert cfg.train.compile is False


@pytest.mark.parametrize("override, needle", [
    (["train.stpes=5"], "did you mean config.train.steps"),
    (["train.steps=abc"], "train.steps must be int"),
    (["model.layers=2.5"], "model.layers must be int"),
    (["nonsense"], "must look like a.b=c"),
    (["eval.erf_length=-1"], "eval.erf_length must be >= 0 (0 = off)"),
    (["eval.erf_segments=0"], "eval.erf_segments >= 1"),
    (["eval.trf_eps=1.5"], "eval.trf_eps in (0, 1)"),
])
def test_bad_overrides_name_the_fix(override, needle):
    with pytest.raises(C.ConfigError, match=re.escape(needle)):
        C.resolve(None, override)


def test_config_round_trip_and_version(tmp_path):
    cfg = C.resolve("demo-quick", ["model.scheme=t5"])
    C.save(cfg, tmp_path / "config.yaml")
    assert C.load(tmp_path / "config.yaml") == cfg
    text = (tmp_path / "config.yaml").read_text().replace("version: 1", "version: 99")
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(C.ConfigError, match="upgrade extrapolab"):
        C.load(tmp_path / "config.yaml")


def test_schemes_lists_every_scheme_with_its_paper():
    res = run_cli("schemes", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert {r["name"] for r in rows} == set(REGISTRY)
    # every row cites its source (a paper with a year, the thesis, or a section/equation) ...
    assert all(re.search(r"(19|20)\d\d|thesis|§|eq\.", r["paper"]) for r in rows), rows
    # ... in the user's terms, not internal labels such as "S6"
    assert not [r["paper"] for r in rows if re.search(r"\bS\d+\b", r["paper"])]
    assert all(r["summary"] for r in rows)


@pytest.mark.parametrize("args, needle", [
    (["train", "--set", "model.scheme=alibbi", "--set", "train.steps=1"], "did you mean 'alibi'"),
    (["train", "--preset", "nope"], "unknown preset 'nope'"),
    (["eval", "/nonexistent/run"], "not a run folder"),
    (["sweep", "/nonexistent/sweep.yaml"], "not found"),
    (["report", "/nonexistent/dir"], "no results.sqlite"),
])
def test_cli_bad_input_is_one_line(args, needle, tmp_path):
    res = run_cli(*args, cwd=tmp_path)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr

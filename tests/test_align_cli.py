"""`extrapolab align RUN`, `align temperature|retrieval` on a tiny trained run (bytes tokenizer, a few steps)."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from extrapolab.cli import align as C
from extrapolab.cli.main import app as main_app
from extrapolab.config import resolve
from extrapolab.data import TokenData
from extrapolab.align.algorithm import load_temperature
from extrapolab.tasks.retrieval import retrieval_stream
from extrapolab.train import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    s = retrieval_stream("mix", 30000, 128, seed=0).astype(np.uint16)
    data = TokenData.from_arrays(s[:24000], s[24000:27000], s[27000:], vocab_size=257, eot_id=256)
    # the run's own data settings (what the CLI re-prepares): 40 small text files, bytes, a tmp cache
    docs = tmp_path_factory.mktemp("docs")
    for i in range(40):
        piece = s[i * 700:(i + 1) * 700]
        (docs / f"d{i:02d}.txt").write_bytes(piece[piece < 128].astype(np.uint8).tobytes())
    cache = tmp_path_factory.mktemp("cache")
    cfg = resolve(None, [f"data.corpus=path:{docs}", "data.tokenizer=bytes", f"data.cache_dir={cache}",
                         "data.valid_percent=30", "data.test_percent=30",
                         "model.layers=2", "model.heads=2", "model.dim=16", "model.train_length=32",
                         "model.scheme=t5", "model.vocab_size=257", "train.steps=4", "train.batch_size=4",
                         "train.warmup_steps=1", "train.eval_every=4", "train.checkpoint_every=4",
                         "train.eval_batches=1", "train.precision=fp32", "eval.lengths=[32,64,128]"])
    path = tmp_path_factory.mktemp("runs") / "t5"
    train(cfg, path, data=data, progress=False)
    return path, data


def test_temperature_then_retrieval(run):
    path, data = run
    out = C.align_cmd(path, None, segments=1, data=data, say=lambda m: None)
    saved = json.loads((path / "temperature.json").read_text())
    assert saved["lengths"] == [64, 128] and saved["train_length"] == 32 and saved["scheme"] == "t5"
    assert load_temperature(path, 128, "pmax") == saved["tau"]["pmax"]["128"]
    assert (path / "temperature.png").is_file() and (path / "temperature.svg").is_file()
    assert "w/ H" in out["table"]
    res = C.retrieval_cmd(path, "passkey", [112, 128], depths=[0.0, 1.0], n=1, rules=["none", "pmax"],
                          preamble=False, data=data)
    recs = json.loads((path / "retrieval-passkey.json").read_text())["records"]
    assert len(recs) == 2 * 2 * 2 and {r["rule"] for r in recs} == {"none", "pmax"}
    want = {(112, load_temperature(path, 112, "pmax")), (128, saved["tau"]["pmax"]["128"])}
    assert {(r["length"], r["tau"]) for r in recs if r["rule"] == "pmax"} == want
    assert "| pmax |" in res["table"] and (path / "retrieval-passkey.svg").is_file()


def test_cli_errors_are_one_line(tmp_path, run):
    r = CliRunner().invoke(C.app, ["temperature", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "error:" in r.output and "Traceback" not in r.output
    path, data = run
    with pytest.raises(Exception, match="no entropy temperature for length 4096"):
        C.retrieval_cmd(path, "kv", [4096], rules=["entropy"], data=data)


def test_align_run_form_is_algorithm_1(run):
    """`extrapolab align RUN --lengths ...` (the issue's form) = `align temperature RUN ...`."""
    path, _ = run
    (path / "temperature.json").unlink(missing_ok=True)
    r = CliRunner().invoke(main_app, ["align", str(path), "--lengths", "48,96", "--segments", "1"])
    assert r.exit_code == 0, r.output
    saved = json.loads((path / "temperature.json").read_text())
    assert saved["lengths"] == [48, 96] and set(saved["tau"]) == {"pmax", "entropy", "length", "prop51", "prop52"}
    assert "| w/ P_max |" in r.output and "temperature.svg" in r.output
    first = saved["tau"]
    r = CliRunner().invoke(main_app, ["align", "temperature", str(path), "--lengths", "48,96", "--segments", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads((path / "temperature.json").read_text())["tau"] == first  # same seed, same result
    assert load_temperature(path, 96, "entropy") == first["entropy"]["96"]


def test_align_group_help_and_errors(tmp_path):
    r = CliRunner().invoke(main_app, ["align", "--help"])
    assert r.exit_code == 0
    for verb in ("temperature", "retrieval", "hf-t5", "experiment"):
        assert verb in r.output
    assert "RUN" in r.output
    r = CliRunner().invoke(main_app, ["align", str(tmp_path / "nothing-here"), "--lengths", "64"])
    assert r.exit_code == 2 and r.output.count("error:") == 1 and "Traceback" not in r.output
    r = CliRunner().invoke(main_app, ["align", "experiment", "--preset", "align-smoke", "--set", "align.lengths=[64]"])
    assert r.exit_code == 2 and "must all exceed model.train_length=128" in r.output

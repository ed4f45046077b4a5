"""`extrapolab eval|align|align retrieval|analyze erf hf:PATH` and `sweep` with `models:` on tiny
random HF models saved to a folder (no download), loaded exactly as a user would."""
import json

import pytest
import yaml
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, TEXT, save_tiny  # noqa: E402

from extrapolab.cli.main import app  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfcli")
    docs = root / "docs"
    docs.mkdir()
    for i in range(24):
        (docs / f"d{i:02d}.txt").write_text(f"doc {i}\n" + TEXT[i * 40:] + TEXT[: i * 40])
    data = [f"data.corpus=path:{docs}", f"data.cache_dir={root / 'cache'}", "data.test_percent=40",
            "data.valid_percent=10"]
    return {"root": root, "llama": save_tiny("llama", root / "llama"), "gpt2": save_tiny("gpt2", root / "gpt2"),
            "sets": [x for kv in data for x in ("--set", kv)], "data": data}


def _run(args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_eval_all_protocols_then_auto_temperature(env, tmp_path):
    out = tmp_path / "out"
    r = _run(["eval", f"hf:{env['llama']}", "--lengths", "16,96", "--protocol", "nonoverlapping", "--protocol",
              "sliding", "--protocol", "last_token", "--protocol", "positionwise", "--out", out, "--device", "cpu",
              "--dtype", "fp32", *env["sets"], "--set", "eval.last_token_n=4", "--set", "eval.position_segments=2",
              "--set", "eval.num_tokens=400"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "eval.json").read_text())
    assert res["model"]["family"] == "llama" and res["lengths"] == [16, MAXPOS, 96]
    for p in ("nonoverlapping", "sliding", "last_token"):
        assert all(res["ppl"][p][str(L)] > 1 for L in (16, MAXPOS, 96)), p
    assert len(res["positionwise"]["nll"]) == 96 and res["verdict"]["nonoverlapping"]
    r = _run(["align", f"hf:{env['llama']}", "--lengths", "96", "--segments", "1", "--out", out, "--device", "cpu",
              *env["sets"]])
    assert r.exit_code == 0, r.output
    tau = json.loads((out / "temperature.json").read_text())
    assert tau["model"]["source"].startswith("hf:") and 0.5 <= tau["tau"]["pmax"]["96"] <= 1.0
    assert (out / "temperature.png").is_file()
    r = _run(["eval", f"hf:{env['llama']}", "--lengths", "96", "--protocol", "nonoverlapping", "--temperature",
              "auto", "--out", out, "--device", "cpu", *env["sets"], "--set", "eval.num_tokens=200"])
    assert r.exit_code == 0, r.output
    auto = json.loads((out / "eval-temperature-auto.json").read_text())
    assert auto["per_length_temperature"]["96"] == pytest.approx(tau["tau"]["pmax"]["96"])
    r = _run(["align", "retrieval", f"hf:{env['llama']}", "--lengths", "96", "--depths", "0.5", "--n", "1",
              "--rules", "none,pmax", "--out", out, "--device", "cpu", "--no-preamble"])
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "retrieval-passkey.json").read_text())["records"]
    assert [x["rule"] for x in rec] == ["none", "pmax"] and rec[1]["tau"] == pytest.approx(tau["tau"]["pmax"]["96"])


def test_learned_positions_refuse_with_exit_2(env):
    r = CliRunner().invoke(app, ["eval", f"hf:{env['gpt2']}", "--lengths", str(MAXPOS + 16), "--device", "cpu",
                                 *env["sets"]])
    assert r.exit_code == 2
    err = r.output.strip().splitlines()
    assert len(err) == 1 and f"<= {MAXPOS}" in err[0] and "learned absolute positions" in err[0]


@pytest.mark.parametrize("args", [["eval", "hf:/no/such/folder"], ["align", "hf:/no/such/folder"],
                                  ["eval", "hf:{gpt2}", "--rope", "linear:4"],
                                  ["eval", "hf:{gpt2}", "--protocol", "cached"],  # E5 on hf: RoPE models only
                                  ["eval", "hf:{llama}", "--temperature", "auto", "--out", "{root}/none"],
                                  ["align", "retrieval", "hf:{llama}", "--rules", "pmax", "--out", "{root}/none"]])
def test_bad_input_is_one_line(env, args):
    args = [a.format(gpt2=env["gpt2"], llama=env["llama"], root=env["root"]) for a in args]
    sets = [] if args[1] == "retrieval" else env["sets"]  # retrieval builds its prompts, reads no corpus
    r = CliRunner().invoke(app, [*args, "--device", "cpu", *sets])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output


def test_erf_of_hf_next_to_nothing_else(env, tmp_path):
    r = _run(["analyze", "erf", f"hf:{env['gpt2']}", "--length", "33", "--segments", "2", "--out", tmp_path,
              "--json", "--device", "cpu", *env["sets"]])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)["runs"][0]
    assert rec["L_ex"] == 33 and 1 <= rec["erf_tokens"] <= 32 and (tmp_path / "erf.png").is_file()


def test_sweep_lists_hf_models_next_to_runs(env, tmp_path):
    cfg = {"name": "mix", "out_dir": str(tmp_path),
           "model": {"layers": 1, "heads": 2, "dim": 16, "train_length": 32},
           "data": {"tokenizer": "bytes", **{kv.split("=", 1)[0][5:]: kv.split("=", 1)[1] for kv in env["data"]}},
           "train": {"steps": 2, "batch_size": 2, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
                     "checkpoint_every": 2, "precision": "fp32", "device": "cpu"},
           "eval": {"protocols": ["nonoverlapping", "positionwise"], "lengths": [32, 64], "num_tokens": 256,
                    "position_segments": 2},
           "sweep": {"schemes": ["alibi"], "seeds": [0], "datasets": [f"path:{env['root'] / 'docs'}"],
                     "models": [f"hf:{env['llama']}", {"source": f"hf:{env['llama']}", "rope": "yarn:2"}]}}
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _run(["sweep", path, "--out", tmp_path / "sw"])
    assert r.exit_code == 0, r.output
    from extrapolab.report.db import ResultsDB

    db = ResultsDB(tmp_path / "sw" / "results.sqlite")
    labels = {row[2] for row in db.scalars("nonoverlapping")}
    assert labels == {"alibi", "hf:llama", "hf:llama+yarn:2"}
    report = (tmp_path / "sw" / "report.md").read_text()
    assert "| L_ex | alibi | hf:llama | hf:llama+yarn:2 |" in report  # one table, runs and models side by side

"""`extrapolab align experiment` end to end at smoke scale: train, align, perplexity, retrieval, report."""
import csv
import json
import math

import pytest
from typer.testing import CliRunner

from extrapolab.cli.main import app
from extrapolab.data import prepare
from extrapolab.align.algorithm import GRID, load_temperature
from extrapolab.io import UserError
from extrapolab.align.experiment import load_align_preset, run_align_experiment

RULES = ["none", "pmax", "entropy", "length", "prop51", "prop52"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("align")
    over = [f"data.cache_dir={tmp / 'cache'}"]
    res = run_align_experiment("align-smoke", out=tmp / "out", overrides=over, progress=False)
    return tmp, over, res


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_report_files_and_tables(smoke):
    _, _, res = smoke
    out, r = res["out"], res["results"]
    assert r["config"]["model"]["scheme"] == "t5" and r["config"]["model"]["train_length"] == 128
    assert r["mixture"]["retrieval_train_tokens"] == 50000 and r["mixture"]["corpus_train_tokens"] <= 100000
    # temperatures: one per (rule, L_ex); Algorithm 1's are grid values, the length rule is exact
    t = _rows(out / "temperature.csv")
    assert [(x["rule"], x["length"]) for x in t] == [(k, "256") for k in ("pmax", "entropy", "length", "prop51", "prop52")]
    taus = {x["rule"]: x["tau"] for x in t}
    assert float(taus["pmax"]) in GRID and float(taus["entropy"]) in GRID
    assert math.isclose(float(taus["length"]), math.log(128) / math.log(256))
    assert load_temperature(out / "run", 256, "pmax") == float(taus["pmax"])
    # perplexity: 6 rules x (L_tr, L_ex); tau=1 at L_tr for every rule, so the same number there
    p = _rows(out / "ppl.csv")
    assert [(x["rule"], x["length"]) for x in p] == [(k, L) for k in RULES for L in ("128", "256")]
    at_tr = {x["ppl"] for x in p if x["length"] == "128"}
    assert len(at_tr) == 1 and 1.0 < float(at_tr.pop()) < 1e4
    for x in p:
        if x["rule"] == "none":
            assert float(x["tau"]) == 1.0 and float(x["ppl_over_tau1"]) == 1.0
        if x["tau"]:
            assert 1.0 < float(x["ppl"]) < 1e4 and float(x["tau"]) == r["ppl"][x["rule"]][x["length"]]["tau"]
    # retrieval: every (task, rule with a tau, length, depth) cell holds n=2 scored examples
    rr = _rows(out / "retrieval.csv")
    for task in ("passkey", "kv"):
        cells = {(x["rule"], x["length"], x["depth"]) for x in rr if x["task"] == task}
        assert {(k, L, d) for k in ("none", "pmax", "length") for L in ("128", "256") for d in ("0.0", "1.0")} <= cells
        assert all(x["n"] == "2" and 0 <= float(x["accuracy"]) <= 1 for x in rr if x["task"] == task)
        assert len(r["retrieval"][task]) == 2 * len(cells)
        md = (out / f"retrieval-{task}.md").read_text()
        assert "| none |" in md and "| pmax |" in md and "rule \\ depth" in md
        for ext in ("png", "svg"):
            assert (out / "figures" / f"retrieval-{task}.{ext}").stat().st_size > 1000
    summary = (out / "summary.md").read_text().splitlines()
    assert summary[0].startswith("| rule | ppl @ 256 |") and "passkey acc > L_tr (%)" in summary[0]
    assert len(summary) == 2 + len(RULES) + 2 and summary[2].startswith("| none (τ=1) |")
    assert summary[-1].startswith("| Alg. 1 H on task prompts | n/a | n/a |")
    # Algorithm 1 on each task's prompts: grid values per L_ex, used by the rules <mode>@task
    for task in ("passkey", "kv"):
        tt = r["task_taus"][task]
        assert set(tt) == {"pmax", "entropy"} and all(tt[m]["256"] in GRID for m in tt)
        assert {x["tau"] for x in rr if x["task"] == task and x["rule"] == "pmax@task" and x["length"] == "256"} \
            == {str(tt["pmax"]["256"])}
    assert "| kv | Alg. 1 H |" in (out / "temperature-tasks.md").read_text()
    for f in ("temperature.png", "temperature.svg", "ppl.png", "ppl.svg"):
        assert (out / "figures" / f).stat().st_size > 1000
    html = (out / "report.html").read_text()
    for needle in ("align-smoke", "budget: smoke", "Wall time", "The result", "Chosen temperatures",
                   "Perplexity beyond L_tr", "on the retrieval prompts themselves", "Retrieval: passkey", "Retrieval: kv", "Trained model"):
        assert needle in html, needle
    assert html.count("data:image/png;base64,") == 4  # temperature, ppl, two heat maps
    assert (out / "report.md").read_text().count("![](figures/") == 4
    h = r["data"]["corpus_hash"]  # the corpus it read, the one the prepared data names (data/origin.py)
    data = prepare(load_align_preset("align-smoke", smoke[1])[0].data, progress=False)
    assert h == json.loads((data.path / "meta.json").read_text())["corpus_hash"]
    assert f"corpus {r['config']['data']['corpus']}: sha256 {h[:12]}… of its manifest" in (out / "report.md").read_text()


def test_rerun_reuses_training_and_stages(smoke):
    tmp, over, res = smoke
    again = run_align_experiment("align-smoke", out=res["out"], overrides=over, progress=False)
    assert again["results"]["ppl"] == res["results"]["ppl"]
    assert again["results"]["retrieval"] == json.loads(json.dumps(res["results"]["retrieval"]))
    assert again["results"]["train"]["steps"] == 6 and again["wall_s"] < res["wall_s"]
    with pytest.raises(UserError, match="another mixture"):
        run_align_experiment("align-smoke", out=res["out"], overrides=over + ["align.task_ratio=0.25"], progress=False)


def test_align_run_on_the_experiment_run(smoke):
    """The experiment's run folder works with `extrapolab align RUN` and `eval --temperature auto`."""
    _, _, res = smoke
    run = res["out"] / "run"
    r = CliRunner().invoke(app, ["align", str(run), "--lengths", "192,256", "--segments", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads((run / "temperature.json").read_text())["lengths"] == [192, 256]
    r = CliRunner().invoke(app, ["eval", str(run), "--protocol", "nonoverlapping", "--lengths", "128,256",
                                 "--temperature", "auto", "--set", "eval.num_tokens=512"])
    assert r.exit_code == 0, r.output
    saved = json.loads((run / "eval-temperature-auto.json").read_text())
    assert float(saved["per_length_temperature"]["128"]) == 1.0
    assert float(saved["per_length_temperature"]["256"]) == load_temperature(run, 256, "pmax")


def test_preset_errors():
    with pytest.raises(UserError, match="align.lengths must all exceed"):
        load_align_preset("align-smoke", ["align.lengths=[64]"])
    with pytest.raises(UserError, match="unknown alignment rule"):
        load_align_preset("align-smoke", ["align.rules=[none,bogus]"])
    with pytest.raises(Exception, match="unknown config key align.nn"):
        load_align_preset("align-smoke", ["align.nn=3"])
    cfg, spec = load_align_preset("align-quick")
    assert cfg.model.scheme == "t5" and spec.retrieval_lengths == [256, 512, 1024, 2048]

"""`extrapolab align rope` end to end at smoke scale: one rotary run, every method swapped in, report."""
import csv
import json
import math

import pytest
from typer.testing import CliRunner

from extrapolab.align.rope_methods import method_setup
from extrapolab.align.rope_study import load_rope_preset, run_rope_study
from extrapolab.cli.main import app
from extrapolab.io import UserError

METHODS = "[rope,pi,dynamic,yarn,pmax,length,selfextend,rerope]"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rope")
    over = [f"data.cache_dir={tmp / 'cache'}", f"rope.methods={METHODS}"]
    res = run_rope_study("rope-smoke", out=tmp / "out", overrides=over, progress=False)
    return tmp, over, res


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_report_tables_and_figures(smoke):
    _, _, res = smoke
    out, methods = res["out"], res["results"]["methods"]
    assert list(methods) == ["rope", "pi", "dynamic", "yarn", "pmax", "length", "selfextend", "rerope"]
    for name in ("summary.md", "ppl.md", "ppl.csv", "passkey.csv", "erf.csv", "temperature.csv", "report.md",
                 "results.json", "run/temperature.json"):
        assert (out / name).is_file(), name
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3  # ppl, passkey, ERF
    for needle in ("RoPE (plain)", "YaRN", "dynamic NTK", "Alg. 1 P_max", "1/f", "rope-smoke", "Wall time"):
        assert needle in html, needle
    ppl = {(r["method"], int(r["length"])): float(r["ppl"]) for r in _rows(out / "ppl.csv")}
    # at L_tr every method but ReRoPE (w = L_tr/8 caps distances) is plain RoPE (s = 1, tau = 1,
    # Self-Extend G = 1): the same weights give the same perplexity
    at_tr = {m: ppl[(m, 128)] for m in methods if m != "rerope"}
    assert max(at_tr.values()) - min(at_tr.values()) < 1e-4 * at_tr["rope"], at_tr
    assert ppl[("pi", 256)] != ppl[("rope", 256)] and ppl[("yarn", 256)] != ppl[("pi", 256)]
    assert all(math.isfinite(v) and v > 1 for v in ppl.values())
    erf = _rows(out / "erf.csv")
    assert all(0 < int(r["erf"]) <= int(r["length"]) for r in erf)
    cell = methods["yarn"]["256"]
    assert cell["options"]["factor"] == 2.0 and cell["options"]["original_length"] == 128
    assert len(cell["passkey"]) == 2  # n=1 x 2 depths
    se = methods["selfextend"]
    assert se["128"]["options"]["G"] == 1 and se["256"]["options"] == {
        "w": 32, "G": 3, "original_length": 128, "logn": False, "base": 10000.0}
    assert se["256"]["max_length"] == (128 - 32) * 3 + 32 >= 256
    assert ppl[("rerope", 256)] != ppl[("rope", 256)] and "Self-Extend" in html


def test_temperature_table_puts_yarn_next_to_the_thesis_rules(smoke):
    _, _, res = smoke
    row = _rows(res["out"] / "temperature.csv")[0]
    f = 0.1 * math.log(2.0) + 1
    assert float(row["yarn_f"]) == pytest.approx(f) and float(row["yarn_tau"]) == pytest.approx(1 / f ** 2)
    assert float(row["length_rule_tau"]) == pytest.approx(math.log(128) / math.log(256))
    assert 0.5 <= float(row["pmax_tau"]) <= 1.0
    assert res["results"]["methods"]["length"]["256"]["tau"] == pytest.approx(math.log(128) / math.log(256))


def test_rerun_reuses_training_and_stages_and_cli(smoke):
    tmp, over, res = smoke
    r = CliRunner().invoke(app, ["align", "rope", "--preset", "rope-smoke", "--out", str(res["out"]),
                                 *sum((["--set", o] for o in over), [])])
    assert r.exit_code == 0, r.output
    again = json.loads((res["out"] / "results.json").read_text())
    assert again["methods"] == json.loads(json.dumps(res["results"]["methods"]))
    assert again["wall_s"] < res["wall_s"] and "RoPE (plain)" in r.output


def test_method_setup_and_bad_presets():
    taus = {"pmax": {512: 0.8}, "length": {512: 0.7}}
    s, tau = method_setup("yarn", 128, 512, 4, taus)
    assert (s.name, s.factor, s.original_length, tau) == ("rotary-yarn", 4.0, 128, 1.0)
    s, tau = method_setup("yarn-ramp", 128, 512, 4, taus)
    assert s.attention_factor(512) == 1.0
    s, tau = method_setup("pmax", 128, 512, 4, taus)
    assert (s.name, tau) == ("rotary", 0.8)
    assert method_setup("entropy", 128, 512, 4, taus)[1] is None  # no tau: the cell is skipped
    assert method_setup("dynamic", 128, 512, 4, taus)[0].options()["original_length"] == 128
    s, tau = method_setup("rerope-leaky", 128, 512, 4, taus)
    assert (s.name, s.rule.window, s.rule.k, s.logn, tau) == ("rotary-rerope-leaky", 16, 16.0, True, 1.0)
    s = method_setup("logn", 128, 512, 4, taus)[0]
    assert (s.name, s.logn, s.original_length) == ("rotary", True, 128)
    assert method_setup("selfextend", 128, 2048, 4, taus)[0].max_length() >= 2048
    with pytest.raises(UserError, match="model.scheme=rotary"):
        load_rope_preset("rope-smoke", ["model.scheme=alibi"])
    with pytest.raises(UserError, match="unknown rope.methods"):
        load_rope_preset("rope-smoke", ["rope.methods=[rope,xpos]"])
    with pytest.raises(UserError, match="must all exceed"):
        load_rope_preset("rope-smoke", ["rope.lengths=[64]"])


@pytest.mark.parametrize("preset", ["rope-quick", "rope-smoke"])
def test_presets_load_with_lengths_beyond_l_tr(preset):
    cfg, spec = load_rope_preset(preset)
    L_tr = cfg.model.train_length
    assert cfg.model.scheme == "rotary" and min(spec.lengths) > L_tr
    if preset == "rope-quick":  # the study compares 2-16x L_tr
        assert [L // L_tr for L in spec.lengths] == [2, 4, 8, 16] and cfg.train.threads == 1

"""Derived sweep entries (`from: LABEL`): a run evaluated with its own eval overrides (xPos with
blockwise causal attention) and the NoPE head scale tuned on its source's run; the spec's one-line
errors; the modern-quick preset as written (every new scheme has a claim)."""
import json
import sqlite3

import pytest
import yaml

from extrapolab.io import UserError
from extrapolab.report.db import ResultsDB
from extrapolab.report.picture import CLAIMS
from extrapolab.sweep.spec import SweepSpec, load_sweep
from extrapolab.executor import Job, LocalExecutor
from extrapolab.sweep.execute import run_all
from extrapolab.sweep.job import run_job
from extrapolab.sweep.sweep import run_sweep

TINY = {
    "name": "derived-smoke", "out_dir": "reports",
    "model": {"layers": 2, "heads": 2, "dim": 16, "train_length": 16},
    "data": {"corpus": "stdlib", "tokenizer": "bytes", "max_bytes": 150000},
    "train": {"steps": 4, "batch_size": 4, "lr": 0.003, "warmup_steps": 1, "eval_every": 4, "eval_batches": 1,
              "checkpoint_every": 4, "log_every": 2},
    "eval": {"protocols": ["nonoverlapping"], "lengths": [16, 32, 64], "num_tokens": 512, "batch_size": 4},
    "sweep": {"schemes": ["none", "xpos", {"from": "xpos", "label": "xpos+bca", "eval": {"bca": True}}, "rotary",
                          {"from": "rotary", "label": "rotary-yarn(s=4)", "rope": {"scheme": "rotary-yarn",
                                                                                   "params": {"factor": 4}}},
                          {"from": "none", "label": "nope-headscale(tuned)",
                           "head_scale": {"steps": 3, "segments": 1, "grid": [1.0, 1.5]}}],
              "seeds": [0], "datasets": ["stdlib"], "reference": "none", "cost_rounds": 1},
}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("derived")
    preset = tmp / "derived.yaml"
    preset.write_text(yaml.safe_dump(TINY))
    over = [f"data.cache_dir={tmp / 'cache'}"]
    res = run_sweep(str(preset), out=tmp / "out", overrides=over, progress=False)
    return preset, over, res["out"]


def _e1(out, label):
    con = sqlite3.connect(out / "results.sqlite")
    rows = con.execute("SELECT s.length, s.value FROM results s JOIN runs r USING (run_id) WHERE r.label=? AND "
                       "s.protocol='nonoverlapping' AND s.metric='ppl'", (label,)).fetchall()
    return dict(rows)


def test_bca_entry_evaluates_its_source_run_with_blockwise_attention(swept):
    _, _, out = swept
    plain, bca = _e1(out, "xpos"), _e1(out, "xpos+bca")
    assert set(plain) == set(bca) == {16, 32, 64}
    assert bca[16] == pytest.approx(plain[16], rel=1e-6)  # at L <= L_tr blockwise causal attention is causal
    assert bca[64] != pytest.approx(plain[64], rel=1e-6)  # beyond it each block sees one block back only
    run = out / "runs" / "stdlib--xpos_bca--s0"
    assert (run / "eval.json").is_file() and not (run / "checkpoints").exists()  # the source's model, no copy
    assert json.loads((run / "eval.json").read_text())["nonoverlapping"]["64"]["ppl"] == pytest.approx(bca[64])


def test_head_scale_entry_tunes_its_source_and_records_what_it_measured(swept):
    _, _, out = swept
    db = ResultsDB(out / "results.sqlite")
    runs = {r["label"]: r for r in db.runs()}
    bench = db.meta()["cost_bench"]
    db.close()
    hs = runs["nope-headscale(tuned)"]
    assert hs["scheme"] == "nope-headscale" and hs["summary"]["derived_from"] == "stdlib--none--s0"
    rec = json.loads((out / "runs" / "stdlib--nope-headscale_tuned_--s0" / "head-scale.json").read_text())
    assert rec["length"] == 64 and rec["key"]["spec"]["ppl_tokens"] == 512  # the sweep's longest L_ex, num_tokens
    # the head-scale step's "after" perplexity is the entry's recorded E1 (same windows), "before" NoPE's
    assert _e1(out, "nope-headscale(tuned)")[64] == pytest.approx(rec["ppl_after"]["length"], rel=1e-5)
    assert _e1(out, "none")[64] == pytest.approx(rec["ppl_before"]["length"], rel=1e-5)
    assert list(bench["rows"]) == ["none", "xpos", "rotary"]  # derived entries are timed as their sources
    curves = sqlite3.connect(out / "results.sqlite").execute(
        "SELECT DISTINCT r.label FROM series s JOIN runs r USING (run_id) WHERE s.protocol='train'").fetchall()
    assert {c for (c,) in curves} == {"none", "xpos", "rotary"}  # no training curves of their own
    md = (out / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| xpos+bca | xPos with blockwise causal attention"))
    assert "rise over ppl at L_tr vs rotary" in row
    assert "| nope-headscale(tuned) | head-scale NoPE beats NoPE" in md


def test_rope_entry_reads_its_source_weights_with_another_rope_kind(swept):
    """rope: {scheme: rotary-yarn}: the rotary run's checkpoint, byte for byte, under the entry's scheme;
    its E1 is the source model's forward with YaRN's frequencies, not the source's."""
    import torch
    from safetensors.torch import load_file

    from extrapolab.eval import evaluate
    from extrapolab.train import load_model

    _, over, out = swept
    src, run = out / "runs" / "stdlib--rotary--s0", out / "runs" / "stdlib--rotary-yarn_s_4_--s0"
    model, cfg = load_model(run, which="best")
    assert cfg.model.scheme == "rotary-yarn" and cfg.model.scheme_params == {"factor": 4}
    a, b = load_file(str(src / "checkpoints/best/model.safetensors")), load_file(str(run / "checkpoints/best/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    yarn = _e1(out, "rotary-yarn(s=4)")
    source, _ = load_model(src, which="best")
    idx = torch.randint(0, 200, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # other frequencies and YaRN's attention factor: other logits from the same weights
        assert (model(idx) - source(idx)).abs().max() > 1e-5  # (4 training steps: small logits)
    from extrapolab.data import prepare

    tokens = prepare(cfg.data, progress=False).split("test")
    direct = evaluate(model, tokens, train_length=16, protocols=["nonoverlapping"], lengths=[64], num_tokens=512,
                      batch_size=4)
    assert direct["nonoverlapping"]["64"]["ppl"] == pytest.approx(yarn[64], rel=1e-5)


def test_resume_skips_derived_entries_and_a_missing_source_is_skipped(swept, tmp_path):
    preset, over, out = swept
    stamp = (out / "runs" / "stdlib--nope-headscale_tuned_--s0" / "head-scale.json").stat().st_mtime_ns
    run_sweep(str(preset), out=out, overrides=over, progress=False)
    assert (out / "runs" / "stdlib--nope-headscale_tuned_--s0" / "head-scale.json").stat().st_mtime_ns == stamp
    # the driver hands out a derived run only once its source run is done
    job = Job("stdlib--x--s0", run_job, (str(tmp_path), "stdlib--x--s0", {}, "[1/1] x",
                                         {"source": "stdlib--none--s0", "step": {}}), tag="[1/1] x")
    db, said = ResultsDB(tmp_path / "results.sqlite"), []
    with LocalExecutor([None]) as ex:
        assert run_all(ex, db, [], [(job, "stdlib--none--s0")], 0.0, 0.0, said.append) == 0
    db.close()
    assert said == ["[1/1] x: skipped, its source run stdlib--none--s0 is not done; re-run this sweep after it"]


@pytest.mark.parametrize("entries, needle", [
    (["none", {"from": "rotary", "label": "x"}], "from: must name the label of an earlier entry"),
    (["none", {"from": "none", "eval": {"bca": True}}], "needs its own label"),
    (["alibi", {"from": "alibi", "label": "hs", "head_scale": {}}], "head_scale needs a NoPE source"),
    (["none", {"from": "none", "label": "x", "params": {"a": 1}}], "no params/model/train of its own"),
    (["none", {"name": "rotary", "from": "none", "label": "x"}], "name must be 'none'"),
    (["none", {"name": "none", "label": "none"}], "appears twice"),
    (["none", {"name": "none", "label": "y", "head": 1}], "must be a name or"),
    (["alibi", {"from": "alibi", "label": "y", "rope": {"scheme": "rotary-yarn"}}], "re-reads a RoPE run"),
    (["rotary", {"from": "rotary", "label": "y", "rope": {"scheme": "alibi"}}], "another registered rotary kind"),
])
def test_bad_derived_entries_are_one_line(entries, needle):
    with pytest.raises(UserError, match=needle):
        SweepSpec.from_dict({"schemes": entries})


def test_head_scale_length_must_exceed_train_length(tmp_path):
    bad = {**TINY, "sweep": {**TINY["sweep"], "schemes": ["none", {"from": "none", "label": "hs",
                                                                  "head_scale": {"length": 8}}]}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(UserError, match="must exceed model.train_length=16"):
        load_sweep(str(tmp_path / "p.yaml"))


def test_modern_quick_preset_has_a_claim_for_every_new_scheme():
    base, spec = load_sweep("modern-quick")  # builds every scheme with the preset's options
    labels = [s.label for s in spec.schemes]
    keys = {c.scheme for c in CLAIMS}
    new = ["xpos", "xpos+bca", "rotary+random", "fox", "hybrid", "cope", "nope-headscale(tuned)", "fire",
           "dape-alibi", "dape-kerple", "dape-fire", "stick-breaking"]
    assert all(lb in labels for lb in new) and all(lb.split("(")[0] in keys for lb in new)
    assert spec.datasets == ["stdlib", "pydoc"] and spec.seeds == [0] and spec.reference == "rotary"
    assert max(base.eval.lengths) == 16 * base.model.train_length
    assert base.eval.erf_length == max(base.eval.lengths)
    assert set(base.eval.protocols) == {"nonoverlapping", "last_token"}


def test_layouts_quick_preset_has_a_claim_for_every_layout_and_rope_kind():
    base, spec = load_sweep("layouts-quick")  # builds every entry's model: each layout whole at 12 layers
    keys = {c.scheme for c in CLAIMS}
    labels = [s.label for s in spec.schemes]
    assert labels[:4] == ["none", "rotary", "alibi", "hybrid"]
    assert all(lb.split("(")[0] in keys for lb in labels[4:]) and len(labels) >= 11
    from extrapolab.sweep.spec import entry_config
    from extrapolab.model.gpt import build_scheme

    kinds = {s.label: build_scheme(entry_config(base, s).model) for s in spec.schemes if s.model}
    assert [kinds["gemma3"].type_of(i) for i in range(12)].count("full") == 2  # 5:1 whole at 12 layers
    assert [kinds["irope"].type_of(i) for i in range(12)].count("full") == 3
    assert max(base.eval.lengths) == 16 * base.model.train_length == base.eval.erf_length and base.eval.first_token


SMOKE = ["model.layers=2", "model.dim=32", "model.heads=2", "model.train_length=32", "data.tokenizer=bytes",
         "data.max_bytes=400000", "train.steps=6", "train.batch_size=4", "train.warmup_steps=2", "train.eval_every=6",
         "train.checkpoint_every=6", "train.log_every=3", "eval.lengths=[32,64,128]", "eval.num_tokens=1024",
         "eval.last_token_n=4", "eval.batch_size=4", "eval.erf_length=128", "sweep.datasets=[stdlib]",
         "sweep.cost_rounds=1"]


@pytest.mark.slow
def test_modern_quick_end_to_end_at_smoke_scale(tmp_path):
    """The preset itself with tiny --set overrides (code corpus only; ~1 min on 2 cores)."""
    res = run_sweep("modern-quick", out=tmp_path / "out", overrides=[f"data.cache_dir={tmp_path}", *SMOKE],
                    progress=False)
    db = ResultsDB(res["out"] / "results.sqlite")
    labels = [r["label"] for r in db.runs()]
    db.close()
    _, spec = load_sweep("modern-quick")
    assert sorted(labels) == sorted(s.label for s in spec.schemes)
    md = (res["out"] / "report.md").read_text()
    pic = md.split("## Does it show the papers' picture? — stdlib")[1].split("\n## ")[0]
    for label in ("alibi", "kerple-log", "xpos", "xpos+bca", "rotary+random", "fox", "hybrid", "cope",
                  "nope-headscale(tuned)", "fire", "dape-alibi", "dape-kerple", "dape-fire", "stick-breaking"):
        row = next(ln for ln in pic.splitlines() if ln.startswith(f"| {label} |"))
        assert row.rsplit("|", 2)[1].strip() in ("yes", "partly", "NO"), row


@pytest.mark.slow
def test_layouts_quick_end_to_end_at_smoke_scale(tmp_path):
    """layouts-quick with tiny --set overrides (12 layers kept, so every layout is whole; ~1.5 min on 2 cores):
    every entry recorded, a verdict per claim, the A6 rows, table and figure."""
    over = [f"data.cache_dir={tmp_path}", *[o for o in SMOKE if not o.startswith(("model.layers", "model.train_length",
                                                                                   "eval.lengths", "eval.erf"))],
            "model.train_length=64", "eval.lengths=[64,128]", "eval.erf_length=128"]
    res = run_sweep("layouts-quick", out=tmp_path / "out", overrides=over, progress=False)
    db = ResultsDB(res["out"] / "results.sqlite")
    labels = [r["label"] for r in db.runs()]
    masses = db.series("first_token", "mass")
    db.close()
    _, spec = load_sweep("layouts-quick")
    assert sorted(labels) == sorted(s.label for s in spec.schemes)
    assert {(row[2], row[4]) for row in masses} >= {("gemma3", 64), ("gemma3", 128)} and all(len(r[5]) == 12 for r in masses)
    md = (res["out"] / "report.md").read_text()
    pic = md.split("## Does it show the papers' picture? — stdlib")[1].split("\n## ")[0]
    for s in spec.schemes[4:]:
        row = next(ln for ln in pic.splitlines() if ln.startswith(f"| {s.label} |"))
        assert row.rsplit("|", 2)[1].strip() in ("yes", "partly", "NO"), row
    assert "## A6 attention on the first token per layer" in md and (res["out"] / "figures/first_token_stdlib.png").is_file()

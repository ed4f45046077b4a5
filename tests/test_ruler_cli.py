"""`extrapolab ruler` end to end: a tiny random Llama with a chat template (hf:DIR, greedy + teacher-forced),
a tiny extrapolab checkpoint (its bytes tokenizer, teacher-forced columns), resume per cell, and bad
input (one-line errors, exit 2, nothing written)."""
import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("wonderwords")
transformers = pytest.importorskip("transformers")

from ruler_tiny import essay_text, save_llama  # noqa: E402

from extrapolab import config as C  # noqa: E402
from extrapolab.cli.main import app  # noqa: E402
from extrapolab.tasks.ruler.text import essay_haystack  # noqa: E402

TASKS = "niah_single_1,niah_single_2,vt,fwe"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    (root / "essay.txt").write_text(essay_text())
    return {"root": root, "llama": save_llama(root / "llama", chat=True),
            "sets": ["--set", f"data.cache_dir={root / 'cache'}", "--set", f"ruler.essay={root / 'essay.txt'}"]}


def _timeless(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def _run(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_hf_model_end_to_end_resume_and_damaged_cell(env, tmp_path):
    out = tmp_path / "out"
    args = ["ruler", f"hf:{env['llama']}", "--tasks", TASKS, "--lengths", "1024,2048", "--n", "2", "--out", out,
            "--device", "cpu", "--dtype", "fp32", *env["sets"]]
    r = _run(args)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "ruler.json").read_text())
    assert res["mode"] == "both" and res["chat_template"][0].startswith("<|im_start|>user")
    assert res["command"].startswith(f"extrapolab ruler hf:{env['llama']} --tasks {TASKS} --lengths 1024,2048")
    assert res["essay"] == "RULER-essay-substitute"
    assert len(res["records"]) == 4 * 2 * 2
    for rec in res["records"]:
        assert {"score", "pred", "tf_exact", "tf_mean_logprob", "depth"} <= set(rec)
        assert rec["tokens"] <= rec["length"]
    cells = res["summary"]["cells"]
    assert set(cells) == set(TASKS.split(",")) and set(cells["vt"]) == {"1024", "2048"}
    assert {r["task"] for r in res["summary"]["depth"]} <= {"niah_single_1", "niah_single_2", "vt"}
    md = (out / "report.md").read_text()
    assert "RULER score" in md and "Teacher-forced" in md and "| **average** |" in md and "wall time" in md
    assert "(sample i drawn with seed 42 + i, RULER's --chunk_amount 2)" in md  # the seeding the report names
    words, ident = essay_haystack(env["root"] / "essay.txt")
    assert res["essay_text"]["words"] == len(words) == len(essay_text().split())  # which text the haystack was
    assert f"{len(words):,} words, sha256 {ident.rsplit(':', 1)[1]}… of the text" in md
    rows = (out / "ruler.csv").read_text().splitlines()
    assert rows[0].startswith("task,length,depth,n,score,tf_exact") and len(rows) > 1 + 8
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()}
    assert len(stamps) == 8
    again = _run(args)  # every cell reused: nothing scored again, same numbers
    assert again.exit_code == 0 and "scoring" not in again.output
    assert {p.name: p.stat().st_mtime_ns for p in (out / "cells").iterdir()} == stamps
    assert json.loads((out / "ruler.json").read_text())["summary"] == res["summary"]
    (out / "cells" / "fwe-1024.json").write_text("{not json")
    third = _run(args)
    assert third.exit_code == 0 and "fwe-1024.json: stored for other settings or damaged; scoring it again" in \
        third.output
    redone = json.loads((out / "ruler.json").read_text())["records"]
    assert _timeless(redone) == _timeless(res["records"])  # the rescored cell is the same: deterministic on CPU


def test_extrapolab_checkpoint_teacher_forced(env, tmp_path):
    from extrapolab.data import prepare
    from extrapolab.train import train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for j in range(20):
        (corpus / f"d{j}.txt").write_text(essay_text()[j * 500:(j + 1) * 500 + 4000])
    over = [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}",
            "model.layers=1", "model.heads=2", "model.dim=16", "model.train_length=32", "model.scheme=alibi",
            "train.steps=2", "train.batch_size=2", "train.eval_every=2", "train.eval_batches=1",
            "train.precision=fp32", "train.threads=1"]
    cfg = C.resolve(None, over)
    train(cfg, tmp_path / "run", data=prepare(cfg.data, progress=False), progress=False)
    r = _run(["ruler", tmp_path / "run", "--tasks", "niah_single_1,fwe", "--lengths", "2048", "--n", "1",
              "--device", "cpu", *env["sets"]])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "run" / "ruler" / "ruler.json").read_text())
    assert res["mode"] == "teacher" and res["chat_template"] is None and res["model"]["scheme"] == "alibi"
    assert all("tf_logprob" in x and "score" not in x for x in res["records"])
    assert "RULER score" not in (tmp_path / "run" / "ruler" / "report.md").read_text()


@pytest.mark.parametrize("case, extra, needle", [
    ("unknown task", ["--tasks", "niah_single_9"], "unknown RULER task 'niah_single_9' (did you mean"),
    ("length too short", ["--tasks", "niah_single_1", "--lengths", "300"],
     "length 300 is too short for RULER task niah_single_1"),
    ("QA needs a download", ["--tasks", "qa_2"], "needs a QA data set download"),
    ("bad metrics", ["--metrics", "fast"], "--metrics takes auto, both, greedy, teacher"),
    ("bad seeding", ["--seeding", "single"], "--seeding takes chunk"),
])
def test_bad_input_one_line_nothing_written(env, tmp_path, case, extra, needle):
    out = tmp_path / "out"
    r = _run(["ruler", f"hf:{env['llama']}", "--lengths", "1024", "--n", "1", "--out", out, "--device", "cpu",
              *env["sets"], *extra])
    assert r.exit_code == 2 and needle in r.output, (case, r.output)
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1
    assert not out.exists()


def test_corrupt_cached_samples_refused(env, tmp_path):
    cache = tmp_path / "cache"
    args = ["ruler", f"hf:{env['llama']}", "--tasks", "fwe", "--lengths", "1024", "--n", "1", "--metrics", "teacher",
            "--out", tmp_path / "a", "--device", "cpu", "--set", f"data.cache_dir={cache}"]
    r = _run([*args, "--prepare"])  # generate and cache only
    assert r.exit_code == 0 and "sample sets ready: 1 (1 samples each)" in r.output and not (tmp_path / "a").exists()
    [f] = list((cache / "ruler").glob("fwe-1024-*.json"))
    data = json.loads(f.read_text())
    data["samples"][0]["outputs"] = ["tampered"]
    f.write_text(json.dumps(data))
    r = _run([*args[:-6], "--out", tmp_path / "b", *args[-4:]])
    assert r.exit_code == 2 and f"cached RULER samples {f} are damaged (checksum mismatch); delete that file" in \
        r.output.replace("\n", "")
    assert not (tmp_path / "b").exists()
    f.write_text("{\"format\": 1, \"key\"")  # truncated
    r = _run([*args[:-6], "--out", tmp_path / "c", *args[-4:]])
    assert r.exit_code == 2 and "not readable JSON" in r.output


def test_model_without_tokenizer_and_chat_without_template(env, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(env["llama"], bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "chat_*"))
    r = _run(["ruler", f"hf:{bare}", "--tasks", "fwe", "--lengths", "1024", "--out", tmp_path / "o", "--device", "cpu"])
    assert r.exit_code == 2 and "no usable tokenizer" in r.output and not (tmp_path / "o").exists()
    plain = save_llama(tmp_path / "plain", chat=False)
    r = _run(["ruler", f"hf:{plain}", "--tasks", "fwe", "--lengths", "1024", "--chat", "on", "--out", tmp_path / "o",
              "--device", "cpu", *env["sets"]])
    assert r.exit_code == 2 and "--chat on needs a tokenizer with a chat template" in r.output
    assert not (tmp_path / "o").exists()


def test_not_a_model(tmp_path):
    r = _run(["ruler", tmp_path, "--tasks", "fwe"])
    assert r.exit_code == 2 and "neither hf:PATH nor a run folder" in r.output



def test_stream_seeding_through_the_verb(env, tmp_path):
    """--seeding stream generates RULER's default single-stream set (tasks/ruler/samples.py), cached apart from
    the per-sample set."""
    from extrapolab.tasks.ruler import ruler_samples

    cache = tmp_path / "cache"
    base = ["ruler", f"hf:{env['llama']}", "--tasks", "fwe", "--lengths", "1024", "--n", "2", "--prepare",
            "--device", "cpu", "--set", f"data.cache_dir={cache}"]
    assert _run([*base, "--seeding", "stream"]).exit_code == 0
    assert _run(base).exit_code == 0
    files = sorted((cache / "ruler").glob("fwe-1024-n2-s42-*.json"))
    sets = {json.loads(f.read_text())["identity"].get("seeding", "chunk"): json.loads(f.read_text())["samples"]
            for f in files}
    assert set(sets) == {"chunk", "stream"}
    tok = transformers.AutoTokenizer.from_pretrained(env["llama"])
    assert sets["stream"] == ruler_samples("fwe", 1024, tok, 2, chat="auto", cache_dir=False, seeding="stream")
    assert sets["stream"][0] == sets["chunk"][0] and sets["stream"][1] != sets["chunk"][1]

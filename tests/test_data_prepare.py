"""prepare/load/TokenData/check_lengths on small temp corpora (bytes and a tiny-vocab BPE)."""
import hashlib
import json
import os
import time

import numpy as np
import pytest

from extrapolab.config import DataConfig
from extrapolab.data import TokenData, check_lengths, load, prepare
from extrapolab.data import build as prepare_mod
from extrapolab.data.tokenizer import EOT, train_bpe
from extrapolab.io import UserError

WORDS = "alpha beta gamma delta value index return yield lambda while import class def self".split()


def _ref_split(path: str, valid: int, test: int) -> str:
    b = int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 100
    return "test" if b < test else "valid" if b < test + valid else "train"


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    texts = {}
    for i in range(80):
        words = rng.choice(WORDS, size=int(rng.integers(5, 40)))
        texts[f"m{i // 10}/doc_{i:02d}.py"] = f"# doc {i} ü\n" + " ".join(words) + "\n"
    for rel, t in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(t)
    return root, texts


def _cfg(root, tmp_path, **kw):
    base = dict(corpus=f"path:{root}", tokenizer="bytes", cache_dir=str(tmp_path / "cache"),
                valid_percent=15, test_percent=15)
    base.update(kw)
    return DataConfig(**base)


def test_bytes_streams_equal_reference_concatenation(corpus, tmp_path):
    root, texts = corpus
    d = prepare(_cfg(root, tmp_path), progress=False)
    assert (d.vocab_size, d.eot_id) == (257, 256)
    for s in ("train", "valid", "test"):
        docs = [texts[p] for p in sorted(texts) if _ref_split(p, 15, 15) == s]
        assert docs, f"fixture should fill every split ({s})"
        ref = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8).astype(np.int64), 256) for t in docs])
        arr = d.split(s)
        assert isinstance(arr, np.memmap) and arr.dtype == np.uint16 and arr.ndim == 1
        np.testing.assert_array_equal(arr, ref)
        # one EOT after every document, at the cumulative document ends
        ends = np.cumsum([len(t.encode()) + 1 for t in docs]) - 1
        np.testing.assert_array_equal(np.flatnonzero(arr == 256), ends)
        assert d.meta["documents"][s] == len(docs) and d.meta["tokens"][s] == arr.size
    assert d.decode(d.split("test")[: len(docs[0].encode())]) == docs[0]
    assert d.encode("ü") == [0xC3, 0xBC]
    man = json.loads((d.path / "manifest.json").read_text())
    assert {m["path"]: m["split"] for m in man["documents"]} == {p: _ref_split(p, 15, 15) for p in texts}
    assert d.meta["manifest_hash"] == d.meta["corpus_hash"] == man["hash"]


def test_cache_is_reused_and_keyed_by_content(corpus, tmp_path):
    root, texts = corpus
    cfg = _cfg(root, tmp_path)
    d1 = prepare(cfg, progress=False)
    stamp = (d1.path / "train.bin").stat().st_mtime_ns
    t0 = time.perf_counter()
    d2 = prepare(cfg, progress=False)
    assert time.perf_counter() - t0 < 2.0
    assert d2.path == d1.path and (d2.path / "train.bin").stat().st_mtime_ns == stamp  # not rewritten
    for s in ("train", "valid", "test"):
        np.testing.assert_array_equal(d1.split(s), d2.split(s))
    assert d2.meta == d1.meta
    # a changed file, or different split settings, give a different dataset
    (root / sorted(texts)[0]).write_text("changed\n")
    d3 = prepare(cfg, progress=False)
    d4 = prepare(_cfg(root, tmp_path, valid_percent=10), progress=False)
    assert len({d1.path, d3.path, d4.path}) == 3 and d3.meta["corpus_hash"] != d1.meta["corpus_hash"]
    leftovers = [p for p in (tmp_path / "cache" / "data").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_bpe_is_trained_on_train_split_only(corpus, tmp_path):
    root, texts = corpus
    # a word that occurs only in held-out documents must not become a merged token
    held = sorted(p for p in texts if _ref_split(p, 15, 15) != "train")
    for p in held:
        (root / p).write_text(texts[p] + " zqxjkv" * 30 + "\n")
    cfg = _cfg(root, tmp_path, tokenizer="bpe", vocab_size=300)
    d = prepare(cfg, progress=False)
    assert d.meta["tokenizer"]["kind"] == "bpe" and d.vocab_size == 300 and d.eot_id == 0
    vocab = d._codec.tok.get_vocab()
    assert not any("zq" in t or "qx" in t or "jk" in t for t in vocab)
    # independent reference: a BPE trained on the train documents alone is the same tokenizer
    train_texts = [(root / p).read_text() for p in sorted(texts) if _ref_split(p, 15, 15) == "train"]
    ref = train_bpe(iter(train_texts), 300)
    assert ref.get_vocab() == vocab
    # and it would differ if the held-out text had been included
    all_texts = [(root / p).read_text() for p in sorted(texts)]
    assert any("zqxjkv" in t for t in train_bpe(iter(all_texts), 300).get_vocab())
    # memmap round trip: the stored stream is the batch encoding of each document plus EOT
    test_docs = [(root / p).read_text() for p in sorted(texts) if _ref_split(p, 15, 15) == "test"]
    ref_ids = [i for t in test_docs for i in ref.encode(t).ids + [0]]
    np.testing.assert_array_equal(d.split("test"), ref_ids)
    assert d.decode(d.encode(test_docs[0])) == test_docs[0]
    # tokenizer cache: a new dataset folder with the same train split reuses the trained BPE
    again = prepare(_cfg(root, tmp_path / "other", tokenizer="bpe", vocab_size=300), progress=False)
    assert again.meta["tokenizer"]["hash"] == d.meta["tokenizer"]["hash"]
    tok_files = list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json"))
    assert len(tok_files) == 1


def test_literal_eot_text_in_a_document_is_not_eot(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    for i in range(30):
        (root / f"f{i}.txt").write_text(f"text {i} {EOT} more text\n")
    d = prepare(_cfg(root, tmp_path, tokenizer="bpe", vocab_size=280, valid_percent=0, test_percent=0),
                progress=False)
    train = d.split("train")
    assert int((train == d.eot_id).sum()) == 30 == d.meta["documents"]["train"]
    assert d.decode(d.encode(EOT)) == EOT and d.eot_id not in d.encode(EOT)


def test_load_errors_name_the_fix(corpus, tmp_path):
    root, _ = corpus
    d = prepare(_cfg(root, tmp_path), progress=False)
    bin_ = d.path / "train.bin"
    data = bin_.read_bytes()
    bin_.write_bytes(data[:-2])  # truncated
    with pytest.raises(UserError, match=r"train\.bin is .* bytes.*re-run `extrapolab prepare`") as e:
        load(d.path)
    assert "\n" not in str(e.value)
    # prepare notices the damage and rebuilds the same content
    d2 = prepare(_cfg(root, tmp_path), progress=False)
    assert (d2.path / "train.bin").read_bytes() == data
    (d2.path / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="meta.json unreadable.*delete that folder"):
        load(d2.path)
    (d2.path / "meta.json").unlink()
    with pytest.raises(UserError, match="meta.json missing"):
        load(d2.path)
    with pytest.raises(UserError, match="run `extrapolab prepare` first"):
        load(tmp_path / "nowhere")


def test_failed_build_leaves_nothing(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    real = prepare_mod._write_split

    def boom(path, docs, codec, dtype, name, progress):
        if name == "test":
            raise KeyboardInterrupt
        return real(path, docs, codec, dtype, name, progress)

    monkeypatch.setattr(prepare_mod, "_write_split", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(_cfg(root, tmp_path), progress=False)
    assert os.listdir(tmp_path / "cache" / "data") == []


def test_settings_and_small_corpus_errors(corpus, tmp_path):
    root, _ = corpus
    for kw, pat in [(dict(valid_percent=50, test_percent=50), "leaves no training data"),
                    (dict(tokenizer="sentencepiece"), "unknown tokenizer"),
                    (dict(tokenizer="bpe", vocab_size=100), "out of range for bpe"),
                    (dict(max_bytes=-1), "max_bytes")]:
        with pytest.raises(UserError, match=pat):
            prepare(_cfg(root, tmp_path, **kw), progress=False)
    one = tmp_path / "one"
    one.mkdir()
    (one / "x.txt").write_text("tiny\n")
    with pytest.raises(UserError, match="corpus too small"):
        prepare(_cfg(one, tmp_path, test_percent=99, valid_percent=0), progress=False)


def test_check_lengths(corpus, tmp_path):
    root, _ = corpus
    d = prepare(_cfg(root, tmp_path), progress=False)
    n = d.split("test").size
    assert check_lengths(d, "test", [8, n - 1]) == n
    with pytest.raises(UserError, match=rf"corpus too small: the test split .* has {n} tokens .* needs {n + 1}") as e:
        check_lengths(d, "test", [8, n])
    assert "eval.lengths" in str(e.value) and "\n" not in str(e.value)
    last_token = lambda L: 4 * L  # noqa: E731  (N=4 disjoint segments of length L)
    check_lengths(d, "test", [n // 4], need=last_token)
    with pytest.raises(UserError, match="last_token_n"):
        check_lengths(d, "test", [n // 4 + 1], need=last_token)
    with pytest.raises(UserError, match="positive"):
        check_lengths(d, "test", [0])


def test_from_arrays():
    tr = np.frombuffer("hello".encode(), np.uint8)
    d = TokenData.from_arrays(tr, np.array([104, 256]), np.array([], dtype=np.int64), 257, 256)
    assert d.decode(d.split("valid")) == "h" + EOT and d.encode("hi") == [104, 105]
    assert d.split("test").size == 0 and d.path is None
    s = TokenData.from_arrays([1, 2, 3], [0], [4], vocab_size=5, eot_id=0)
    with pytest.raises(UserError, match="no tokenizer"):
        s.decode([1, 2])
    with pytest.raises(UserError, match="0..4"):
        TokenData.from_arrays([1, 5], [0], [0], vocab_size=5, eot_id=0)
    with pytest.raises(UserError, match="unknown split"):
        s.split("dev")


def test_dtype_widens_for_large_vocab():
    from extrapolab.data.store import dtype_for

    assert dtype_for(65536) == np.uint16 and dtype_for(65537) == np.uint32


@pytest.mark.slow
def test_full_stdlib_bpe4096(tmp_path):
    cfg = DataConfig(corpus="stdlib", tokenizer="bpe", vocab_size=4096, cache_dir=str(tmp_path))
    d = prepare(cfg, progress=False)
    m = d.meta
    assert d.vocab_size == 4096 and sum(m["documents"].values()) > 300
    assert 0.2 < m["tokens_per_byte"]["train"] < 0.4  # ~0.31 tokens/byte on code (measured on the stdlib)
    assert min(m["tokens"].values()) > 50_000
    t0 = time.perf_counter()
    assert prepare(cfg, progress=False).path == d.path and time.perf_counter() - t0 < 5

"""Corpora, manifest and split rule (extrapolab.data.corpus): listing only, nothing tokenized."""
import hashlib
import sys
import types
from pathlib import Path

import pytest

from extrapolab.data import corpus as C
from extrapolab.io import UserError


def _tree(root: Path, files: dict) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return root


# ---- split rule -----------------------------------------------------------------------------------
def test_split_matches_definition_and_is_disjoint():
    paths = [f"pkg{i % 7}/mod_{i}.py" for i in range(3000)]
    seen = {}
    for p in paths:
        bucket = int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) % 100  # the split rule of docs/architecture.md
        want = "test" if bucket < 5 else "valid" if bucket < 15 else "train"
        assert C.split_of(p, 10, 5) == want
        seen[p] = want
    docs = [C.Document(p, "x") for p in paths]
    parts = C.assign_splits(docs, 10, 5)
    names = [{d.path for d in parts[s]} for s in C.SPLITS]
    assert sum(map(len, names)) == len(paths)
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    # proportions close to the percentages (3000 draws: 3 sigma bounds)
    assert abs(len(parts["test"]) / 3000 - 0.05) < 0.012
    assert abs(len(parts["valid"]) / 3000 - 0.10) < 0.017
    # deterministic across calls and independent of document order
    again = C.assign_splits(list(reversed(docs)), 10, 5)
    assert {d.path for d in again["test"]} == names[2]


def test_split_percent_edges():
    paths = [f"f{i}.txt" for i in range(500)]
    assert all(C.split_of(p, 0, 0) == "train" for p in paths)
    assert all(C.split_of(p, 0, 100) == "test" for p in paths)


# ---- manifest ----------------------------------------------------------------------------------------
def test_manifest_entries_and_hash_change_detection(tmp_path):
    root = _tree(tmp_path / "c", {"a.txt": "alpha\n", "sub/b.txt": "beta βeta\n", "sub/c.md": "gamma\n"})
    c1 = C.read_corpus(f"path:{root}")
    m = c1.manifest()
    assert [e["path"] for e in m] == ["a.txt", "sub/b.txt", "sub/c.md"]
    raw = (root / "sub/b.txt").read_bytes()
    assert m[1] == {"path": "sub/b.txt", "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    h1 = C.manifest_hash(m)
    lines = "".join(f"{e['sha256']}\t{e['bytes']}\t{e['path']}\n" for e in m)
    assert h1 == hashlib.sha256(lines.encode()).hexdigest()
    # stable: re-reading (and touching mtimes) gives the same hash
    (root / "a.txt").touch()
    assert C.manifest_hash(C.read_corpus(f"path:{root}").manifest()) == h1
    # one changed byte, or a rename, changes it
    (root / "a.txt").write_text("alphA\n")
    h2 = C.manifest_hash(C.read_corpus(f"path:{root}").manifest())
    (root / "a.txt").rename(root / "a2.txt")
    h3 = C.manifest_hash(C.read_corpus(f"path:{root}").manifest())
    assert len({h1, h2, h3}) == 3


# ---- path: corpora ---------------------------------------------------------------------------------
def test_path_folder_skips_binary_empty_hidden(tmp_path):
    root = _tree(tmp_path / "c", {
        "good.py": "print('hi')\n",
        "img.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00",  # NUL bytes
        "latin1.txt": "caf\xe9".encode("latin-1"),  # not UTF-8
        "empty.txt": "",
        "blank.txt": "  \n\n",
        ".git/config": "[core]\n",
        "__pycache__/x.pyc": "not really",
        "deep/er/ok.txt": "nested text\n",
    })
    c = C.read_corpus(f"path:{root}")
    assert [d.path for d in c.documents] == ["deep/er/ok.txt", "good.py"]
    assert c.skipped == {"binary": 2, "empty": 2}
    assert c.documents[1].text == "print('hi')\n"


def test_path_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist") as e:
        C.read_corpus(f"path:{tmp_path / 'nope'}")
    assert "\n" not in str(e.value)
    root = _tree(tmp_path / "bin", {"a.bin": b"\x00\x01\x02", "b.bin": b"\xff\xfe\x00"})
    with pytest.raises(UserError, match=r"no usable text \(2 binary\)") as e:
        C.read_corpus(f"path:{root}")
    assert "\n" not in str(e.value)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(UserError, match="no usable text"):
        C.read_corpus(f"path:{tmp_path / 'emptydir'}")
    with pytest.raises(UserError, match="unknown corpus"):
        C.read_corpus("wikipedia")


def test_single_file_is_cut_into_line_pieces(tmp_path):
    text = "".join(f"line {i} {'x' * (i % 50)}\n" for i in range(6000))  # 211 KB
    f = tmp_path / "book.txt"
    f.write_text(text)
    c = C.read_corpus(f"path:{f}")
    sizes = [len(d.data) for d in c.documents]
    assert len(sizes) == len(text.encode()) // C.SINGLE_FILE_PIECE_BYTES + 1 == 4
    assert all(C.SINGLE_FILE_PIECE_BYTES <= s < C.SINGLE_FILE_PIECE_BYTES + 70 for s in sizes[:-1])
    assert "".join(d.text for d in c.documents) == text
    assert all(d.text.endswith("\n") for d in c.documents)
    assert [d.path for d in c.documents][:2] == ["book.txt#00000", "book.txt#00001"]


def test_max_bytes_sample_is_exact_and_deterministic(tmp_path):
    files = {f"d{i:03d}.txt": f"document {i} " + "é" * (40 + i) + "\n" for i in range(120)}
    root = _tree(tmp_path / "c", files)
    a = C.read_corpus(f"path:{root}", max_bytes=3000)
    b = C.read_corpus(f"path:{root}", max_bytes=3000)
    assert a.manifest() == b.manifest()
    assert 3000 - 1 <= a.num_bytes <= 3000  # last document cut at a character boundary
    full = {d.path: d.text for d in C.read_corpus(f"path:{root}").documents}
    cut = [d for d in a.documents if d.text != full[d.path]]
    assert len(cut) <= 1 and all(full[d.path].startswith(d.text) for d in cut)
    # spread over the corpus (hash order), not just the alphabetical start
    assert max(d.path for d in a.documents) > "d060"


# ---- stdlib ---------------------------------------------------------------------------------------
def test_stdlib_filters_on_a_fake_tree(tmp_path):
    root = _tree(tmp_path / "lib", {
        "os.py": "import sys\n",
        "json/__init__.py": "x = 1\n",
        "json/tests/t.py": "assert 1\n",
        "test/test_os.py": "assert 1\n",
        "idlelib/idle_test/t.py": "assert 1\n",
        "unittest/test/testmock/m.py": "assert 1\n",
        "site-packages/numpy/core.py": "x\n",
        "lib-dynload/README.py": "x\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": "x\n",
        "pydoc_data/topics.py": "topics = {}\n",
        "pydoc_data/__init__.py": "",
        "_sysconfigdata__linux.py": "build_time_vars = {}\n",
        "encodings/cp437.py": '""" Python Character Mapping Codec cp437 generated from \'VENDORS/CP437.TXT\' with gencodec.py.\n"""\n',
        "encodings/cp858.py": '""" Python Character Mapping Codec for CP858, modified from cp850.\n"""\ndecoding_map = {}\n',
        "encodings/utf_8.py": "import codecs\n",
        "__pycache__/os.cpython-311.pyc": b"\x00bin",
        "README.txt": "not python\n",
    })
    c = C.stdlib_corpus(root=root)
    assert [d.path for d in c.documents] == ["encodings/utf_8.py", "json/__init__.py", "os.py"]
    assert c.skipped == {"filtered": 2, "empty": 1}


def test_real_stdlib_listing():
    c = C.read_corpus("stdlib")
    paths = [d.path for d in c.documents]
    assert "os.py" in paths and "asyncio/events.py" in paths and "encodings/utf_8.py" in paths
    for p in paths:
        parts = p.split("/")
        assert p.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "lib-dynload", "__pycache__"} & set(parts[:-1])
        assert not parts[0].startswith("config-") and not parts[-1].startswith("_sysconfigdata")
    assert "pydoc_data/topics.py" not in paths and "encodings/cp437.py" not in paths
    assert len(paths) > 300 and c.num_bytes > 3_000_000  # 658 files, 10.0 MB on CPython 3.11.7
    if sys.version_info[:3] == (3, 11, 7):
        assert 640 <= len(paths) <= 680


# ---- pydoc ----------------------------------------------------------------------------------------
def test_pydoc_missing_is_one_line_with_fix(tmp_path):
    with pytest.raises(UserError) as e:
        C.pydoc_corpus(root=tmp_path / "absent")
    assert str(e.value) == C.PROSE_HINT and "python3-doc" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(C.pydoc_root() is None, reason="python3-doc not installed")
def test_pydoc_listing_when_installed():
    c = C.read_corpus("pydoc", max_bytes=200_000)
    assert c.documents and all(d.path.endswith(".rst.txt") for d in c.documents)
    assert 199_000 <= c.num_bytes <= 200_000


# ---- Hugging Face ---------------------------------------------------------------------------------
def test_hf_spec_parsing():
    assert C.parse_hf("hf:wikitext:wikitext-2-raw-v1@validation") == ("wikitext", "wikitext-2-raw-v1", "validation")
    assert C.parse_hf("hf:user/set") == ("user/set", None, "train")
    with pytest.raises(UserError, match="hf:<dataset>"):
        C.parse_hf("hf:")


def test_hf_rows_become_documents_with_a_fake_datasets(monkeypatch):
    rows = [{"id": 1, "text": "first doc"}, {"id": 2, "text": "  "}, {"id": 3, "text": "third doc"}]
    calls = []

    class FakeDS(list):
        column_names = ["id", "text"]

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return FakeDS(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    c = C.read_corpus("hf:me/set:cfg@valid")
    assert calls == [("me/set", "cfg", "valid")]
    assert [(d.path, d.text) for d in c.documents] == [("valid/000000000", "first doc"), ("valid/000000002", "third doc")]
    assert c.skipped == {"empty": 1}


def test_hf_offline_error_names_the_fix():
    pytest.importorskip("datasets")  # conftest sets HF_DATASETS_OFFLINE=1: nothing leaves the machine
    with pytest.raises(UserError) as e:
        C.read_corpus("hf:extrapolab-tests/no-such-dataset@train")
    msg = str(e.value)
    assert "\n" not in msg and "HF_DATASETS_OFFLINE" in msg and "data.corpus=stdlib" in msg

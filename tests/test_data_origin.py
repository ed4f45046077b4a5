"""Which corpus a result measured (data/origin.py): the corpus hash of a prepared dataset against the sha256
of its manifest written out here, the source of the stdlib / python3-doc corpora against the interpreter and
dpkg-query itself, the report's line, and the one warning line over runs with different hashes."""
import hashlib
import json
import platform
import shutil
import subprocess

import pytest

from extrapolab.config import DataConfig
from extrapolab.data import corpus_line, prepare, provenance
from extrapolab.data import origin as P
from extrapolab.data.corpus import pydoc_root, stdlib_root


def _corpus(tmp_path, texts):
    root = tmp_path / "corpus"
    for rel, t in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(t)
    return DataConfig(corpus=f"path:{root}", tokenizer="bytes", cache_dir=str(tmp_path / "cache"), valid_percent=20,
                      test_percent=20)


def test_provenance_is_the_sha256_of_the_manifest_and_follows_the_text(tmp_path):
    texts = {f"d{i:02d}.txt": f"document {i} " * (i + 3) for i in range(30)}
    cfg = _corpus(tmp_path, texts)
    p = provenance(prepare(cfg, progress=False))
    listing = "".join(f"{hashlib.sha256(t.encode()).hexdigest()}\t{len(t.encode())}\t{rel}\n"
                      for rel, t in sorted(texts.items()))
    assert p == {"corpus": cfg.corpus, "corpus_hash": hashlib.sha256(listing.encode()).hexdigest(), "source": None}
    meta = json.loads((prepare(cfg, progress=False).path / "meta.json").read_text())
    assert meta["corpus_hash"] == p["corpus_hash"] and "corpus_source" in meta  # recorded with the data
    (tmp_path / "corpus" / "d07.txt").write_text("one word changed")  # another package version, say
    q = provenance(prepare(cfg, progress=False))
    assert q["corpus_hash"] != p["corpus_hash"]
    line = corpus_line(q)
    assert line == f"corpus {cfg.corpus}: sha256 {q['corpus_hash'][:12]}… of its manifest"
    assert corpus_line(None, "pydoc") == "corpus pydoc: corpus hash not recorded"
    assert provenance({"corpus": "arrays"}) is None  # data made in memory has no corpus to name


def test_stdlib_source_names_the_interpreter():
    src = P.corpus_source("stdlib", str(stdlib_root()))
    assert src.startswith(f"{platform.python_implementation()} {platform.python_version()} standard library")


@pytest.mark.skipif(shutil.which("dpkg-query") is None or pydoc_root() is None, reason="no dpkg or no python3-doc")
def test_pydoc_source_is_the_debian_package_that_owns_the_text():
    """The package dpkg says installed the _sources folder, with its version (and the python3-doc metapackage's)."""
    root = pydoc_root()
    owner = subprocess.run(["dpkg-query", "-S", str(root)], capture_output=True, text=True).stdout.split(":")[0]
    version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", owner], capture_output=True, text=True).stdout
    src = P.corpus_source("pydoc", str(root))
    assert src.startswith(f"{owner} {version}") and version
    meta = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-doc"], capture_output=True, text=True)
    if meta.returncode == 0 and owner != "python3-doc":
        assert src.endswith(f"(python3-doc {meta.stdout})")


def test_sources_without_dpkg_or_package(monkeypatch):
    """A host without dpkg (or a folder no package owns) still gets a line, never an error."""
    P._dpkg.cache_clear()
    monkeypatch.setattr(P.shutil, "which", lambda name: None)
    try:
        assert P.corpus_source("pydoc", "/some/_sources") == "python3-doc files at /some/_sources (no Debian package owns them)"
        assert P.corpus_source("linux", "/usr/src/linux-source-6.1.tar.xz") == \
            "linux-source-6.1.tar.xz (no Debian package owns it)"
        assert P.corpus_source("path:/x", "/x") is None
    finally:
        P._dpkg.cache_clear()


def test_mixed_corpora_is_one_line_naming_each_hash():
    a = {"corpus": "pydoc", "corpus_hash": "a" * 64, "source": "python3.11-doc 3.11.2-6+deb12u8"}
    b = {"corpus": "pydoc", "corpus_hash": "b" * 64, "source": "python3.11-doc 3.11.2-6+deb12u9"}
    s = {"corpus": "stdlib", "corpus_hash": "c" * 64, "source": None}
    assert P.mixed_corpora([("r1", a), ("r2", a), ("r3", s), ("r4", None)]) is None
    line = P.mixed_corpora([("r1", a), ("r2", b), ("r3", a), ("r4", s)])
    assert "\n" not in line and line.startswith("warning:")
    assert "corpus pydoc has 2 hashes: aaaaaaaaaaaa (r1, r3); bbbbbbbbbbbb (r2)" in line and "stdlib" not in line


def test_prepare_prints_the_corpus_line(tmp_path):
    from typer.testing import CliRunner

    from extrapolab.cli.main import app

    cfg = _corpus(tmp_path, {f"d{i:02d}.txt": f"text {i} " * 20 for i in range(30)})
    r = CliRunner().invoke(app, ["prepare", "--set", f"data.corpus={cfg.corpus}", "--set", "data.tokenizer=bytes",
                                 "--set", f"data.cache_dir={cfg.cache_dir}"])
    assert r.exit_code == 0, r.output
    assert corpus_line(provenance(prepare(cfg, progress=False))) in r.output.splitlines()

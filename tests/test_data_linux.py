"""The Linux-source corpus (extrapolab.data.linux) on a synthetic tarball with Debian's member layout:
same split, manifest and max_bytes rules as a folder corpus (checked against path_corpus), one-line errors."""
import hashlib
import io
import json
import tarfile

import numpy as np
import pytest

from extrapolab.config import DataConfig
from extrapolab.data import corpus as C
from extrapolab.data import linux as LX
from extrapolab.data import prepare
from extrapolab.io import UserError

TOP = "linux-source-6.1"


def _files(n: int = 60) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    out = {}
    for i in range(n):
        body = "".join(f"static int f{i}_{j}(int x) {{ return x * {j}; }} /* ü */\n"
                       for j in range(int(rng.integers(3, 40))))
        out[f"drivers/d{i % 7}/file{i:03d}.{'c' if i % 3 else 'h'}"] = body.encode()
    return out


EXTRA = {  # skipped members, each for its own reason
    "arch/x86/entry.S": b"mov %rax, %rbx\n",  # not .c/.h
    "Makefile": b"obj-y += x.o\n",
    "drivers/gpu/drm/amd/include/asic_reg/nbio_sh_mask.h": b"#define A 1\n",  # generated
    "drivers/blob.c": b"int a;\x00\x01binary",  # NUL byte
    "drivers/latin1.c": "/* caf\xe9 */\n".encode("latin-1"),  # not UTF-8
    "include/empty.h": b"  \n",
}


def _tarball(path, files: dict[str, bytes], top: str = TOP):
    with tarfile.open(path, "w:xz") as tf:
        dirs = sorted({f"{top}/{r.rsplit('/', 1)[0]}" for r in files if "/" in r} | {top})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for rel, data in files.items():
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"{top}/drivers/link.c")  # a symlink member is not a document
        link.type, link.linkname = tarfile.SYMTYPE, "d0/file000.h"
        tf.addfile(link)
    return path


@pytest.fixture(scope="module")
def tarball(tmp_path_factory):
    files = _files()
    return _tarball(tmp_path_factory.mktemp("lx") / "linux-source-6.1.tar.xz", {**files, **EXTRA}), files


def test_documents_manifest_and_split_follow_the_corpus_rules(tarball):
    path, files = tarball
    c = C.read_corpus(f"linux:{path}")
    assert [d.path for d in c.documents] == sorted(files)  # relative paths, top folder dropped
    for d in c.documents:
        assert d.data == files[d.path]
    m = c.manifest()
    assert m[0] == {"path": sorted(files)[0], "sha256": hashlib.sha256(files[sorted(files)[0]]).hexdigest(),
                    "bytes": len(files[sorted(files)[0]])}
    assert c.skipped == {"generated": 1, "binary": 2, "empty": 1}
    parts = C.assign_splits(c.documents, 10, 10)
    for s, docs in parts.items():
        assert all(C.split_of(d.path, 10, 10) == s for d in docs)
    # a patch release under another top folder: same paths, same manifest hash, same splits
    other = _tarball(path.parent / "linux-source-6.1.99.tar.xz", {**files, **EXTRA}, top="linux-source-6.1.99")
    assert C.manifest_hash(C.read_corpus(f"linux:{other}").manifest()) == C.manifest_hash(m)


@pytest.mark.parametrize("max_bytes", [1, 700, 5000, 20000, 10**9])
def test_max_bytes_takes_the_same_sample_as_a_folder_corpus(tarball, tmp_path, max_bytes):
    """Streaming with a bounded heap == sorting every path by split hash and taking the prefix."""
    path, files = tarball
    root = tmp_path / "tree"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    got = LX.linux_corpus(max_bytes, path)
    want = C.path_corpus(str(root), max_bytes)
    assert [(d.path, d.text) for d in got.documents] == [(d.path, d.text) for d in want.documents]
    assert got.num_bytes == min(max_bytes, sum(map(len, files.values())))


def test_large_files_are_skipped(tarball, monkeypatch):
    path, files = tarball
    biggest = max(files, key=lambda r: len(files[r]))
    monkeypatch.setattr(LX, "MAX_FILE_BYTES", len(files[biggest]) - 1)
    c = LX.linux_corpus(0, path)
    assert biggest not in {d.path for d in c.documents} and c.skipped["over_1MB"] >= 1


def test_missing_and_corrupt_tarballs_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(LX, "LINUX_GLOB", str(tmp_path / "none" / "linux-source-*.tar.*"))
    with pytest.raises(UserError, match=r"make corpus-linux.*apt-get install") as e:
        C.read_corpus("linux")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not found"):
        C.read_corpus(f"linux:{tmp_path / 'nope.tar.xz'}")
    bad = tmp_path / "linux-source-6.1.tar.xz"
    bad.write_bytes(b"\xfd7zXZ\x00garbage" * 10)
    with pytest.raises(UserError, match="cannot read Linux source tarball"):
        C.read_corpus(f"linux:{bad}")


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75, -1])
def test_truncated_download_is_refused_not_read_as_a_smaller_corpus(tarball, tmp_path, keep):
    """A cut .tar.xz (a download that stopped) is one line naming the fix at any cut point, also
    where tar's reader alone would stop quietly at a member header or miss only the xz footer."""
    data = tarball[0].read_bytes()
    cut = tmp_path / "linux-source-6.1.tar.xz"
    cut.write_bytes(data[:int(len(data) * keep)] if keep > 0 else data[:keep])
    with pytest.raises(UserError) as e:
        LX.linux_corpus(tarball=cut)
    assert "\n" not in str(e.value) and "truncated or corrupt" in str(e.value) and "make corpus-linux" in str(e.value)


def test_installed_tarball_is_the_newest_version(tmp_path, monkeypatch):
    for v in ("6.1", "6.12", "6.9"):
        _tarball(tmp_path / f"linux-source-{v}.tar.xz", {"a.c": f"int v = {len(v)};\n".encode()}, top=f"linux-source-{v}")
    monkeypatch.setattr(LX, "LINUX_GLOB", str(tmp_path / "linux-source-*.tar.*"))
    assert LX.linux_tarball().name == "linux-source-6.12.tar.xz"
    c = C.read_corpus("linux")
    assert c.name == "linux" and c.root.endswith("linux-source-6.12.tar.xz")


def test_prepare_records_the_manifest(tarball, tmp_path):
    path, files = tarball
    d = prepare(DataConfig(corpus=f"linux:{path}", tokenizer="bytes", cache_dir=str(tmp_path / "cache"),
                           valid_percent=10, test_percent=10), progress=False)
    man = json.loads((d.path / "manifest.json").read_text())
    assert {m["path"] for m in man["documents"]} == set(files)
    assert man["skipped"] == {"generated": 1, "binary": 2, "empty": 1}
    total = sum(d.num_tokens(s) for s in ("train", "valid", "test"))
    assert total == sum(map(len, files.values())) + len(files)  # bytes + one EOT per document


def test_second_prepare_skips_rereading_the_same_archive(tarball, tmp_path, monkeypatch):
    path, _ = tarball
    cfg = DataConfig(corpus=f"linux:{path}", tokenizer="bytes", cache_dir=str(tmp_path / "cache"))
    first = prepare(cfg, progress=False)
    monkeypatch.setattr(LX, "linux_corpus", lambda *a, **k: pytest.fail("the archive was read again"))
    again = prepare(cfg, progress=False)
    assert again.path == first.path and np.array_equal(again.split("train"), first.split("train"))
    copy = path.parent / "copy" / path.name  # another file (path, mtime): read again
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(path.read_bytes())
    with pytest.raises(pytest.fail.Exception, match="read again"):
        prepare(DataConfig(corpus=f"linux:{copy}", tokenizer="bytes", cache_dir=str(tmp_path / "cache")), progress=False)

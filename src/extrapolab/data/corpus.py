"""Corpora as lists of documents ``(relative path, text)``, their manifest and the split rule.

Specs accepted by :func:`read_corpus` (``data.corpus``):

- ``stdlib``  the running interpreter's standard-library ``.py`` source (code corpus, like the
  papers' GitHub set), without tests, site-packages, build config and generated tables;
- ``pydoc``   Debian ``python3-doc``'s reStructuredText sources (English prose corpus);
- ``linux``   the Linux kernel's ``.c``/``.h`` files from Debian's ``linux-source`` tarball (large
  code corpus for ~100M-parameter models; ``linux:<tarball>`` for another one; see ``linux.py``);
- ``path:<file or folder>``  any text file or folder (binary files skipped and counted);
- ``hf:<dataset>[:<config>][@split]``  a Hugging Face dataset (needs ``datasets``; online once).

The manifest lists (path, sha256, bytes) for every document actually used; the corpus hash is
the sha256 of that listing, so a run records exactly what it trained on. Documents go to
train/valid/test by the first 8 hex digits of sha256(relative path) mod 100 (docs/architecture.md, "Data").
"""
from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from pathlib import Path

from ..io import UserError
from .documents import (SPLITS, Corpus, Document, _decode, assign_splits, manifest_hash,  # noqa: F401 (re-exported)
                        split_bucket, split_of)

SINGLE_FILE_PIECE_BYTES = 64 * 1024  # a one-file corpus is cut into pieces so every split gets some
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "lib-dynload", "__pycache__", "test", "tests",
                     "idle_test", "testmock", "testdata"}
_GENERATED = re.compile(r"generated from|gencodec\.py|genwincodec\.py|^decoding_(?:table|map)\s*=", re.M)
PROSE_HINT = ("prose corpus not installed; run `make prose` (sudo apt-get install -y python3-doc) "
              "or use --set data.corpus=stdlib")


# ---- file-system corpora ------------------------------------------------------------------------

def _order(candidates: list[tuple[str, Path, int]], max_bytes: int) -> list[tuple[str, Path, int]]:
    """Reading order. With ``max_bytes`` the paths go in split-hash order, so the prefix that fits
    is a deterministic sample spread over the whole corpus rather than its alphabetical start."""
    if max_bytes <= 0:
        return sorted(candidates)
    return sorted(candidates, key=lambda c: (hashlib.sha256(c[0].encode()).hexdigest(), c[0]))


def _read_files(name: str, root: Path, candidates: list[tuple[str, Path, int]], max_bytes: int,
                filters=()) -> Corpus:
    skipped = {"binary": 0, "empty": 0}
    docs: list[Document] = []
    budget = max_bytes if max_bytes > 0 else None
    for rel, full, _ in _order(candidates, max_bytes):
        if budget is not None and budget <= 0:
            break
        try:
            raw = full.read_bytes()
        except OSError:
            skipped["unreadable"] = skipped.get("unreadable", 0) + 1
            continue
        text = _decode(raw)
        if text is None:
            skipped["binary"] += 1
            continue
        if any(f(rel, text) for f in filters):
            skipped["filtered"] = skipped.get("filtered", 0) + 1
            continue
        if budget is not None and len(raw) > budget:  # the last document is cut at a char boundary
            text = raw[:budget].decode("utf-8", errors="ignore")
        if not text.strip():
            skipped["empty"] += 1
            continue
        if budget is not None:
            budget -= len(text.encode("utf-8"))
        docs.append(Document(rel, text))
    docs.sort(key=lambda d: d.path)
    return Corpus(name, docs, {k: v for k, v in skipped.items() if v}, str(root))


def _walk(root: Path, keep_dir=lambda rel, name: True, keep_file=lambda rel: True) -> list[tuple[str, Path, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and keep_dir(rel_dir, d))
        for f in filenames:
            rel = (rel_dir / f).as_posix()
            full = Path(dirpath) / f
            if f.startswith(".") or not keep_file(rel) or not full.is_file():
                continue
            out.append((rel, full, full.stat().st_size))
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_generated(rel: str, text: str) -> bool:
    """Charmap codec tables (encodings/cp437.py, ...: generated from mapping files, or copies of
    such tables): 256-entry lookup tables, not code."""
    return rel.startswith("encodings/") and bool(_GENERATED.search(text))


def stdlib_corpus(max_bytes: int = 0, root: Path | None = None) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise UserError(f"standard library folder {root} not found; use --set data.corpus=path:<folder>")

    def keep_dir(rel: Path, d: str) -> bool:
        return d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")

    def keep_file(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return rel.endswith(".py") and rel != "pydoc_data/topics.py" and not name.startswith("_sysconfigdata")

    cands = _walk(root, keep_dir, keep_file)
    return _read_files("stdlib", root, cands, max_bytes, filters=(_stdlib_generated,))


def pydoc_root() -> Path | None:
    """The python3-doc ``_sources`` folder, preferring the running Python's version."""
    import glob
    import sys

    roots = {}
    for p in glob.glob("/usr/share/doc/python3*/html/_sources"):
        real = Path(p).resolve()
        if real.is_dir() and any(real.rglob("*.rst.txt")):
            roots.setdefault(real, p)
    if not roots:
        return None
    mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for real in roots:
        if mine in real.parts:
            return real
    return sorted(roots, key=lambda r: str(r))[-1]


def pydoc_corpus(max_bytes: int = 0, root: Path | None = None) -> Corpus:
    root = Path(root) if root is not None else pydoc_root()
    if root is None or not root.is_dir():
        raise UserError(PROSE_HINT)
    cands = _walk(root, keep_file=lambda rel: rel.endswith(".rst.txt"))
    if not cands:  # the folder exists but the package's sources are gone (e.g. a partial install)
        raise UserError(f"{PROSE_HINT} ({root} has no .rst.txt files)")
    return _read_files("pydoc", root, cands, max_bytes)


def _pieces(rel: str, text: str, size: int = SINGLE_FILE_PIECE_BYTES) -> list[Document]:
    """Cut one text at line boundaries into ~``size``-byte documents ``rel#00000``, ``rel#00001``..."""
    out, buf, n = [], [], 0
    for line in text.splitlines(keepends=True):
        buf.append(line)
        n += len(line.encode("utf-8"))
        if n >= size:
            out.append("".join(buf))
            buf, n = [], 0
    if buf:
        out.append("".join(buf))
    return [Document(f"{rel}#{i:05d}", t) for i, t in enumerate(out) if t.strip()]


def path_corpus(spec_path: str, max_bytes: int = 0) -> Corpus:
    p = Path(spec_path).expanduser()
    name = f"path:{spec_path}"
    if not p.exists():
        raise UserError(f"corpus path {p} does not exist; fix data.corpus=path:<file or folder>")
    if p.is_file():
        corpus = _read_files(name, p.parent, [(p.name, p, p.stat().st_size)], max_bytes)
        if corpus.documents:  # one document would land in one split: cut it so all three get text
            corpus.documents = _pieces(p.name, corpus.documents[0].text)
    else:
        corpus = _read_files(name, p, _walk(p, keep_dir=lambda rel, d: d != "__pycache__"), max_bytes)
    if not corpus.documents:
        why = ", ".join(f"{v} {k}" for k, v in corpus.skipped.items()) or "no files"
        raise UserError(f"corpus path {p} has no usable text ({why}); point data.corpus at UTF-8 text files")
    return corpus


# ---- Hugging Face datasets (optional) ------------------------------------------------------------
def parse_hf(spec: str) -> tuple[str, str | None, str]:
    body = spec[len("hf:"):]
    body, _, split = body.partition("@")
    name, _, config = body.partition(":")
    if not name:
        raise UserError(f"bad corpus {spec!r}; write hf:<dataset>[:<config>][@split], e.g. hf:wikitext:wikitext-103-raw-v1@train")
    return name, (config or None), (split or "train")


def hf_corpus(spec: str, max_bytes: int = 0) -> Corpus:
    name, config, split = parse_hf(spec)
    try:
        import datasets
    except ImportError:
        raise UserError("Hugging Face corpora need the `datasets` package; pip install 'extrapolab[hf]' "
                        "or use --set data.corpus=stdlib") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, bad config: all one-line for the user
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(f"cannot load Hugging Face dataset {name!r} (config {config}, split {split}): "
                        f"{type(e).__name__}: {first}; go online once (unset HF_DATASETS_OFFLINE) so it is "
                        "cached, check the name, or use --set data.corpus=stdlib") from None
    columns = list(getattr(ds, "column_names", None) or [])
    col = "text" if "text" in columns else next((c for c in columns if _is_str_feature(ds, c)), None)
    if col is None:
        raise UserError(f"Hugging Face dataset {name!r} has no text column (columns: {columns}); pick a text dataset")
    docs, total, empty = [], 0, 0
    for i, row in enumerate(ds):
        text = row[col]
        if not isinstance(text, str) or not text.strip():
            empty += 1
            continue
        if max_bytes > 0 and total >= max_bytes:
            break
        docs.append(Document(f"{split}/{i:09d}", text))
        total += len(text.encode("utf-8"))
    return Corpus(spec, docs, {"empty": empty} if empty else {}, f"hf:{name}")


def _is_str_feature(ds, col: str) -> bool:
    feat = getattr(ds, "features", {}).get(col) if hasattr(ds, "features") else None
    return getattr(feat, "dtype", None) in ("string", "large_string")


def read_corpus(spec: str, max_bytes: int = 0) -> Corpus:
    """Read ``data.corpus`` into documents; one-line UserError for anything unusable."""
    spec = (spec or "").strip()
    if spec == "stdlib":
        corpus = stdlib_corpus(max_bytes)
    elif spec == "pydoc":
        corpus = pydoc_corpus(max_bytes)
    elif spec == "linux" or spec.startswith("linux:"):
        from .linux import linux_corpus

        corpus = linux_corpus(max_bytes, spec.partition(":")[2] or None)
    elif spec.startswith("path:"):
        corpus = path_corpus(spec[len("path:"):], max_bytes)
    elif spec.startswith("hf:"):
        corpus = hf_corpus(spec, max_bytes)
    else:
        raise UserError(f"unknown corpus {spec!r}; use stdlib, pydoc, linux, path:<file or folder> or "
                        "hf:<dataset>[:<config>][@split]")
    if not corpus.documents:
        raise UserError(f"corpus {spec} has no documents; use a different data.corpus")
    return corpus

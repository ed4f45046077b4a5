"""Documents, corpora, the manifest hash and the split rule shared by every corpus reader
(``corpus.py`` for folders and Hugging Face datasets, ``linux.py`` for the kernel tarball).

Documents go to train/valid/test by the first 8 hex digits of sha256(relative path) mod 100
(docs/architecture.md, "Data").
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Document:
    path: str  # relative, '/'-separated
    text: str

    @property
    def data(self) -> bytes:
        return self.text.encode("utf-8")


@dataclass
class Corpus:
    name: str  # the spec it was read from
    documents: list[Document]  # sorted by path
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    root: str = ""

    def manifest(self) -> list[dict]:
        out = []
        for d in self.documents:
            raw = d.data
            out.append({"path": d.path, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)})
        return out

    @property
    def num_bytes(self) -> int:
        return sum(len(d.data) for d in self.documents)


def manifest_hash(manifest: list[dict]) -> str:
    """sha256 of the canonical listing ``sha256<TAB>bytes<TAB>path`` per line, sorted by path."""
    lines = "".join(f"{m['sha256']}\t{m['bytes']}\t{m['path']}\n" for m in sorted(manifest, key=lambda m: m["path"]))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def split_bucket(path: str) -> int:
    """0..99 from the first 8 hex digits of sha256(relative path)."""
    return int(hashlib.sha256(path.encode("utf-8")).hexdigest()[:8], 16) % 100


def split_of(path: str, valid_percent: int, test_percent: int) -> str:
    b = split_bucket(path)
    if b < test_percent:
        return "test"
    if b < test_percent + valid_percent:
        return "valid"
    return "train"


def assign_splits(docs: list[Document], valid_percent: int, test_percent: int) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in docs:
        out[split_of(d.path, valid_percent, test_percent)].append(d)
    return out


def _decode(raw: bytes) -> str | None:
    """Text of a file, or None for binary (NUL byte or not UTF-8)."""
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text[1:] if text.startswith("\ufeff") else text

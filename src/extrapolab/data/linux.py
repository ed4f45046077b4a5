"""The Linux kernel's C source as a large code corpus (``data.corpus=linux``), read straight from
Debian's ``linux-source-<version>`` tarball without extracting it.

Why: the papers train GPT-2-small-sized models (~100M parameters) at L_tr = 512 on GitHub code
(ALiBi §4, KERPLE §5, Sandwich §4, Chi's thesis Table 3.x); the Python standard library (10 MB,
about 3 M tokens) is too small for that, and no corpus of that size ships on PyPI. Debian's
``linux-source-6.1`` (main component, GPL-2.0; ``apt-get install linux-source-6.1``, ~140 MB
download) installs ``/usr/src/linux-source-6.1.tar.xz``: 55,405 ``.c``/``.h`` files, 1.18 GB, of
which 54,677 files, 768 MB are kept here (measured on 6.1.192-2; ~300 M tokens with a 16k BPE).

Rules, the same as the other corpora (``documents.py``, ``corpus.py``): a document is one ``.c``/``.h`` member; its
relative path drops the tarball's top folder (``linux-source-6.1/kernel/fork.c`` -> ``kernel/fork.c``),
so a patch release moves no file to another split; split by sha256(relative path); the manifest lists
path + sha256 + bytes of every document used. Skipped, and counted in ``Corpus.skipped``: files
that are not UTF-8 or hold a NUL byte ("binary"), AMD GPU register headers (``asic_reg/``:
generated ``#define`` tables, 0.4 GB) and any file over ``MAX_FILE_BYTES`` (generated tables and
firmware arrays), empty files. With ``max_bytes`` the documents are taken in split-hash order, as
for folder corpora, so the sample is spread over the whole tree; the archive is streamed once and
at most about ``max_bytes`` of text is held in memory.

A damaged archive is a one-line error, never a smaller corpus: the compressed stream is read to its
end-of-stream marker (tar's own reader stops quietly when a truncated download happens to end at a
member header, which would silently drop the rest of the tree).
"""
from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import heapq
import lzma
import re
import tarfile
import zlib
from pathlib import Path

from ..io import UserError
from .documents import Corpus, Document, _decode

LINUX_GLOB = "/usr/src/linux-source-*.tar.*"
RULES_VERSION = 1  # bump when the member filters below change: prepared data keyed by the archive is re-read
MAX_FILE_BYTES = 1_000_000
SUFFIXES = (".c", ".h")
_GENERATED_DIRS = ("/asic_reg/",)
LINUX_HINT = ("Linux source corpus not installed; run `make corpus-linux` (sudo apt-get install -y "
              "linux-source-6.1, ~140 MB) or use --set data.corpus=stdlib")


#: compressed-stream magic bytes -> opener; each raises EOFError on a stream cut before its end marker
_OPENERS = {b"\xfd7zXZ\x00": lzma.open, b"BZh": bz2.open, b"\x1f\x8b": gzip.open}
_DAMAGED = (tarfile.TarError, OSError, EOFError, lzma.LZMAError, zlib.error)


def _open_stream(path: Path):
    """The archive's decompressed byte stream (xz, bzip2, gzip by magic bytes; else plain tar)."""
    with path.open("rb") as f:
        head = f.read(6)
    opener = next((o for magic, o in _OPENERS.items() if head.startswith(magic)), None)
    return opener(path, "rb") if opener else path.open("rb")


def _version_key(path: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", Path(path).name))


def linux_tarball() -> Path | None:
    """The newest installed ``/usr/src/linux-source-<version>.tar.{xz,bz2,gz}``, or None."""
    found = sorted(glob.glob(LINUX_GLOB), key=_version_key)
    return Path(found[-1]) if found else None


def _relative(name: str) -> str:
    """``linux-source-6.1/kernel/fork.c`` -> ``kernel/fork.c`` (the top folder names the version)."""
    parts = name.lstrip("./").split("/", 1)
    return parts[1] if len(parts) == 2 else parts[0]


def _skip_reason(rel: str, size: int) -> str | None:
    if any(d in f"/{rel}" for d in _GENERATED_DIRS):
        return "generated"
    if size > MAX_FILE_BYTES:
        return "over_1MB"
    return None


def linux_corpus(max_bytes: int = 0, tarball: str | Path | None = None) -> Corpus:
    """Documents of the kernel tarball (see module doc); one-line UserError when it is missing."""
    path = Path(tarball).expanduser() if tarball is not None else linux_tarball()
    if path is None:
        raise UserError(LINUX_HINT)
    if not path.is_file():
        raise UserError(f"Linux source tarball {path} not found; run `make corpus-linux` or fix data.corpus=linux:<tarball>")
    skipped: dict[str, int] = {}
    # (negated split-hash key, relative path, text): a max-heap on the key keeps the documents that come
    # first in split-hash order; with max_bytes, those past the budget are dropped as the stream goes
    kept: list[tuple[str, str, str]] = []
    total = 0
    try:
        with _open_stream(path) as raw, tarfile.open(fileobj=raw, mode="r|") as tf:  # one pass, nothing extracted
            for m in tf:
                if not m.isfile() or not m.name.endswith(SUFFIXES):
                    continue
                rel = _relative(m.name)
                why = _skip_reason(rel, m.size)
                text = None if why else _decode(tf.extractfile(m).read())
                if text is None or not text.strip():
                    why = why or ("binary" if text is None else "empty")
                    skipped[why] = skipped.get(why, 0) + 1
                    continue
                key = hashlib.sha256(rel.encode()).hexdigest()
                heapq.heappush(kept, (_neg(key), rel, text))
                total += len(text.encode("utf-8"))
                while max_bytes > 0 and len(kept) > 1 and total - _size(kept[0]) >= max_bytes:
                    total -= _size(heapq.heappop(kept))
            while raw.read(1 << 20):  # past tar's end blocks to the compressed stream's end marker
                pass
    except _DAMAGED as e:
        raise UserError(f"cannot read Linux source tarball {path}, truncated or corrupt ({type(e).__name__}: "
                        f"{str(e)[:120]}); reinstall it with `make corpus-linux`") from None
    docs = [Document(rel, text) for _, rel, text in sorted(kept, key=lambda k: (_neg(k[0]), k[1]))]
    if max_bytes > 0 and total > max_bytes and docs:  # the last document in hash order is cut, as elsewhere
        last = docs[-1]
        cut = last.data[:len(last.data) - (total - max_bytes)].decode("utf-8", errors="ignore")
        docs[-1] = Document(last.path, cut)
    docs.sort(key=lambda d: d.path)
    return Corpus(f"linux:{tarball}" if tarball is not None else "linux", docs, skipped, str(path))


def _neg(hexkey: str) -> str:
    """An order-reversing map of a hex string (for a max-heap with heapq's min-heap)."""
    return hexkey.translate(_FLIP)


_FLIP = str.maketrans("0123456789abcdef", "fedcba9876543210")


def _size(entry: tuple[str, str, str]) -> int:
    return len(entry[2].encode("utf-8"))

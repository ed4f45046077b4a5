"""Which corpus a number was measured on, in one line a reader can compare across hosts.

Two hosts that run the same preset read "the same" corpus from what they have installed: the
stdlib corpus from the running interpreter, the prose corpus from Debian's ``python3-doc``, the
Linux corpus from ``linux-source-<version>``. A package one release apart changes a few documents,
so the same commit reproduces a code table to the digit and a prose table not at all. The prepared
data already names its corpus exactly (``meta.json`` ``corpus_hash``: sha256 of the manifest,
data/documents.py); this module puts that hash, and where the text came from, beside every result:

* :func:`corpus_source` -- the source in words: the interpreter (implementation and version) for
  ``stdlib``, the Debian package that owns the folder or archive and its version for ``pydoc`` and
  ``linux`` (``dpkg-query -S``, then ``-W``; ``pydoc`` also names the ``python3-doc`` metapackage the
  Makefile installs), nothing for ``path:`` / ``hf:`` corpora (the hash is their identity);
* :func:`provenance` -- ``{"corpus", "corpus_hash", "source"}`` of a prepared dataset (its meta; the
  source is recorded when the data is built and worked out on this host for data built before that);
  :func:`corpus_provenance` the same from a data config, for studies on ``hf:`` models;
* :func:`corpus_line` -- the line every report prints; :func:`mixed_corpora` -- the one warning line
  when results to be compared (a sweep's runs, a resumed sweep, a report over several runs) were
  measured on different hashes of the same corpus.
"""
from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from pathlib import Path

HASH_DIGITS = 12  #: hex digits of the corpus hash shown (the records keep all 64)
NOT_RECORDED = "corpus hash not recorded"


@functools.lru_cache(maxsize=None)
def _dpkg(*args: str) -> str | None:
    """stdout of ``dpkg-query ARGS`` (stripped), or None without dpkg or on any failure (no package)."""
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def package_version(name: str) -> str | None:
    """The installed version of Debian package ``name`` (e.g. "3.11.2-1"), or None."""
    return _dpkg("-W", "-f=${Version}", name)


def owning_package(path) -> str | None:
    """The Debian package that installed ``path`` (``dpkg-query -S``, symlinks resolved), or None."""
    if not path:
        return None
    out = _dpkg("-S", str(Path(path).resolve()))
    if not out:
        return None
    first = out.splitlines()[0].split(":", 1)[0]  # "python3.11-doc: /usr/share/doc/..." (or "a, b: path")
    return first.split(",")[0].strip() or None


def corpus_source(corpus: str, root: str | None = None) -> str | None:
    """Where the text of corpus ``corpus`` (read from ``root``) came from, in words (module doc)."""
    spec = (corpus or "").strip()
    owner = owning_package(root) if spec in ("stdlib", "pydoc") or spec.startswith("linux") else None
    pkg = f"{owner} {package_version(owner) or '(version unknown)'}" if owner else None
    if spec == "stdlib":
        interp = f"{platform.python_implementation()} {platform.python_version()} standard library"
        return f"{interp} ({pkg})" if pkg else interp
    if spec == "pydoc":
        meta = package_version("python3-doc")
        extra = f" (python3-doc {meta})" if meta and owner != "python3-doc" else ""
        return (pkg + extra) if pkg else f"python3-doc files at {root} (no Debian package owns them)"
    if spec == "linux" or spec.startswith("linux:"):
        return pkg or (f"{Path(root).name} (no Debian package owns it)" if root else None)
    return None


def provenance(data) -> dict | None:
    """``{"corpus", "corpus_hash", "source"}`` of a prepared dataset (a ``TokenData`` or its meta dict);
    None for data with no corpus hash (arrays made in memory)."""
    meta = getattr(data, "meta", data) or {}
    chash = meta.get("corpus_hash")
    if not chash:
        return None
    source = meta.get("corpus_source")
    if source is None and "corpus_source" not in meta:  # prepared before sources were recorded: this host's
        source = corpus_source(meta.get("corpus", ""), meta.get("corpus_root"))
    return {"corpus": meta.get("corpus"), "corpus_hash": chash, "source": source}


def corpus_provenance(data_cfg) -> dict:
    """:func:`provenance` of ``data_cfg.corpus`` read as ``prepare`` reads it, for studies that tokenize it with a
    model's own tokenizer (``hf:``) and so have no prepared meta to read it from."""
    from .corpus import read_corpus
    from .documents import manifest_hash

    corpus = read_corpus(data_cfg.corpus, data_cfg.max_bytes)
    return {"corpus": data_cfg.corpus, "corpus_hash": manifest_hash(corpus.manifest()),
            "source": corpus_source(data_cfg.corpus, corpus.root)}


def corpus_line(p: dict | None, corpus: str | None = None) -> str:
    """``corpus pydoc: sha256 3f2a9c0b1d4e... of the manifest, from python3.11-doc 3.11.2-6+deb12u8 (...)``;
    ``corpus X: corpus hash not recorded`` without one."""
    name = (p or {}).get("corpus") or corpus or "?"
    if not p or not p.get("corpus_hash"):
        return f"corpus {name}: {NOT_RECORDED}"
    line = f"corpus {name}: sha256 {p['corpus_hash'][:HASH_DIGITS]}… of its manifest"
    return line + (f", from {p['source']}" if p.get("source") else "")


def mixed_corpora(records) -> str | None:
    """One warning line when ``records`` (``(label, provenance or None)`` pairs, e.g. a sweep's runs) hold
    more than one hash for the same corpus name, naming the hashes and which labels hold each; else None."""
    by_corpus: dict = {}
    for label, p in records:
        if p and p.get("corpus_hash"):
            by_corpus.setdefault(p.get("corpus"), {}).setdefault(p["corpus_hash"], []).append(str(label))
    parts = []
    for corpus, hashes in by_corpus.items():
        if len(hashes) > 1:
            parts.append(f"corpus {corpus} has {len(hashes)} hashes: " + "; ".join(
                f"{h[:HASH_DIGITS]} ({_few(labels)})" for h, labels in hashes.items()))
    if not parts:
        return None
    return ("warning: these results were measured on different texts of the same corpus (another host or "
            "package version): " + " | ".join(parts) + "; compare them with care or re-run on one corpus")


def _few(labels: list[str], n: int = 3) -> str:
    return ", ".join(labels[:n]) + (f" and {len(labels) - n} more" if len(labels) > n else "")

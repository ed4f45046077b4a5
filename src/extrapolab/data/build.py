"""``prepare(cfg)``: corpus -> manifest -> split -> tokenizer -> memory-mapped token streams (cached).

The cache folder ``<cache_dir>/data/<corpus>-<tokenizer>-<key>`` is keyed by the corpus hash
(sha256 of the manifest), tokenizer settings and split settings; it is built in a temp folder
and renamed into place, so it is either complete or absent. A second call re-reads and hashes
the corpus (tens of ms for the 10 MB stdlib; the Linux tarball is found by its path, size and mtime
instead, see ``_archive_pointer``) and opens the cached streams. Building holds a lock
on the entry (``.<entry>.lock``, ``fcntl.flock``): a concurrent prepare of the same dataset waits
and then reuses it, and temp folders left by a killed prepare are removed by the next one.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..io import LockBusy, UserError, atomic_path, atomic_write_json, file_lock
from .corpus import SPLITS, Corpus, assign_splits, manifest_hash, read_corpus
from .origin import corpus_source
from .store import DATA_FORMAT, TokenData, dtype_for, load
from .tokenizer import TOKENIZER_VERSION, BytesCodec, check_settings, get_bpe

SPLIT_RULE = "int(sha256(relative path)[:8], 16) % 100: < test_percent -> test, < test+valid -> valid, else train"
BATCH_DOCS = 64


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def check_split_settings(valid_percent: int, test_percent: int) -> None:
    for name, v in (("valid_percent", valid_percent), ("test_percent", test_percent)):
        if not 0 <= v <= 100:
            raise UserError(f"data.{name}={v} must be within 0..100")
    if valid_percent + test_percent >= 100:
        raise UserError(f"data.valid_percent + data.test_percent = {valid_percent + test_percent} leaves no "
                        "training data; keep the sum below 100 (default 5 + 5)")


def dataset_key(corpus_hash: str, cfg) -> str:
    vocab = cfg.vocab_size if cfg.tokenizer == "bpe" else 257
    raw = json.dumps([DATA_FORMAT, corpus_hash, cfg.tokenizer, vocab, TOKENIZER_VERSION,
                      cfg.valid_percent, cfg.test_percent])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _slug(spec: str) -> str:
    spec = spec.rstrip("/")
    base = spec if spec in ("stdlib", "pydoc", "linux") else spec.split(":", 1)[0] + "-" + re.split(r"[/:]", spec)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base)[:40]


def prepare(cfg, progress: bool = True) -> TokenData:
    """Build or reuse the prepared dataset for ``cfg`` (a ``DataConfig``) and return it."""
    check_settings(cfg.tokenizer, cfg.vocab_size)
    check_split_settings(cfg.valid_percent, cfg.test_percent)
    if cfg.max_bytes < 0:
        raise UserError(f"data.max_bytes={cfg.max_bytes} must be >= 0 (0 = whole corpus)")
    pointer = _archive_pointer(cfg)
    if pointer is not None and pointer.is_file():  # the same archive file, settings and rules: skip re-reading it
        try:
            return load(pointer.parent / json.loads(pointer.read_text())["folder"])
        except (UserError, ValueError, KeyError, TypeError, OSError):
            pass  # stale or damaged: read the archive again below
    data = _prepare_read(cfg, progress)
    if pointer is not None:
        atomic_write_json(pointer, {"folder": data.path.name, "corpus": cfg.corpus})
    return data


def _archive_pointer(cfg) -> Path | None:
    """For a corpus read from one large archive (``linux``): ``<cache>/data/.archive-<key>.json`` naming the
    prepared folder, keyed by the archive's path, size and mtime and every setting that shapes the data,
    so a second prepare (each sweep run, ``eval RUN``) does not decompress and hash ~1 GB again (~1 min).
    None for the other corpora: re-reading them costs tens of ms and catches any edit."""
    from .linux import RULES_VERSION, linux_tarball

    spec = (cfg.corpus or "").strip()
    if spec != "linux" and not spec.startswith("linux:"):
        return None
    path = Path(spec.partition(":")[2]).expanduser() if spec.partition(":")[2] else linux_tarball()
    if path is None or not path.is_file():
        return None  # read_corpus raises the one-line error
    st = path.stat()
    raw = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, RULES_VERSION, cfg.max_bytes, DATA_FORMAT,
                      cfg.tokenizer, cfg.vocab_size, TOKENIZER_VERSION, cfg.valid_percent, cfg.test_percent])
    return Path(cfg.cache_dir) / "data" / f".archive-{hashlib.sha256(raw.encode()).hexdigest()[:16]}.json"


def _prepare_read(cfg, progress: bool) -> TokenData:
    corpus = read_corpus(cfg.corpus, cfg.max_bytes)
    manifest = corpus.manifest()
    chash = manifest_hash(manifest)
    tok_tag = f"bpe{cfg.vocab_size}" if cfg.tokenizer == "bpe" else "bytes"
    folder = Path(cfg.cache_dir) / "data" / f"{_slug(cfg.corpus)}-{tok_tag}-{dataset_key(chash, cfg)}"
    if folder.is_dir():
        try:
            return load(folder)
        except UserError:
            pass  # damaged, or being replaced: decided under the lock below
    # one builder per cache entry: a concurrent prepare of the same dataset waits, then reuses it
    with file_lock(_lock_path(folder), wait=None, owner=f"extrapolab prepare {cfg.corpus}",
                   on_wait=lambda who: _say(f"waiting for another process preparing {folder.name} ({who})", progress)):
        if folder.is_dir():
            try:
                return load(folder)
            except UserError as e:  # our own cache entry, keyed by content: rebuilding it is safe
                _say(f"rebuilding damaged cache ({e})", progress)
                shutil.rmtree(folder, ignore_errors=True)
        clean_stale_tmp(folder.parent, progress)
        return _build(cfg, corpus, manifest, chash, folder, progress)


def _lock_path(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def clean_stale_tmp(parent: Path, progress: bool = False) -> list[Path]:
    """Remove ``.tmp-<entry>-*`` build folders left by a prepare that was killed.

    A temp folder is stale when nobody holds its entry's lock (a live builder always does; the
    kernel drops the lock of a dead one); the caller's own entry counts as free (re-entrant).
    """
    removed = []
    for tmp in sorted(Path(parent).glob(".tmp-*")):
        name = tmp.name[len(".tmp-"):].rpartition("-")[0]  # mkdtemp: .tmp-<entry>-<random>
        if not tmp.is_dir() or not name:
            continue
        try:
            with file_lock(_lock_path(Path(parent) / name), wait=0):
                shutil.rmtree(tmp, ignore_errors=True)
        except LockBusy:
            continue  # being built right now
        removed.append(tmp)
        _say(f"removed {tmp.name}, left by a prepare that was stopped", progress)
    return removed


def _build(cfg, corpus: Corpus, manifest: list[dict], chash: str, folder: Path, progress: bool) -> TokenData:
    t_start = time.perf_counter()
    splits = assign_splits(corpus.documents, cfg.valid_percent, cfg.test_percent)
    if not splits["train"]:
        raise UserError(f"corpus too small: none of its {len(corpus.documents)} documents fell in the train split; "
                        "use a bigger corpus (data.max_bytes=0) or lower data.valid_percent/test_percent")
    split_of = {d.path: s for s, docs in splits.items() for d in docs}
    tok_info: dict = {"cached": None, "train_seconds": None}
    if cfg.tokenizer == "bytes":
        codec = BytesCodec()
    else:
        train_manifest = [m for m in manifest if split_of[m["path"]] == "train"]
        _say(f"BPE tokenizer (vocab {cfg.vocab_size}) on {len(train_manifest)} train documents ...", progress)
        codec, tok_info = get_bpe([d.text for d in splits["train"]], manifest_hash(train_manifest),
                                  cfg.vocab_size, Path(cfg.cache_dir))
        if tok_info["train_seconds"] is not None:
            _say(f"trained BPE in {tok_info['train_seconds']:.1f} s", progress)
    dtype = dtype_for(codec.vocab_size)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        counts = {}
        for s in SPLITS:
            counts[s] = _write_split(tmp / f"{s}.bin", splits[s], codec, dtype, s, progress)
        codec.save(tmp)
        atomic_write_json(tmp / "manifest.json", {
            "corpus": cfg.corpus, "root": corpus.root, "hash": chash, "skipped": corpus.skipped,
            "documents": [dict(m, split=split_of[m["path"]]) for m in manifest],
        })
        nbytes = {s: sum(m["bytes"] for m in manifest if split_of[m["path"]] == s) for s in SPLITS}
        meta = {
            "format": DATA_FORMAT,
            "corpus": cfg.corpus,
            "corpus_root": corpus.root,
            "corpus_hash": chash,
            "manifest_hash": chash,
            "corpus_source": corpus_source(cfg.corpus, corpus.root),  # the package or interpreter it came from
            "max_bytes": cfg.max_bytes,
            "skipped": corpus.skipped,
            "vocab_size": codec.vocab_size,
            "eot_id": codec.eot_id,
            "dtype": dtype.name,
            "tokenizer": {"kind": codec.kind, "vocab_size": codec.vocab_size, "requested_vocab_size":
                          cfg.vocab_size if codec.kind == "bpe" else 257, "eot_id": codec.eot_id,
                          "hash": codec.hash, "version": TOKENIZER_VERSION, "trained_on": "train",
                          "train_seconds": tok_info["train_seconds"], "from_cache": tok_info["cached"]},
            "split": {"rule": SPLIT_RULE, "valid_percent": cfg.valid_percent, "test_percent": cfg.test_percent},
            "documents": {s: len(splits[s]) for s in SPLITS},
            "tokens": counts,
            "bytes": nbytes,
            "tokens_per_byte": {s: round(counts[s] / nbytes[s], 4) if nbytes[s] else None for s in SPLITS},
            "eot": "after every document",
            "versions": _versions(),
            "prepare_seconds": round(time.perf_counter() - t_start, 3),
        }
        atomic_write_json(tmp / "meta.json", meta)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished the same dataset first: use theirs
            if not (folder / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(f"prepared {cfg.corpus}: " + ", ".join(f"{s} {counts[s]:,} tokens" for s in SPLITS), progress)
    return load(folder)


def _write_split(path: Path, docs, codec, dtype: np.dtype, name: str, progress: bool) -> int:
    """Encode ``docs`` in batches (HF batch encoding for BPE), EOT after each, to a flat ``.bin``."""
    from tqdm.auto import tqdm

    eot = np.array([codec.eot_id], dtype=dtype)
    total = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f, \
            tqdm(total=len(docs), desc=f"tokenize {name}", unit="doc", disable=not progress, leave=False) as bar:
        for i in range(0, len(docs), BATCH_DOCS):
            batch = docs[i:i + BATCH_DOCS]
            for ids in codec.encode_batch([d.text for d in batch]):
                f.write(ids.astype(dtype).tobytes())
                f.write(eot.tobytes())
                total += ids.size + 1
            bar.update(len(batch))
    return total


def _versions() -> dict:
    import tokenizers

    from .. import __version__

    return {"extrapolab": __version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__,
            "python": platform.python_version()}

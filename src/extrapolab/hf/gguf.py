"""GGUF files (llama.cpp's format) as ``hf:FILE.gguf``: converted once, then a plain local folder.

transformers reads a GGUF file with ``from_pretrained(dir, gguf_file=name)`` (with the ``gguf`` and
``accelerate`` packages) and de-quantises every tensor to float (``GgufConfig(dequantize=True)``:
the same dense model whether or not a packed-matmul kernel is installed). That takes seconds to
minutes, so the first load writes what it produced as an ordinary model folder and every later
load reads that folder (``from_pretrained`` of safetensors, as for any ``hf:DIR``):

    <cache_dir>/gguf/<sha256[:16]>/  model.safetensors  config.json  tokenizer files  gguf.json

keyed by the file's sha256 (a renamed copy hits the same folder; a changed file does not).
transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the fp32 state dict (tied
weights stored once, as ``save_pretrained`` does) and the config (without its GGUF
``quantization_config``) are written here; the tokenizer saves itself. The folder is built under a
temporary name and renamed when complete, under a lock, so a failure, a kill or a second process
never leaves a half-written folder in its place (a killed build's temp folder is removed by the
next build of that file).

Before anything is written the file is checked: the magic (``GGUF``), its header parsed by
``gguf.GGUFReader`` (metadata only, no weights), every tensor's data inside the file (a truncated
download), and the architecture read by transformers' own GGUF config reader; each failure is one
line naming the file and the fix. :func:`read_gguf` is also the run record's ``model.gguf`` block:
file, sha256, the quantisation types the weights came from, and the metadata that matters here.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch

from ..io import UserError, atomic_write_json, file_lock, fsync_path, sha256_file

MAGIC = b"GGUF"
FORMAT = 1  # layout of the cached folder; a different number is converted again
SUBDIR = "gguf"
#: GGUF metadata recorded in the run record (``{arch}.`` keys; llama.cpp names, see gguf.constants.Keys)
ARCH_KEYS = {"context_length": "context_length", "rope_freq_base": "rope.freq_base",
             "rope_dimension_count": "rope.dimension_count", "head_count": "attention.head_count",
             "head_count_kv": "attention.head_count_kv", "block_count": "block_count",
             "embedding_length": "embedding_length", "feed_forward_length": "feed_forward_length",
             "sliding_window": "attention.sliding_window", "vocab_size": "vocab_size"}
GENERAL_KEYS = {"architecture": "general.architecture", "name": "general.name",
                "tokenizer_model": "tokenizer.ggml.model", "add_bos_token": "tokenizer.ggml.add_bos_token"}
NOT_GGUF = "pass hf:FILE.gguf (a llama.cpp GGUF file) or hf:DIR (a folder written by save_pretrained)"
DAMAGED = "download it again and check its sha256"



def _value(field):
    v = field.contents()
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def check_magic(path: Path) -> None:
    """One line unless ``path`` is a readable file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}); {NOT_GGUF}") from None
    if head != MAGIC:
        raise UserError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); {NOT_GGUF}")


def read_gguf(path) -> dict:
    """The file's metadata (no weights): architecture, quantisation types, the keys of ``ARCH_KEYS``.
    Raises a one-line UserError for a file that is not GGUF or is truncated (see module doc)."""
    path = Path(path)
    check_magic(path)
    try:
        import gguf
    except ImportError:
        raise UserError("hf:FILE.gguf needs the `gguf` and `accelerate` packages; install them "
                        "(pip install -e '.[hf]')") from None
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
        fields = reader.fields
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OverflowError, OSError, EOFError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is a truncated or damaged GGUF file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'unreadable header'}); {DAMAGED}") from None
    if not reader.tensors:
        raise UserError(f"{path} is a GGUF file without weights (no tensors); pass the model's full GGUF file")
    if end > size:
        raise UserError(f"{path} is a truncated GGUF file ({size:,} bytes, its tensors need {end:,}); {DAMAGED}")
    meta = {k: _value(fields[key]) for k, key in GENERAL_KEYS.items() if key in fields}
    arch = meta.get("architecture", "")
    meta.update({k: _value(fields[f"{arch}.{key}"]) for k, key in ARCH_KEYS.items() if f"{arch}.{key}" in fields})
    types = Counter(t.tensor_type.name for t in reader.tensors)
    weights = Counter()
    for t in reader.tensors:
        weights[t.tensor_type.name] += int(t.n_elements)
    ftype = fields.get("general.file_type")
    file_type = None
    if ftype is not None:
        try:
            file_type = gguf.LlamaFileType(int(_value(ftype))).name
        except ValueError:
            file_type = int(_value(ftype))
    return {"file": str(path.resolve()), "bytes": size, "file_type": file_type,
            "quantization": dict(types.most_common()), "parameters_by_type": dict(weights.most_common()),
            "metadata": meta}


def _check_architecture(tr, path: Path, meta: dict):
    """transformers' own GGUF config reader on the file -> its config, or a one-line error."""
    arch = meta.get("architecture", "?")
    try:
        config = tr.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        supported = ", ".join(sorted(set(tr.integrations.ggml.GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}))
        raise UserError(f"{path}: transformers {tr.__version__} cannot read GGUF architecture {arch!r} "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); use a GGUF of an "
                        f"architecture it reads: {supported}") from None
    if type(config) not in tr.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UserError(f"{path}: GGUF architecture {arch!r} ({config.model_type}) is not a causal LM in "
                        f"transformers {tr.__version__}; use a decoder-only model's GGUF")
    return config


def _state_dict(model) -> dict:
    """fp32 state dict with each shared tensor once (tied output head dropped, as save_pretrained does)."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    sd = model.state_dict()
    out, seen = {}, set()
    for k in sorted(sd, key=lambda k: k in tied):  # a tied target comes after its source
        t = sd[k]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = t.detach().contiguous()
    return out


def _convert(tr, path: Path, tmp: Path, record: dict) -> None:
    """Load ``path`` through transformers (de-quantised to fp32) and write the plain folder ``tmp``."""
    from safetensors.torch import save_file

    kw = dict(gguf_file=path.name, local_files_only=True)
    try:
        model = tr.AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, quantization_config=tr.GgufConfig(dequantize=True), **kw)
        tok = tr.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
        raise UserError(f"transformers {tr.__version__} cannot load {path} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); {DAMAGED}") from None
    try:
        tmp.mkdir(parents=True)
        save_file(_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the folder holds plain float weights
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        from importlib.metadata import version

        atomic_write_json(tmp / "gguf.json", {**record, "format": FORMAT, "converted_with": {
            "transformers": tr.__version__, "gguf": version("gguf"), "dtype": "float32"}})
        for f in tmp.iterdir():
            fsync_path(f)
    except OSError as e:  # disk full, quota, read-only cache
        raise UserError(f"could not write the converted {path.name} under {tmp.parent} ({e.strerror or e}); "
                        "free disk space or set data.cache_dir to a writable folder") from None


def _cached(folder: Path, digest: str) -> dict | None:
    """The record of a complete converted folder for ``digest``, else None."""
    try:
        rec = json.loads((folder / "gguf.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if rec.get("sha256") == digest and rec.get("format") == FORMAT else None


def _made_dirs(path: Path) -> list[Path]:
    """``path`` and its missing parents, created; returned deepest first (to remove if left empty)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return missing


def gguf_folder(path, cache_dir, tr) -> tuple[Path, dict]:
    """(plain model folder of GGUF file ``path``, its record); converts once per sha256 (module doc)."""
    path = Path(path)
    check_magic(path)
    digest = sha256_file(path)
    root = Path(cache_dir) / SUBDIR
    folder = root / digest[:16]

    def found(rec, how="hit"):  # same bytes: the stored record, with this file's name
        keep = {k: v for k, v in rec.items() if k != "format"}
        return folder, {**keep, "file": str(path.resolve()), "cache": how, "folder": str(folder)}

    rec = _cached(folder, digest)
    if rec:
        return found(rec)
    record = {**read_gguf(path), "sha256": digest}
    _check_architecture(tr, path, record["metadata"])
    created = _made_dirs(root)
    try:
        with file_lock(root / f".{digest[:16]}.lock", wait=None, owner=f"converting {path.name}"):
            rec = _cached(folder, digest)  # another process may have finished it meanwhile
            if not rec:
                for stale in root.glob(f".{digest[:16]}.tmp-*"):  # left by a killed build
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = root / f".{digest[:16]}.tmp-{os.getpid()}"
                print(f"converting {path.name} once (de-quantising through transformers) -> {folder}",
                      file=sys.stderr, flush=True)
                try:
                    _convert(tr, path, tmp, record)
                    if folder.exists():  # an older format: replaced whole
                        shutil.rmtree(folder)
                    os.replace(tmp, folder)
                    fsync_path(root)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                return found(_cached(folder, digest), "converted")
    except BaseException:
        for d in created:  # nothing left in the cache by a failed first conversion
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return found(rec)

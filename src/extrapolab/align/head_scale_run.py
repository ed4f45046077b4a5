"""The NoPE head scale on one trained run (Wang et al., ACL 2024, "Length Generalization of Causal
Transformers without Position Encoding", arXiv 2404.12224, §3-4: the uniform attention scale, then one
scale per head tuned alone at the target length): ``extrapolab align head-scale RUN --length L``.

The step next to Algorithm 1 for NoPE runs. :func:`head_scale_run` calls the three functions of
:mod:`.head_scale` in order on a run's training split -- :func:`~.head_scale.with_head_scale` (the same
model, scheme ``nope-headscale``, every λ = 1), :func:`~.head_scale.uniform_scale_search` (one λ for
every head on a grid, lowest loss at L) and :func:`~.head_scale.tune_head_scale` (the λ alone, every
other weight frozen, λ >= 1 after each step, from the search's best) -- and writes the tuned model as a
run folder of its own: ``config.yaml`` (scheme ``nope-headscale``), ``checkpoints/best`` and
``checkpoints/last``, and ``head-scale.json`` (the search, the tuning and E1 perplexity at L_tr and at
L before and after, on the run's evaluation split). Every other verb reads that folder as any run
(``extrapolab eval OUT``, ``analyze``, ``align``).

The folder is built in a temporary folder next to its destination and renamed into place, so it is
complete or absent; ``head-scale.json`` keeps the settings and the source checkpoint's sha256, and
the same command with the same settings reuses it instead of tuning again (resumable like the other
align verbs). Inside a sweep the same function makes a ``head_scale:`` entry's run (sweep/derived.py).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .. import config as C
from ..io import UserError, atomic_write_json, is_locked, run_lock, run_lock_path
from .head_scale import SCALE_GRID, tune_head_scale, uniform_scale_search, with_head_scale

RESULT = "head-scale.json"


@dataclass
class HeadScaleSpec:
    """The settings of one head-scale step (the official run: 200 steps at lr 0.1, λ >= 1)."""

    length: int  # the target length L (> the run's L_tr)
    grid: list[float] = field(default_factory=lambda: list(SCALE_GRID))  # uniform scales searched
    segments: int = 4  # search: segments of L tokens from the training split
    steps: int = 200  # tuning steps, one batch of ``batch_size`` segments of L each
    lr: float = 0.1
    min_scale: float | None = 1.0  # the focus constraint (None: only λ > 0)
    batch_size: int = 1
    seed: int = 0
    ppl_tokens: int = 16384  # E1 before/after: tokens of the evaluation split scored at L and at L_tr
    which: str = "best"  # the source run's checkpoint

    @classmethod
    def from_dict(cls, d: dict) -> "HeadScaleSpec":
        try:
            spec = C.from_dict(cls, dict(d), "head_scale")
        except TypeError as e:  # a missing length
            raise UserError(f"head_scale needs length (the target length L), e.g. {{length: 1024}}; {e}") from None
        return spec.checked()

    def checked(self) -> "HeadScaleSpec":
        if not self.grid or any(not float(g) > 0 for g in self.grid):
            raise UserError(f"head-scale grid must be positive scales, e.g. 1.0,1.2,1.4; got {self.grid}")
        for name in ("segments", "steps", "batch_size", "ppl_tokens"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"head-scale {name} must be >= 1, got {getattr(self, name)}")
        if not float(self.lr) > 0:
            raise UserError(f"head-scale lr must be > 0, got {self.lr}; the paper uses 0.1")
        if self.which not in ("best", "last"):
            raise UserError(f"head-scale checkpoint must be best or last, got {self.which!r}")
        return self


def check_source(run_dir: Path, length: int) -> C.RunConfig:
    """The source run's config, or a one-line error: not a run, not NoPE, L <= L_tr, being trained."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not a run folder (no config.yaml); pass a folder made by `extrapolab train`")
    cfg = C.load(run_dir / "config.yaml")
    if cfg.model.scheme != "none" or getattr(cfg.model, "arch", "gpt") != "gpt":
        raise UserError(f"{run_dir} is not a NoPE run (model.scheme={cfg.model.scheme}); the head scale applies to "
                        "runs trained with model.scheme=none")
    if int(length) <= cfg.model.train_length:
        raise UserError(f"--length {length} must exceed the run's training length {cfg.model.train_length}; "
                        f"e.g. --length {4 * cfg.model.train_length}")
    holder = is_locked(run_lock_path(run_dir))
    if holder:
        raise UserError(f"{run_dir} is being trained by another process ({holder}); wait for it to finish")
    return cfg


def _source_sha(run_dir: Path, which: str) -> str:
    from ..train.checkpoint import MANIFEST, WEIGHTS, checkpoint_path

    path = checkpoint_path(run_dir, which)
    if path is None:
        raise UserError(f"run {run_dir} has no '{which}' checkpoint; train it first or pass --checkpoint last")
    return json.loads((path / MANIFEST).read_text())["files"][WEIGHTS]["sha256"]


def default_out(run_dir: Path, length: int) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f"{run_dir.name}-headscale-{int(length)}"


def stored(out: Path, key: dict) -> dict | None:
    """``out``'s head-scale.json when it was made with ``key`` and its checkpoint is there, else None."""
    try:
        old = json.loads((Path(out) / RESULT).read_text())
    except (OSError, ValueError):
        return None
    if old.get("key") != key or not (Path(out) / "checkpoints" / "best").is_dir():
        return None
    return old


def head_scale_run(run_dir, spec: HeadScaleSpec, out=None, *, device: str = "cpu", dtype: str = "fp32",
                   data=None, say=lambda m: None) -> dict:
    """Search, tune and save the head scale of NoPE run ``run_dir`` at ``spec.length`` -> the stored
    result (``out``/head-scale.json, with "out" and "reused" added)."""
    from ..eval.perplexity import nonoverlapping
    from ..train import load_model, placement
    from ..train.checkpoint import save_checkpoint, unique_weights, aliases

    run_dir, spec = Path(run_dir), spec.checked()
    cfg = check_source(run_dir, spec.length)
    out = Path(out) if out else default_out(run_dir, spec.length)
    if out.resolve() == run_dir.resolve():
        raise UserError(f"--out {out} is the source run; pass another folder")
    key = json.loads(json.dumps({"source": str(run_dir.resolve()), "sha256": _source_sha(run_dir, spec.which),
                                 "spec": asdict(spec)}))
    with run_lock(out, owner=f"align head-scale {run_dir.name}"):
        old = stored(out, key)
        if old is not None:
            say(f"head scale: reusing {out / RESULT}")
            return {**old, "out": str(out), "reused": True}
        t0 = time.time()
        place = placement(device, dtype)
        model, _ = load_model(run_dir, spec.which, place.device)
        if data is None:
            from ..data import prepare

            data = prepare(cfg.data, progress=False)
        train_tokens, test_tokens = data.split("train"), data.split(cfg.eval.split)
        L, L_tr, bs = int(spec.length), cfg.model.train_length, cfg.eval.batch_size

        def ppl(m, length):
            with torch.no_grad(), place.autocast():
                return nonoverlapping(m, test_tokens, length, max_tokens=spec.ppl_tokens, batch_size=bs)["ppl"]

        before = {"train_length": ppl(model, L_tr), "length": ppl(model, L)}
        say(f"head scale: NoPE ppl {before['length']:.3f} at L={L}; searching one scale over {len(spec.grid)} values")
        hs = with_head_scale(model, 1.0, spec.min_scale)
        with place.autocast():
            search = uniform_scale_search(hs, train_tokens, L, spec.grid, segments=spec.segments, seed=spec.seed)
            say(f"head scale: uniform λ = {search['best']:g}; tuning the {hs.scheme.scale.numel()} scales alone for "
                f"{spec.steps} steps at L={L}")
            tune = tune_head_scale(hs, train_tokens, L, steps=spec.steps, lr=spec.lr, init=search["best"],
                                   min_scale=spec.min_scale, batch_size=spec.batch_size, seed=spec.seed)
        hs.eval()
        after = {"train_length": ppl(hs, L_tr), "length": ppl(hs, L)}
        res = {"key": key, "source": str(run_dir), "length": L, "train_length": L_tr, "search": search,
               "tune": tune, "ppl_before": before, "ppl_after": after, "split": cfg.eval.split,
               "placement": place.describe(), "seconds": time.time() - t0}
        new = copy.deepcopy(cfg)
        new.name, new.model = out.name, replace(cfg.model, scheme="nope-headscale",
                                                scheme_params={"scale": float(search["best"]),
                                                               "min_scale": spec.min_scale})
        weights = unique_weights(hs.state_dict(), aliases(hs))

        def fill(tmp: Path) -> None:
            for which in ("best", "last"):
                save_checkpoint(tmp / "checkpoints" / which, weights, new, None)
            C.save(new, tmp / "config.yaml")
            atomic_write_json(tmp / RESULT, res)

        _replace_folder(out, fill)
        say(f"head scale: ppl at L={L} {before['length']:.3f} -> {after['length']:.3f}; wrote {out}")
        return {**res, "out": str(out), "reused": False}


def _replace_folder(dest: Path, fill) -> None:
    """``fill(tmp)`` a temporary folder next to ``dest``, then rename it to ``dest`` (the old one removed)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o755)
    old = dest.parent / f".{dest.name}.old"
    try:
        fill(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def head_scale_table(res: dict) -> str:
    """Markdown: E1 perplexity at L_tr and at L before (NoPE) and after (tuned head scale)."""
    b, a, L, L_tr = res["ppl_before"], res["ppl_after"], res["length"], res["train_length"]
    lam = torch.tensor(res["tune"]["scale"])
    return "\n".join([
        f"| E1 ppl | L_tr = {L_tr} | L = {L} |", "|---|---|---|",
        f"| NoPE | {b['train_length']:.3f} | {b['length']:.3f} |",
        f"| head scale (uniform λ {res['search']['best']:g}, then per head) | {a['train_length']:.3f} | "
        f"{a['length']:.3f} |", "",
        f"λ per layer and head: min {float(lam.min()):.3f}, mean {float(lam.mean()):.3f}, max {float(lam.max()):.3f} "
        f"(tuning loss {res['tune']['loss_before']:.3f} -> {res['tune']['loss_after']:.3f})"])

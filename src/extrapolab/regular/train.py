"""Train and evaluate one (task, model, seed) of the regular-language benchmark (thesis §6.4).

Protocol (thesis Table 6.1 and the authors' reference code): every step draws ONE length uniformly from
the task's valid lengths in [train_min, train_max] (1..40 Deletang, 1..50 Bhattacharya) and a
batch of 128 strings of that length; Adam, gradient clipping 1.0. The loss is on the final label
(``supervision="last"``, the table's protocol) or averaged over the label of every valid prefix
(``"prefix"``: the automaton state after each step, Liu et al. 2023a's dense transduction). Every ``eval_every`` steps the
model is scored on held-out strings at the largest training length ("in-distribution") and at
the validation lengths: default 2·train_max and 8·train_max, i.e. 80 and 320 for the Deletang
tasks, 100 and 400 for the others, strings drawn from a seed stream disjoint from the test
strings. The longer one needs more levels than any training length, which is what selects
checkpoints that extrapolate (docs/results/regular-table-6.1.md). The checkpoint with the best validation accuracy is
kept (ties: the earlier one); training stops once both accuracies reach ``stop_acc`` in
``stop_patience`` consecutive evaluations. Finally every valid length in [test_min, test_max]
(step ``test_stride``) is scored on ``test_samples`` fresh strings; ``mean_test`` averages
exactly those lengths (e.g. all 460 lengths 41..500 for Parity, the 230 odd lengths for
Modular Arithmetic, the 25 even lengths 52..100 for D_n).
"""
from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..io import UserError, atomic_write_json, atomic_write_with
from ..positional import randomized
from ..positional.base import SchemeError
from ..positional.positions import to_device
from .baselines import build_model
from .tasks import IGNORE, make_task

VAL_STREAM, TEST_STREAM, TRAIN_STREAM = 7001, 7002, 7003
#: RegularRunConfig fields that say where a run computes, not what: ignored when a finished run is matched
PLACEMENT = ("device", "precision")


@dataclass
class RegularRunConfig:
    task: str = "parity"
    task_options: dict = field(default_factory=dict)
    model: str = "regulargpt"  # regulargpt | transformer | lstm | rnn
    model_options: dict = field(default_factory=dict)
    seed: int = 0
    steps: int = 3000  # maximum optimizer steps
    batch_size: int = 128
    lr: float = 1e-3
    clip: float = 1.0
    train_min: int = 1
    train_max: int | None = None  # None: the task's (40 or 50)
    eval_every: int = 100
    val_lengths: list[int] | None = None  # None: [2 * train_max, 8 * train_max]
    val_samples: int = 256
    stop_acc: float | None = 1.0  # None: never stop early
    stop_patience: int = 1  # stop after this many consecutive evaluations at stop_acc
    test_min: int | None = None  # None: the task's (41 or 51)
    test_max: int | None = None  # None: the task's (500 or 100)
    test_stride: int = 1
    test_samples: int = 128
    eval_tokens: int = 8192  # tokens per evaluation batch (memory bound)
    supervision: str = "last"  # "last": the label of the whole string | "prefix": of every prefix
    #: "contiguous" or "random:L_MAX": the transformer sees sorted positions drawn from [0, L_MAX) for
    #: every batch, in training and scoring alike (Ruoss et al. 2023; positional/randomized.py)
    positions: str = "contiguous"
    # where the run trains and is scored, and the forward passes' autocast (``train.placement``
    # rules: auto = CUDA when visible / bf16 on such a GPU). PLACEMENT: not part of the run's identity,
    # so a table resumes a run trained elsewhere; result.json records what was used.
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | bf16 | auto

    @classmethod
    def from_dict(cls, d: dict) -> "RegularRunConfig":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise UserError(f"unknown run option(s) {bad}; valid: {sorted(names)}")
        return cls(**d)

    def resolved(self) -> "RegularRunConfig":
        """Fill task-dependent defaults and check ranges; raises UserError with the fix."""
        task = make_task(self.task, **self.task_options)
        c = copy.deepcopy(self)
        c.train_max = c.train_max or task.train_max
        c.test_min = c.test_min or task.test_lengths[0]
        c.test_max = c.test_max or task.test_lengths[1]
        if c.val_lengths is None:
            c.val_lengths = [task.lengths(f * c.train_max, f * c.train_max + 2)[0] for f in (2, 8)]
        if not task.lengths(c.train_min, c.train_max):
            raise UserError(f"no valid training length in [{c.train_min}, {c.train_max}] for {c.task}")
        if c.test_max < c.test_min or c.test_stride < 1:
            raise UserError(f"bad test range [{c.test_min}, {c.test_max}] step {c.test_stride}")
        for name in ("steps", "batch_size", "eval_every", "val_samples", "test_samples", "stop_patience"):
            if getattr(c, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(c, name)}")
        for t in c.val_lengths:
            task.check_length(int(t))
        if c.supervision not in ("last", "prefix"):
            raise UserError(f"supervision must be 'last' or 'prefix', got {c.supervision!r}")
        if c.supervision == "prefix" and c.model == "regulargpt" and c.model_options.get("K", 1) != 1:
            raise UserError("supervision=prefix needs RegularGPT thickness K=1; drop K or use supervision=last")
        try:
            L_max = randomized.parse(c.positions, "positions")
        except SchemeError as e:
            raise UserError(str(e)) from None
        longest = max(c.train_max, c.test_max, *map(int, c.val_lengths))
        if L_max is not None and c.model != "transformer":
            raise UserError(f"positions={c.positions} needs model=transformer (the {c.model} takes no positions)")
        if L_max is not None and L_max < longest:
            raise UserError(f"positions=random:{L_max} cannot give the {longest}-token strings this run scores "
                            f"distinct positions; use random:{max(2048, longest)}")
        return c


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def max_position(cfg: RegularRunConfig) -> int | None:
    """L_MAX of ``cfg.positions`` ("random:L_MAX"), None for contiguous positions."""
    return randomized.parse(cfg.positions, "positions")


def _positions(rng: np.random.Generator, max_position: int | None, length: int, dev) -> torch.Tensor | None:
    """Sorted random positions [length] for one batch, drawn from the batch's own ``rng`` (so a length's
    strings and positions depend only on its seed stream), or None (0..length-1)."""
    if max_position is None:
        return None
    return randomized.draw_on(rng, max_position, length, dev)


def _call(model, x: torch.Tensor, positions: torch.Tensor | None, prefixes: bool = False) -> torch.Tensor:
    fn = model.forward_prefixes if prefixes else model
    return fn(x) if positions is None else fn(x, positions)


@torch.no_grad()
def accuracy_at(model, task, length: int, samples: int, rng: np.random.Generator,
                eval_tokens: int = 8192, max_position: int | None = None) -> float:
    """Fraction of ``samples`` fresh strings of ``length`` classified correctly (at random positions
    from [0, max_position) when given, one draw per batch)."""
    was_training = model.training
    model.eval()
    per = max(1, min(samples, eval_tokens // max(1, length)))
    dev = _device_of(model)
    correct = 0
    for s in range(0, samples, per):
        x, y = task.sample(rng, min(per, samples - s), length)
        pos = _positions(rng, max_position, length, dev)
        pred = _call(model, torch.from_numpy(x).to(dev), pos).argmax(-1)  # [b]
        correct += int((pred == torch.from_numpy(y).to(dev)).sum())
    model.train(was_training)
    return correct / samples


def evaluate_lengths(model, task, lengths, samples: int = 128, seed: int = 0,
                     eval_tokens: int = 8192, progress: bool = False, stream: int = TEST_STREAM,
                     max_position: int | None = None) -> dict[int, float]:
    """{length: accuracy}; each length's strings (and random positions) depend only on (stream, seed, length)."""
    out = {}
    for t in tqdm(list(lengths), desc="eval", disable=not progress, leave=False):
        out[int(t)] = accuracy_at(model, task, int(t), samples, _rng(stream, seed, t), eval_tokens, max_position)
    return out


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _loss(model, task, x: np.ndarray, y: np.ndarray, supervision: str, place=None, positions=None) -> torch.Tensor:
    """Cross-entropy of the final label, or (``"prefix"``) the mean over every labelled prefix.
    The forward runs under ``place``'s autocast; the loss is taken on fp32 logits."""
    dev = _device_of(model)
    with place.autocast() if place is not None else contextlib.nullcontext():
        idx = to_device(torch.from_numpy(x), dev)  # [B, T]
        logits = _call(model, idx, positions, supervision == "prefix")  # [B, (T,) classes]
    if supervision == "prefix":
        target = to_device(torch.from_numpy(task.prefix_labels(x)), dev)  # [B, T], IGNORE where no label
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE)
    return F.cross_entropy(logits.float(), to_device(torch.from_numpy(y), dev))


def run_placement(cfg: RegularRunConfig):
    """The ``train.placement.Placement`` of ``cfg.device`` / ``cfg.precision`` (one-line error when absent)."""
    from ..train import placement

    return placement(cfg.device, cfg.precision)


def train_step(model, opt, task, rng: np.random.Generator, lengths, cfg: RegularRunConfig, place) -> torch.Tensor:
    """One optimizer step on a batch of ONE length drawn from ``lengths``; returns its loss, a 0-d tensor on the
    model's device: reading it makes the host wait for the step, so :func:`fit` reads the losses at each
    validation round, not each step (the batch goes to a GPU through pinned memory, without blocking either)."""
    x, y = task.sample(rng, cfg.batch_size, int(rng.choice(lengths)))
    pos = _positions(rng, max_position(cfg), x.shape[1], _device_of(model))  # [T] or None (0..T-1)
    loss = _loss(model, task, x, y, cfg.supervision, place, pos)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    if hasattr(model, "constrain_"):
        model.constrain_()
    return loss.detach()


def fit(cfg: RegularRunConfig, progress: bool = True):
    """Train from scratch -> (best model, history list, info dict). ``cfg`` must be resolved."""
    task = make_task(cfg.task, **cfg.task_options)
    place = run_placement(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, task.vocab_size, task.num_classes, **cfg.model_options)
    model = place.put(model)  # initialised on the CPU: the same weights on any device
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = _rng(TRAIN_STREAM, cfg.seed)
    train_lengths = task.lengths(cfg.train_min, cfg.train_max)
    in_len = train_lengths[-1]
    history, best, best_key, best_step = [], None, (-1.0, -1.0), 0
    t0 = time.perf_counter()
    bar = tqdm(range(1, cfg.steps + 1), desc=f"{cfg.task}/{cfg.model}/seed{cfg.seed}",
               disable=not progress, leave=False)
    losses, streak = [], 0
    for step in bar:
        losses.append(train_step(model, opt, task, rng, train_lengths, cfg, place))
        if step % cfg.eval_every and step != cfg.steps:
            continue
        with place.autocast():
            acc_in = accuracy_at(model, task, in_len, cfg.val_samples, _rng(VAL_STREAM, cfg.seed, in_len),
                                 max_position=max_position(cfg))
            acc_val = float(np.mean([accuracy_at(model, task, int(t), cfg.val_samples, _rng(VAL_STREAM, cfg.seed, t),
                                                 max_position=max_position(cfg)) for t in cfg.val_lengths]))
        history.append({"step": step, "loss": float(torch.stack(losses).float().mean()), "acc_train_len": acc_in,
                        "acc_val": acc_val, "seconds": time.perf_counter() - t0})
        losses = []
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", acc=f"{acc_in:.3f}", val=f"{acc_val:.3f}")
        if (acc_val, acc_in) > best_key:
            best_key, best_step = (acc_val, acc_in), step
            best = copy.deepcopy(model.state_dict())
        done = cfg.stop_acc is not None and acc_in >= cfg.stop_acc and acc_val >= cfg.stop_acc
        streak = streak + 1 if done else 0
        if streak >= cfg.stop_patience:
            break
    bar.close()
    train_seconds = time.perf_counter() - t0
    model.load_state_dict(best)
    info = {"steps_run": history[-1]["step"], "best_step": best_step, "train_seconds": train_seconds,
            "best_acc_val": best_key[0], "best_acc_train_len": best_key[1],
            "num_params": sum(p.numel() for p in model.parameters()), "placement": place.describe()}
    return model, history, info


def run(cfg: RegularRunConfig, out_dir: str | Path | None = None, progress: bool = True,
        threads: int | None = None) -> dict:
    """Train + evaluate; writes config.json, model.safetensors, result.json under ``out_dir``."""
    if threads:
        torch.set_num_threads(int(threads))
    cfg = cfg.resolved()
    model, history, info = fit(cfg, progress)
    result = {"config": asdict(cfg), **info, **_score(model, cfg, progress), "history": history}
    if out_dir is not None:
        save_run(out_dir, cfg, model, result)
    result["model"] = model
    return result


#: run options that only change the final scoring, never training (``reevaluate`` may change them)
TEST_OPTIONS = ("test_min", "test_max", "test_stride", "test_samples", "eval_tokens")


def _score(model, cfg: RegularRunConfig, progress: bool = False) -> dict:
    """The result.json fields of the final evaluation of a trained model (``cfg`` resolved)."""
    task = make_task(cfg.task, **cfg.task_options)
    place = run_placement(cfg)
    model = place.put(model)
    t0 = time.perf_counter()
    test_lengths = task.lengths(cfg.test_min, cfg.test_max)[:: cfg.test_stride]
    in_lengths = task.lengths(cfg.train_min, cfg.train_max)
    with place.autocast():
        per_len = evaluate_lengths(model, task, test_lengths, cfg.test_samples, cfg.seed,
                                   cfg.eval_tokens, progress, max_position=max_position(cfg))
        per_in = evaluate_lengths(model, task, in_lengths, cfg.test_samples, cfg.seed, cfg.eval_tokens,
                                  max_position=max_position(cfg))
    return {
        "task": task.describe(),
        "eval_seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads(),
        "eval_placement": place.describe(),
        "test_lengths": {"min": cfg.test_min, "max": cfg.test_max, "stride": cfg.test_stride,
                         "count": len(test_lengths), "samples_per_length": cfg.test_samples},
        "mean_test": float(np.mean(list(per_len.values()))),
        "min_test": float(min(per_len.values())),
        "mean_train_lengths": float(np.mean(list(per_in.values()))),
        "acc_at_train_max": per_in[in_lengths[-1]],
        "per_length": {str(k): v for k, v in per_len.items()},
        "per_train_length": {str(k): v for k, v in per_in.items()},
    }


def reevaluate(run_dir, progress: bool = False, **test_options) -> dict:
    """Score a finished run again with other ``TEST_OPTIONS`` and rewrite its config.json and
    result.json (training record kept). Training never reads these options (the test strings come
    from their own seed stream), so the result is what a fresh run with the new config gives."""
    bad = sorted(set(test_options) - set(TEST_OPTIONS) - set(PLACEMENT))
    if bad:
        raise UserError(f"reevaluate changes only {', '.join(TEST_OPTIONS + PLACEMENT)}, not {bad}")
    model, cfg, old = load_run(run_dir)
    if not old:
        raise UserError(f"{Path(run_dir) / 'result.json'} is missing; train the run first")
    new_cfg = RegularRunConfig.from_dict({**asdict(cfg), **test_options}).resolved()
    result = {**old, "config": asdict(new_cfg), **_score(model, new_cfg, progress)}
    save_run(run_dir, new_cfg, model, result)
    return result


def save_run(out_dir, cfg: RegularRunConfig, model, result: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    atomic_write_json(out / "config.json", asdict(cfg))
    atomic_write_with(out / "model.safetensors", lambda p: save_file(state, str(p)))
    atomic_write_json(out / "result.json", {k: v for k, v in result.items() if k != "model"})


def load_run(run_dir) -> tuple[torch.nn.Module, RegularRunConfig, dict]:
    """-> (model with the saved weights, its config, its result.json); one-line errors."""
    from safetensors.torch import load_file

    d = Path(run_dir)
    for name in ("config.json", "model.safetensors"):
        if not (d / name).is_file():
            raise UserError(f"{d / name} is missing; train first with `extrapolab regular train --out {d}`")
    try:
        cfg = RegularRunConfig.from_dict(json.loads((d / "config.json").read_text()))
        state = load_file(str(d / "model.safetensors"))
    except (ValueError, OSError) as e:
        raise UserError(f"corrupt run in {d} ({type(e).__name__}); delete it and train again") from None
    task = make_task(cfg.task, **cfg.task_options)
    model = build_model(cfg.model, task.vocab_size, task.num_classes, **cfg.model_options)
    try:
        model.load_state_dict(state)
    except RuntimeError:
        raise UserError(f"weights in {d} do not fit its config; delete the folder and train again") from None
    model.eval()
    res_path = d / "result.json"
    result = json.loads(res_path.read_text()) if res_path.is_file() else {}
    return model, cfg, result

"""The training loop (docs/architecture.md, "Train short"): GPT + AdamW + warmup/cosine, accumulation,
clipping, autocast, periodic validation, crash-safe checkpoints and exact resume.

Each optimizer step: ``grad_accum`` micro-batches (gradients of the mean loss), unscale + clip,
lr from :func:`optim.lr_at`, AdamW step, ``model.constrain_()`` (KERPLE's positivity / exponent
projections). ``train.batch_size`` is the *global* micro-batch (split over processes), so one
optimizer step sees ``batch_size × grad_accum`` windows of ``train_length`` (+1) tokens whatever
the number of processes. A resumed run restores weights, optimizer, sampler and every RNG, so on
CPU its losses equal an uninterrupted run bit for bit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import config as config_mod
from ..config import RunConfig
from ..data.origin import provenance
from ..io import UserError, run_lock
from ..model.attention import AttnOptions, flush_denormals
from ..model.regular_lm import build_model
from ..positional import randomized
from ..positional.positions import to_device
from . import dist as D
from . import records as R
from . import tb
from .setup import check_train, load_data, same_data, write_checksum
from .checkpoint import aliases, checkpoint_path, clean_stale, full_weights, load_checkpoint, save_checkpoint, unique_weights
from .optim import build_optimizer, lr_at, set_lr
from .sampler import WindowSampler, valid_windows
from .step import autocast, forward_backward, host_rng, resolve_precision, set_host_rng

def train(cfg: RunConfig, run_dir: Path | None = None, *, data=None, resume: bool = True,
          progress: bool = True, stop_after: int | None = None) -> dict:
    """Train (or resume, or skip if finished) the run in ``run_dir`` (default out_dir/name).

    A run folder is trained by one process at a time (:func:`..io.run_lock`): another process
    training into it gets a one-line error naming the holder.

    ``resume=False`` starts over: an existing run's checkpoints, metrics and summary are replaced.

    ``stop_after=N`` returns after global step N as a kill would (no extra checkpoint, no
    summary): for resume tests. Returns the summary dict (or ``{"finished": False, "step": N}``).
    """
    run_dir = Path(run_dir) if run_dir is not None else Path(cfg.out_dir) / cfg.name
    env = D.setup(cfg.train.device)
    ok = False
    try:  # one process per run folder (rank 0 of a distributed job holds it for every rank)
        with run_lock(run_dir, owner=f"training {run_dir.name}") if env.is_main else contextlib.nullcontext():
            out = _Trainer(cfg, run_dir, env, data, resume, progress, stop_after).run()
        ok = True
        return out
    finally:
        env.close(synchronize=ok)


class _Trainer:
    def __init__(self, cfg, run_dir, env, data, resume, progress, stop_after):
        check_train(cfg)
        self.env, self.progress, self.stop_after = env, progress, stop_after
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.out_dir) / cfg.name
        if cfg.train.flush_denormals:
            flush_denormals(True)
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        self.data = data if data is not None else load_data(cfg, env, progress)
        self.cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=int(self.data.vocab_size)))
        self.precision = resolve_precision(cfg.train.precision, env.device)
        self.resume = resume

    # ---- setup ---------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, tc, env = self.cfg, self.cfg.train, self.env
        ckpt = None
        last = checkpoint_path(self.run_dir, "last")
        if last is not None and self.resume:
            ckpt = load_checkpoint(last, cfg)
            same_data(ckpt.config, cfg, self.run_dir)
            if ckpt.config.model.vocab_size != cfg.model.vocab_size:
                raise UserError(f"run {self.run_dir} was trained on a {ckpt.config.model.vocab_size}-token vocabulary "
                                f"but the data now has {cfg.model.vocab_size}; use the same data or another --name")
            if ckpt.state is None:
                raise UserError(f"checkpoint {last} has no training state; delete it to retrain")
            summary = R.read_summary(self.run_dir)
            if ckpt.state.get("finished") and ckpt.step >= tc.steps and summary is not None:
                if env.is_main and self.progress:
                    print(f"run {self.run_dir} already finished at step {ckpt.step}; delete it or pick another --name to retrain")
                return summary
        random.seed(tc.seed)
        np.random.seed(tc.seed)
        torch.manual_seed(tc.seed)
        raw = build_model(cfg.model)  # GPT, or RegularGPT for model.arch=regulargpt
        self.alias = aliases(raw)
        if ckpt is not None:
            raw.load_state_dict(full_weights(raw, ckpt.weights, ckpt.path))
        raw.to(env.device)
        if tc.compile:
            raw.forward = torch.compile(raw.forward)
        self.model = D.wrap(raw, tc.strategy, env)
        self.raw = D.unwrap(self.model)
        self.optimizer = build_optimizer(self.raw, tc)
        self.window = cfg.model.train_length + 1
        self.sampler = WindowSampler(self.data.split("train"), self.window, tc.batch_size, tc.grad_accum,
                                     tc.seed, env.rank, env.world)
        self.max_position = randomized.parse(tc.positions)  # None: positions 0..L-1
        self.positions = randomized.PositionSampler(self.max_position, tc.seed) if self.max_position else None
        if tc.eval_batches:  # eval_batches=0: no validation, so a corpus without a valid split is fine
            windows = valid_windows(self.data.split("valid"), self.window, tc.eval_batches * tc.batch_size)
            self.valid = windows[env.rank::env.world]
        else:
            self.valid = np.zeros((0, self.window), dtype=np.int64)
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=self.precision == "fp16")
        self.step, self.tokens, self.train_seconds = 0, 0, 0.0
        self.best = (math.inf, None)
        self.loss_acc = torch.zeros((), dtype=torch.float64, device=env.device)
        self.gnorm_acc = torch.zeros((), dtype=torch.float64, device=env.device)  # sum of clipped-step grad norms
        self.loss_count = 0
        if ckpt is not None:
            self._restore(ckpt.state)
        else:
            torch.manual_seed(tc.seed + 7919 * (env.rank + 1))  # own dropout stream per rank
        if env.is_main:
            self._prepare_dir(fresh=ckpt is None)
        self.tb = tb.TensorBoardLog(self.run_dir, self.step, fresh=ckpt is None) \
            if tc.tensorboard and env.is_main else None
        env.barrier()
        self.start_step = self.step
        return self._loop()

    def _restore(self, st: dict) -> None:
        D.restore_optimizer(self.model, self.optimizer, st["optimizer"])
        self.sampler.load_state_dict(json.loads(st["sampler"]))
        if self.positions is not None:
            self.positions.load_state_dict(json.loads(st["positions"]))
        if st.get("scaler"):
            self.scaler.load_state_dict(st["scaler"])
        set_host_rng(st["host_rng"])
        torch_states, cuda_states = st["torch_rng"], st["cuda_rng"]
        if len(torch_states) == self.env.world:
            torch.set_rng_state(torch_states[self.env.rank])
            if self.env.device.type == "cuda" and cuda_states[self.env.rank] is not None:
                torch.cuda.set_rng_state(cuda_states[self.env.rank], self.env.device)
        else:  # resumed with another process count: fresh per-rank streams
            torch.manual_seed(self.cfg.train.seed + 7919 * (self.env.rank + 1) + int(st["step"]))
        self.step, self.tokens = int(st["step"]), int(st["tokens"])
        self.train_seconds = float(st["train_seconds"])
        self.best = (float(st["best_valid_loss"]), st["best_step"])
        self.loss_acc.fill_(float(st["loss_acc"]) / self.env.world)
        self.gnorm_acc.fill_(float(st.get("gnorm_acc", 0.0)))  # checkpoints before grad norms were logged: 0
        self.loss_count = int(st["loss_count"])

    def _prepare_dir(self, fresh: bool) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckroot = self.run_dir / "checkpoints"
        clean_stale(ckroot)
        if fresh:  # resume=False, or leftovers of a run killed before its first checkpoint
            for name in (R.METRICS, R.SUMMARY):
                (self.run_dir / name).unlink(missing_ok=True)
            for which in ("best", "last"):
                for p in (ckroot / which, ckroot / f".{which}.old"):
                    shutil.rmtree(p, ignore_errors=True)
        else:
            R.truncate_rows(self.run_dir, self.step)
            (self.run_dir / R.SUMMARY).unlink(missing_ok=True)
        config_mod.save(self.cfg, self.run_dir / "config.yaml")

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> dict:
        cfg, tc, env = self.cfg, self.cfg.train, self.env
        tokens_per_step = tc.batch_size * tc.grad_accum * cfg.model.train_length
        wall0 = time.perf_counter()
        self.memory = R.start_peak_memory(env.device)  # this run's own peak, even in a reused process
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (self.progress and env.is_main),
                   desc=cfg.name, unit="step", dynamic_ncols=True)
        interval_time, interval_steps, first_batch = 0.0, 0, None
        cuda = env.device.type == "cuda"
        train_opts = None if tc.attention == "auto" else AttnOptions(impl=tc.attention)  # train.attention
        try:  # close the bar on errors too, so a one-line error starts on its own line
            while self.step < tc.steps:
                if self.stop_after is not None and self.step >= self.stop_after:
                    break
                t0 = time.perf_counter()
                batches = [to_device(torch.from_numpy(b), env.device) for b in self.sampler.step_batches()]  # [b, L+1]
                positions = None if self.positions is None else \
                    [self.positions.draw(cfg.model.train_length, env.device) for _ in batches]  # [L] per micro-batch
                first_batch = first_batch or hashlib.sha256(batches[0].cpu().numpy().tobytes()).hexdigest()
                lr = lr_at(self.step, tc)
                set_lr(self.optimizer, lr)
                loss = forward_backward(self.model, batches, self.precision, env.device,
                                        self.scaler if self.scaler.is_enabled() else None, positions, train_opts)
                if tc.grad_clip > 0:
                    self.scaler.unscale_(self.optimizer)
                    norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
                    self.gnorm_acc += (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                self.raw.constrain_()
                if cuda:
                    torch.cuda.synchronize(env.device)
                dt = time.perf_counter() - t0
                self.step += 1
                self.tokens += tokens_per_step
                self.loss_acc += loss
                self.loss_count += 1
                interval_time, interval_steps = interval_time + dt, interval_steps + 1
                self.train_seconds += dt
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    total = env.all_reduce_sum([self.loss_acc.item()])[0] / env.world
                    row = {"step": self.step, "loss": total / self.loss_count, "lr": lr, "tokens": self.tokens,
                           "sec_per_step": interval_time / interval_steps,
                           "tokens_per_s": tokens_per_step * interval_steps / interval_time}
                    if tc.grad_clip > 0:  # the global norm before clipping, mean over the interval
                        row["grad_norm"] = self.gnorm_acc.item() / self.loss_count
                    self._row(row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                    self.loss_acc.zero_()
                    self.gnorm_acc.zero_()
                    self.loss_count, interval_time, interval_steps = 0, 0.0, 0
                finished = self.step == tc.steps
                if (tc.eval_every and self.step % tc.eval_every == 0) or finished:
                    self._validate()
                if (tc.checkpoint_every and self.step % tc.checkpoint_every == 0) or finished:
                    self._save_last(finished)
                bar.update(1)
        finally:
            bar.close()
            if self.tb is not None:
                self.tb.close()
        write_checksum(self.raw, env, self.run_dir, self.step, first_batch)
        if self.step < tc.steps:
            R.peak_memory(self.memory)  # stop measuring (a sampler thread where the kernel cannot reset)
            return {"finished": False, "step": self.step, "run_dir": str(self.run_dir)}
        return self._finish(tokens_per_step, time.perf_counter() - wall0)

    def _row(self, row: dict) -> None:
        if self.env.is_main:
            R.append_row(self.run_dir, row)
            if self.tb is not None:
                self.tb.row(row)

    @torch.no_grad()
    def _validate(self) -> None:
        if len(self.valid) == 0:
            return
        env = self.env
        b = max(1, self.cfg.train.batch_size // env.world)
        self.raw.eval()
        nll = torch.zeros((), dtype=torch.float64, device=env.device)
        # random positions: the same draws at every validation, so valid losses compare across steps
        draws = randomized.PositionSampler(self.max_position, self.cfg.train.seed, randomized.STREAM_VALID) \
            if self.max_position else None
        for i in range(0, len(self.valid), b):
            x = torch.from_numpy(self.valid[i:i + b]).to(env.device)  # [b, L+1]
            pos = None if draws is None else draws.draw(x.shape[1] - 1, env.device)  # [L]
            with autocast(self.precision, env.device):
                logits = self.raw(x[:, :-1], pos)  # [b, L, V]
            nll += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                   reduction="sum").double()
        self.raw.train()
        total, count = env.all_reduce_sum([nll.item(), float(self.valid[:, 1:].size)])
        loss = total / count
        self._row({"step": self.step, "valid_loss": loss, "valid_ppl": math.exp(min(loss, 700.0))})
        if loss < self.best[0]:
            self.best = (loss, self.step)
            weights = D.model_state(self.model)
            if env.is_main:
                state = {"step": self.step, "valid_loss": loss, "finished": False}
                save_checkpoint(self.run_dir / "checkpoints" / "best", unique_weights(weights, self.alias), self.cfg, state)
            env.barrier()

    def _save_last(self, finished: bool) -> None:
        env = self.env
        weights, optim = D.gather_state(self.model, self.optimizer)
        torch_rng = env.all_gather(torch.get_rng_state())
        cuda_rng = env.all_gather(torch.cuda.get_rng_state(env.device) if env.device.type == "cuda" else None)
        loss_acc = env.all_reduce_sum([self.loss_acc.item()])[0]
        if env.is_main:
            state = {
                "step": self.step, "finished": finished, "optimizer": optim,
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                "sampler": json.dumps(self.sampler.state_dict()), "host_rng": host_rng(),
                "positions": json.dumps(self.positions.state_dict()) if self.positions is not None else None,
                "torch_rng": torch_rng, "cuda_rng": cuda_rng, "tokens": self.tokens,
                "train_seconds": self.train_seconds, "best_valid_loss": self.best[0], "best_step": self.best[1],
                "loss_acc": loss_acc, "loss_count": self.loss_count, "world_size": env.world,
                "gnorm_acc": self.gnorm_acc.item(),
            }
            save_checkpoint(self.run_dir / "checkpoints" / "last", unique_weights(weights, self.alias), self.cfg, state)
        env.barrier()

    def _finish(self, tokens_per_step: int, wall: float) -> dict:
        env, tc = self.env, self.cfg.train
        mem, kind = R.peak_memory(self.memory)
        mem = max(env.all_gather(mem))
        summary = None
        if env.is_main:
            base = {
                "name": self.cfg.name, "run_dir": str(self.run_dir), "finished": True, "steps": self.step,
                "params": sum(p.numel() for p in self.raw.parameters()), "tokens": self.tokens,
                "train_seconds": self.train_seconds, "wall_seconds": wall, "resumed_from": self.start_step or None,
                "peak_memory_mb": mem, "peak_memory_kind": kind, "device": str(env.device),
                "precision": self.precision, "world_size": env.world, "strategy": tc.strategy,
                "backend": env.backend, "scheme": self.cfg.model.scheme, "train_length": self.cfg.model.train_length,
                "positions": tc.positions,
                "data": provenance(self.data),  # the corpus hash and its source: which text this run measured
            }
            summary = R.build_summary(self.run_dir, base, tokens_per_step)
            R.write_summary(self.run_dir, summary)
        return env.all_gather(summary)[0]

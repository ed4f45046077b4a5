"""E8 cost table: speed and memory of every scheme against bias-free SDPA (docs/protocols.md, E8).

Follows the comparisons of ALiBi Fig. 2 (train/inference speed and memory vs L), thesis Table 3.4
(train sec/step, tokens/s per kernel) and Sandwich appendix B (cached sliding-window generation
costs O(w̄·L) against O(w̄²·L) for re-encoding the window). Everything is measured in ONE run:

* train: full-model step (forward + backward + AdamW + ``constrain_``) at each L_tr with
  ``batch_tokens // L_tr`` sequences, and a no-grad forward, every ratio to NoPE (``none``:
  bias-free ``scaled_dot_product_attention(is_causal=True)``) from the same run;
* long: one-sequence forward at 4k-64k tokens (``AttnOptions(impl="auto")``), ratio to NoPE;
* generation: per-token time with a ``KVCache(window=w̄)`` at positions w̄..8·w̄ against one
  forward over the last w̄ tokens (re-encoding), and the speed-up at 8·w̄.

Timing: schemes are measured round-robin (the order rotates each round) after ``warmup`` steps,
so load from other processes on a shared CPU hits all of them alike; each number is the median
over ``repeats`` rounds. Memory: peak RSS above the pre-call RSS, sampled every 2 ms by a thread
(/proc/self/statm) after ``malloc_trim``; tracemalloc does not see torch's allocations.
"""
from __future__ import annotations

import ctypes
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace

import torch

from .. import positional
from ..io import UserError, atomic_write_json
from ..model.attention import AttnOptions
from ..model.gpt import GPT, KVCache, ModelConfig

BASE = "none"
DEMO = ModelConfig(vocab_size=4096, layers=4, heads=4, dim=128, scheme=BASE)
QUICK = dict(lengths_train=(128, 512), long_lengths=(4096,), repeats=3, warmup=1, gen_window=64,
             schemes=("sinusoidal", "rotary", "alibi", "t5", "kerple-log", "sandwich", "windowed"))
MEMORY_METHOD = "peak RSS delta (MiB) above the pre-call RSS, sampled every 2 ms by a thread"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.mib``: the peak RSS increase during the block."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.mib = interval, float("nan")

    def __enter__(self):
        _trim()
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.mib = (self.peak - self.base) / 2**20
        self.abs_mib = self.peak / 2**20


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed2(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds): CPU time is what load from other processes skews least."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _round_robin(jobs: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall s, median CPU s) per job over ``repeats`` rounds; the order rotates each round."""
    names, times = list(jobs), {n: [] for n in jobs}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            times[n].append(_timed2(jobs[n]))
    return {n: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for n, t in times.items()}


def _model(cfg: ModelConfig, scheme: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(replace(cfg, scheme=scheme, scheme_params={}))


def _ratios(rows: dict, keys: tuple[str, ...]) -> None:
    base = rows.get(BASE)
    for row in rows.values():
        for key in keys:
            if base and row.get(key) is not None and base.get(key):
                row[key + "_ratio"] = row[key] / base[key]


def _quiet(msg: str) -> None:
    pass


def _stderr(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_train(schemes, lengths, cfg, repeats, warmup, batch_tokens, say=_quiet) -> dict:
    out = {}
    for L in lengths:
        say(f"train L_tr={L}: {len(schemes)} schemes x ({warmup} warm-up + {repeats} rounds)")
        B = max(1, batch_tokens // L)
        g = torch.Generator().manual_seed(L)
        idx = torch.randint(0, cfg.vocab_size, (B, L + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        steps, fwds, models = {}, {}, {}
        for s in schemes:
            m = _model(cfg, s)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def step(m=m, opt=opt):
                loss = m.loss(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                m.constrain_()

            def fwd(m=m):
                with torch.no_grad():
                    m(x)

            for _ in range(warmup):
                step(), fwd()
            steps[s], fwds[s], models[s] = step, fwd, m
        t_step = _round_robin(steps, repeats)
        t_fwd = _round_robin(fwds, repeats)
        rows = {}
        for s in schemes:
            with PeakRSS() as mem:
                steps[s]()
            (ws, cs), (wf, cf) = t_step[s], t_fwd[s]
            rows[s] = {"batch": B, "step_ms": 1e3 * ws, "step_cpu_ms": 1e3 * cs,
                       "train_tokens_per_s": B * L / ws, "fwd_ms": 1e3 * wf, "fwd_cpu_ms": 1e3 * cf,
                       "fwd_tokens_per_s": B * L / wf, "peak_mib": mem.mib}
        _ratios(rows, ("step_ms", "step_cpu_ms", "fwd_ms", "fwd_cpu_ms", "peak_mib"))
        out[str(L)] = rows
        del models, steps, fwds
    return out


def bench_long(schemes, lengths, cfg, repeats, say=_quiet) -> dict:
    out = {}
    opts = AttnOptions(impl="auto")
    models = {s: _model(cfg, s).eval() for s in schemes}
    with torch.no_grad():  # warm-up: kernels, caches, thread pools
        for m in models.values():
            m(torch.zeros(1, min(1024, cfg.train_length), dtype=torch.long), opts=opts)
    for L in lengths:
        x = torch.randint(0, cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(L))
        rows, times = {}, {s: [] for s in models}
        mems, absm = {}, {}
        for r in range(repeats):
            order = list(models)[r % len(models):] + list(models)[: r % len(models)]
            for s in order:
                m = models[s]
                say(f"long L={L}: {s}")
                try:
                    m.scheme.check_length(L)
                except positional.SchemeError as e:
                    rows[s] = {"skipped": str(e).split(";")[0]}
                    continue
                with torch.no_grad(), PeakRSS() as mem:
                    times[s].append(_timed2(lambda: m(x, opts=opts)))
                mems[s] = max(mems.get(s, 0.0), mem.mib)
                absm[s] = max(absm.get(s, 0.0), mem.abs_mib)
        for s, t in times.items():
            if t:
                sec, cpu = statistics.median(w for w, _ in t), statistics.median(c for _, c in t)
                rows[s] = {"fwd_s": sec, "fwd_cpu_s": cpu, "tokens_per_s": L / sec, "peak_mib": mems[s],
                           "peak_abs_mib": absm[s]}
        _ratios(rows, ("fwd_s", "fwd_cpu_s", "peak_mib"))
        out[str(L)] = {s: rows[s] for s in models}
    return out


def bench_generation(schemes, cfg, window, probes, reps, say=_quiet) -> dict:
    """Per-token decode time with a w̄-window KV cache at w̄·probes vs re-encoding w̄ tokens."""
    out = {"window": window, "positions": [window * p for p in probes]}
    last = window * max(probes)
    end = last + reps - 1  # tokens last .. last+reps-1 are timed for the last probe
    for s in schemes:
        say(f"generation w={window}: {s}")
        m = _model(cfg, s).eval()
        try:
            m.scheme.check_length(end + 1)
        except positional.SchemeError as e:
            out[s] = {"skipped": str(e).split(";")[0]}
            continue
        g = torch.Generator().manual_seed(1)
        toks = torch.randint(0, cfg.vocab_size, (1, end + 1), generator=g)
        per_tok, marks = {}, {window * p for p in probes}
        with torch.no_grad():
            cache = KVCache(cfg.layers, window=window)
            nxt = toks[:, :window]
            m(nxt, positions=torch.arange(window), cache=cache)
            for t in range(window, end + 1):
                if t in marks or any(t - k in marks for k in range(1, reps)):
                    per_tok.setdefault(max(p for p in marks if p <= t), []).append(
                        _timed(lambda: m(toks[:, t:t + 1], positions=torch.tensor([t]), cache=cache)))
                else:
                    m(toks[:, t:t + 1], positions=torch.tensor([t]), cache=cache)
            pos = torch.arange(last - window + 1, last + 1)
            re = statistics.median(_timed(lambda: m(toks[:, last - window + 1:last + 1], positions=pos))
                                   for _ in range(reps))
        cached = [1e3 * statistics.median(per_tok[p]) for p in sorted(per_tok)]
        out[s] = {"cached_ms": cached, "reencode_ms": 1e3 * re,
                  "speedup_at_end": re * 1e3 / cached[-1], "cached_tokens_per_s": 1e3 / cached[-1]}
    return out


def run_bench(
    schemes=None,
    lengths_train=(128, 512),
    long_lengths=(4096, 16384, 65536),
    model_cfg: ModelConfig | None = None,
    repeats: int = 5,
    warmup: int = 2,
    gen_window: int = 256,
    out_json=None,
    *,
    quick: bool = False,
    batch_tokens: int = 4096,
    long_repeats: int = 1,
    gen_probes=(1, 2, 4, 8),
    gen_reps: int = 8,
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Measure every scheme (default: all registered) in one run; write ``out_json`` if given."""
    if quick:
        lengths_train, long_lengths = QUICK["lengths_train"], QUICK["long_lengths"]
        repeats, warmup, gen_window = QUICK["repeats"], QUICK["warmup"], QUICK["gen_window"]
    names = positional.names()
    schemes = list(schemes or (QUICK["schemes"] if quick else names))
    bad = [s for s in schemes if s not in names]
    if bad:
        raise UserError(f"unknown scheme(s) {', '.join(bad)}; run `extrapolab schemes` for valid names")
    if repeats < 1 or warmup < 0 or gen_window < 1 or any(int(L) < 2 for L in (*lengths_train, *long_lengths)):
        raise UserError("bench needs repeats >= 1, warmup >= 0, gen_window >= 1 and lengths >= 2")
    schemes = [BASE] + [s for s in schemes if s != BASE]
    cfg = model_cfg or DEMO
    gen_end = gen_window * max(gen_probes) + gen_reps
    cfg = replace(cfg, train_length=max(cfg.train_length, *lengths_train, gen_end))
    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.time()
    res = {"meta": {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor()
        or platform.machine(), "cpus": os.cpu_count(), "model": asdict(cfg), "repeats": repeats,
        "warmup": warmup, "long_repeats": long_repeats, "batch_tokens": batch_tokens,
        "memory": MEMORY_METHOD, "baseline": f"{BASE} (bias-free SDPA is_causal)",
        "load_avg_start": os.getloadavg()}}
    say = _stderr if progress else _quiet
    res["train"] = bench_train(schemes, lengths_train, cfg, repeats, warmup, batch_tokens, say)
    res["long"] = bench_long(schemes, long_lengths, cfg, long_repeats, say)
    res["generation"] = bench_generation(schemes, cfg, gen_window, gen_probes, gen_reps, say)
    res["meta"].update(seconds=time.time() - t0, load_avg_end=os.getloadavg())
    if out_json:
        atomic_write_json(out_json, res)
    return res


def _f(v, fmt="{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def format_table(result: dict) -> str:
    """Markdown tables of a :func:`run_bench` result (ratios to NoPE from the same run)."""
    meta, lines = result["meta"], []
    lines.append(f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpus']} CPUs; medians of "
                 f"{meta['repeats']} rounds; memory = {meta['memory']}; baseline = {meta['baseline']}; "
                 "×NoPE = ratio of wall-clock medians, ×NoPE cpu = ratio of process-CPU-time medians")
    for L, rows in result.get("train", {}).items():
        lines += ["", f"### train, L_tr = {L} (batch {next(iter(rows.values()))['batch']})", "",
                  "| scheme | step ms | ×NoPE | ×NoPE cpu | train tok/s | fwd tok/s | fwd ×NoPE | "
                  "fwd ×NoPE cpu | peak MiB | mem ×NoPE |", "|---" * 10 + "|"]
        for s, r in rows.items():
            lines.append(f"| {s} | {r['step_ms']:.1f} | {_f(r.get('step_ms_ratio'))} | "
                         f"{_f(r.get('step_cpu_ms_ratio'))} | {r['train_tokens_per_s']:.0f} | "
                         f"{r['fwd_tokens_per_s']:.0f} | {_f(r.get('fwd_ms_ratio'))} | "
                         f"{_f(r.get('fwd_cpu_ms_ratio'))} | {r['peak_mib']:.0f} | {_f(r.get('peak_mib_ratio'))} |")
    for L, rows in result.get("long", {}).items():
        lines += ["", f"### long-context forward, L = {L}, batch 1", "",
                  "| scheme | fwd s | ×NoPE | ×NoPE cpu | tok/s | peak Δ MiB | peak RSS MiB | mem ×NoPE |",
                  "|---" * 8 + "|"]
        for s, r in rows.items():
            if "skipped" in r:
                lines.append(f"| {s} | skipped: {r['skipped']} |" + " |" * 6)
            else:
                lines.append(f"| {s} | {r['fwd_s']:.2f} | {_f(r.get('fwd_s_ratio'))} | "
                             f"{_f(r.get('fwd_cpu_s_ratio'))} | {r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | "
                             f"{r['peak_abs_mib']:.0f} | {_f(r.get('peak_mib_ratio'))} |")
    gen = result.get("generation")
    if gen:
        pos = gen["positions"]
        lines += ["", f"### generation, KV cache window w̄ = {gen['window']} (ms/token at position)", "",
                  "| scheme | " + " | ".join(f"cached @{p}" for p in pos) + " | re-encode w̄ | speed-up @"
                  f"{pos[-1]} |", "|---" * (len(pos) + 3) + "|"]
        for s, r in gen.items():
            if not isinstance(r, dict):
                continue
            if "skipped" in r:
                lines.append(f"| {s} | skipped: {r['skipped']} |" + " |" * (len(pos) + 1))
                continue
            lines.append(f"| {s} | " + " | ".join(f"{c:.2f}" for c in r["cached_ms"])
                         + f" | {r['reencode_ms']:.2f} | {r['speedup_at_end']:.1f}× |")
    return "\n".join(lines)

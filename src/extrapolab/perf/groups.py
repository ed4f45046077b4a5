"""The row groups of ``extrapolab bench`` (perf/bench.py's docstring describes each): train steps,
long-context forwards, cached generation, flush-to-zero. Each is ``fn(ctx) -> dict``, listed in
``perf.bench.GROUPS`` and formatted by ``perf.table.FORMATTERS``."""
from __future__ import annotations

from typing import Callable

import torch

from .. import positional
from ..memory import PeakMemory
from ..model import flex
from ..model.attention import AttnOptions, attend, flush_denormals
from ..model.cache import KVCache
from ..model.gpt import GPT
from ..positional import randomized
from ..train.step import autocast
from .context import BASE, Context, Spec, build_model
from .timing import add_ratios, paired_ratio, paired_rounds, round_robin, timed


def attention_only(model: GPT, B: int, L: int, grad: bool) -> Callable[[], None]:
    """Bias tables + every layer's attention on fixed q, k, v (no projections, MLP or vocabulary);
    a scheme with positions from content (FoX) computes them from a fixed layer input, inside."""
    cfg, dev = model.cfg, model.tok.weight.device
    g = torch.Generator().manual_seed(L)
    qkv = [torch.randn(B, cfg.heads, L, cfg.dim // cfg.heads, generator=g).to(dev).requires_grad_(grad)
           for _ in range(3)]  # q, k, v: [B, H, L, D]
    hidden = torch.randn(B, L, cfg.dim, generator=g).to(dev)  # [B, L, C] the layers' input
    pos, opts = torch.arange(L, device=dev), model.attn_opts  # the row's impl, its path counter

    def run() -> None:
        with torch.set_grad_enabled(grad):
            # under the bench's autocast q, k, v arrive in its dtype, as the model's projections hand them over
            amp = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
            args = [t.to(amp) for t in qkv] if amp is not None else qkv
            bias = model.shared_bias(pos, opts)
            total = 0.0
            for i in range(cfg.layers):
                s = model.scheme.for_layer(i)
                p = s.content_positions(hidden, i) if s.has_content else None
                total = total + attend(*args, pos, pos, s, i, opts, bias, content=None if p is None else (p, p),
                                       **model.blocks[i].extras.attend_kwargs())[0].sum()  # sinks, SSMax
            if grad:
                total.backward()
    return run


def observe(model: GPT) -> dict:
    """Start recording what ``model``'s calls run: the attention paths (counted into ``model.attn_opts.paths``)
    and the FlexAttention compiles from here on; :func:`observed` reads them after the row's warm-up."""
    model.attn_opts = AttnOptions(**{**model.attn_opts.__dict__, "paths": {}})
    return {"events_from": len(flex._COMPILED[0].events) if flex._COMPILED else 0}


def observed(model: GPT, mark: dict) -> dict:
    """{"paths": {path: calls}, "kernels": [each new compiled shape's tile options, outcome, seconds]} since
    :func:`observe` (docs/attention.md: which path runs when; "Tiles")."""
    events = flex._COMPILED[0].events[mark["events_from"]:] if flex._COMPILED else []
    return {"paths": dict(model.attn_opts.paths or {}), "kernels": list(events)}


def unfused_reason(model: GPT) -> str:
    """Why no fused kernel runs a scheme ('' when one does): its score-level hooks' reason."""
    reasons = {model.scheme.for_layer(i).reference_only for i in range(model.cfg.layers)} - {""}
    return "; ".join(sorted(reasons))


def window_limited(model: GPT, L: int) -> bool:
    """True when the last query of an L-token sequence cannot see some earlier key ("sparse")."""
    if not model.scheme.has_bias:
        return False
    with torch.no_grad():
        pos = torch.arange(L, device=model.tok.weight.device)
        b = model.scheme.bias(pos[-1:], pos, 0)  # [H, 1, L]
    return bool(torch.isinf(b).any())


def batch_of(ctx: Context, L: int) -> int:
    """Sequences per train row at L_tr = L: ``batch``, or batch_tokens // L."""
    return int(ctx.opts.get("batch") or max(1, ctx.opts["batch_tokens"] // L))


def train_batch(ctx: Context, L: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(B, x, y) of the train rows at L_tr = L: :func:`batch_of` sequences, seeded by L, on the device."""
    B = batch_of(ctx, L)
    idx = torch.randint(0, ctx.cfg.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(L))
    return B, idx[:, :-1].to(ctx.device), idx[:, 1:].to(ctx.device)  # [B, L] each


def train_jobs(ctx: Context, m: GPT, x, y, parts, B, L, max_position: int = 0) -> dict[str, Callable]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    draws = randomized.PositionSampler(max_position) if max_position else None  # as the trainer draws them

    def step():
        loss = m.loss(x, y, None if draws is None else draws.draw(L, x.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        m.constrain_()

    def fwd():
        with torch.no_grad():
            m(x)

    jobs = {"step_s": step, "fwd_s": fwd}
    if "attn_s" in parts:
        jobs["attn_s"] = attention_only(m, B, L, grad=True)
    return {k: ctx.amp(v) for k, v in jobs.items() if k in parts}


def _bases(jobs) -> dict:
    """Each (label, part) job's baseline job: NoPE's same part (when NoPE is benched: not by a group that
    skipped it), timed next to it by :func:`.timing.paired_rounds`."""
    return {j: (BASE, j[1]) for j in jobs if j[0] != BASE and (BASE, j[1]) in jobs}


def _measured(times: dict, beside: dict, label: str, parts) -> dict:
    """A row's per-round seconds of each part and, where paired, NoPE's seconds next to each call
    (``<part>_beside``, read by :func:`.timing.paired_ratio`)."""
    return {**{p: times[(label, p)] for p in parts},
            **{p + "_beside": beside[(label, p)] for p in parts if (label, p) in beside}}


def bench_train(ctx: Context) -> dict:
    out, parts = {}, tuple(ctx.opts.get("parts", ("step_s", "fwd_s", "attn_s")))
    for L in ctx.opts["lengths_train"]:
        B, x, y = train_batch(ctx, L)
        ctx.say(f"train L_tr={L}, batch {B}: {len(ctx.specs)} schemes x ({ctx.warmup} warm-up + {ctx.rounds} rounds)")
        jobs, models = {}, {}
        seen = {}
        for s in ctx.specs:
            models[s.label] = build_model(ctx, s)
            mark = observe(models[s.label])
            for part, fn in train_jobs(ctx, models[s.label], x, y, parts, B, L, s.positions).items():
                for _ in range(ctx.warmup):
                    fn()
                jobs[(s.label, part)] = fn
            seen[s.label] = observed(models[s.label], mark)
        times, beside = paired_rounds(jobs, _bases(jobs), ctx.rounds, ctx.device)
        prov = ctx.prov(L=L, batch=B, group="train")
        rows = {}
        for s in ctx.specs:
            with PeakMemory(ctx.device) as mem:  # one more step, untimed
                jobs[(s.label, parts[0])]()
            rows[s.label] = {"scheme": s.name, **({"model": dict(s.model)} if s.model else {}), "batch": B, **prov,
                             "peak_mib": mem.mib,
                             "params": sum(p.numel() for p in models[s.label].parameters()),
                             **_measured(times, beside, s.label, parts), **seen[s.label]}
            why = unfused_reason(models[s.label])
            if why:  # no fused kernel: the bench says why
                rows[s.label]["unfused"] = why
        add_ratios(rows, BASE, parts)
        out[str(L)] = rows
        del models, jobs
    return out


def bench_long(ctx: Context) -> dict:
    out = {}
    rounds = max(3, int(ctx.opts.get("long_repeats", 3)))
    for L in ctx.opts["long_lengths"]:
        x = torch.randint(0, ctx.cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(ctx.device)
        rows, jobs, mems = {}, {}, {}
        for s in ctx.natural():
            m = build_model(ctx, s).eval()
            try:
                m.scheme.check_length(L)
            except positional.SchemeError as e:
                rows[s.label] = {"skipped": str(e).split(";")[0]}
                continue

            def fwd(m=m):
                with torch.no_grad():
                    m(x)

            mark = observe(m)
            fwd, attn = ctx.amp(fwd), ctx.amp(attention_only(m, 1, L, grad=False))
            ctx.say(f"long L={L}: {s.label} warm-up at this length")
            with PeakMemory(ctx.device) as mem:  # the warm-up forward is the memory probe
                fwd()
            attn()
            jobs[(s.label, "fwd_s")], jobs[(s.label, "attn_s")] = fwd, attn
            mems[s.label] = (mem.mib, mem.abs_mib, window_limited(m, L), unfused_reason(m), observed(m, mark))
        ctx.say(f"long L={L}: {len(mems)} schemes x {rounds} rotated rounds")
        times, beside = paired_rounds(jobs, _bases(jobs), rounds, ctx.device)
        prov = ctx.prov(L=L, batch=1, group="long")
        for label, (mib, abs_mib, sparse, why, seen) in mems.items():
            rows[label] = {**prov, "peak_mib": mib, "peak_abs_mib": abs_mib, "sparse": sparse,
                           **_measured(times, beside, label, ("fwd_s", "attn_s")),
                           **({"unfused": why} if why else {}), **seen}
        if BASE in mems:
            add_ratios({k: r for k, r in rows.items() if "skipped" not in r}, BASE, ("fwd_s", "attn_s"))
        out[str(L)] = {s.label: rows[s.label] for s in ctx.natural()}
    return out


def bench_generation(ctx: Context) -> dict:
    """Per-token decode time with a w̄-window KV cache at w̄·probes vs re-encoding w̄ tokens."""
    window, probes, reps = ctx.opts["gen_window"], ctx.opts.get("gen_probes", (1, 2, 4, 8)), ctx.opts.get("gen_reps", 8)
    out, dev = {"window": window, "positions": [window * p for p in probes]}, ctx.device
    last = window * max(probes)
    end, marks = last + reps - 1, {window * p for p in probes}  # tokens last..last+reps-1 timed last
    for s in ctx.natural():
        ctx.say(f"generation w={window}: {s.label}")
        m = build_model(ctx, s).eval()
        try:
            m.scheme.check_length(end + 1)
        except positional.SchemeError as e:
            out[s.label] = {"skipped": str(e).split(";")[0]}
            continue
        toks = torch.randint(0, ctx.cfg.vocab_size, (1, end + 1), generator=torch.Generator().manual_seed(1)).to(dev)
        per_tok = {}
        with torch.no_grad(), autocast(ctx.precision, dev):
            cache = KVCache(ctx.cfg.layers, window=window)
            m(toks[:, :window], positions=torch.arange(window, device=dev), cache=cache)
            for t in range(window, end + 1):
                call = lambda t=t: m(toks[:, t:t + 1], positions=torch.tensor([t], device=dev), cache=cache)
                if t in marks or any(t - k in marks for k in range(1, reps)):
                    per_tok.setdefault(max(p for p in marks if p <= t), []).append(timed(call, dev))
                else:
                    call()
            pos = torch.arange(last - window + 1, last + 1, device=dev)
            re = sorted(timed(lambda: m(toks[:, last - window + 1:last + 1], positions=pos), dev)
                        for _ in range(reps))[reps // 2]
        cached = [1e3 * sorted(per_tok[p])[len(per_tok[p]) // 2] for p in sorted(per_tok)]
        out[s.label] = {"cached_ms": cached, "reencode_ms": 1e3 * re,
                        "speedup_at_end": re * 1e3 / cached[-1], "cached_tokens_per_s": 1e3 / cached[-1]}
    return out


def bench_denormals(ctx: Context) -> dict:
    """ALiBi and NoPE train steps with flush-to-zero on vs off: one thread (the mode is per thread),
    L = the largest L_tr, interleaved; flushing is left on afterwards (as the CLI and trainer run)."""
    if ctx.device.type != "cpu":
        return {"skipped": "flush-to-zero is a CPU setting"}
    L = max(ctx.opts["lengths_train"])
    B = max(1, ctx.opts["batch_tokens"] // L)
    idx = torch.randint(0, ctx.cfg.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(L))
    x, y = idx[:, :-1], idx[:, 1:]  # [B, L] each
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        jobs, before = {}, {}
        for name in (BASE, "alibi"):
            for mode in ("flush", "keep"):
                label = f"{name} {mode}"
                jobs[label] = train_jobs(ctx, build_model(ctx, Spec(name, name)), x, y, ("step_s",), B, L)["step_s"]
                before[label] = lambda on=(mode == "flush"): flush_denormals(on)
                for _ in range(ctx.warmup):
                    before[label](), jobs[label]()
        ctx.say(f"denormals L={L}, batch {B}, 1 thread: 4 rows x {ctx.rounds} rounds")
        times = round_robin(jobs, ctx.rounds, ctx.device, before)
        prov = ctx.prov(L=L, batch=B, group="denormals")
    finally:
        flush_denormals(True)
        torch.set_num_threads(threads)
    rows = {k: {**prov, "step_s": t} for k, t in times.items()}
    for mode in ("flush", "keep"):  # ALiBi / NoPE within a mode; flushing off / on for each scheme
        rows[f"alibi {mode}"]["vs_nope"] = paired_ratio(rows[f"alibi {mode}"], rows[f"{BASE} {mode}"], "step_s")
    for name in (BASE, "alibi"):
        rows[f"{name} keep"]["keep_vs_flush"] = paired_ratio(rows[f"{name} keep"], rows[f"{name} flush"], "step_s")
    return {"L": L, "batch": B, "threads": 1, "rows": rows}

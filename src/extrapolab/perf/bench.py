"""E8 cost table: speed and memory of every scheme against bias-free SDPA (docs/protocols.md, E8).

Follows the comparisons of ALiBi Fig. 2 (train/inference speed and memory vs L), thesis Table 3.4
(train sec/step, tokens/s per kernel) and Sandwich appendix B (cached sliding-window generation
costs O(w̄·L) against O(w̄²·L) for re-encoding the window). Everything is measured in ONE process,
every ratio to NoPE (``none``: bias-free ``scaled_dot_product_attention(is_causal=True)``) is
paired per round and refused across processes or sizes (:mod:`.timing`). Row groups:

* train: full-model step (forward + backward + AdamW + ``constrain_``), no-grad forward, and the
  attention alone (bias tables + every layer's attention, forward + backward; at demo size the
  vocabulary projection dominates a model step and hides it), at each L_tr;
* long: one-sequence forward and attention-only forward at 4k-64k tokens, warmed up at that
  length, ``long_repeats`` >= 3 rotated rounds; window-limited schemes are marked "sparse";
* generation: per-token time with a ``KVCache(window=w̄)`` at positions w̄..8·w̄ against one
  forward over the last w̄ tokens (re-encoding);
* denormals: ALiBi and NoPE train steps with flush-to-zero on and off, one thread, same process.

Memory: extrapolab.memory.PeakMemory around one extra, untimed call per row.
To add a row group (e.g. a RegularGPT LM), write ``fn(ctx: Context) -> dict`` and add it to
``GROUPS`` here and a formatter to ``perf.table.FORMATTERS``.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

from .. import config as C
from .. import positional
from ..io import UserError, atomic_write_json
from ..memory import PeakMemory
from ..model.attention import AttnOptions, attend, flush_denormals
from ..model.gpt import GPT, KVCache, ModelConfig
from ..train.step import autocast, resolve_precision
from .timing import add_ratios, paired_ratio, provenance, round_robin, timed

BASE = "none"
DEMO = ModelConfig(vocab_size=4096, layers=4, heads=4, dim=128, scheme=BASE)
ROUNDS = 9  # paired rounds per row: a median's 95% interval within ±3% on an idle 2-core CPU
QUICK = dict(lengths_train=(128, 512), long_lengths=(4096,), gen_window=64,
             schemes=("sinusoidal", "rotary", "alibi", "t5", "kerple-log", "sandwich", "windowed",
                      "fox", "hybrid", "nope-headscale", "cope"))


def preset_settings(name: str) -> dict:
    """``run_bench`` keywords at a demo preset's shape (``extrapolab bench --preset gpu-quick``): its
    model sizes and vocabulary, its schemes, its batch; train steps at L_tr and 4·L_tr, long
    forwards at 16·L_tr and 64·L_tr (gpu-quick: 512, 2,048; 8,192, 32,768)."""
    preset = name if name.startswith("demo-") or name.endswith((".yaml", ".yml")) else f"demo-{name}"
    raw = C.load_preset(preset)
    cfg = C.resolve(base=raw)
    L = cfg.model.train_length
    model = replace(ModelConfig(**{k: v for k, v in cfg.model.to_dict().items() if k in ModelConfig.__dataclass_fields__}),
                    vocab_size=int(cfg.data.vocab_size), scheme=BASE, dropout=0.0)
    schemes = [(s, s, {}) if isinstance(s, str) else (s.get("label") or s["name"], s["name"], dict(s.get("params") or {}))
               for s in (raw.get("sweep") or {}).get("schemes", QUICK["schemes"])]
    return {"model_cfg": model, "schemes": schemes, "lengths_train": (L, 4 * L), "long_lengths": (16 * L, 64 * L),
            "batch": cfg.train.batch_size, "gen_window": L}


@dataclass(frozen=True)
class Spec:
    """One benched scheme: a row label, the registered name and its options."""
    label: str
    name: str
    params: dict = field(default_factory=dict)


def as_specs(schemes) -> list[Spec]:
    """Names, Specs or (label, name, params) -> Specs, NoPE first (added when missing)."""
    out = []
    for s in schemes:
        out.append(s if isinstance(s, Spec) else Spec(s, s) if isinstance(s, str) else Spec(*s))
    bad = [s.name for s in out if s.name not in positional.names()]
    if bad:
        raise UserError(f"unknown scheme(s) {', '.join(bad)}; run `extrapolab schemes` for valid names")
    return [Spec(BASE, BASE)] + [s for s in out if s.label != BASE]


@dataclass
class Context:
    specs: list[Spec]
    cfg: ModelConfig
    device: torch.device
    rounds: int
    warmup: int
    say: Callable[[str], None]
    opts: dict  # group options: lengths_train, batch_tokens, batch, parts, long_lengths, ...
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast around every timed call, as training runs

    def amp(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` run under this bench's autocast (fp32: unchanged)."""
        if self.precision == "fp32":
            return fn

        def run():
            with autocast(self.precision, self.device):
                return fn()
        return run

    def prov(self, **sizes) -> dict:
        """:func:`.timing.provenance` of a row: device, threads, precision and the model's sizes."""
        return provenance(self.device, precision=self.precision, model=asdict(replace(self.cfg, scheme="")), **sizes)


def _model(ctx: Context, spec: Spec, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(replace(ctx.cfg, scheme=spec.name, scheme_params=dict(spec.params))).to(ctx.device)


def attention_only(model: GPT, B: int, L: int, grad: bool) -> Callable[[], None]:
    """Bias tables + every layer's attention on fixed q, k, v (no projections, MLP or vocabulary);
    a scheme with positions from content (FoX) computes them from a fixed layer input, inside."""
    cfg, dev = model.cfg, model.tok.weight.device
    g = torch.Generator().manual_seed(L)
    qkv = [torch.randn(B, cfg.heads, L, cfg.dim // cfg.heads, generator=g).to(dev).requires_grad_(grad)
           for _ in range(3)]  # q, k, v: [B, H, L, D]
    hidden = torch.randn(B, L, cfg.dim, generator=g).to(dev)  # [B, L, C] the layers' input
    pos, opts = torch.arange(L, device=dev), AttnOptions(impl="auto")

    def run() -> None:
        with torch.set_grad_enabled(grad):
            bias = model.shared_bias(pos, opts)
            total = 0.0
            for i in range(cfg.layers):
                s = model.scheme.for_layer(i)
                p = s.content_positions(hidden, i) if s.has_content else None
                total = total + attend(*qkv, pos, pos, s, i, opts, bias,
                                       content=None if p is None else (p, p))[0].sum()
            if grad:
                total.backward()
    return run


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


def _train_jobs(ctx: Context, m: GPT, x, y, parts, B, L) -> dict[str, Callable]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step():
        loss = m.loss(x, y)
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


def bench_train(ctx: Context) -> dict:
    out, parts = {}, tuple(ctx.opts.get("parts", ("step_s", "fwd_s", "attn_s")))
    for L in ctx.opts["lengths_train"]:
        B = int(ctx.opts.get("batch") or max(1, ctx.opts["batch_tokens"] // L))
        ctx.say(f"train L_tr={L}, batch {B}: {len(ctx.specs)} schemes x ({ctx.warmup} warm-up + {ctx.rounds} rounds)")
        idx = torch.randint(0, ctx.cfg.vocab_size, (B, L + 1), generator=torch.Generator().manual_seed(L))
        x, y = idx[:, :-1].to(ctx.device), idx[:, 1:].to(ctx.device)  # [B, L] each
        jobs, models = {}, {}
        for s in ctx.specs:
            models[s.label] = _model(ctx, s)
            for part, fn in _train_jobs(ctx, models[s.label], x, y, parts, B, L).items():
                for _ in range(ctx.warmup):
                    fn()
                jobs[(s.label, part)] = fn
        times = round_robin(jobs, ctx.rounds, ctx.device)
        prov = ctx.prov(L=L, batch=B, group="train")
        rows = {}
        for s in ctx.specs:
            with PeakMemory(ctx.device) as mem:  # one more step, untimed
                jobs[(s.label, parts[0])]()
            rows[s.label] = {"scheme": s.name, "batch": B, **prov, "peak_mib": mem.mib,
                             "params": sum(p.numel() for p in models[s.label].parameters()),
                             **{p: times[(s.label, p)] for p in parts}}
            why = unfused_reason(models[s.label])
            if why:  # no fused kernel: the bench says why
                rows[s.label]["unfused"] = why
        add_ratios(rows, BASE, parts)
        out[str(L)] = rows
        del models, jobs
    return out


def bench_long(ctx: Context) -> dict:
    out, opts = {}, AttnOptions(impl="auto")
    rounds = max(3, int(ctx.opts.get("long_repeats", 3)))
    for L in ctx.opts["long_lengths"]:
        x = torch.randint(0, ctx.cfg.vocab_size, (1, L), generator=torch.Generator().manual_seed(L)).to(ctx.device)
        rows, jobs, mems = {}, {}, {}
        for s in ctx.specs:
            m = _model(ctx, s).eval()
            try:
                m.scheme.check_length(L)
            except positional.SchemeError as e:
                rows[s.label] = {"skipped": str(e).split(";")[0]}
                continue

            def fwd(m=m):
                with torch.no_grad():
                    m(x, opts=opts)

            fwd, attn = ctx.amp(fwd), ctx.amp(attention_only(m, 1, L, grad=False))
            ctx.say(f"long L={L}: {s.label} warm-up at this length")
            with PeakMemory(ctx.device) as mem:  # the warm-up forward is the memory probe
                fwd()
            attn()
            jobs[(s.label, "fwd_s")], jobs[(s.label, "attn_s")] = fwd, attn
            mems[s.label] = (mem.mib, mem.abs_mib, window_limited(m, L), unfused_reason(m))
        ctx.say(f"long L={L}: {len(mems)} schemes x {rounds} rotated rounds")
        times = round_robin(jobs, rounds, ctx.device)
        prov = ctx.prov(L=L, batch=1, group="long")
        for label, (mib, abs_mib, sparse, why) in mems.items():
            rows[label] = {**prov, "peak_mib": mib, "peak_abs_mib": abs_mib, "sparse": sparse,
                           "fwd_s": times[(label, "fwd_s")], "attn_s": times[(label, "attn_s")],
                           **({"unfused": why} if why else {})}
        if BASE in mems:
            add_ratios({k: r for k, r in rows.items() if "skipped" not in r}, BASE, ("fwd_s", "attn_s"))
        out[str(L)] = {s.label: rows[s.label] for s in ctx.specs}
    return out


def bench_generation(ctx: Context) -> dict:
    """Per-token decode time with a w̄-window KV cache at w̄·probes vs re-encoding w̄ tokens."""
    window, probes, reps = ctx.opts["gen_window"], ctx.opts.get("gen_probes", (1, 2, 4, 8)), ctx.opts.get("gen_reps", 8)
    out, dev = {"window": window, "positions": [window * p for p in probes]}, ctx.device
    last = window * max(probes)
    end, marks = last + reps - 1, {window * p for p in probes}  # tokens last..last+reps-1 timed last
    for s in ctx.specs:
        ctx.say(f"generation w={window}: {s.label}")
        m = _model(ctx, s).eval()
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
                jobs[label] = _train_jobs(ctx, _model(ctx, Spec(name, name)), x, y, ("step_s",), B, L)["step_s"]
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


#: row groups in the order run_bench measures them (see the module docstring to add one)
GROUPS: dict[str, Callable[[Context], dict]] = {
    "train": bench_train, "long": bench_long, "generation": bench_generation, "denormals": bench_denormals}


def _stderr(msg: str) -> None:
    import sys

    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_bench(schemes=None, lengths_train=(128, 512), long_lengths=(4096, 16384, 65536),
              model_cfg: ModelConfig | None = None, repeats: int = ROUNDS, warmup: int = 2,
              gen_window: int = 256, out_json=None, *, quick: bool = False, batch_tokens: int = 4096,
              long_repeats: int = 3, gen_probes=(1, 2, 4, 8), gen_reps: int = 8, threads: int | None = None,
              device: str = "cpu", groups=None, batch: int | None = None, flush: bool = True,
              progress: bool = True, dtype: str = "fp32") -> dict:
    """Measure every scheme (default: all registered) in one process; write ``out_json`` if given.

    ``dtype`` fp32 | bf16 | fp16 | auto: every timed call runs under that autocast, as training does
    (``auto``: bf16 on a GPU that supports it, fp32 on the CPU)."""
    if quick:
        lengths_train, long_lengths, gen_window = QUICK["lengths_train"], QUICK["long_lengths"], QUICK["gen_window"]
    specs = as_specs(schemes or (QUICK["schemes"] if quick else positional.names()))
    if repeats < 1 or warmup < 0 or gen_window < 1 or any(int(L) < 2 for L in (*lengths_train, *long_lengths)):
        raise UserError("bench needs repeats >= 1, warmup >= 0, gen_window >= 1 and lengths >= 2")
    groups = list(groups or GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise UserError(f"unknown bench group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA device; use --device cpu")
    precision = resolve_precision(dtype, dev, what="--dtype")
    cfg = model_cfg or DEMO
    gen_end = gen_window * max(gen_probes) + gen_reps if "generation" in groups else 0
    cfg = replace(cfg, train_length=max(cfg.train_length, *lengths_train, gen_end))
    if threads:
        torch.set_num_threads(int(threads))
    if dev.type == "cpu" and flush:
        flush_denormals(True)  # every row but `denormals` runs as the CLI and the trainer do
    ctx = Context(specs, cfg, dev, int(repeats), int(warmup), _stderr if progress else (lambda m: None),
                  dict(lengths_train=tuple(lengths_train), long_lengths=tuple(long_lengths), batch_tokens=batch_tokens,
                       long_repeats=long_repeats, batch=batch, gen_window=gen_window, gen_probes=gen_probes, gen_reps=gen_reps),
                  precision)
    t0 = time.time()
    res = {"meta": {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(dev), "precision": precision,
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "pid": os.getpid(),
        "model": asdict(cfg), "repeats": ctx.rounds, "warmup": ctx.warmup, "long_repeats": max(3, long_repeats),
        "batch_tokens": batch_tokens, "flush_denormals": dev.type == "cpu" and flush,
        "memory": "peak increase over the entry level (extrapolab.memory.PeakMemory), one untimed call",
        "baseline": f"{BASE} (bias-free SDPA is_causal)", "load_avg_start": os.getloadavg()}}
    for g in groups:
        res[g] = GROUPS[g](ctx)
    res["meta"].update(seconds=time.time() - t0, load_avg_end=os.getloadavg())
    if out_json:
        atomic_write_json(out_json, res)
    return res

"""``bench --groups layouts``: the one SDPA call of the causal path, timed in the three layouts the model hands it.

NoPE, ALiBi, Qin and T5 pass q, k and v as three views of one fused qkv projection ([B, L, 3, H, D] read as
[B, H, L, D]); rotary, xPos and NoPE head scale pass a q and k of their own (the rotation or the per-head scale
writes new dense tensors, in the projection's [B, L, H, D] order) beside v's view: same order, other strides.
On an H200 (2026-11-27, docs/results/gpu-h200-2026-11-27.md) the check's profile stage had rotary and xPos 13-17 ms
a step slower than ALiBi with as many kernel launches, head scale 13 ms, each with kernel time within 1.10x NoPE's
(the train rows, noisier, did not show that gap against ALiBi; rotary still ran 13-19 ms over NoPE's step beside
it in two of three rounds). This group times ``scaled_dot_product_attention(is_causal=True)``
forward + backward at each train length and batch, per layout: wall time per call (queue drained before and after
each batch of ``layers`` calls) and host time per call (the same calls' enqueue time, measured before the drain:
where it nears the wall time the call is host-bound). Nothing of extrapolab's model runs: the layouts alone.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .context import Context
from .groups import batch_of
from .timing import enqueued, fmt_ratio, paired_ratio, rotated

#: label -> who hands SDPA that layout
LAYOUTS = {"packed": "q, k, v: views of one fused projection (NoPE, ALiBi, Qin, T5)",
           "qk-own": "q, k dense [B, L, H, D], v a view (rotary, xPos, NoPE head scale)",
           "contiguous": "q, k, v each a contiguous [B, H, L, D]"}


def _inputs(kind: str, B: int, H: int, L: int, D: int, dev, dtype, g) -> tuple[tuple, tuple]:
    """((q, k, v) [B, H, L, D], the leaves their gradients are taken for) in layout ``kind``."""
    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_(True)
    if kind == "contiguous":
        q, k, v = (leaf(B, H, L, D) for _ in range(3))
        return (q, k, v), (q, k, v)
    P = leaf(B, L, 3, H, D)  # [B, L, 3, H, D] the fused projection's output
    views = [P[:, :, i].transpose(1, 2) for i in range(3)]  # each [B, H, L, D], strides of P
    if kind == "packed":
        return tuple(views), (P,)
    Q, K = leaf(B, L, H, D), leaf(B, L, H, D)  # what empty_like of a view of P gives: P's order, dense
    return (Q.transpose(1, 2), K.transpose(1, 2), views[2]), (Q, K, P)


def bench_layouts(ctx: Context) -> dict:
    """{L: {layout: {wall_s, host_s (per round, per call), wall_ms, host_ms (their medians), wall_ratio (to packed's
    call in the same round: :func:`.timing.paired_ratio`)}}}."""
    cfg, dev = ctx.cfg, ctx.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ctx.precision, torch.float32)
    H, D, n = cfg.heads, cfg.dim // cfg.heads, cfg.layers
    out = {}
    for L in ctx.opts["lengths_train"]:
        B = batch_of(ctx, L)
        ctx.say(f"layouts L={L}, batch {B}: {len(LAYOUTS)} layouts x {ctx.rounds} rounds x {n} SDPA calls")
        g = torch.Generator().manual_seed(L)
        jobs = {}
        for kind in LAYOUTS:
            (q, k, v), leaves = _inputs(kind, B, H, L, D, dev, dtype, g)
            grad_out = torch.randn(B, H, L, D, generator=g).to(dev, dtype)

            def call(q=q, k=k, v=v, leaves=leaves, grad_out=grad_out):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, L, D]
                torch.autograd.grad(o, leaves, grad_out)
            jobs[kind] = call
        for fn in jobs.values():
            for _ in range(max(1, ctx.warmup)):
                fn()
        rows = {kind: {"wall_s": [], "host_s": [], "batch": B, "who": LAYOUTS[kind],
                       **ctx.prov(L=L, batch=B, group="layouts")} for kind in jobs}
        for r in range(ctx.rounds):
            for kind in rotated(list(jobs), r):
                host, wall = enqueued(lambda fn=jobs[kind]: [fn() for _ in range(n)], dev)  # n calls
                rows[kind]["host_s"].append(host / n)
                rows[kind]["wall_s"].append(wall / n)
        for r in rows.values():
            r.update(wall_ms=1e3 * statistics.median(r["wall_s"]), host_ms=1e3 * statistics.median(r["host_s"]),
                     wall_ratio=paired_ratio(r, rows["packed"], "wall_s"))
        out[str(L)] = rows
    return out


def format_layouts(res: dict) -> list[str]:
    """Per L: each layout's wall and host time per SDPA call (forward + backward) and its wall time over packed's."""
    lines = []
    for L, rows in res.items():
        B = next(iter(rows.values()))["batch"]
        lines += ["", f"### SDPA layouts, L = {L} (batch {B}; is_causal, forward + backward per call)", "",
                  "host ms: the calls' enqueue time; near the wall time a call is bound by the host.", "",
                  "| layout | handed over by | wall ms | host ms | wall ×packed |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {r['who']} | {r['wall_ms']:.3f} | {r['host_ms']:.3f} | {fmt_ratio(r['wall_ratio'])} |"
                  for k, r in rows.items()]
    return lines

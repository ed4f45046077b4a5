"""``bench --groups profile``: where one train step's time goes, kernel by kernel, per scheme (torch.profiler).

The train rows say how much slower than NoPE a scheme's step is; this group says why. For each scheme and L_tr
it builds the row's model, runs its warm-up steps (compiles included), then profiles one more step (forward,
backward, AdamW, ``constrain_``) with ``torch.profiler``: on CUDA the device kernels (each launch's name, its
time on the GPU and how many launches; what a fused kernel removes shows as fewer launches and less time), on
the CPU the aten operators by self time (the eager dispatches a GPU would launch as kernels). It times nothing
against a baseline -- the profiler's overhead makes its totals no speed figure; the train rows are -- beyond
the fastest of 3 unprofiled steps beside them, with the host's time to issue each (until the step's last launch
returns, before waiting for the GPU: :func:`.timing.enqueued`), and is off by default (``--groups profile``, or
``train,profile``). On a GPU the two together tell a step bound by its kernels (busy ≈ step) from one bound by
the host launching them (busy far below the step: GPT-2 small at 16 x 512 may be one -- every eager operator a
scheme adds per layer then costs its launch, whatever its arithmetic). On a GPU each row also lists the host's side
of the profiled step (CPU events by self time): on an H200 (2026-11-27) rotary's and xPos's steps took 13-17 ms
more than ALiBi's with as many launches, head scale's 13 ms, each with kernel time within 1.10x NoPE's, which the
kernel list alone could not explain. The train rows there drew NoPE's step between 24.7 and 51.7 ms beside the
schemes it was paired with: at this size, on those hosts, the wall-time ratios move with the host, while the
profile's busy time (the kernels' own) and the host's time to issue a step say which side bounds it and what a
step bound by its kernels (a larger batch, a compiled model) would pay, as "busy ×NoPE".
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .context import Context, build_model
from .groups import train_batch, train_jobs
from .timing import enqueued, sync

#: kernels (operators on the CPU) listed per row, most time first
TOP = 8
#: characters of a kernel's name kept (CUDA template names run to hundreds)
NAME = 72


def _ranked(total: dict, calls: dict, top: int) -> list:
    return [[n[:NAME], total[n] / 1e3, calls[n]] for n in sorted(total, key=lambda n: -total[n])[:top]]


def summarize(prof, device: torch.device, top: int = TOP) -> dict:
    """{launches, kernel_ms, top: [[name, ms, calls], ...]} of one profiled call: CUDA kernels on a GPU, else the
    aten operators by self CPU time. On a GPU also the host's side, ``host_ms`` and ``host_top``: every CPU event
    (operators, CUDA runtime calls such as ``cudaLaunchKernel``) by self CPU time, which names where a host-bound
    step's time goes (one slow call, or many launches)."""
    total, calls = defaultdict(float), defaultdict(int)
    host, hcalls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if device.type == "cuda":
            if e.device_type != DeviceType.CUDA:
                host[e.name] += e.self_cpu_time_total
                hcalls[e.name] += 1
                continue
            us = e.time_range.elapsed_us()
        else:
            if not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        total[e.name] += us
        calls[e.name] += 1
    out = {"launches": sum(calls.values()), "kernel_ms": sum(total.values()) / 1e3, "what": "cuda kernels"
           if device.type == "cuda" else "aten operators (self CPU time)", "top": _ranked(total, calls, top)}
    if device.type == "cuda":
        out.update(host_ms=sum(host.values()) / 1e3, host_top=_ranked(host, hcalls, top))
    return out


def bench_profile(ctx: Context) -> dict:
    """{L_tr: {label: summary}}: one profiled train step per scheme after the row's warm-up (at least one step)."""
    out = {}
    for L in ctx.opts["lengths_train"]:
        B, x, y = train_batch(ctx, L)
        ctx.say(f"profile L_tr={L}, batch {B}: {len(ctx.specs)} schemes x ({max(1, ctx.warmup)} warm-up, 3 timed "
                "and 1 profiled step)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
        rows = {}
        for s in ctx.specs:
            model = build_model(ctx, s)
            step = train_jobs(ctx, model, x, y, ("step_s",), B, L, s.positions)["step_s"]
            for _ in range(max(1, ctx.warmup)):
                step()
            host, wall = zip(*(enqueued(step, ctx.device) for _ in range(3)))  # unprofiled, as the train rows see it
            with profile(activities=activities) as prof:
                step()
                sync(ctx.device)
            rows[s.label] = {"scheme": s.name, "batch": B, "step_ms": 1e3 * min(wall), "host_step_ms": 1e3 * min(host),
                             **summarize(prof, ctx.device),
                             **ctx.prov(L=L, batch=B, group="profile")}
            del model
        out[str(L)] = rows
    return out


def format_profile(res: dict) -> list[str]:
    """Per L_tr: each scheme's launches, their total time and its top kernels (operators on the CPU)."""
    lines = []
    for L, rows in res.items():
        what = next(iter(rows.values()), {}).get("what", "")
        base = rows.get("none", {}).get("kernel_ms")
        lines += ["", f"### profile: one train step, L_tr = {L} ({what})", "",
                  "step ms: the fastest of 3 unprofiled steps; host ms: the fastest time the host took to issue one of "
                  "them (until the step's last launch returned, before waiting for the GPU); busy ms: the listed "
                  "calls' time summed under the profiler, and its ratio to NoPE's (what a step bound by its kernels "
                  "pays: a larger batch, or a compiled model). On a GPU, host ms near the step and busy far below it "
                  "mean the step waits on the host's launches (fewer launches, not faster kernels, is then what "
                  "helps).", "",
                  "| scheme | step ms | host ms | calls | busy ms | busy ×NoPE | top (ms, calls) |",
                  "|---|---|---|---|---|---|---|"]
        for label, r in rows.items():
            top = "; ".join(f"`{n}` {ms:.2f} ×{c}" for n, ms, c in r["top"][:5])
            busy = f"{r['kernel_ms'] / base:.2f}" if base else "—"
            host = f"{r['host_step_ms']:.1f}" if "host_step_ms" in r else "—"
            lines.append(f"| {label} | {r['step_ms']:.1f} | {host} | {r['launches']} | {r['kernel_ms']:.1f} | {busy} "
                         f"| {top} |")
        hosted = {label: r for label, r in rows.items() if r.get("host_top")}
        if hosted:
            lines += ["", "The host's side of the same profiled step: every CPU event by self time (operators and CUDA "
                      "runtime calls; the profiler's overhead included, so compare rows, not with the step).", "",
                      "| scheme | host ms | top (ms, calls) |", "|---|---|---|"]
            for label, r in hosted.items():
                top = "; ".join(f"`{n}` {ms:.2f} ×{c}" for n, ms, c in r["host_top"][:6])
                lines.append(f"| {label} | {r['host_ms']:.1f} | {top} |")
    return lines

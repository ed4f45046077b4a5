"""One command that proves extrapolab on a bare CUDA machine (run it as `scripts/gpu-check.sh` or `make gpu-check`).

From the source tree (`PYTHONPATH=src`, no setup step, no network), on a machine with torch >= 2.11 and CUDA, it runs
in one pass, each stage with a time limit (every kernel compiled cold: about 10.5 minutes on a bare H200 machine
on 2026-11-27 -- pytest 273 s, train 95 s, long 113 s, profile 66 s, torchrun 15 s, the demo's limit 60 s -- over
the 8 hoped for; since then the pytest stage's fp32 flex tests compile one length instead of two, and the bench
adds 9-round train rows and the A/B rows rotary+eager and none/alibi/fox+cudnn (an estimated +60 s; not yet run) and the
exact routes' long chunk with its +table rows beside them (an estimated +60 s; not yet run);
`--stages` splits it into two commands), everything written under OUT:

1. `pytest -m gpu` over tests/ (every GPU test; per-file times from its JUnit XML, each file goal < 3 min);
2. `extrapolab bench --preset gpu-quick` (GPT-2 small, bf16): train rows at L_tr 512 and long forwards at 32,768 (the
   goals' length; each further length costs every flex scheme a cold compile) for every scheme with a CUDA goal
   (docs/attention.md, perf.table.GPU_GOALS) plus NoPE, each row with the attention path it took, FlexAttention's
   tile options, outcome and compile seconds, any fallback; and A/B rows beside them (`rotary+eager`: the eager
   rotation; `SCHEME+cudnn`: SDPA's cuDNN backend first; `SCHEME+table`: the paths before the exact routes, the
   gathered table and FIRE's MLP at every score, beside `auto`'s near-far, closed-form and flex-pieces routes);
3. a 300-step `demo --preset gpu-quick` slice on NoPE and ALiBi with its E1 table;
4. one profiled train step per scheme that misses a goal (`bench --groups profile,layouts`: its CUDA kernels by
   time, the host's side of the step, and SDPA alone in the model's three q/k/v layouts);
5. a one-process `torchrun` training run (the multi-GPU path's code at world size 1: NCCL on CUDA);

then prints the goals met, missed or unresolved and writes OUT/gpu-check.md (and docs/results/gpu-<gpu>.md with a
dated copy, gpu-<gpu>-<date>.md, that the next run leaves in place): the GPU's name,
torch, CUDA, triton, the command, each stage's wall time and outcome. `--dry-run` runs the same stages at toy
sizes on the CPU (gloo), which the test suite uses to check this script's plumbing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the bench's schemes in chunks, one process each (NoPE timed next to every row in each): a compile that is slow
#: or a process that dies costs one chunk, not the table. @flex: training a learnable table on FlexAttention with the
#: table read detached and its gradient from model/table_grad.py's kernel, beside the automatic rule's dense mask
#: (memory-efficient SDPA): the A/B behind flex.AUTO_TABLE_GRAD (T5, KERPLE, FIRE at its training length); fox@flex:
#: FoX's positions from content in FlexAttention's score_mod (model/flex_content.py) beside its folded path (the A/B
#: behind flex.AUTO_CONTENT); alibi@flex: a parameter-free table on FlexAttention beside the automatic rule's dense mask
#: below flex.MIN_LENGTH (the A/B behind that length; Qin's measured it at 512 on 2026-11-27). Long rows: alibi@flex,
#: ALiBi's forward on FlexAttention beside the folded path `auto` now takes (folded.LONG_EVAL, from FoX's 1.53x there)
#: rotary+eager: rotary's rotations by the eager formula beside the fused kernel (positional/turn.py): on the H200
#: (2026-11-27) rotary's steps ran 13-19 ms over NoPE's beside them with as many launches as ALiBi's, where the H100's
#: eager rotation (2026-11-26) had cost 1.23x; the A/B says whether the kernel's launch costs the host that much
ROTARY_FAMILY = ("rotary", "xpos", "hybrid", "nope-headscale")
TRAIN_CHUNKS = {"a1": ROTARY_FAMILY + ("rotary+eager",), "a2": ("alibi", "sandwich", "windowed"),
                "b1": ("qin-type1", "kerple-log", "t5"), "b2": ("fox", "fire"),
                "c": ("t5@flex", "kerple-log@flex", "fire@flex", "fox@flex", "alibi@flex")}
#: +cudnn: SDPA's cuDNN backend first (model/sdpa.py) for the whole-sequence calls, NoPE's and the folded path's
#: (ALiBi, FoX: head size 64 + bias columns, which takes FA2's 96-wide kernel: 1.41x and 1.49x on the H200), beside
#: the flash kernel SDPA picks by default
#: chunk c: the exact routes' A/B (docs/attention.md). In chunk b `auto` runs T5 on the near-far path, KERPLE-log and
#: Qin on closed-form score_mods and FIRE's rows on flex-pieces, none of them measured on a GPU yet; `+table` runs the
#: same schemes as the H200 measured them on 2026-11-27 (the gathered table: 3.82-3.89x NoPE's; FIRE's MLP at every
#: score: 16.2x), in a process of its own so a route that fails to compile costs one chunk
LONG_CHUNKS = {"a": ROTARY_FAMILY + TRAIN_CHUNKS["a2"] + ("alibi@flex", "none+cudnn", "alibi+cudnn"),
               "b": TRAIN_CHUNKS["b1"] + TRAIN_CHUNKS["b2"] + ("fox+cudnn",),
               "c": ("t5+table", "kerple-log+table", "qin-type1+table", "fire+table")}
#: opt-in (`--stages bench-compile`; not in the default run, whose 15 minutes are taken): train rows with the model's
#: forward through torch.compile, as `train.compile` trains (NoPE, the rotary family, FoX and the Toeplitz path's
#: tables trace into one graph: tests/test_compile_graph.py), each beside eager NoPE
COMPILE_ROWS = ("none+compile", "rotary+compile", "alibi+compile", "t5+compile", "fox+compile")
#: stages run only when named exactly (a prefix such as bench-train leaves them out): bench-compile, and the @flex
#: A/B chunk, whose routes lost to `auto`'s choices on the H100 (2026-11-27: T5 2.08x vs 1.29x, KERPLE-log 2.05x vs
#: 1.22x, FIRE 4.79x vs 2.28x, FoX 2.02x vs 1.81x; docs/results/gpu-h100-2026-11-27.md): 72 s of the default run
OPTIONAL = ("bench-compile", "bench-train-c")
#: stage -> seconds it may take, from the first runs on a bare H100 machine (torch 2.11;
#: docs/results/gpu-h100-2026-11-2*.md):
#: every FlexAttention kernel compiles cold there (3-20 s each; ALiBi, Sandwich and windowed training did not
#: finish warming up in 60 s, the long rows' flex schemes 15-40 s per length), so the whole check is ~15
#: minutes, over the 8 hoped for: on a machine whose commands stop at 10 minutes, run it as two commands
#: (--stages). A stage past its limit keeps what it wrote (see _stage). The third run (2026-11-27) took: pytest
#: 212.6 s (stopped at 200), the train chunks 28 + 78 + 34 + 36 + 72 s, the long chunks 62 + 112 s, profile 59 s,
#: torchrun 20 s: 12 minutes without the demo, 13.3 minutes of device time with the machine's start.
#: pytest workers sharing the one GPU: 16 ran an H100 out of memory (2026-11-27: 27 failures, 20 of them
#: out-of-memory errors; the 7 others fp32 gradients from TF32 products in our kernels). With 8 workers the fourth
#: run's pytest (an H200, 75 tests, single tests compiling up to 121 s) took 273 s of its 280: now 360.
#: bench-long-c (the +table rows, added after that run) is an ESTIMATE: chunk b's five rows with their compiles took
#: 55.9 s on the H200, these four are the same kernels (FIRE's rows alone ~25 s: a 15.6 s compile and ~1 s a call),
#: so ~60 s; 120 allows for a slower start. Chunk b now also compiles the routes' new kernels (the band of the near-far
#: path, two closed forms, FIRE's two calls: an estimated +30-60 s), still within its 190
PYTEST_WORKERS = 8
#: seconds a stage past its limit has, after SIGINT, to write what it has before SIGKILL
GRACE = 15
#: paired rounds of the train rows (each ~1 s for a chunk's rows): with 3, a goal's interval was the rounds' min-max
#: and the H200's NoPE steps ranged 24.7-51.7 ms beside the schemes (2026-11-27), leaving 7 of 12 train goals
#: "unresolved"; with 9 the interval is the 2nd-smallest to 2nd-largest ratio (perf.timing.median_ci)
TRAIN_ROUNDS = 9
LIMITS = {"pytest": 360, "bench-train-a1": 60, "bench-train-a2": 90, "bench-train-b1": 70, "bench-train-b2": 60,
          "bench-train-c": 95, "bench-long-a": 150, "bench-long-b": 190, "bench-long-c": 120, "demo": 60, "profile": 90,
          "torchrun": 30, "bench-compile": 240}


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _env() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "unknown (no git)"
    info["date"] = time.strftime("%Y-%m-%d")
    return info


def _stage(name: str, cmd: list[str], out: Path, limit: float, stages: dict, extra: dict | None = None) -> int:
    """Run ``cmd`` with ``limit`` seconds, its output in OUT/<name>.log; record rc and wall time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           **(extra or {})}
    t0 = time.time()
    print(f"[gpu-check] {name}: {' '.join(shlex.quote(c) for c in cmd)} (limit {limit} s)", flush=True)
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:  # SIGINT first: pytest still writes its JUnit XML of the tests run so far
            rc = 124
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stages[name] = {"rc": rc, "seconds": round(time.time() - t0, 1), "limit_s": limit,
                    "command": " ".join(shlex.quote(c) for c in cmd)}
    print(f"[gpu-check] {name}: rc {rc} in {stages[name]['seconds']} s", flush=True)
    return rc


def _pytest_summary(xml: Path) -> dict:
    """Counts and per-file seconds from pytest's JUnit XML."""
    if not xml.is_file():
        return {"missing": True}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    files: dict[str, float] = {}
    failed = []
    for case in suite.iter("testcase"):
        parts = case.get("classname", "").split(".")
        f = next((p for p in parts if p.startswith("test_")), parts[0]) + ".py"
        files[f] = files.get(f, 0.0) + float(case.get("time", 0))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "seconds_per_file": dict(sorted(files.items(), key=lambda kv: -kv[1])), "failed": failed}


def _fallbacks(out: Path) -> list[str]:
    """Every one-line 'runs on the ... path instead' warning the stages printed."""
    lines = []
    for log in sorted(out.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "path instead" in line:
                lines.append(f"{log.stem}: {line.strip()[:300]}")
    return sorted(set(lines))


def _e1_table(demo_out: Path) -> str:
    tables = sorted(demo_out.rglob("*nonoverlapping*.md")) or sorted(demo_out.rglob("*e1*.md"))
    return tables[0].read_text() if tables else "(no E1 table written)"


def _worksteal() -> list[str]:
    """``--dist worksteal`` where this pytest-xdist has it (3.2 and later), else nothing (its default scheduling)."""
    try:
        from importlib.metadata import version
        major, minor = (int(x) for x in version("pytest-xdist").split(".")[:2])
    except Exception:  # noqa: BLE001 -- no xdist, or an odd version string: the default
        return []
    return ["--dist", "worksteal"] if (major, minor) >= (3, 2) else []


def _commands(out: Path, dry: bool) -> dict[str, tuple[list[str], dict]]:
    """Every stage's command and extra environment, in order."""
    py = sys.executable
    dev = ["--device", "cpu", "--dtype", "fp32"] if dry else ["--device", "cuda", "--dtype", "bf16"]
    # worksteal (xdist >= 3.2): an idle worker takes queued tests from a busy one, so the few tests that compile for
    # a minute or two do not leave the stage waiting on one worker's queue
    workers = ["-n", str(min(PYTEST_WORKERS, os.cpu_count() or 1)), *_worksteal()] if not dry else []
    # one compile worker per test process: 16 pytest workers each starting inductor's pool of 16 compile
    # processes (each importing torch) left no test finished after 127 s on an H100 machine's 16 cores; the
    # caching allocator hands memory back between segments (expandable segments) and after each GPU test (conftest)
    cmds = {"pytest": ([py, "-m", "pytest", "-m", "gpu", "-q", *workers, "--timeout", "240", "-p", "no:cacheprovider",
                        "-p", "no:benchmark", "-o", "addopts=", "--junitxml", str(out / "pytest-gpu.xml"), "-rfE",
                        "--tb=line", "tests"], {"TORCHINDUCTOR_COMPILE_THREADS": "1",
                                                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})}
    sizes = (["--train-lengths", "64", "--long-lengths", "256"] if dry else
             ["--preset", "gpu-quick", "--train-lengths", "512", "--long-lengths", "32768"])

    def bench_with(rounds: int) -> list[str]:
        return [py, "-m", "extrapolab", "bench", *dev, "--rounds", str(2 if dry else rounds), *sizes]
    bench = bench_with(3)
    for group, chunks in (("train", TRAIN_CHUNKS), ("long", LONG_CHUNKS)):
        for key, schemes in chunks.items():
            name = f"bench-{group}-{key}"
            if dry:  # toy rows; CPU FlexAttention has no backward, so @flex rows train as themselves
                schemes = ("rotary", "xpos", "alibi", "fire") if key == "a1" else (schemes[0].split("@")[0],)
            rounds = TRAIN_ROUNDS if group == "train" else 3
            cmds[name] = (bench_with(rounds) + ["--schemes", ",".join(schemes), "--groups", group, "--out",
                                                str(out / f"{name}.json")], {})
    cmds["demo"] = ([py, "-m", "extrapolab", "demo", "--preset", "smoke" if dry else "gpu-quick", "--out",
                     str(out / "demo"), *dev, "--set", "sweep.schemes=[none,alibi]", "--set", "sweep.reference=alibi",
                     "--set", "sweep.time_budget_s=0", "--set", f"train.steps={20 if dry else 300}",
                     "--set", "eval.protocols=[nonoverlapping]"], {})
    profiled = ("rotary",) if dry else ("rotary", "rotary+eager", "xpos", "nope-headscale", "alibi", "qin-type1", "t5",
                                         "t5@flex", "fox", "fox@flex", "fire")
    cmds["profile"] = (bench + ["--schemes", ",".join(profiled), "--groups", "profile,layouts", "--out",
                                str(out / "profile.json")], {})
    cmds["bench-compile"] = (bench + ["--schemes", ",".join(("rotary+compile",) if dry else COMPILE_ROWS),
                                      "--groups", "train", "--out", str(out / "bench-compile.json")], {})
    cmds["torchrun"] = ([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                         "extrapolab.train", "--preset", "demo-smoke", "--run-dir", str(out / "torchrun"),
                         "--no-progress", "--set", "train.steps=10", "--set",
                         f"train.device={'cpu' if dry else 'cuda'}"], {})
    return cmds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="reports/gpu-check", help="output folder")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (checks the plumbing)")
    ap.add_argument("--report-only", action="store_true", help="run nothing: write the report from what OUT holds "
                    "(stages.json, env.json, logs), e.g. after copying it off the GPU machine")
    ap.add_argument("--stages", default="", help="comma-separated stages to run (default: all); the report "
                    "covers every stage recorded in OUT, so a check can run in two commands: "
                    "--stages pytest,bench-train then --stages bench-long,demo,profile,torchrun")
    ap.add_argument("--budget", type=float, default=0, help="seconds this command may take (0: no limit): a stage "
                    "whose time limit would end past it is not started, and the line that says so names the "
                    "--stages that run what was left (e.g. --budget 560 under a 10-minute command limit)")
    args = ap.parse_args(argv)
    if not (args.dry_run or args.report_only) and not _cuda_visible():
        # before anything is written: without a GPU every stage would skip or fail in turn (about ten minutes)
        print("gpu_check.py: error: this check needs a CUDA GPU and none is visible to torch here; run it on a GPU "
              "machine, or pass --dry-run to check its plumbing on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    saved = out / "env.json"  # the machine that ran the stages (the report may be written elsewhere)
    if args.report_only:
        if not (out / "stages.json").is_file():
            ap.error(f"{out} holds no stages.json: run the check into it first")
        env = json.loads(saved.read_text()) if saved.is_file() else _env()
        stages = json.loads((out / "stages.json").read_text())
        _report(out, env, {k: stages[k] for k in _commands(out, args.dry_run) if k in stages},
                float(env.get("wall_s", 0)), args.dry_run)
        return 0 if all(s["rc"] == 0 for s in stages.values()) else 1
    env = _env()
    print(f"[gpu-check] {env}", flush=True)
    dry = args.dry_run
    slack = 10 if dry else 1  # a small, shared CPU runs the toy sizes without the GPU's limits
    cmds = _commands(out, dry)
    want = [w.strip() for w in args.stages.split(",") if w.strip()]
    unknown = [w for w in want if not any(n == w or n.startswith(w + "-") for n in cmds)]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(cmds)} or a prefix such as bench-long")
    record = out / "stages.json"  # every stage run into OUT so far, this command's replacing earlier ones
    stages = json.loads(record.read_text()) if record.is_file() and want else {}
    left = []  # stages the budget did not start
    for name, (cmd, extra) in cmds.items():
        if name in OPTIONAL and name in want or name not in OPTIONAL and (
                not want or any(name == w or name.startswith(w + "-") for w in want)):
            if args.budget and (left or time.time() - t0 + LIMITS[name] * slack + GRACE > args.budget):
                left.append(name)
                continue
            _stage(name, cmd, out, LIMITS[name] * slack, stages, extra)
            record.write_text(json.dumps(stages, indent=1))
    if left:
        print(f"[gpu-check] not started within --budget {args.budget:g} s: {', '.join(left)}; run them with "
              f"--stages {','.join(left)} into the same OUT", flush=True)
    stages = {k: stages[k] for k in cmds if k in stages}
    before = float(json.loads(saved.read_text()).get("wall_s", 0)) if saved.is_file() and want else 0.0
    env["wall_s"] = round(time.time() - t0 + before, 1)  # this command's and the earlier ones' into OUT
    saved.write_text(json.dumps(env, indent=1))
    _report(out, env, stages, env["wall_s"], dry)
    return 0 if all(s["rc"] == 0 for s in stages.values()) else 1


def _report(out: Path, env: dict, stages: dict, wall: float, dry: bool) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from extrapolab.perf.layouts import format_layouts
    from extrapolab.perf.profile import format_profile
    from extrapolab.perf.table import check_gpu_goals, format_table

    bench = {}
    for f in sorted(out.glob("bench-*.json")):  # the chunks' rows merged (NoPE's row from the first chunk)
        res = json.loads(f.read_text())
        bench.setdefault("meta", res["meta"])
        for g in ("train", "long"):
            for L, rows in (res.get(g) or {}).items():
                merged = bench.setdefault(g, {}).setdefault(L, {})
                merged.update({k: v for k, v in rows.items() if k not in merged})
    pt = _pytest_summary(out / "pytest-gpu.xml")
    summary = out / "torchrun" / "summary.json"
    run = json.loads(summary.read_text()) if summary.is_file() else {}
    lines = [f"# extrapolab GPU check on {env['gpu']}", "",
             f"`scripts/gpu-check.sh {'--dry-run ' if dry else ''}{out.name}` at commit {env['commit']}: torch {env['torch']}, "
             f"CUDA {env['cuda']}, triton {env['triton']}, Python {env['python']}; wall time {wall:.0f} s.", "",
             "| stage | rc | seconds (limit) | command |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['rc']}{' (timed out)' if v['rc'] == 124 else ''} | {v['seconds']} ({v['limit_s']}) | "
              f"`{v['command']}` |" for k, v in stages.items()]
    lines += ["", "## pytest -m gpu", "", json.dumps(pt, indent=1)]
    if bench.get("meta"):
        lines += ["", "## bench (ratios to bias-free SDPA timed next to each call)", "", format_table(bench)]
        if not dry:
            lines += ["", "## goals (docs/attention.md)", ""] + check_gpu_goals(bench)
    prof = out / "profile.json"
    if prof.is_file():
        profiled = json.loads(prof.read_text())
        lines += ["", "## profile: where one train step's time goes (the kernels by GPU time)"]
        lines += format_profile(profiled.get("profile") or {})
        if profiled.get("layouts"):
            lines += format_layouts(profiled["layouts"])
    fb = _fallbacks(out)
    lines += ["", "## fallbacks (one-line warnings)", ""] + (fb or ["none"])
    lines += ["", "## demo slice: E1 (NoPE, ALiBi)", "", _e1_table(out / "demo")]
    if "torchrun" in stages:
        lines += ["", f"## torchrun, one process: rc {stages['torchrun']['rc']}, backend {run.get('backend')}, world "
                  f"size {run.get('world_size')}, device {run.get('device')}, {run.get('steps')} steps"]
    text = "\n".join(lines) + "\n"
    (out / "gpu-check.md").write_text(text)
    if not dry:
        slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
        chip = re.search(r"[a-z]\d{2,3}", slug.replace("nvidia-", ""))  # h100, h200, a100, l40 ...
        name = f"gpu-{chip.group(0) if chip else slug}"  # the latest run, and a dated copy that the next keeps
        for dest in (ROOT / "docs" / "results" / f"{name}.md",
                     ROOT / "docs" / "results" / f"{name}-{env.get('date') or time.strftime('%Y-%m-%d')}.md"):
            dest.write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())

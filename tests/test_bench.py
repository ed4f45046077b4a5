"""E8 benchmark (extrapolab.perf): one-process paired ratios, provenance checks, rotation, goals, errors."""
import json
import os
from dataclasses import replace

import pytest
import torch

from extrapolab.io import UserError
from extrapolab.model.gpt import ModelConfig
from extrapolab.perf.bench import run_bench
from extrapolab.perf.table import check_goals, format_table
from extrapolab.perf import timing
from extrapolab.perf.timing import (ProvenanceError, median_ci, paired_ratio, paired_rounds, provenance, round_robin,
                                     rotated)

TINY = ModelConfig(vocab_size=64, layers=2, heads=2, dim=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    res = run_bench(["alibi", "kerple-log", "learned", ("windowed(8)", "windowed", {"window": 8})],
                    lengths_train=(16,), long_lengths=(200,), model_cfg=TINY, repeats=3, warmup=0, gen_window=4,
                    out_json=out, batch_tokens=32, gen_reps=2, threads=1, progress=False)
    return res, out


def test_rows_of_one_pass_share_process_and_sizes(tiny):
    res, out = tiny
    assert json.loads(out.read_text())["meta"]["baseline"].startswith("none")
    rows = res["train"]["16"]
    assert list(rows) == ["none", "alibi", "kerple-log", "learned", "windowed(8)"]
    assert {r["pid"] for r in rows.values()} == {os.getpid()}
    assert len({r["config"] for r in rows.values()}) == 1 and '"L": 16' in rows["none"]["config"]
    for r in rows.values():
        assert r["batch"] == 2 and all(len(r[k]) == 3 for k in ("step_s", "fwd_s", "attn_s"))
        for k in ("step_s", "fwd_s", "attn_s"):  # the stored ratio is the paired one, recomputable
            assert r[k + "_ratio"] == paired_ratio(r, rows["none"], k)
            assert (k + "_beside" in r) == (r is not rows["none"])  # NoPE's time next to each call
    assert len(rows["alibi"]["step_s_beside"]) == 3 and "fwd_s_beside" in res["long"]["200"]["alibi"]
    assert rows["none"]["step_s_ratio"]["median"] == 1.0


def test_long_rows_rotate_three_rounds_and_mark_sparse(tiny):
    res, _ = tiny
    long = res["long"]["200"]
    assert "skipped" in long["learned"] and "learned APE" in long["learned"]["skipped"]
    assert all(len(long[s]["fwd_s"]) == 3 for s in ("none", "alibi", "windowed(8)"))  # >= 3 even if fewer asked
    assert long["windowed(8)"]["sparse"] and not long["alibi"]["sparse"] and not long["none"]["sparse"]
    table = format_table(res)
    assert "| windowed(8) (sparse) |" in table and "attention-only" in table and "L = 200" in table
    assert "flushing off" in table and "goals: not checked" in table


def test_denormals_rows_pair_alibi_with_nope_in_each_mode(tiny):
    d = tiny[0]["denormals"]
    assert d["threads"] == 1 and set(d["rows"]) == {"none flush", "none keep", "alibi flush", "alibi keep"}
    assert d["rows"]["alibi keep"]["vs_nope"]["rounds"] == 3
    assert "keep_vs_flush" in d["rows"]["none keep"]


def test_ratio_refuses_another_process_or_another_size():
    import torch

    cpu = torch.device("cpu")
    base = {**provenance(cpu, L=512, batch=8), "t": [1.0, 1.0, 1.0]}
    same = {**provenance(cpu, L=512, batch=8), "t": [1.1, 1.2, 1.0]}
    assert paired_ratio(same, base, "t")["median"] == pytest.approx(1.1)
    other_pid = {**same, "pid": base["pid"] + 1}
    other_size = {**provenance(cpu, L=128, batch=8), "t": [1.1, 1.2, 1.0]}
    with pytest.raises(ProvenanceError, match="pid"):
        paired_ratio(other_pid, base, "t")
    with pytest.raises(ProvenanceError, match="config"):
        paired_ratio(other_size, base, "t")
    with pytest.raises(ProvenanceError, match="rounds"):
        paired_ratio({**same, "t": [1.0, 1.0]}, base, "t")


def test_rounds_rotate_so_nope_is_not_always_first():
    calls = []
    res = round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "c": lambda: calls.append("c")},
                      3, __import__("torch").device("cpu"))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] and all(len(v) == 3 for v in res.values())
    assert rotated([1, 2, 3], 4) == [2, 3, 1]


def test_each_call_is_timed_next_to_a_call_of_its_baseline():
    """paired_rounds: every job but the baselines runs right after or right before its own baseline's call,
    in the rotated order, on the other side of it in the next round; a baseline's time per round is the
    median of its calls, a job without a baseline is timed alone."""
    calls = []
    jobs = {n: (lambda n=n: calls.append(n)) for n in ("B1", "B2", "a", "b", "c", "solo")}
    base_of = {"a": "B1", "b": "B2", "c": "B1"}
    times, beside = paired_rounds(jobs, base_of, 2, __import__("torch").device("cpu"))
    assert calls == ["B1", "a", "b", "B2", "B1", "c", "solo",  # round 0: a, b, c, solo
                     "B2", "b", "c", "B1", "solo", "a", "B1"]  # round 1 rotated: b, c, solo, a; sides swap
    assert set(beside) == {"a", "b", "c"} and all(len(times[n]) == 2 for n in jobs)


def test_pairing_next_to_the_baseline_cancels_a_slowdown_of_the_host(monkeypatch):
    """A host that runs 3x slower for stretches of a few calls: paired with the NoPE call next to it, each
    ratio is the true one (1.5x) in every round; paired with NoPE's one call per round (round_robin), the
    ratio also reads the slowdown."""
    import torch

    cost = {"none": 1.0, "x": 1.5, "y": 2.0, "z": 1.0}
    jobs = {n: (lambda n=n: n) for n in cost}
    clock = []

    def fake_timed(fn, device):
        clock.append(fn())
        slow = 3.0 if (len(clock) - 1) // 2 % 3 == 1 else 1.0  # pairs of calls: every third pair is slow
        return cost[fn()] * slow

    monkeypatch.setattr(timing, "timed", fake_timed)
    cpu = torch.device("cpu")
    times, beside = paired_rounds(jobs, {n: "none" for n in ("x", "y", "z")}, 6, cpu)
    prov = provenance(cpu, L=1)
    row, base = {**prov, "t": times["x"], "t_beside": beside["x"]}, {**prov, "t": times["none"]}
    r = paired_ratio(row, base, "t")
    assert r["min"] == r["max"] == pytest.approx(1.5)
    clock.clear()
    rr = round_robin(jobs, 6, cpu)
    per = [a / b for a, b in zip(rr["x"], rr["none"])]
    assert max(per) / min(per) > 2


def test_median_interval_from_order_statistics():
    assert median_ci([5, 1, 3, 2, 4, 7, 6]) == (1, 7)  # n = 7: only min..max covers 95%
    assert median_ci(list(range(1, 10))) == (2, 8)  # n = 9: P(B <= 1) = 0.0195 <= 0.025


def test_goals_read_the_train_rows_at_512():
    def row(scheme, m):
        return {"scheme": scheme, "step_s_ratio": {"median": m, "min": m, "max": m, "stable": True}}

    res = {"meta": {"threads": 2, "repeats": 9},
           "train": {"512": {"none": row("none", 1.0), "rotary": row("rotary", 1.14), "alibi": row("alibi", 1.02),
                             "t5": row("t5", 1.05), "learned": row("learned", 1.5)}}}
    lines = check_goals(res)
    assert "NOT met" in lines[0] and "rotary 1.14 MISSED" in lines[0] and "alibi 1.02" in lines[0]
    assert "T5 and KERPLE" in lines[1] and "met" in lines[1] and "learned" not in " ".join(lines)
    res["meta"]["threads"] = 1
    assert "goals are stated for 2 threads" in check_goals(res)[0]


def test_unknown_scheme_and_bad_sizes_fail_in_one_line(tmp_path):
    with pytest.raises(UserError, match="extrapolab schemes"):
        run_bench(["alibbi"], model_cfg=TINY, out_json=tmp_path / "x.json")
    with pytest.raises(UserError, match="repeats"):
        run_bench(["alibi"], model_cfg=TINY, repeats=0)
    with pytest.raises(UserError, match="bench group"):
        run_bench(["alibi"], model_cfg=TINY, groups=("nope",))
    assert not (tmp_path / "x.json").exists()


def test_bf16_bench_runs_under_autocast_and_never_pairs_with_fp32(monkeypatch):
    """``--dtype bf16``: every timed call runs under bf16 autocast (the linear layers see it), the
    precision is in each row's provenance, so a bf16 row is never divided by an fp32 one."""
    import torch

    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a, **kw: seen.append(torch.is_autocast_enabled("cpu")) or real(*a, **kw))
    kw = dict(lengths_train=(16,), model_cfg=TINY, repeats=1, warmup=0, batch_tokens=32, threads=1,
              groups=("train",), progress=False)
    bf16 = run_bench(["alibi"], dtype="bf16", **kw)
    assert seen and all(seen) and bf16["meta"]["precision"] == "bf16"
    seen.clear()
    fp32 = run_bench(["alibi"], dtype="fp32", **kw)
    assert seen and not any(seen)
    a, b = bf16["train"]["16"]["alibi"], fp32["train"]["16"]["none"]
    assert '"precision": "bf16"' in a["config"]
    with pytest.raises(ProvenanceError):
        paired_ratio(a, b, "step_s")
    with pytest.raises(UserError, match="--dtype fp16 needs a CUDA device"):
        run_bench(["alibi"], dtype="fp16", **kw)


def test_sweep_cost_pass_times_on_the_sweeps_device_and_precision(monkeypatch):
    """sweep/cost.py hands the sweep's train.device / train.precision to the bench (a GPU sweep is
    timed on its GPU in bf16, never on the CPU) and keys its stored pass on them."""
    from extrapolab import config as C
    from extrapolab.sweep import cost
    from extrapolab.sweep.sweep import SchemeSpec

    got = {}
    monkeypatch.setattr(cost, "run_bench", lambda *a, **kw: got.update(kw) or {
        "meta": {}, "train": {str(kw["lengths_train"][0]): {}}})
    base = C.resolve(None, ["model.layers=1", "model.heads=2", "model.dim=16", "model.train_length=16",
                            "train.device=cpu", "train.precision=bf16"])
    res = cost.run_cost_bench(base, 64, [SchemeSpec("alibi")], rounds=1)
    assert got["device"] == "cpu" and got["dtype"] == "bf16"
    assert res["settings"]["precision"] == "bf16" and res["settings"]["device"] == "cpu"


def test_bench_at_the_gpu_quick_preset_shape():
    """`bench --preset gpu-quick`: the preset's GPT-2-small shape, vocabulary and schemes, train steps
    at L_tr and 4x, long forwards at 16x and 64x L_tr (the issue's 512 / 2,048 and 32,768)."""
    from extrapolab.perf.bench import as_specs, preset_settings

    kw = preset_settings("gpu-quick")
    m = kw["model_cfg"]
    assert (m.layers, m.dim, m.heads, m.vocab_size, m.dropout) == (12, 768, 12, 8192, 0.0)
    assert kw["lengths_train"] == (512, 2048) and kw["long_lengths"] == (8192, 32768) and kw["batch"] == 16
    assert [s.label for s in as_specs(kw["schemes"])] == ["none", "sinusoidal", "rotary", "alibi", "t5", "kerple-log",
                                                          "sandwich"]


def test_bench_preset_and_quick_are_exclusive_and_unknown_preset_is_one_line():
    from typer.testing import CliRunner

    from extrapolab.cli.main import app

    res = CliRunner().invoke(app, ["bench", "--quick", "--preset", "gpu-quick"])
    assert res.exit_code == 2 and "--quick or --preset" in res.output
    res = CliRunner().invoke(app, ["bench", "--preset", "nope-nope"])
    assert res.exit_code == 2 and res.output.count("\n") == 1


def test_new_hooks_bench_against_nope_and_say_why_a_scheme_is_not_fused():
    """FoX (positions from content), a hybrid, the head scale and CoPE (reference path) in one process
    with NoPE; CoPE's rows and table carry the reason no fused kernel runs it; the goals name them."""
    res = run_bench(["fox", ("hybrid(2)", "hybrid", {"every": 2}), "nope-headscale", "cope"], lengths_train=(16,),
                    long_lengths=(64,), model_cfg=TINY, repeats=1, warmup=0, batch_tokens=32, threads=1,
                    progress=False, groups=("train", "long"))
    rows, long = res["train"]["16"], res["long"]["64"]
    assert list(rows) == ["none", "fox", "hybrid(2)", "nope-headscale", "cope"]
    assert "whole row" in rows["cope"]["unfused"] and "whole row" in long["cope"]["unfused"]
    assert not any("unfused" in rows[s] for s in ("fox", "hybrid(2)", "nope-headscale"))
    table = format_table(res)
    assert "- cope: reference path, no fused kernel: CoPE's position" in table
    res["train"]["512"] = res["train"].pop("16")  # the goals read L_tr = 512 rows
    res["long"]["4096"] = res["long"].pop("64")
    goals = "\n".join(check_goals(res))
    for want in ("positions from content <= 1.30x", "score-level (reference path) <= 3.00x",
                 "learned temperature <= 1.10x", "positions from content <= 1.50x NoPE per forward at L = 4096"):
        assert want in goals, goals


def test_fire_dape_and_stick_breaking_bench_with_their_goals_and_reasons():
    """FIRE (Toeplitz up to L, dense beyond: fused kernels, no reason printed), DAPE and stick-breaking
    (reference path: the reason in rows and table); FIRE's goals are the 1.30x train step and 1.5x forward,
    the score-level schemes' the 3x train step."""
    res = run_bench(["fire", "dape-alibi", "stick-breaking"], lengths_train=(16,), long_lengths=(64,), model_cfg=TINY,
                    repeats=1, warmup=0, batch_tokens=32, threads=1, progress=False, groups=("train", "long"))
    rows, long = res["train"]["16"], res["long"]["64"]
    assert "unfused" not in rows["fire"] and "unfused" not in long["fire"]
    assert "MLP" in rows["dape-alibi"]["unfused"] and "softmax" in long["stick-breaking"]["unfused"]
    table = format_table(res)
    assert "- dape-alibi: reference path, no fused kernel: DAPE's MLP" in table
    assert "- stick-breaking: reference path, no fused kernel: stick-breaking" in table
    res["train"]["512"] = res["train"].pop("16")
    res["long"]["4096"] = res["long"].pop("64")
    goals = "\n".join(check_goals(res))
    assert "Toeplitz up to L (FIRE) <= 1.30x NoPE per train step" in goals and "(fire " in goals
    assert "Toeplitz up to L (FIRE) <= 1.50x NoPE per forward at L = 4096" in goals
    assert "score-level (reference path) <= 3.00x" in goals and "dape-alibi" in goals and "stick-breaking" in goals


def test_randomized_positions_rows_train_at_drawn_positions_and_skip_the_long_groups(monkeypatch):
    """A Spec with positions = L_MAX trains at sorted draws from [0, L_MAX) each step (what the trainer
    feeds with train.positions=random:L_MAX); the long/generation rows are those of positions 0..L-1."""
    from extrapolab.model.gpt import GPT

    seen = []
    loss = GPT.loss

    def spy(self, idx, targets, positions=None):
        seen.append(None if positions is None else positions.tolist())
        return loss(self, idx, targets, positions)

    monkeypatch.setattr(GPT, "loss", spy)
    res = run_bench([("rotary+random", "rotary", {}, 64)], lengths_train=(16,), long_lengths=(32,), model_cfg=TINY,
                    repeats=2, warmup=0, gen_window=4, batch_tokens=32, gen_reps=2, threads=1, progress=False)
    drawn = [p for p in seen if p is not None]
    assert drawn and all(len(p) == 16 and p == sorted(set(p)) and p[-1] < 64 for p in drawn)
    assert len({tuple(p) for p in drawn}) > 1 and None in seen  # fresh draws each step; NoPE at 0..L-1
    assert "rotary+random" in res["train"]["16"] and res["train"]["16"]["rotary+random"]["scheme"] == "rotary"
    assert "rotary+random" not in res["long"]["32"] and "rotary+random" not in res["generation"]


def test_rows_say_which_path_ran_and_scheme_at_impl_forces_one():
    """Every row records the attention paths its calls took (the table's "path" column); ``name@impl`` times the
    same scheme on another implementation beside the automatic one; a bad impl is a one-line error."""
    res = run_bench(["alibi", "alibi@plain", "t5", "t5@blocked"], lengths_train=(16,), long_lengths=(64,),
                    model_cfg=TINY, repeats=1, warmup=1, groups=["train", "long"], batch_tokens=32, threads=1,
                    progress=False)
    train, long = res["train"]["16"], res["long"]["64"]
    assert set(train["none"]["paths"]) == {"causal"} and set(train["alibi"]["paths"]) == {"toeplitz"}
    assert set(train["alibi@plain"]["paths"]) == {"reference"} and train["alibi@plain"]["scheme"] == "alibi"
    assert set(long["t5@blocked"]["paths"]) == {"toeplitz"} and all(r["kernels"] == [] for r in long.values())
    assert "| alibi@plain | reference |" in format_table(res)
    with pytest.raises(UserError, match="SCHEME@IMPL") as err:
        run_bench(["alibi@fast"], model_cfg=TINY, progress=False)
    assert "\n" not in str(err.value)


def test_profile_group_lists_each_schemes_operators_and_runs_only_on_request():
    """``--groups profile``: one profiled train step per scheme (NoPE too); on the CPU its aten operators by self
    time. The rotation's eager operators make rotary's step dispatch more of them than NoPE's; a bench that names
    no group leaves the profile out (it times nothing against NoPE)."""
    from extrapolab.perf.bench import DEFAULT_GROUPS, GROUPS

    res = run_bench(["rotary"], lengths_train=(16,), model_cfg=TINY, groups=["profile"], repeats=1, warmup=1,
                    progress=False)
    rows = res["profile"]["16"]
    assert set(rows) == {"none", "rotary"} and "train" not in res
    for r in rows.values():
        assert r["top"] and r["kernel_ms"] > 0 and all(name.startswith("aten::") for name, _, _ in r["top"])
    assert rows["rotary"]["launches"] > rows["none"]["launches"]
    for r in rows.values():  # on the CPU the host's time to issue a step is the step
        assert 0 < r["host_step_ms"] and r["step_ms"] > 0
    text = format_table(res)
    assert "### profile: one train step, L_tr = 16" in text and "| rotary | " in text
    busy = rows["rotary"]["kernel_ms"] / rows["none"]["kernel_ms"]
    assert f"| {rows['rotary']['kernel_ms']:.1f} | {busy:.2f} |" in text and "| busy ×NoPE |" in text
    assert "profile" in GROUPS and "profile" not in DEFAULT_GROUPS


def test_scheme_plus_compile_rows_time_the_forward_through_torch_compile(monkeypatch):
    """``name+compile`` benches the model as ``train.compile`` trains it (its forward through torch.compile; here a
    recording stand-in, the real compile being minutes on a small CPU) beside the eager row; an unknown ``+``
    option is a one-line error."""
    from extrapolab.perf import context

    compiled = []
    monkeypatch.setattr(context.torch, "compile", lambda fn, **kw: compiled.append(fn.__self__.scheme.name) or fn)
    res = run_bench(["rotary", "rotary+compile", "alibi@sdpa+compile"], lengths_train=(16,), model_cfg=TINY,
                    repeats=1, warmup=1, groups=["train"], batch_tokens=32, threads=1, progress=False)
    rows = res["train"]["16"]
    assert {"rotary", "rotary+compile", "alibi@sdpa+compile"} <= set(rows)
    assert rows["rotary+compile"]["scheme"] == "rotary" and set(rows["alibi@sdpa+compile"]["paths"]) == {"toeplitz"}
    assert sorted(compiled) == ["alibi", "rotary"]
    for bad in ("rotary+fast", "rotary+compile+compile"):
        with pytest.raises(UserError, match=r"SCHEME\[@IMPL\]\[\+OPTION...\] with OPTION one of compile, eager") as err:
            run_bench([bad], model_cfg=TINY, progress=False)
        assert "\n" not in str(err.value)


def test_scheme_plus_eager_rows_rotate_by_the_eager_formula(monkeypatch):
    """``rotary+eager`` times rotary with its rotations off the fused kernel (the A/B of the kernel's cost on a
    GPU): every rotation of that row's calls, and only of that row's, sees the kernel disabled."""
    from extrapolab.positional import rotary as rot, turn

    seen = set()
    real = rot.turn_pair
    monkeypatch.setattr(rot, "turn_pair", lambda *a: seen.add(turn.ENABLED) or real(*a))
    res = run_bench(["rotary", "rotary+eager"], lengths_train=(16,), model_cfg=TINY, repeats=1, warmup=1,
                    groups=["train"], batch_tokens=32, threads=1, progress=False)
    rows = res["train"]["16"]
    assert rows["rotary+eager"]["scheme"] == "rotary" and turn.ENABLED
    assert seen == {True, False}  # both rows rotated: the kernel allowed in one, off in the other


def test_scheme_plus_cudnn_rows_put_cudnn_first_for_their_sdpa_calls(monkeypatch):
    """``alibi+cudnn`` runs the row's model with SDPA's cuDNN backend first in line (the A/B beside flash on a GPU;
    on the CPU SDPA has no cuDNN and runs as before): every SDPA call of that row, and only of that row, sees cuDNN
    first, and the priority is SDPA's own again afterwards."""
    import torch.nn.functional as F

    order = torch._C._get_sdp_priority_order
    before, seen = order(), set()
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: seen.add(order()[0]) or real(*a, **kw))
    res = run_bench(["alibi", "alibi+cudnn"], lengths_train=(16,), model_cfg=TINY, repeats=1, warmup=1,
                    groups=["train"], batch_tokens=32, threads=1, progress=False)
    cudnn = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    assert res["train"]["16"]["alibi+cudnn"]["scheme"] == "alibi" and order() == before
    assert seen == {before[0], cudnn} and before[0] != cudnn


def test_plus_cudnn_on_a_torch_without_sdpa_priority_is_one_line(monkeypatch):
    """torch < 2.6 has no ``sdpa_kernel(..., set_priority=...)``: a ``+cudnn`` row is then a one-line error that
    says so, before anything is timed."""
    import torch.nn.attention as attention

    monkeypatch.setattr(attention, "sdpa_kernel", lambda backends: None)  # the older signature
    with pytest.raises(UserError, match=r"needs torch >= 2.6 .*drop the \+cudnn rows") as err:
        run_bench(["alibi+cudnn"], lengths_train=(16,), model_cfg=TINY, repeats=1, warmup=1, groups=["train"],
                  batch_tokens=32, threads=1, progress=False)
    assert "\n" not in str(err.value)


def test_gpu_goal_verdicts_read_the_interval_not_the_median():
    """The H200 run's rotary train step: median 1.48x over rounds 1.03-1.69 against a 1.10x goal is unresolved,
    not MISSED; an interval wholly below a goal is met, wholly above is MISSED."""
    from extrapolab.perf.table import check_gpu_goals, goal_verdict

    assert goal_verdict({"median": 1.48, "ci95": [1.03, 1.69]}, 1.10) == "unresolved (1.03-1.69)"
    assert goal_verdict({"median": 1.05, "ci95": [1.01, 1.10]}, 1.10) == "met"
    assert goal_verdict({"median": 1.41, "ci95": [1.40, 1.43]}, 1.30) == "MISSED"
    assert goal_verdict({"median": 1.2}, 1.30) == "met"  # a row without an interval: its median alone
    res = {"train": {"512": {"rotary": {"step_s_ratio": {"median": 1.48, "ci95": [1.03, 1.69]}}}},
           "long": {"32768": {"rotary": {"fwd_s_ratio": {"median": 1.07, "ci95": [1.01, 1.09]}},
                              "alibi": {"fwd_s_ratio": {"median": 1.41, "ci95": [1.40, 1.43]}}}}}
    lines = check_gpu_goals(res)
    rot = next(x for x in lines if x.startswith("gpu goal rotary:"))
    assert "train step 1.48x <= 1.10x unresolved (1.03-1.69)" in rot and "forward 32k 1.07x <= 1.10x met" in rot
    assert any(x.startswith("gpu goal alibi:") and "forward 32k 1.41x <= 1.30x MISSED" in x for x in lines)
    assert not any(x.startswith("gpu goal fire:") for x in lines)  # nothing measured: no line


def test_cuda_profile_summary_adds_the_hosts_side():
    """On a GPU the profile lists the kernels by GPU time and, beside them, every CPU event by self time (the
    host's side of a host-bound step); a CPU profile has no such table."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from extrapolab.perf.profile import format_profile, summarize

    def ev(name, dev, us):
        return SimpleNamespace(name=name, device_type=dev, self_cpu_time_total=us if dev == DeviceType.CPU else 0,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))
    events = [ev("flash_fwd", DeviceType.CUDA, 300), ev("flash_fwd", DeviceType.CUDA, 300),
              ev("turn_kernel", DeviceType.CUDA, 90), ev("aten::_scaled_dot_product_cudnn_attention", DeviceType.CPU, 700),
              ev("cudaLaunchKernel", DeviceType.CPU, 5), ev("cudaLaunchKernel", DeviceType.CPU, 5)]
    got = summarize(SimpleNamespace(events=lambda: events), torch.device("cuda"))
    assert got["launches"] == 3 and abs(got["kernel_ms"] - 0.69) < 1e-9
    assert got["host_top"][0] == ["aten::_scaled_dot_product_cudnn_attention", 0.7, 1]
    assert got["host_top"][1] == ["cudaLaunchKernel", 0.01, 2] and abs(got["host_ms"] - 0.71) < 1e-9
    text = "\n".join(format_profile({"512": {"rotary": {"step_ms": 45.8, **got}}}))
    assert "| rotary | 0.7 | `aten::_scaled_dot_product_cudnn_attention` 0.70 ×1; `cudaLaunchKernel` 0.01 ×2 |" in text
    cpu = summarize(SimpleNamespace(events=lambda: [ev("aten::mm", DeviceType.CPU, 10)]), torch.device("cpu"))
    assert "host_top" not in cpu and "host's side" not in "\n".join(format_profile({"16": {"none": {"step_ms": 1, **cpu}}}))


def test_layouts_group_times_sdpa_in_the_models_three_layouts_with_their_gradients():
    """``--groups layouts``: the causal path's SDPA call in the layouts the model hands it, each a forward and backward
    whose inputs really have that layout; wall >= host time, packed's ratio 1; on request only."""
    from extrapolab.perf.bench import DEFAULT_GROUPS
    from extrapolab.perf.layouts import LAYOUTS, _inputs

    g = torch.Generator().manual_seed(0)
    (q, k, v), leaves = _inputs("packed", 2, 3, 8, 4, "cpu", torch.float32, g)
    assert len(leaves) == 1 and q.stride() == k.stride() == v.stride() and not q.is_contiguous()
    (q, k, v), leaves = _inputs("qk-own", 2, 3, 8, 4, "cpu", torch.float32, g)
    assert q.transpose(1, 2).is_contiguous() and k.stride() == q.stride() != v.stride() and len(leaves) == 3
    rotated = torch.empty_like(_inputs("packed", 2, 3, 8, 4, "cpu", torch.float32, g)[0][0])  # turn's output
    assert rotated.stride() == q.stride()  # the layout rotary hands SDPA
    (q, k, v), leaves = _inputs("contiguous", 2, 3, 8, 4, "cpu", torch.float32, g)
    assert all(t.is_contiguous() for t in (q, k, v))
    res = run_bench(["rotary"], lengths_train=(16,), model_cfg=TINY, groups=["layouts"], repeats=2, warmup=1,
                    progress=False)
    rows = res["layouts"]["16"]
    assert list(rows) == list(LAYOUTS) and rows["packed"]["wall_ratio"]["median"] == 1.0
    for r in rows.values():
        assert 0 < r["host_ms"] <= r["wall_ms"] and len(r["wall_s"]) == len(r["host_s"]) == 2
        assert all(h <= w for h, w in zip(r["host_s"], r["wall_s"]))
    assert "### SDPA layouts, L = 16" in format_table(res) and "layouts" not in DEFAULT_GROUPS


def test_exact_routes_show_under_their_own_names_beside_plus_table_rows(monkeypatch):
    """The exact routes' rows (docs/attention.md: near-far for T5, closed forms for KERPLE and Qin, FIRE's pieces)
    print their own path names, and ``SCHEME+table`` runs the same scheme on the paths before them, in the
    long forward and in its attention-only column: T5 on the CPU where nearfar.AUTO_CPU is set (from
    nearfar.CPU_MIN_LENGTH tokens, lowered here), KERPLE on FlexAttention (impl="flex": eager on the CPU). FIRE's
    flex-pieces and flex-rows names: tests/test_flex_pieces.py (eager FlexAttention runs its MLP slowly)."""
    from extrapolab.model import nearfar

    monkeypatch.setattr(nearfar, "AUTO_CPU", True)
    monkeypatch.setattr(nearfar, "CPU_MIN_LENGTH", 160)
    res = run_bench(["t5", "t5+table", "kerple-log@flex", "kerple-log@flex+table"],
                    model_cfg=replace(TINY, train_length=64), lengths_train=(16,), long_lengths=(160,), repeats=1,
                    warmup=0, groups=["long"], threads=1, progress=False)
    paths = {k: set(r["paths"]) for k, r in res["long"]["160"].items()}
    assert paths == {"none": {"causal"}, "t5": {"nearfar"}, "t5+table": {"toeplitz"},
                     "kerple-log@flex": {"flex-closed"}, "kerple-log@flex+table": {"flex"}}, paths
    assert "| t5+table | toeplitz |" in format_table(res) and "| kerple-log@flex | flex-closed |" in format_table(res)

"""What our E1 costs on a Hugging Face model against a bare transformers forward, in one process.

``extrapolab bench --hf hf:PATH --lengths 16384``: for each length L, the windows E1
(nonoverlapping, docs/protocols.md) scores on a seeded random token stream (``windows``
consecutive L-token chunks, one per batch) are run two ways:

* ``e1``: ``eval.nonoverlapping`` through :class:`~.adapter.HFCausalLM` -- the final hidden states
  once, then the vocabulary in blocks of positions (eval/core.py), NLL summed in float64;
* ``bare``: ``model(input_ids=window, use_cache=False)`` of transformers under inference mode on
  exactly the ids our E1 feeds (the window prefix included, hf/adapter.py): the full [L, V] logits
  and nothing else, the number a user would time as "one forward".

The timing rules are the bench's (perf/timing.py): both jobs in this process, rounds in rotated
order, the ratio is the median of the per-round ratios e1 / bare with their min-max. Memory: the
first (untimed, warm-up) call of each job runs inside ``extrapolab.memory.PeakMemory``: peak RSS of
the process (absolute, weights included) and its increase over the level before the call. The goals
of the real-model study: E1 within 1.10x of the bare forward, and E1 on SmolLM2-135M at 16,384
tokens under 2.5 GiB peak RSS (its [L, V] fp32 logit matrix alone is 3.2 GB).

``--rope SPEC`` (repeatable) adds, per length, our E1 of the same model with that extension
(``e1 SPEC``: e.g. ``selfextend:3,2048``, ``rerope:1024+logn`` or ``dca:1024``, hf/load.py) to the
same rounds, timed against plain E1: the third goal is that multi-pass methods (Self-Extend,
ReRoPE, dual chunk attention) cost at most 2.2x plain. Such a model shares the plain model's
parameter tensors (``load_state_dict(..., assign=True)``: same weights, one copy in memory), is
loaded after the plain jobs' memory probes and dropped after its length, so every peak RSS counts
one copy of the weights.

``--sinks K:W`` adds E5's cached window with K attention sinks and a W-token window (StreamingLLM,
hf/cached.py): ``e5 sinks`` prefills the first K + W tokens of the length's first window and decodes
the next :data:`DECODE` one at a time, keys cached before rotation and rotated at their cache slots
every step; ``e5 rotated`` decodes the same tokens with transformers' own cache and sdpa, keys
cached rotated and cut to the same K + W (the rotated-key cache of transformers#35350: the same
attention work without the re-rotation, not a correct StreamingLLM). Token-by-token decoding is
not E1's one forward, so this ratio is to ``e5 rotated``, with the same 2.2x goal.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from ..eval import nonoverlapping
from ..io import UserError
from ..memory import PeakMemory
from ..perf.timing import fmt_ratio, paired_ratio, provenance, round_robin
from .adapter import open_hf
from .load import parse_rope

GOAL_RATIO = 1.10
GOAL_RSS_GIB = 2.5
GOAL_TWOPASS = 2.2
TWOPASS = ("selfextend", "rerope", "dca", "streaming")  # --rope parts that run more than one attention pass
DECODE = 128  # tokens decoded one at a time by the --sinks rows


def _with_rope(spec: str, rope: str, plain, **kw):
    """``spec`` loaded with ``--rope rope``, its parameters replaced by ``plain``'s tensors (module doc)."""
    model = open_hf(spec, rope=rope, **kw)
    model.hf.load_state_dict(plain.hf.state_dict(), assign=True)
    return model


def parse_sinks(text: str | None) -> tuple[int, int] | None:
    """``--sinks K:W`` -> (K, W), or a one-line UserError."""
    if not text:
        return None
    k, _, w = str(text).partition(":")
    try:
        K, W = int(k), int(w)
    except ValueError:
        K = W = -1
    if K < 0 or W < 1:
        raise UserError(f"--sinks takes K:W (K >= 0 attention sinks, a window of W >= 1 tokens), e.g. 4:1024; "
                        f"got {text!r}")
    return K, W


def _sink_jobs(plain, sink_model, stream, K: int, W: int) -> dict:
    """The two --sinks jobs (module doc) over the stream's first K + W + DECODE tokens."""
    from transformers import DynamicCache

    from ..eval import cached_window_ppl

    n = K + W + DECODE
    ids = torch.tensor([list(plain.prefix) + stream[:n].tolist()], device=next(plain.parameters()).device)
    keep = len(plain.prefix) + K

    def ours():
        return cached_window_ppl(sink_model, stream[:n + 1], n, window=W, sinks=K, batch_size=1)

    def rotated():
        with torch.inference_mode():
            cache, first = DynamicCache(config=plain.hf.config), keep + W
            plain.hf(input_ids=ids[:, :first], past_key_values=cache, use_cache=True)
            for t in range(first, ids.shape[1]):
                for layer in cache.layers:  # keep + W - 1 keys: the next token makes keep + W
                    rest = slice(layer.keys.shape[2] - (W - 1), layer.keys.shape[2])
                    layer.keys = torch.cat([layer.keys[:, :, :keep], layer.keys[:, :, rest]], 2)
                    layer.values = torch.cat([layer.values[:, :, :keep], layer.values[:, :, rest]], 2)
                plain.hf(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t]], device=ids.device),
                         past_key_values=cache, use_cache=True)
    return {"e5 sinks": ours, "e5 rotated": rotated}


def bench_hf_eval(spec: str, lengths=(2048,), *, windows: int = 1, rounds: int = 3, device: str = "cpu",
                  dtype: str = "fp32", threads: int | None = None, cache_dir=None, seed: int = 0, ropes=(),
                  sinks: str | None = None, say=lambda m: None) -> dict:
    """{"meta": {...}, "rows": {str(L): {e1_s, bare_s (per round), ratio, e1/bare peak RSS, ppl,
    "ropes": {SPEC: {e1_s, ratio to plain E1, peak RSS, ppl}}, "sinks": {...} with --sinks}}}."""
    sink_kw = parse_sinks(sinks)
    if sink_kw and sum(sink_kw) + DECODE > min(int(L) for L in lengths):
        raise UserError(f"--sinks {sinks} decodes K + W + {DECODE} tokens of each length's first window, more than "
                        f"L = {min(int(L) for L in lengths)}; use a smaller W")
    if rounds < 1 or windows < 1 or not lengths or min(int(L) for L in lengths) < 2:
        raise UserError(f"bench --hf needs rounds >= 1, windows >= 1 and lengths >= 2; got rounds={rounds}, "
                        f"windows={windows}, lengths={list(lengths)}")
    for r in ropes:  # every --rope is read before the first forward: a typo costs no warm-up
        parse_rope(r)
    if threads:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    model = open_hf(spec, device=device, dtype=dtype, cache_dir=cache_dir)
    load_s = time.perf_counter() - t0
    dev = next(model.parameters()).device
    V, pre = model.cfg.vocab_size, list(model.prefix)
    rows = {}
    for L in map(int, lengths):
        model.check_length(L)
        g = torch.Generator().manual_seed(seed + L)
        stream = torch.randint(0, V, (windows * L + 1,), generator=g).numpy().astype(np.int64)  # [T]
        inputs = [torch.tensor([pre + stream[s:s + L].tolist()], device=dev) for s in range(0, windows * L, L)]

        def e1():
            return nonoverlapping(model, stream, L, batch_size=1)

        def bare():
            with torch.inference_mode():
                for x in inputs:  # [1, P+L] each
                    model.hf(input_ids=x, use_cache=False)

        say(f"bench --hf L={L}: warm-up + memory probe of both jobs")
        with PeakMemory(dev) as m_bare:
            bare()
        with PeakMemory(dev) as m_e1:
            res = e1()
        jobs, extra = {"e1": e1, "bare": bare}, {}
        if sink_kw:  # its own model (switched to our attention function), sharing the weights
            sink_model = _with_rope(spec, None, model, device=device, dtype=dtype, cache_dir=cache_dir)
            jobs.update(_sink_jobs(model, sink_model, stream, *sink_kw))
        for r in ropes:  # loaded now: the plain probes above saw one copy of the weights
            mr = _with_rope(spec, r, model, device=device, dtype=dtype, cache_dir=cache_dir)
            jobs[f"e1 {r}"] = lambda mr=mr: nonoverlapping(mr, stream, L, batch_size=1)
            with PeakMemory(dev) as m_r:
                extra[r] = {"res": jobs[f"e1 {r}"](), "mem": m_r}
        say(f"bench --hf L={L}: {rounds} rotated rounds of {', '.join(jobs)}")
        times = round_robin(jobs, rounds, dev)
        prov = provenance(dev, L=L, windows=windows, model=spec, dtype=dtype)
        rows[str(L)] = {"windows": windows, "e1_s": times["e1"], "bare_s": times["bare"],
                        "ratio": paired_ratio({**prov, "s": times["e1"]}, {**prov, "s": times["bare"]}, "s"),
                        "e1_peak_mib": m_e1.abs_mib, "e1_peak_delta_mib": m_e1.mib,
                        "bare_peak_mib": m_bare.abs_mib, "bare_peak_delta_mib": m_bare.mib,
                        "memory_method": m_e1.method, "ppl": res["ppl"], "tokens": res["tokens"],
                        "ropes": {r: {"e1_s": times[f"e1 {r}"], "ppl": x["res"]["ppl"], "peak_mib": x["mem"].abs_mib,
                                      "ratio": paired_ratio({**prov, "s": times[f"e1 {r}"]}, {**prov, "s": times["e1"]},
                                                            "s"), "twopass": any(t in r for t in TWOPASS)}
                                  for r, x in extra.items()}}
        if sink_kw:
            rows[str(L)]["sinks"] = {"K": sink_kw[0], "W": sink_kw[1], "decoded": DECODE, "e5_s": times["e5 sinks"],
                                     "rotated_s": times["e5 rotated"],
                                     "ratio": paired_ratio({**prov, "s": times["e5 sinks"]},
                                                           {**prov, "s": times["e5 rotated"]}, "s")}
        del jobs, extra
    meta = {"model": spec, "name": model.loaded.name, "family": model.loaded.family, "vocab": V,
            "parameters": model.loaded.info.get("parameters"), "window_prefix": pre, "device": str(dev),
            "dtype": dtype, "threads": torch.get_num_threads(), "rounds": rounds, "load_s": load_s, "ropes": list(ropes),
            "sinks": sinks,
            "gguf_cache": (model.loaded.info.get("gguf") or {}).get("cache"), "pid": os.getpid(),
            "stream": "seeded random token ids (timing does not depend on the text)",
            "baseline": "transformers model(input_ids, use_cache=False) under inference_mode, same windows",
            "load_avg": os.getloadavg()}
    return {"meta": meta, "rows": rows}


def format_hf_eval(result: dict) -> str:
    """Markdown table of :func:`bench_hf_eval` and its two goal lines."""
    m = result["meta"]
    lines = [f"### E1 on {m['model']} ({m['family']}, V = {m['vocab']:,}) vs a bare transformers forward "
             f"over the same windows ({m['device']}, {m['threads']} threads, {m['rounds']} rotated rounds; "
             f"×bare = median (min–max) of the per-round ratios, ~ = 95% interval wider than ±3%)", "",
             "| L | windows | E1 s | bare forward s | E1 ×bare | E1 peak RSS MiB | bare peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    goals = []
    for L, r in result["rows"].items():
        lines.append(f"| {L} | {r['windows']} | {statistics.median(r['e1_s']):.2f} | "
                     f"{statistics.median(r['bare_s']):.2f} | {fmt_ratio(r['ratio'])} | {r['e1_peak_mib']:.0f} | "
                     f"{r['bare_peak_mib']:.0f} |")
        ok_t = r["ratio"]["median"] <= GOAL_RATIO
        ok_m = r["e1_peak_mib"] / 1024 <= GOAL_RSS_GIB
        goals.append(f"L={L}: E1 time {r['ratio']['median']:.2f}x bare ({'met' if ok_t else 'NOT met'}, goal <= "
                     f"{GOAL_RATIO:.2f}x); E1 peak RSS {r['e1_peak_mib'] / 1024:.2f} GiB "
                     f"({'met' if ok_m else 'NOT met'}, goal <= {GOAL_RSS_GIB} GiB for SmolLM2-135M at 16,384)")
    ext = [(L, r, x) for L, row in result["rows"].items() for r, x in row.get("ropes", {}).items()]
    if ext:
        lines += ["", "| L | --rope | E1 s | ×plain E1 | peak RSS MiB | ppl |", "|---|---|---|---|---|---|"]
        for L, r, x in ext:
            lines.append(f"| {L} | {r} | {statistics.median(x['e1_s']):.2f} | {fmt_ratio(x['ratio'])} | "
                         f"{x['peak_mib']:.0f} | {x['ppl']:.3f} |")
            if x["twopass"]:
                ok = x["ratio"]["median"] <= GOAL_TWOPASS
                kind = "three-pass" if "dca" in r else "two-pass"
                goals.append(f"L={L}: {kind} --rope {r}: E1 {x['ratio']['median']:.2f}x plain E1 "
                             f"({'met' if ok else 'NOT met'}, goal <= {GOAL_TWOPASS}x)")
    sk = [(L, row["sinks"]) for L, row in result["rows"].items() if row.get("sinks")]
    if sk:
        lines += ["", "| L | sinks K | window W | tokens decoded | e5 sinks s | e5 rotated s | ×rotated |",
                  "|---|---|---|---|---|---|---|"]
        for L, x in sk:
            lines.append(f"| {L} | {x['K']} | {x['W']} | {x['decoded']} | {statistics.median(x['e5_s']):.2f} | "
                         f"{statistics.median(x['rotated_s']):.2f} | {fmt_ratio(x['ratio'])} |")
            ok = x["ratio"]["median"] <= GOAL_TWOPASS
            goals.append(f"L={L}: E5 with {x['K']} sinks: {x['ratio']['median']:.2f}x the rotated-key cache "
                         f"({'met' if ok else 'NOT met'}, goal <= {GOAL_TWOPASS}x)")
    return "\n".join(lines + [""] + goals + [f"(model load {m['load_s']:.1f} s, GGUF cache: {m['gguf_cache']})"
                                             if m.get("gguf_cache") else f"(model load {m['load_s']:.1f} s)"])

"""Speed of RegularGPT as an LM against full causal attention at the same depth (Chi 2024 thesis
§6.2.4: O(T·C·K·log_C T) against O(T²·L) for a vanilla transformer).

For each length T: a RegularGPT LM (``model.arch=regulargpt``, chunk C, thickness K) runs
K·ceil(log_C T) sub-layers; the reference is our GPT with NoPE (bias-free
``scaled_dot_product_attention(is_causal=True)``, the fused kernel) and exactly that many layers,
same width, heads and vocabulary. Rows: a no-grad forward and a training step (forward + backward
+ AdamW), each the median over ``repeats`` rounds in which the two models' order rotates, so load
from other processes hits both alike; ratios are RegularGPT / full attention from the same run.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..io import UserError
from ..model.gpt import GPT, ModelConfig
from ..model.regular_lm import RegularLM
from ..positional.sliding_dilated import num_levels


def _median_rotated(jobs: dict, repeats: int) -> dict[str, float]:
    """Median wall seconds per job over ``repeats`` rounds; the order rotates each round."""
    names, times = list(jobs), {n: [] for n in jobs}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            jobs[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def _jobs(model: torch.nn.Module, x: torch.Tensor, train: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @torch.no_grad()
    def fwd():
        model(x)

    def step():
        logits = model(x[:, :-1])  # [B, T-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"fwd": fwd, "step": step} if train else {"fwd": fwd}


def bench_regular_lm(lengths=(256, 1024, 4096), *, C: int = 16, K: int = 1, dim: int = 128, heads: int = 4,
                     vocab: int = 256, batch_tokens: int = 4096, repeats: int = 3, warmup: int = 1,
                     train: bool = True, seed: int = 0) -> dict:
    """{"meta": {...}, "rows": {str(T): {levels, layers, regular_fwd_ms, full_fwd_ms, fwd_ratio,
    [regular_step_ms, full_step_ms, step_ratio]}}}; batch = max(1, batch_tokens // T)."""
    if C < 2 or K < 1 or not lengths or min(lengths) < 2 or repeats < 1:
        raise UserError(f"bench needs C >= 2, K >= 1, lengths >= 2 and repeats >= 1; got C={C}, K={K}, "
                        f"lengths={list(lengths)}, repeats={repeats}")
    base = ModelConfig(vocab_size=vocab, heads=heads, dim=dim, scheme="none")
    rows = {}
    for T in lengths:
        levels = num_levels(T, C)
        torch.manual_seed(seed)
        reg = RegularLM(ModelConfig(**{**base.to_dict(), "arch": "regulargpt", "C": C, "K": K, "train_length": T}))
        full = GPT(ModelConfig(**{**base.to_dict(), "layers": K * levels}))
        x = torch.randint(0, vocab, (max(1, batch_tokens // T), T + 1))
        jobs = {f"{m}_{k}": f for m, model in (("regular", reg), ("full", full))
                for k, f in _jobs(model, x, train).items()}
        for f in jobs.values():  # warm-up: allocator, kernels, optimizer state
            for _ in range(warmup):
                f()
        t = _median_rotated(jobs, repeats)
        row = {"levels": levels, "layers": K * levels, "batch": int(x.shape[0])}
        for k in ("fwd", "step") if train else ("fwd",):
            row[f"regular_{k}_ms"] = 1e3 * t[f"regular_{k}"]
            row[f"full_{k}_ms"] = 1e3 * t[f"full_{k}"]
            row[f"{k}_ratio"] = t[f"regular_{k}"] / t[f"full_{k}"]
        rows[str(T)] = row
    meta = {"C": C, "K": K, "dim": dim, "heads": heads, "vocab": vocab, "batch_tokens": batch_tokens,
            "repeats": repeats, "threads": torch.get_num_threads(),
            "baseline": "GPT, NoPE (SDPA is_causal), K·ceil(log_C T) layers"}
    return {"meta": meta, "rows": rows}


def format_regular_lm(result: dict) -> str:
    """Markdown table of ``bench_regular_lm``'s result (ratios = RegularGPT / full attention)."""
    m = result["meta"]
    train = any("step_ratio" in r for r in result["rows"].values())
    head = "| T | levels | layers | RegularGPT fwd ms | full fwd ms | ×full |"
    sep = "|---|---|---|---|---|---|"
    if train:
        head += " RegularGPT step ms | full step ms | ×full |"
        sep += "---|---|---|"
    lines = [f"RegularGPT LM C={m['C']}, K={m['K']} vs full causal attention at the same depth "
             f"(d={m['dim']}, H={m['heads']}, {m['threads']} threads)", "", head, sep]
    for T, r in result["rows"].items():
        line = (f"| {T} | {r['levels']} | {r['layers']} | {r['regular_fwd_ms']:.1f} | {r['full_fwd_ms']:.1f} "
                f"| {r['fwd_ratio']:.2f} |")
        if train:
            line += f" {r['regular_step_ms']:.1f} | {r['full_step_ms']:.1f} | {r['step_ratio']:.2f} |"
        lines.append(line)
    return "\n".join(lines)

"""Speed of RegularGPT as an LM against full causal attention at the same depth (Chi 2024 thesis
§6.2.4: O(T·C·K·log_C T) against O(T²·L) for a vanilla transformer).

For each length T: a RegularGPT LM (``model.arch=regulargpt``, chunk C, thickness K) runs
K·ceil(log_C T) sub-layers; the reference is our GPT with NoPE (bias-free
``scaled_dot_product_attention(is_causal=True)``, the fused kernel) and exactly that many layers,
same width, heads and vocabulary. Rows: a no-grad forward and a training step (forward + backward
+ AdamW). The timing rules are the bench's (perf/timing.py): both models in this process, rounds
in rotated order, and the ratio is the median of the per-round ratios RegularGPT / full attention
with their min-max, flagged ``~`` when its 95% interval is wider than ±3%.
"""
from __future__ import annotations

import statistics

import torch

from ..io import UserError
from ..model.gpt import GPT, ModelConfig
from ..model.regular_lm import RegularLM
from ..positional.sliding_dilated import num_levels
from .timing import fmt_ratio, paired_ratio, provenance, round_robin


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
                     vocab: int = 256, batch_tokens: int = 4096, repeats: int = 7, warmup: int = 1,
                     train: bool = True, seed: int = 0, device: str = "cpu") -> dict:
    """{"meta": {...}, "rows": {str(T): {levels, layers, batch, regular_fwd_ms, full_fwd_ms, fwd_ratio,
    [regular_step_ms, full_step_ms, step_ratio], rounds}}}; batch = max(1, batch_tokens // T); a
    ratio is ``timing.paired_ratio``'s dict (median, min, max, ci95, stable); ``rounds`` holds the
    per-round seconds of each job."""
    if C < 2 or K < 1 or not lengths or min(lengths) < 2 or repeats < 1:
        raise UserError(f"bench needs C >= 2, K >= 1, lengths >= 2 and repeats >= 1; got C={C}, K={K}, "
                        f"lengths={list(lengths)}, repeats={repeats}")
    dev = torch.device(device)
    base = ModelConfig(vocab_size=vocab, heads=heads, dim=dim, scheme="none")
    kinds = ("fwd", "step") if train else ("fwd",)
    rows = {}
    for T in lengths:
        levels = num_levels(T, C)
        torch.manual_seed(seed)
        reg = RegularLM(ModelConfig(**{**base.to_dict(), "arch": "regulargpt", "C": C, "K": K, "train_length": T}))
        full = GPT(ModelConfig(**{**base.to_dict(), "layers": K * levels}))
        x = torch.randint(0, vocab, (max(1, batch_tokens // T), T + 1)).to(dev)  # [B, T + 1]
        jobs = {f"{m}_{k}": f for m, model in (("regular", reg.to(dev)), ("full", full.to(dev)))
                for k, f in _jobs(model, x, train).items()}
        for f in jobs.values():  # warm-up: allocator, kernels, optimizer state
            for _ in range(warmup):
                f()
        times = round_robin(jobs, repeats, dev)  # {job: [seconds per round]}
        prov = provenance(dev, T=T, batch=int(x.shape[0]), C=C, K=K, dim=dim, heads=heads, vocab=vocab)
        row = {"levels": levels, "layers": K * levels, "batch": int(x.shape[0]), "rounds": times}
        for k in kinds:
            row[f"regular_{k}_ms"] = 1e3 * statistics.median(times[f"regular_{k}"])
            row[f"full_{k}_ms"] = 1e3 * statistics.median(times[f"full_{k}"])
            row[f"{k}_ratio"] = paired_ratio({**prov, k: times[f"regular_{k}"]}, {**prov, k: times[f"full_{k}"]}, k)
        rows[str(T)] = row
    meta = {"C": C, "K": K, "dim": dim, "heads": heads, "vocab": vocab, "batch_tokens": batch_tokens,
            "repeats": repeats, "threads": torch.get_num_threads(), "device": str(dev),
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
             f"(d={m['dim']}, H={m['heads']}, {m['device']}, {m['threads']} threads, {m['repeats']} paired "
             "rounds; ×full = median (min–max) of the per-round ratios, ~ = 95% interval wider than ±3%)",
             "", head, sep]
    for T, r in result["rows"].items():
        line = (f"| {T} | {r['levels']} | {r['layers']} | {r['regular_fwd_ms']:.1f} | {r['full_fwd_ms']:.1f} "
                f"| {fmt_ratio(r['fwd_ratio'])} |")
        if train:
            line += f" {r['regular_step_ms']:.1f} | {r['full_step_ms']:.1f} | {fmt_ratio(r['step_ratio'])} |"
        lines.append(line)
    return "\n".join(lines)

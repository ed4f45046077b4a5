"""Speed of sliding-dilated attention (thesis §6.2.4: O(T·C) per layer, O(T·C·K·log_C T) per
model) against full causal attention (O(T²) per layer), measured in one run.

Per layer, all T queries:
  * ``full``      bias-free fused causal SDPA over T keys (the fastest dense baseline);
  * ``full+mask`` the same attention with the eq. 6.1 mask as a dense [1, H, T, T] bias
                  (what a dense implementation of RegularGPT pays);
  * ``dilated``   ``sliding_dilated_attention``: every query gathers its C keys at distances
                  j·C^l, O(T·C·D).
Whole model, last-token output: RegularGPT's chunked forward (O(T·C) in total over the
ceil(log_C T) levels) against the dense ``forward_full``. The log-log slope of time vs T is
~1 for O(T) and ~2 for O(T²).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from .regular_gpt import RegularGPT, RegularGPTConfig


def sliding_dilated_attention(q, k, v, r: torch.Tensor, level: int, C: int) -> torch.Tensor:
    """Eq. 6.1 attention for all positions in O(T·C): q/k/v [B, H, T, Dh], r [H, C] -> [B, H, T, Dh].

    Query t sees keys t - j·C^level for j < C that exist (t - j·C^level >= 0), with bias r_j.
    """
    B, H, T, Dh = q.shape
    step = C ** level
    scores, vals = [], []
    for j in range(C):
        s = j * step
        if s >= T:
            break
        kj = F.pad(k, (0, 0, s, 0))[:, :, :T]  # [B, H, T, Dh]: key t - s at row t
        vj = F.pad(v, (0, 0, s, 0))[:, :, :T]
        sc = (q * kj).sum(-1) / math.sqrt(Dh) + r[:, j].view(1, H, 1)  # [B, H, T]
        if s:
            sc[:, :, :s] = -math.inf  # no key before position 0
        scores.append(sc)
        vals.append(vj)
    p = torch.softmax(torch.stack(scores, -1), dim=-1)  # [B, H, T, C']
    return torch.einsum("bhtc,cbhtd->bhtd", p, torch.stack(vals))  # [B, H, T, Dh]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def benchmark(lengths=(500, 1024, 2048, 4096), C: int = 2, dim: int = 64, heads: int = 8,
              batch: int = 1, repeats: int = 3, seed: int = 0) -> dict:
    """-> {"rows": [...per T...], "slopes": {...}}; times in milliseconds (best of ``repeats``)."""
    torch.manual_seed(seed)
    dh = dim // heads
    model = RegularGPT(RegularGPTConfig(dim=dim, heads=heads, C=C)).eval()
    r = torch.randn(heads, C)  # [H, C]
    rows = []
    for T in lengths:
        q, k, v = (torch.randn(batch, heads, T, dh) for _ in range(3))  # [B, H, T, Dh]
        level = max(0, math.ceil(math.log(T, C)) - 1)
        pos = torch.arange(T)
        dist = pos[:, None] - pos[None, :]  # [T, T]
        with torch.no_grad():
            model.scheme.r.copy_(r)
        mask = model.scheme.bias_from_distance(dist.clamp(min=0), level)  # [H, T, T]
        mask = mask.masked_fill(dist < 0, -math.inf)[None]  # [1, H, T, T]
        idx = torch.randint(0, 2, (batch, T))
        row = {
            "T": int(T), "level": level,
            "full_ms": 1e3 * _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats),
            "full_mask_ms": 1e3 * _time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), repeats),
            "dilated_ms": 1e3 * _time(lambda: sliding_dilated_attention(q, k, v, r, level, C), repeats),
            "model_chunked_ms": 1e3 * _time(lambda: model(idx), repeats),
            "model_dense_ms": 1e3 * _time(lambda: model.forward_full(idx), max(1, repeats // 2)),
        }
        row["full_over_dilated"] = row["full_ms"] / row["dilated_ms"]
        row["dense_over_chunked"] = row["model_dense_ms"] / row["model_chunked_ms"]
        rows.append(row)
    logT = np.log([r_["T"] for r_ in rows])
    slopes = {}
    for key in ("full_ms", "full_mask_ms", "dilated_ms", "model_chunked_ms", "model_dense_ms"):
        if len(rows) > 1:
            slopes[key] = float(np.polyfit(logT, np.log([r_[key] for r_ in rows]), 1)[0])
    return {"C": C, "dim": dim, "heads": heads, "batch": batch, "threads": torch.get_num_threads(),
            "rows": rows, "loglog_slopes": slopes}


def format_bench(res: dict) -> str:
    head = (f"sliding-dilated vs full attention (C={res['C']}, D={res['dim']}, H={res['heads']}, "
            f"batch={res['batch']}, {res['threads']} thread(s); ms, best of repeats)")
    cols = ["T", "full_ms", "full_mask_ms", "dilated_ms", "full_over_dilated",
            "model_chunked_ms", "model_dense_ms", "dense_over_chunked"]
    lines = [head, "  ".join(f"{c:>17}" for c in cols)]
    for r in res["rows"]:
        lines.append("  ".join(f"{r[c]:>17.3f}" if isinstance(r[c], float) else f"{r[c]:>17}" for c in cols))
    if res["loglog_slopes"]:
        lines.append("log-log slope of time vs T: " +
                     ", ".join(f"{k}={v:.2f}" for k, v in res["loglog_slopes"].items()))
    return "\n".join(lines)

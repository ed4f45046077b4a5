"""A6: attention mass on the first token, per layer (the "attention sink" of Xiao et al. 2024, StreamingLLM,
arXiv 2309.17453, §3.1: trained LMs put a large share of every query's attention on the initial token,
whatever it is; gpt-oss learns a sink logit per head so that softmax need not; Sun et al. 2024, "Massive
Activations", and Gu et al. 2025, "When Attention Sink Emerges", study where it comes from).

For layer l the mass is the mean over heads, segments and the queries m = 1..L-1 of p_l(m, 0), the
weight query m gives to the token at position 0 (query 0 can see only itself and is left out). A sliding
or chunked layer (positional/layout.py) gives 0 where the first token is outside its window or chunk;
that is what the layer attends to. Rows are recomputed per query block from the recorded q, k
(analysis/attn.py), so memory is O(H · block · L), never L x L. With uniform attention the mass would
be the mean of 1/(m + 1), ~ln(L)/L: the figure draws that line for reference.
"""
from __future__ import annotations

import numpy as np
import torch

from ..eval.core import model_device
from ..model.attention import AttnOptions
from .attn import attention_rows, capture_qkv, iter_row_blocks
from .common import as_segments, new_figure, save_figure


def first_token_mass(model, segments, *, opts: AttnOptions | None = None, block: int = 256) -> dict:
    """{"length": L, "per_layer": [R] mean p(m, 0) over heads, segments and queries m >= 1, "uniform": the
    same mean for uniform causal attention} for segments [N, L]."""
    seg = as_segments(segments).to(model_device(model))
    N, L = seg.shape
    pos = torch.arange(L, device=seg.device)
    sums = np.zeros(len(model.blocks))
    count = 0
    with torch.no_grad():
        qkv = capture_qkv(model, seg, opts, pos)
        for layer in range(len(model.blocks)):
            for rows in iter_row_blocks(L, torch.arange(1, L), block):
                p = attention_rows(model, qkv[layer], layer, rows.to(seg.device), pos, opts)  # [N, H, n, L]
                sums[layer] += float(p[..., 0].double().mean(1).sum())  # mean over heads, summed over rows
                count += int(p.shape[0] * p.shape[2]) if layer == 0 else 0
    uniform = float(np.mean([1.0 / (m + 1) for m in range(1, L)]))
    return {"length": int(L), "segments": int(N), "per_layer": [float(s / count) for s in sums], "uniform": uniform}


def plot_first_token(curves: dict[str, list[float]], stem, *, length: int, uniform: float | None = None,
                     title: str = "") -> list[str]:
    """Mass on the first token by layer, one line per label."""
    fig, ax = new_figure(6.4, 4.0)
    for i, (label, ys) in enumerate(curves.items()):
        ax.plot(range(1, len(ys) + 1), ys, marker="o", lw=1.2, label=label, ls="-" if i < 10 else "--")
    if uniform is not None:
        ax.axhline(uniform, color="grey", ls=":", lw=1, label=f"uniform attention ({uniform:.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention weight on token 0")
    ax.set_ylim(0, max(1e-3, max((max(v) for v in curves.values()), default=0.0)) * 1.1)
    ax.set_title(title or f"A6 attention on the first token, L = {length}")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, stem)


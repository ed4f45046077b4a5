"""A5: attention sharpness by input length (thesis Table 5.1, §5.3.3 and §5.4).

For each attention logit vector l^(i) (one per layer, head and query position) the thesis takes
P_max^(i) = max softmax(l^(i)) and H^(i) = -sum p log p (natural log), and averages them:
"P_max is the average maximum probability and H is the average entropy" over N = R·H·L
vectors. Longer inputs give flatter attention (smaller P_max, larger H): the "dispersed
attention" that temperature alignment (T1) corrects. We report the averages per layer and over
all layers, at each length. In a causal LM query i sees i+1 keys; ``queries='all'`` averages over
every query as the thesis does, ``queries='last'`` uses only the last query (the fully
extrapolated one).

Rows are recomputed per query block from the recorded q/k projections (see ``attn.py``) so the
memory is O(H·block·L): lengths are not limited by the L x L probability matrix. The
``method='probs'`` path uses ``model(..., return_probs=True)`` instead (plain attention, L x L per
layer) and serves as a cross-check at modest lengths.
"""
from __future__ import annotations

import numpy as np
import torch

from ..eval.core import model_device
from ..io import UserError
from ..model.attention import AttnOptions, temperature_record
from .attn import attention_rows, capture_qkv, iter_row_blocks
from .common import as_segments, new_figure, save_figure


def sharpness_from_probs(p: torch.Tensor) -> tuple[float, float, int]:
    """(sum of max-probabilities, sum of entropies, count) over all rows of p [..., L]."""
    p = p.double()
    pmax = p.max(dim=-1).values
    ent = torch.special.entr(p).sum(-1)  # -p log p with 0 log 0 = 0
    return float(pmax.sum()), float(ent.sum()), int(pmax.numel())


def _check(lengths, L_avail: int) -> list[int]:
    out = sorted({int(x) for x in lengths})
    if not out or out[0] < 1:
        raise UserError(f"lengths must be positive integers, got {list(lengths)}")
    if out[-1] > L_avail:
        raise UserError(f"length {out[-1]} exceeds the {L_avail} tokens per segment; pass longer segments")
    return out


def attention_sharpness(
    model,
    tokens,
    lengths,
    *,
    opts: AttnOptions | None = None,
    queries: str = "all",
    method: str = "rows",
    block: int = 256,
) -> dict:
    """Per length L: mean max-probability and mean entropy per layer (and overall).

    ``tokens``: segments [N, >= max(lengths)] (each segment's first L tokens are used).
    Returns {"lengths": [...], "per_length": {L: {"p_max": [R], "entropy": [R], "p_max_mean",
    "entropy_mean", "log_L"}}}; log L is the entropy of uniform attention over L keys.
    """
    if queries not in ("all", "last"):
        raise UserError(f"queries must be 'all' or 'last', got {queries!r}")
    if method not in ("rows", "probs"):
        raise UserError(f"method must be 'rows' or 'probs', got {method!r}")
    seg = as_segments(tokens)
    lengths = _check(lengths, seg.shape[1])
    dev = model_device(model)
    opts = opts or AttnOptions(impl="auto")
    R = len(model.blocks)
    out = {}
    was_training = model.training
    model.eval()
    try:
        for L in lengths:
            model.scheme.check_length(L)
            acc = np.zeros((R, 3))  # sum p_max, sum entropy, count
            pos = torch.arange(L, device=dev)
            rows = torch.arange(L) if queries == "all" else torch.tensor([L - 1])
            for i in range(seg.shape[0]):
                idx = seg[i:i + 1, :L].to(dev)
                if method == "probs":
                    with torch.no_grad():
                        probs = model(idx, pos, opts=opts, return_probs=True)["probs"]  # R x [1, H, L, L]
                    for layer, p in enumerate(probs):
                        acc[layer] += sharpness_from_probs(p[:, :, rows.to(dev)])
                    continue
                qkv = capture_qkv(model, idx, opts, positions=pos)
                for layer, x in enumerate(qkv):
                    for blk in iter_row_blocks(L, rows, block):
                        with torch.no_grad():
                            p = attention_rows(model, x, layer, blk.to(dev), pos, opts)  # [1, H, b, L]
                        acc[layer] += sharpness_from_probs(p)
            pm, ent = acc[:, 0] / acc[:, 2], acc[:, 1] / acc[:, 2]
            out[L] = {"p_max": pm.tolist(), "entropy": ent.tolist(),
                      "p_max_mean": float(acc[:, 0].sum() / acc[:, 2].sum()),
                      "entropy_mean": float(acc[:, 1].sum() / acc[:, 2].sum()),
                      "log_L": float(np.log(L))}
    finally:
        model.train(was_training)
    return {"lengths": lengths, "queries": queries, "temperature": temperature_record(opts.temperature),
            "per_length": out}


def sharpness_table(res: dict) -> str:
    """Markdown table in the layout of thesis Table 5.1 (rows P_max and H, one column per length)."""
    Ls = res["lengths"]
    per = res["per_length"]
    head = "| criterion | " + " | ".join(str(L) for L in Ls) + " |"
    sep = "|---|" + "---|" * len(Ls)
    pm = "| P_max | " + " | ".join(f"{per[L]['p_max_mean']:.3f}" for L in Ls) + " |"
    en = "| H | " + " | ".join(f"{per[L]['entropy_mean']:.3f}" for L in Ls) + " |"
    return "\n".join([head, sep, pm, en])


def plot_sharpness(res: dict, path_stem, *, train_length: int | None = None) -> list[str]:
    """P_max and entropy per layer vs length (log x), with log L (uniform attention) for reference."""
    fig, (a1, a2) = new_figure(9.0, 3.6, ncols=2)
    Ls = res["lengths"]
    per = res["per_length"]
    R = len(per[Ls[0]]["p_max"])
    for layer in range(R):
        a1.plot(Ls, [per[L]["p_max"][layer] for L in Ls], marker="o", lw=1, label=f"layer {layer}")
        a2.plot(Ls, [per[L]["entropy"][layer] for L in Ls], marker="o", lw=1, label=f"layer {layer}")
    a2.plot(Ls, [per[L]["log_L"] for L in Ls], ls="--", color="gray", lw=1, label="log L (uniform)")
    for ax, name in ((a1, "mean max probability"), (a2, "mean entropy (nats)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input length L")
        ax.set_ylabel(name)
        if train_length:
            ax.axvline(train_length, color="red", ls=":", lw=1)
        ax.legend(fontsize=6)
    fig.suptitle(f"Attention sharpness ({res['queries']} queries)")
    return save_figure(fig, path_stem)

"""A1: cumulative normalized gradient and empirical receptive field (ERF).

Sandwich paper (Chi, Fan, Rudnicky 2023) §5.1, following Luo et al. 2016:

    s_m = ||g_m||_2 / sum_{n=1}^{L_ex} ||g_n||_2,      c_m = sum_{n=m}^{L_ex} s_n,
    ERF = min{m | c_m > 0.99}

where g_m is the gradient of the loss of *predicting the last token* w.r.t. the input embedding
e_m. For APE schemes e_m includes the position embedding (``GPT.embed`` = token + position).

Conventions used here (the paper's Figs. 4-7 and its text, e.g. "the most recent 512 (1536-th
to 2047-th)" when "predicting the next (2048-th) token"):

* a segment holds L_ex tokens at 1-based positions 1..L_ex; the model reads tokens 1..L_ex-1
  and we take the gradient of -log p(token L_ex); ``c`` has L_ex entries and c_{L_ex} = 0
  (the target itself is not an input);
* c_m is non-increasing with c_1 = 1, so the printed ``min{m | c_m > 0.99}`` is always 1. The
  paper's reported ERFs ("ERF = 768 tokens") are the number of most recent tokens that hold
  more than 99% of the gradient. We report both readings of that quantity:
  ``erf_position`` m* = max{m | c_m > 0.99} (1-based) and ``erf_tokens`` = L_ex - m* (the
  context tokens m*..L_ex-1), i.e. min{t | the t most recent inputs hold > 99%}.

``attention_erf`` is Qin et al. 2024's attention-based ERF n_emp(eps) = inf_j (C_ij > C_ii(1-eps))
(section "Theoretical Receptive Field"): the fewest most recent keys holding > 1-eps of the
last query's attention, per layer and head.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..eval.core import model_device
from ..io import UserError
from ..memory import PeakMemory
from ..model.attention import AttnOptions
from .attn import attention_rows, capture_qkv
from .common import as_segments, new_figure, save_figure

ERF_CONVENTION = (
    "c has L_ex entries over 1-based positions 1..L_ex; inputs are tokens 1..L_ex-1 and the "
    "target is token L_ex (c_{L_ex}=0). erf_position = max{m | c_m > threshold}; erf_tokens = "
    "L_ex - erf_position = fewest most-recent input tokens holding > threshold of the gradient "
    "(the paper's 'ERF = 768 tokens'). The literal min{m | c_m > 0.99} is always 1 since c_1 = 1."
)


def _frozen(model):
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    return saved


@contextmanager
def _checkpointed_blocks(model, enabled: bool):
    """Recompute each block in the backward pass: only one layer's attention state is alive."""
    if not enabled:
        yield
        return
    originals = [blk.forward for blk in model.blocks]
    for blk, fwd in zip(model.blocks, originals):
        blk.forward = functools.partial(checkpoint, fwd, use_reentrant=False)
    try:
        yield
    finally:
        for blk in model.blocks:
            del blk.forward  # back to the class method


def cumulative_gradient(
    model,
    segments,
    *,
    opts: AttnOptions | None = None,
    batch_size: int = 1,
    checkpoint_layers: bool = True,
    return_per_segment: bool = False,
):
    """c [L_ex] (float64 numpy) averaged over the N segments [N, L_ex] (see module docstring).

    Parameters are frozen during the call (only the input embeddings carry gradient), so learnable
    biases keep the fused attention kernel. Default ``opts``: the blocked path (block 512), whose
    memory is O(H · block · L) per layer instead of L x L. ``checkpoint_layers`` recomputes each
    block during the backward pass, so the attention masks/scores of only one layer are alive.
    With ``return_per_segment`` returns (c_mean [L_ex], c_all [N, L_ex]).
    """
    seg = as_segments(segments)
    N, L = seg.shape
    if L < 2:
        raise UserError(f"segments need at least 2 tokens (context + target), got length {L}")
    model.scheme.check_length(L - 1)
    opts = opts or AttnOptions(impl="blocked", block_size=512)
    dev = model_device(model)
    was_training = model.training
    model.eval()
    saved = _frozen(model)
    rows = []
    try:
        pos = torch.arange(L - 1, device=dev)
        for s in range(0, N, max(1, int(batch_size))):
            chunk = seg[s:s + batch_size].to(dev)
            idx, tgt = chunk[:, :-1], chunk[:, -1]  # [B, L-1], [B]
            with torch.no_grad():
                e0 = model.embed(idx, pos)  # [B, L-1, C]
            e = e0.detach().requires_grad_(True)
            with _checkpointed_blocks(model, checkpoint_layers):
                logits = model(idx, pos, inputs_embeds=e, opts=opts)  # [B, L-1, V]
                nll = F.cross_entropy(logits[:, -1].float(), tgt, reduction="sum")
                (g,) = torch.autograd.grad(nll, e)  # [B, L-1, C]
            norms = g.detach().double().norm(dim=-1).cpu()  # [B, L-1]
            total = norms.sum(-1, keepdim=True)
            if bool((total == 0).any()):
                raise UserError("the loss gradient w.r.t. every input embedding is zero; check the model")
            sm = norms / total  # [B, L-1]
            c = sm.flip(-1).cumsum(-1).flip(-1)  # [B, L-1]  c_m = sum_{n>=m} s_n
            rows.append(torch.cat([c, torch.zeros(c.shape[0], 1, dtype=c.dtype)], dim=1))  # [B, L]
            del logits, e, g
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)
        model.train(was_training)
    c_all = torch.cat(rows).numpy()  # [N, L]
    c_mean = c_all.mean(0)
    return (c_mean, c_all) if return_per_segment else c_mean


def erf(c, threshold: float = 0.99) -> dict:
    """ERF of a cumulative-gradient curve c [L_ex] (see ERF_CONVENTION)."""
    c = np.asarray(c, dtype=np.float64)
    if c.ndim != 1 or c.size < 2:
        raise UserError(f"c must be a 1-D curve over L_ex >= 2 positions, got shape {c.shape}")
    if not 0.0 < threshold < 1.0:
        raise UserError(f"threshold must lie in (0, 1), got {threshold}")
    L = int(c.size)
    over = np.nonzero(c > threshold)[0]
    m_star = int(over.max()) + 1 if over.size else 1
    return {
        "erf_position": m_star,
        "erf_tokens": L - m_star,
        "L_ex": L,
        "threshold": float(threshold),
        "convention": ERF_CONVENTION,
    }


def measure_erf(model, segments, *, threshold: float = 0.99, opts: AttnOptions | None = None,
                batch_size: int = 1, checkpoint_layers: bool = True) -> dict:
    """cumulative_gradient + erf + wall time + peak memory (CUDA peak or sampled RSS)."""
    import time

    t0 = time.perf_counter()
    with PeakMemory(model_device(model)) as mem:
        c_mean, c_all = cumulative_gradient(model, segments, opts=opts, batch_size=batch_size,
                                            checkpoint_layers=checkpoint_layers, return_per_segment=True)
    out = erf(c_mean, threshold)
    per_seg = [erf(row, threshold)["erf_tokens"] for row in c_all]
    out.update({
        "c": c_mean,
        "erf_tokens_per_segment_mean": float(np.mean(per_seg)),
        "segments": int(c_all.shape[0]),
        "seconds": time.perf_counter() - t0,
        "peak_memory_mb": mem.peak_mb,
        "peak_memory_method": mem.method,
    })
    return out


def attention_erf(model, segments, eps: float = 0.01, *, opts: AttnOptions | None = None) -> dict:
    """Qin's n_emp(eps) for the last query of each segment: [layers][heads] mean over segments."""
    if not 0.0 < eps < 1.0:
        raise UserError(f"eps must lie in (0, 1), got {eps}")
    seg = as_segments(segments)
    dev = model_device(model)
    N, L = seg.shape
    if not getattr(model, "dense_attention", True):  # RegularGPT: C keys per query per level, no rows
        return {"eps": eps, "L": L, "per_layer_head": [], "mean": float("nan"), "max_head_mean": float("nan"),
                "note": f"{type(model).__name__} has no dense attention rows (thesis eq. 6.1 reads C keys per level)"}
    pos = torch.arange(L, device=dev)
    out = np.zeros((len(model.blocks), model.cfg.heads))
    was_training = model.training
    model.eval()
    try:
        for i in range(N):
            idx = seg[i:i + 1].to(dev)
            qkv = capture_qkv(model, idx, opts)
            for layer, x in enumerate(qkv):
                with torch.no_grad():
                    p = attention_rows(model, x, layer, torch.tensor([L - 1]), pos, opts)[0, :, 0]  # [H, L]
                recent = p.double().flip(-1).cumsum(-1).cpu().numpy()  # [H, L] mass of j most recent
                j = (recent > (1.0 - eps)).argmax(-1) + 1  # [H]
                out[layer] += j
    finally:
        model.train(was_training)
    out /= N
    return {"eps": eps, "L": L, "per_layer_head": out.tolist(), "mean": float(out.mean()),
            "max_head_mean": float(out.max(axis=1).mean())}


def plot_erf(curves: dict, path_stem, *, train_length: int | None = None, threshold: float = 0.99,
             title: str = "Cumulative normalized gradient",
             xlabel: str = "position m (1-based; the last token is predicted)") -> list[str]:
    """Overlay several runs' c_m (Sandwich Figs. 4-7, 11): x = position m, L_tr window marked."""
    fig, ax = new_figure()
    L = None
    for name, c in curves.items():
        c = np.asarray(c)
        L = len(c)
        info = erf(c, threshold)
        ax.plot(np.arange(1, L + 1), c, label=f"{name} (ERF {info['erf_tokens']} tok)")
    if L and train_length:
        ax.axvline(L - train_length, color="gray", ls="--", lw=1, label=f"L_tr = {train_length} most recent")
    ax.axhline(threshold, color="red", ls=":", lw=1, label=f"c = {threshold}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("c_m")
    ax.set_title(title)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem)

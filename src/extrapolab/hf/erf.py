"""A1 cumulative normalized gradient / ERF of an HF causal LM, through its real input embeddings.

Sandwich (Chi, Fan, Rudnicky 2023) §5.1 after Luo et al. 2016: s_m = ||g_m|| / sum_n ||g_n||,
c_m = sum_{n>=m} s_n, with g_m the gradient of -log p(last token) w.r.t. input embedding e_m;
the conventions (1-based positions, c_{L_ex} = 0, ``erf_tokens``) are those of
``analysis.erf`` (ERF_CONVENTION), whose :func:`erf` reads the ERF off the curve.

Here e_m is the HF model's token embedding (``get_input_embeddings()(idx)``), fed back as
``inputs_embeds`` with gradient; a learned position embedding (GPT-2) is added inside the model
after it, so dL/d(token embedding) = dL/d(token + position), the quantity of the paper.
Parameters are frozen for the call; memory is the HF model's own forward + backward at L_ex
(sdpa: no L x L tensor for the RoPE / GPT-2 families). Only the last position's logits are formed
where the head reads the final hidden state (hf/adapter.py ``CHUNKED``), not [L, V].
``checkpoint=True`` recomputes each decoder layer in the backward pass through transformers' own
``activation_checkpointing_enable`` (only the layers' inputs are kept: SmolLM2 at 8,192 tokens needs
about 1.3 GB less per 1,000 tokens); transformers checkpoints only in training mode, so the model
runs in it for the call, which changes nothing only when every dropout probability is zero -- a
model with dropout is run without checkpointing (the record says which).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from ..analysis.common import as_segments
from ..memory import PeakMemory
from ..analysis.erf import erf
from ..eval.core import model_device
from ..io import UserError


def can_checkpoint(hf) -> bool:
    """transformers can checkpoint the model's layers and training mode changes nothing: no dropout
    module with p > 0 and no config field named like a dropout probability above 0."""
    if not getattr(hf, "supports_gradient_checkpointing", False):
        return False
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in hf.modules()):
        return False
    cfg = hf.config.to_dict()
    return not any(isinstance(v, (int, float)) and v > 0 for k, v in cfg.items() if "dropout" in k or "pdrop" in k)


@contextmanager
def checkpointed(hf, enabled: bool = True):
    """transformers' gradient checkpointing for the block (see module doc); yields whether it is on."""
    if not (enabled and can_checkpoint(hf)):
        yield False
        return
    was = hf.training
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    hf.train()
    try:
        yield True
    finally:
        hf.activation_checkpointing_disable()
        hf.train(was)


def _last_logits(model, e: torch.Tensor, opts) -> torch.Tensor:
    """Logits [B, V] of the last position for input embeddings e [B, L, C]."""
    if getattr(model, "chunked", False):
        return model.logits_from_hidden(model.final_hidden(inputs_embeds=e, opts=opts)[:, -1])  # [B, V]
    return model(inputs_embeds=e, opts=opts)[:, -1]


def hf_cumulative_gradient(model, segments, batch_size: int = 1, opts=None, checkpoint: bool = False) -> np.ndarray:
    """c [N, L_ex] (float64) per segment for ``model`` (an ``HFCausalLM``) on segments [N, L_ex];
    ``opts``: an AttnOptions (its temperature); ``checkpoint``: see module doc."""
    seg = as_segments(segments)
    N, L = seg.shape
    if L < 2:
        raise UserError(f"segments need at least 2 tokens (context + target), got length {L}")
    model.check_length(L - 1)
    dev = model_device(model)
    was_training = model.training
    model.eval()
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    rows = []
    try:
        for s in range(0, N, max(1, int(batch_size))):
            chunk = seg[s:s + batch_size].to(dev)
            idx, tgt = chunk[:, :-1], chunk[:, -1]  # [B, L-1], [B]
            with torch.no_grad():
                e = model.embed(idx)  # [B, L-1, C]
            e = e.detach().requires_grad_(True)
            with checkpointed(model.hf, checkpoint):
                nll = F.cross_entropy(_last_logits(model, e, opts).float(), tgt, reduction="sum")
                (g,) = torch.autograd.grad(nll, e)  # [B, L-1, C]
            norms = g.detach().double().norm(dim=-1).cpu()  # [B, L-1]
            if bool((norms.sum(-1) == 0).any()):
                raise UserError("the loss gradient w.r.t. every input embedding is zero; check the model")
            c = (norms / norms.sum(-1, keepdim=True)).flip(-1).cumsum(-1).flip(-1)  # [B, L-1] c_m
            rows.append(torch.cat([c, torch.zeros(c.shape[0], 1, dtype=c.dtype)], dim=1))  # [B, L]
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)
        model.train(was_training)
    return torch.cat(rows).numpy()


def hf_measure_erf(model, segments, threshold: float = 0.99, batch_size: int = 1, opts=None,
                   checkpoint: bool = False) -> dict:
    """ERF of the mean curve + per-segment mean, wall time and peak memory (like analysis.measure_erf)."""
    t0 = time.perf_counter()
    with PeakMemory(model_device(model)) as mem:
        c_all = hf_cumulative_gradient(model, segments, batch_size, opts, checkpoint)
    out = erf(c_all.mean(0), threshold)
    out.update({"c": c_all.mean(0),
                "erf_tokens_per_segment_mean": float(np.mean([erf(r, threshold)["erf_tokens"] for r in c_all])),
                "segments": int(c_all.shape[0]), "seconds": time.perf_counter() - t0,
                "peak_memory_mb": mem.peak_mb, "peak_memory_method": mem.method,
                "checkpointed": bool(checkpoint and can_checkpoint(model.hf))})
    return out


def erf_of_hf(spec, *, length: int | None = None, segments: int = 4, threshold: float = 0.99, preset=None,
              overrides=None, device: str = "auto", dtype: str = "auto", rope: str | None = None,
              train_length: int | None = None) -> tuple[dict, dict, int | None]:
    """ERF of ``hf:PATH`` on the test split of the preset's corpus (data.*; ``--set`` overrides) ->
    (record, the curve c, L_tr). Default L_ex: 2·L_tr, within a learned-position model's table."""
    from .. import config as C
    from ..analysis.common import segments_from_stream
    from .adapter import open_hf
    from .data import hf_split

    cfg = C.resolve(preset, overrides)
    model = open_hf(spec, device=device, dtype=dtype, rope=rope, train_length=train_length,
                    cache_dir=cfg.data.cache_dir)
    stream = hf_split(cfg.data, model.loaded.tokenizer, cfg.eval.split)
    L_tr = model.loaded.train_length
    L = int(length or 2 * (L_tr or 512))
    if not length and model.loaded.max_length:
        L = min(L, model.loaded.max_length + 1)
    e = hf_measure_erf(model, segments_from_stream(stream, L, segments), threshold)
    name = f"hf:{model.loaded.name}" + (f" ({rope})" if rope else "")
    rec = {"name": name, "erf_tokens": e["erf_tokens"], "erf_position": e["erf_position"], "L_ex": L,
           "peak_memory_mb": e["peak_memory_mb"], "seconds": e["seconds"], "attention_erf": None, "trf": None}
    return rec, e["c"], L_tr

"""Softmax temperature per layer inside a Hugging Face causal LM (thesis ch. 5, §5.4, Algorithm 1).

Softmax_tau(l) = softmax(l / tau) divides the *whole* pre-softmax logit, the scaled q·k and any
additive position bias, as ``AttnOptions.temperature`` does for our GPT. Nothing of the model's
attention maths is copied: each family's attention module already carries the factor that
multiplies q·k, and tau divides it for the duration of a ``with`` block (restored after):

* GPT-2, GPT-NeoX / Pythia, Llama, Mistral, Qwen2 (transformers 5 attention interface): the
  module's ``scaling`` is passed to eager / sdpa / flash attention as the logit scale, so
  ``scaling / tau`` gives softmax(q·k·scaling / tau). RoPE is applied to q and k before, and
  YaRN's attention factor lives in cos/sin, so both are inside the divided logit.
* BLOOM (ALiBi): ``scores = beta·alibi + inv_norm_factor·q·k`` (``alibi.baddbmm``), so both
  ``beta`` and ``inv_norm_factor`` are divided by tau.
* MPT (ALiBi): ``scores = softmax_scale·q·k + position_bias``; ``softmax_scale`` is divided and a
  forward pre-hook divides the ``position_bias`` handed to that layer (the model's shared
  tensor is not changed, so every layer gets its own tau).

The causal mask (dtype-min or -inf) is left alone: masked keys get probability 0 either way.
Falcon (ALiBi folded into the sdpa mask and the eager logit in two different ways) and other
families are refused with one line rather than guessed.

:class:`HFTarget` is the alignment target of Algorithm 1 (see ``align.temperature.as_target``):
statistics come from each layer's attention probabilities p, returned by eager attention
(``attn_implementation="eager"``, which materialises [B, H, L, L] per layer: O(L²) memory, fine
at alignment lengths), and the sink gets tau·log p = l + (per-row constant), which softmax
re-temperatures exactly as l (probabilities that underflow to 0 count as masked keys).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Sequence

import torch

from ..io import UserError

#: model_type -> how tau enters its attention (see module doc)
KINDS = {"gpt2": "scaling", "gpt_neox": "scaling", "llama": "scaling", "mistral": "scaling",
         "qwen2": "scaling", "bloom": "bloom", "mpt": "mpt"}
_ATTRS = {"scaling": ("scaling",), "bloom": ("inv_norm_factor", "beta"), "mpt": ("softmax_scale",)}


def _hf(model):
    return getattr(model, "hf", model)  # the adapter or the HF model itself


def attention_modules(model) -> tuple[str, list]:
    """(kind, the self-attention modules in layer order) of an HF causal LM, or a one-line error."""
    hf = _hf(model)
    mt = getattr(getattr(hf, "config", None), "model_type", type(hf).__name__)
    kind = KINDS.get(mt)
    if kind is None:
        raise UserError(f"per-layer softmax temperature is not wired for {mt} models; supported: "
                        f"{', '.join(sorted(KINDS))} (see extrapolab/hf/temperature.py)")
    mods = [m for m in hf.modules() if type(m).__name__.endswith("Attention")
            and all(hasattr(m, a) for a in _ATTRS[kind])]
    n = getattr(hf.config, "num_hidden_layers", len(mods))
    if len(mods) != n:
        raise UserError(f"found {len(mods)} attention modules in a {n}-layer {mt} model; this transformers "
                        "version is not supported for temperature (see extrapolab/hf/temperature.py)")
    return kind, mods


def layer_taus(tau, n: int) -> list[float]:
    taus = [float(tau)] * n if isinstance(tau, (int, float)) else [float(t) for t in tau]
    if len(taus) != n:
        raise UserError(f"got {len(taus)} per-layer temperatures for a {n}-layer model; give one per layer")
    if any(not (t > 0 and math.isfinite(t)) for t in taus):
        raise UserError(f"softmax temperatures must be positive and finite, got {taus}")
    return taus


@contextmanager
def hf_temperature(model, tau: float | Sequence[float] = 1.0):
    """Within the block every layer's softmax uses logits / tau (one tau, or one per layer)."""
    kind, mods = attention_modules(model)
    taus = layer_taus(tau, len(mods))
    saved, handles = [], []
    try:
        for m, t in zip(mods, taus):
            if t == 1.0:
                continue
            for a in _ATTRS[kind]:
                saved.append((m, a, getattr(m, a)))
                setattr(m, a, getattr(m, a) / t)
            if kind == "mpt":
                def pre(module, args, kwargs, t=t):
                    pb = kwargs.get("position_bias")
                    if pb is not None:
                        kwargs = {**kwargs, "position_bias": pb / t}  # [H, 1, Lk] ALiBi / tau
                    return args, kwargs
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        yield model
    finally:
        for h in handles:
            h.remove()
        for m, a, v in reversed(saved):
            setattr(m, a, v)


class HFTarget:
    """Algorithm 1 target over an HF causal LM (wrapped by ``hf.adapter.HFCausalLM``)."""

    def __init__(self, model) -> None:
        self.model = model
        self.num_layers = len(attention_modules(model)[1])

    @contextmanager
    def scope(self, tau=1.0, sink=None):
        taus = layer_taus(tau, self.num_layers)
        handles = []
        if sink is not None:
            for i, attn in enumerate(attention_modules(self.model)[1]):
                def grab(m, a, out, i=i):
                    w = out[1] if isinstance(out, tuple) and len(out) > 1 else None  # [B, H, Lq, Lk]
                    if w is None:
                        raise UserError("the attention returned no probabilities; load the model with "
                                        "attn_implementation='eager' (load_hf(..., attn='eager'))")
                    sink.add(i, taus[i] * torch.log(w.float()))
                handles.append(attn.register_forward_hook(grab))
        try:
            with hf_temperature(self.model, taus):
                yield self
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def forward(self, ids: torch.Tensor):
        return self.model(ids)

"""NoPE with a learned attention scale per head (Wang, Ji, Wu, Yan, Gui, Zhang, Huang, Wang, ACL 2024,
"Length Generalization of Causal Transformers without Position Encoding", arXiv 2404.12224: the
uniform attention scale and its head-based version, "HeadScale").

NoPE fails beyond L_tr because its attention distributions spread out ("distraction"); scaling the
logits re-concentrates them. Per layer and head h:

    softmax(λ_h · q·k / sqrt(d))        i.e. a temperature tau_h = 1 / λ_h dividing the whole logit

exactly as the official code (github.com/AntNLP/nope_head_scale, ``models/llama_nope.py``,
``ScaleMixin.query_scale``, read for this file): ``scale_param`` [num_heads] per attention layer,
q multiplied by λ_h / sqrt(d). Their procedure: pre-train NoPE, choose λ by a search over one
uniform scale at the target length, then fine-tune the λ alone (everything else frozen) at the
target length with the LM loss (``run_hs.sh``: 200 steps, lr 0.1 or 0.05, initial λ 1.6 at 8k),
clamping λ >= 1 after each step ("focus" constraint, ``ParamClampCallback``, ``--scale_lb 1``).
``align/head_scale.py`` runs that search and tuning on one of our runs (``search_uniform_scale``,
``tune_head_scale``); as a scheme of the zoo, ``nope-headscale`` trains the λ with the model from
``scale`` (default 1: NoPE at the start).

The temperature enters through the ``temperature`` hook ([H, 1], per head), so attention stays on
the fused causal kernel: q's rows are divided by tau_h (docs/attention.md).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import PositionalScheme, SchemeError
from .registry import register


@register
class NoPEHeadScale(PositionalScheme):
    name = "nope-headscale"
    kind = "none"
    paper = "Wang et al. 2024 (ACL), NoPE length generalization: head-based attention scale λ_h (HeadScale)"
    summary = "NoPE with softmax(λ_h·q·k/sqrt(d)): one learned scale per layer and head"

    def __init__(self, num_heads: int, layers: int = 4, scale: float = 1.0, min_scale: float | None = None) -> None:
        super().__init__(num_heads)
        if int(layers) < 1:
            raise SchemeError(f"nope-headscale needs layers >= 1 (the model's depth), got {layers}")
        if not float(scale) > 0:
            raise SchemeError(f"nope-headscale scale must be > 0 (the initial λ), got {scale}; e.g. scale=1.6")
        if min_scale is not None and not float(min_scale) > 0:
            raise SchemeError(f"nope-headscale min_scale must be > 0 or None, got {min_scale}; the paper uses 1")
        self.layers, self.scale0 = int(layers), float(scale)
        self.min_scale = None if min_scale is None else float(min_scale)
        self.scale = nn.Parameter(torch.full((self.layers, self.num_heads), self.scale0))  # [layers, H] λ

    def temperature(self, q_pos, layer=0):
        if not 0 <= int(layer) < self.layers:
            raise SchemeError(f"nope-headscale has scales for {self.layers} layers but layer {layer} attends; "
                              "build it with layers = the model's depth (GPT passes model.layers)")
        lam = self.scale[layer].clamp(min=1e-4)  # [H] λ > 0 (a scale at 0 would be an infinite temperature)
        return (1.0 / lam)[:, None]  # [H, 1] tau_h = 1 / λ_h

    @torch.no_grad()
    def constrain_(self) -> None:
        self.scale.clamp_(min=self.min_scale if self.min_scale is not None else 1e-4)

    def options(self):
        return {"layers": self.layers, "scale": self.scale0, "min_scale": self.min_scale}

"""FoX, the Forgetting Transformer's forget gate (Lin, Nikishin, He, Courville, ICLR 2025, "Forgetting
Transformer: Softmax Attention with a Forget Gate", arXiv 2503.02130, §2 "Forgetting Attention").

Per head h and token t, from the layer's attention input x_t (after the pre-norm):

    f_t = σ(w_h·x_t + b_h)                                  the forget gate
    D_ij = Σ_{l=j+1..i} log f_l                             (0 on the diagonal, -inf for j > i)
    O = softmax(Q K^T / sqrt(d) + D) V

With F_i = Σ_{l<=i} log f_l, D_ij = F_i - F_j: an ALiBi-form bias -s·(p_i - p_j) with p = -F and
slope s = 1. ``content_positions`` returns p (float64, non-decreasing since log f < 0) and
attention folds p_j into one extra head dimension of the fused causal kernel (model/folded.py),
so training and long inputs never build an L x L bias; the gradient reaches the gate through p.
FoX uses no other positions (the paper's FoX is NoPE plus the gate; its "Pro" block adds output
gates, QK-norm and a KV shift, which are not positional and are not here). A KV cache carries p of
the cached keys and continues the cumulative sum from the last one (``KVCache.content``).

Initialisation as the official code (github.com/zhixuan-lin/forgetting-transformer,
``modeling_forgetting_transformer.py``, ``fgate_type="full"``, read for this file): one gate
projection nn.Linear(hidden_size, num_heads, bias=True) per layer, weight N(0, initializer_range =
0.02), bias 0, so f ≈ σ(0) = 0.5 at the start and the model begins very local. (x-transformers'
``DataDependentAlibi`` starts its gate near 0.993 instead; we follow the paper's code.) log f =
logsigmoid(logit) in fp32, as there; the logit itself is computed in the gate's own dtype (fp32) even under
autocast, where the official code's projection runs in 16 bits: more exact, and eight kernel launches fewer per
layer and train step (autocast's casts of x, w and b and the logit's back to fp32, forward and backward; counted on
the CPU), which a GPU's host-bound GPT-2 small step pays for (docs/results/gpu-h200-2026-11-27.md).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .base import PositionalScheme, SchemeError
from .registry import register


def _without_autocast(device_type: str):
    """A context where autocast is off for ``device_type`` (nothing to do where it is not on, or has no autocast)."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


@register
class FoX(PositionalScheme):
    name = "fox"
    kind = "content"
    has_content = True
    relative = True  # the bias depends on the tokens between m and n, never on absolute positions
    paper = "Lin et al. 2025 (Forgetting Transformer, ICLR), §2: D_ij = Σ_{l=j+1..i} log σ(w_h·x_l + b_h)"
    summary = "data-dependent forget gate f_t = σ(w_h·x_t + b_h); bias Σ log f between key and query"
    no_trf = "FoX's bias depends on the text (its gates), not on the distance alone: no formula for the TRF"

    def __init__(self, num_heads: int, dim: int = 128, layers: int = 4, init_std: float = 0.02,
                 gate_bias: float = 0.0) -> None:
        super().__init__(num_heads)
        if int(dim) < 1 or int(layers) < 1:
            raise SchemeError(f"fox needs dim >= 1 and layers >= 1 (the model's width and depth), got dim={dim}, "
                              f"layers={layers}")
        if not float(init_std) >= 0:
            raise SchemeError(f"fox init_std must be >= 0, got {init_std}")
        self.dim, self.layers = int(dim), int(layers)
        self.init_std, self.gate_bias = float(init_std), float(gate_bias)
        # per layer: the gate projection w [H, dim], b [H] (raw parameters: the model's own init of
        # nn.Linear layers leaves them alone)
        self.w = nn.Parameter(torch.randn(self.layers, self.num_heads, self.dim) * self.init_std)  # [layers, H, dim]
        self.b = nn.Parameter(torch.full((self.layers, self.num_heads), self.gate_bias))  # [layers, H]

    def log_gate(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """log f [B, H, L] (fp32) of x [B, L, dim] at ``layer``."""
        self._check_layer(layer)
        w = self.w[layer]  # [H, dim]
        with _without_autocast(x.device.type):  # in w's dtype: autocast would cast x, w and b each layer
            logit = F.linear(x.to(w.dtype), w, self.b[layer])  # [B, L, H]
        return F.logsigmoid(logit.float()).transpose(1, 2)  # [B, H, L]

    def gate(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """f [B, H, L] in (0, 1): the per-token forget gate (analysis/bias.py draws it)."""
        return self.log_gate(x, layer).exp()

    def content_positions(self, x, layer=0, past=None):
        p = -torch.cumsum(self.log_gate(x, layer).double(), dim=-1)  # [B, H, L] p = -F, non-decreasing
        return p if past is None else p + past.to(p.dtype)[..., None]

    def alibi_slopes(self, layer=0):
        # [H] ones on the gates' device (D_ij = -(p_i - p_j)): a fresh host tensor was copied to the GPU, a blocking
        # copy, in every layer of every step
        return self.on_device(("slopes",), self.w.device, lambda: torch.ones(self.num_heads, dtype=torch.float64))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= int(layer) < self.layers:
            raise SchemeError(f"fox has gates for {self.layers} layers but layer {layer} attends; build it with "
                              "layers = the model's depth (GPT passes model.layers)")

    def options(self):
        return {"dim": self.dim, "layers": self.layers, "init_std": self.init_std, "gate_bias": self.gate_bias}

"""DAPE, data-adaptive positional encoding (Zheng, Gao, Shi, Wong, Xiong, Li, Li, Li, NeurIPS 2024, "DAPE:
Data-Adaptive Positional Encoding for Length Extrapolation", arXiv 2405.14722, §3: the bias made
adaptive by a function f of the attention scores and the static bias, across heads), and DAPE V2
(Zheng et al. 2024, "DAPE V2: Process Attention Score as Feature Map for Length Extrapolation", arXiv
2410.04798, §3: f a convolution over neighbouring keys, the score map as a feature map):

    logits = z + B + f([z; B])        z = q·k/sqrt(d) of every head, B the base scheme's bias (every head)
    f = Linear(2H, 32) → LeakyReLU → Linear(32, H)          per (i, j)              (DAPE, ``kernel=1``)
    f = Conv(2H, 32, 1×k) → LeakyReLU → Conv(32, H, 1×k)     over keys, k = 3       (DAPE V2, ``kernel=3``)

exactly as the official code (github.com/chuanyang-Zheng/DAPE, read for this file: ``DAPE.py``
``AliBi_DAPE``, ``ParallelKerpleLog_DAPE``, ``FIRE_DAPE``; ``megatron/model/positional_embeddings.py``
``AliBi_C``, ``FIRE_C``, ``Alibi_DAPEV2``, ``Kerple_DAPEV2``, ``FIRE_DAPEV2``; ``transformer.py``,
where the module maps the scaled scores z to ``x + a + mlp2(cat(x, a))`` before the causal mask and
softmax): width ``mlp_width`` = 32 in every config, LeakyReLU (slope 0.01), the residual z + B kept,
one module per attention layer (so ``layers`` sets of weights here), PyTorch's default initialisation
of nn.Linear / nn.Conv2d. A base without a bias (NoPE, RoPE: the official ``DAPEV1``/``DAPEV2``) feeds
z alone (H input channels). DAPE V2's convolution sees the scores with future keys zeroed
(``torch.tril`` there); we treat every key beyond the visible ones as zero in the same way, also past
the end of the block, so a row does not depend on how many keys the tensor holds (the official code
zero-pads the hidden layer at the tensor's edge, which changes the last row of a sequence only, and
its KV-cache rows, whose ``tril`` of a one-row score keeps just the first key). Keys outside an
evaluation window enter as zeros too.

f sees every head of a (query, key) cell (and, for V2, neighbouring keys), so DAPE runs through the
score-level hook ``scores`` on the reference path (``reference_only``), in query blocks, never L x L
beyond one block. Registered as ``dape`` (``base=`` any registered bias, rotary or NoPE scheme,
``base_params=``) and as the paper's three, ``dape-alibi``, ``dape-kerple`` (KERPLE-log) and
``dape-fire``; ``kernel=3`` makes any of them DAPE V2. The base keeps its own parameter layout (our
KERPLE is shared across layers; the GPT-NeoX code builds one per layer) and, for FIRE, the paper's
ReLU (the official ``FIRE_DAPE`` uses LeakyReLU inside FIRE's own MLP too).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Delegating, PositionalScheme, RelativeBias, SchemeError
from .registry import REGISTRY, build, register, scheme_params

#: elements of the MLP's hidden layer per chunk of keys (memory, not results: any size is exact)
HIDDEN_ELEMS = 1 << 19


@register
class DAPE(Delegating, PositionalScheme):
    name = "dape"
    kind = "score"
    paper = ("Zheng et al. 2024 (DAPE, NeurIPS) §3: z + B + MLP(z, B) across heads; DAPE V2 (arXiv 2410.04798) §3: "
             "a 1×3 convolution over keys")
    summary = "base bias plus an MLP (or 1×3 convolution, kernel=3) of every head's score and bias per cell"
    reference_only = ("DAPE's MLP mixes every head's score q·k and bias at each (query, key) (V2: and neighbouring "
                      "keys), which no fused kernel computes: reference path")
    no_trf = "DAPE's bias is an MLP of the attention scores q·k, not a function of the distance: no formula for the TRF"

    def __init__(self, num_heads: int, base: str = "alibi", base_params: dict | None = None, kernel: int = 1,
                 width: int = 32, layers: int = 4, original_length: int = 512) -> None:
        super().__init__(num_heads)
        if int(kernel) < 1 or int(kernel) % 2 == 0 or int(width) < 1 or int(layers) < 1:
            raise SchemeError(f"dape needs an odd kernel >= 1 (1: DAPE, 3: DAPE V2), width >= 1 and layers >= 1, got "
                              f"kernel={kernel}, width={width}, layers={layers}")
        self.base_name, self.base_params = str(base), dict(base_params or {})
        self.kernel, self.width, self.layers, self.original_length = int(kernel), int(width), int(layers), int(original_length)
        cls = REGISTRY.get(self.base_name)
        if cls is None or cls.kind not in ("none", "rotary", "bias") or cls.has_weight or cls.has_content \
                or cls.reference_only:
            raise SchemeError(f"dape base={self.base_name!r} must be a registered bias, rotary or NoPE scheme without "
                              "a multiplicative kernel, e.g. alibi, kerple-log, fire, rotary or none")
        sizes = {"layers": self.layers, "original_length": self.original_length}
        accepted = scheme_params(cls)
        self.base = build(self.base_name, num_heads, **self.base_params,
                          **{k: v for k, v in sizes.items() if k in accepted and k not in self.base_params})
        if self.base.second_pass() is not None:
            raise SchemeError(f"dape base={self.base_name!r} scores far keys in a second pass; pick a one-pass scheme")
        self.relative = self.base.relative  # z and a relative bias are translation invariant, and so is f of them
        H, W, k = num_heads, self.width, self.kernel
        C = 2 * H if self.base.has_bias else H  # [z; B], or z alone without a bias (the official DAPEV1/V2)

        def uniform(*shape, fan_in):  # nn.Linear / nn.Conv2d default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1.0 / math.sqrt(fan_in)
            return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))

        G = self.layers
        self.w1, self.b1 = uniform(G, W, C, 1, k, fan_in=C * k), uniform(G, W, fan_in=C * k)  # [G, W, C, 1, k], [G, W]
        self.w2, self.b2 = uniform(G, H, W, 1, k, fan_in=W * k), uniform(G, H, fan_in=W * k)  # [G, H, W, 1, k], [G, H]

    # ---- delegated to the base scheme --------------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        return self.base.has_bias

    def bias(self, q_pos, k_pos, layer=0):
        if not self.base.has_bias:
            return None
        if isinstance(self.base, RelativeBias):  # in the weights' precision (fp64 in exactness tests)
            return self.base.bias(q_pos, k_pos, layer, dtype=self.w1.dtype)
        return self.base.bias(q_pos, k_pos, layer)

    # ---- the data-adaptive term --------------------------------------------------------------------
    def adaptive(self, z: torch.Tensor, b: torch.Tensor | None, visible: torch.Tensor, layer: int) -> torch.Tensor:
        """f([z; B]) [B, H, bq, bk] of scores z [B, H, bq, bk] and bias b [H|1, bq, bk] (0 where not visible;
        None without a bias); ``visible`` [bq, bk] is the causal/window mask (V2 zeroes the rest). Keys go in
        chunks whose hidden layer [B, width, bq, chunk] stays near HIDDEN_ELEMS elements."""
        if not 0 <= int(layer) < self.layers:
            raise SchemeError(f"dape has weights for {self.layers} layers but layer {layer} attends; build it with "
                              "layers = the model's depth (GPT passes model.layers)")
        g, P, H = int(layer), self.kernel // 2, self.num_heads
        w1, b1, w2, b2 = (t[g].to(z.dtype) for t in (self.w1, self.b1, self.w2, self.b2))
        B, _, bq, bk = z.shape
        step = max(1, HIDDEN_ELEMS // (B * bq * self.width))  # keys per chunk
        bb = None if b is None else b.to(z.dtype).expand(H, -1, -1)  # [H, bq, bk]
        if P == 0:  # DAPE: one MLP per cell, channels last; the bias half of the first layer once for the batch
            outs = []
            for j0 in range(0, bk, step):
                pre = F.linear(z[..., j0:j0 + step].movedim(1, -1), w1[:, :H, 0, 0])  # [B, bq, c, W]
                pre = pre.add_(b1 if bb is None else F.linear(bb[..., j0:j0 + step].movedim(0, -1), w1[:, H:, 0, 0], b1))
                hid = F.leaky_relu(pre, inplace=True)  # in place: autograd keeps one [B, bq, c, W] tensor per chunk
                outs.append(F.linear(hid, w2[:, :, 0, 0], b2).movedim(-1, 1))  # [B, H, bq, c]
            return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        x = z if bb is None else torch.cat([z, bb.expand(B, -1, -1, -1)], 1)  # [B, C, bq, bk]
        x = F.pad(x.masked_fill(~visible, 0.0), (2 * P, 2 * P))  # future/out-of-window keys are zeros (official tril)
        outs = []
        for j0 in range(0, bk, step):
            j1 = min(bk, j0 + step)
            hid = F.leaky_relu(F.conv2d(x[..., j0:j1 + 4 * P], w1, b1))  # [B, W, bq, c + 2P]: hidden at keys j0-P..j1+P-1
            if j0 < P:  # the official hidden layer is zero-padded before key 0
                hid = torch.cat([hid.new_zeros(*hid.shape[:3], P - j0), hid[..., P - j0:]], -1)
            outs.append(F.conv2d(hid, w2, b2))  # [B, H, bq, c]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def scores(self, logits, block):
        return logits + self.adaptive(block.qk, block.bias, block.visible, block.layer).to(logits.dtype)

    def options(self):
        return {"base": self.base_name, "base_params": self.base_params, "kernel": self.kernel, "width": self.width,
                "layers": self.layers, "original_length": self.original_length}


class _DapeOn(DAPE):
    """DAPE on a fixed base scheme (the paper's DAPE-ALiBi, DAPE-Kerple, DAPE-FIRE)."""

    BASE = ""

    def __init__(self, num_heads: int, base_params: dict | None = None, kernel: int = 1, width: int = 32,
                 layers: int = 4, original_length: int = 512) -> None:
        super().__init__(num_heads, base=self.BASE, base_params=base_params, kernel=kernel, width=width,
                         layers=layers, original_length=original_length)

    def options(self):
        return {k: v for k, v in super().options().items() if k != "base"}


@register
class DapeAlibi(_DapeOn):
    name, BASE = "dape-alibi", "alibi"
    summary = "DAPE on ALiBi: ALiBi plus an MLP of every head's score and bias (kernel=3: DAPE V2)"


@register
class DapeKerple(_DapeOn):
    name, BASE = "dape-kerple", "kerple-log"
    summary = "DAPE on KERPLE-log: its bias plus an MLP of every head's score and bias (kernel=3: DAPE V2)"


@register
class DapeFire(_DapeOn):
    name, BASE = "dape-fire", "fire"
    summary = "DAPE on FIRE: its bias plus an MLP of every head's score and bias (kernel=3: DAPE V2)"

"""Model options of an attention layer that any positional scheme combines with (docs/attention.md, "Model
options"): ``model.sinks``, ``model.ssmax``, ``model.qk_norm``, ``model.gate``. Each block owns one
:class:`AttnExtras` with its parameters; with every option off it holds none and changes nothing.

* **Attention sinks** (gpt-oss, OpenAI 2025; ``gpt_oss/torch/model.py`` ``sdpa`` and transformers'
  ``GptOssAttention``, read for this file): one learned logit s_h per head in the softmax denominator,
  p = softmax([l, s_h])[:-1], initialised at 0 (x-transformers' ``head_learned_sink``; gpt-oss ships trained
  values). A model option rather than a scheme option: it acts on the softmax, not on positions, so every
  scheme (and every layer type) takes it unchanged. Attention carries it on its fused paths
  (:mod:`.sinks`).
* **SSMax** (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399, eq. 2:
  softmax((s·log n)·z)): s_h learned per layer and head, n the number of keys the query sees; a per-query
  temperature 1 / (s_h·log n) of attention's step 6 (``reference.ssmax_tau``), so it divides the whole logit
  (bias included). s starts at 1 / log L_tr, so that at the training length the layer starts as softmax
  (our choice: the paper's initial value is not given in the text we read).
* **QK-norm** (Henry et al. 2020, "Query-Key Normalization for Transformers", Findings of EMNLP: L2-normalised
  q and k with a learned scale; in the form of Qwen3 / Gemma 3 / OLMo 2's ``q_norm`` / ``k_norm``):
  q ← w_q ⊙ q / sqrt(mean(q²) + eps) per head over the head dimension (that is sqrt(d)·q/|q|, the L2
  normalisation, times a learned per-dimension scale w, initialised at 1, shared by the heads; eps 1e-6,
  in fp32 as transformers' ``Qwen3RMSNorm``), likewise k. Applied to q and k BEFORE the scheme rotates them, as
  Qwen3, Gemma 3 and OLMo 2 do (transformers' ``Qwen3Attention.forward``: ``q_norm`` then
  ``apply_rotary_pos_emb``): a rotation keeps the norm, so the two orders differ only in where w acts, and
  before it the scheme's own scaling (YaRN's attention factor, xPos, log-n) still applies on top.
* **Output gate** (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708: the gate at
  position G1, after SDPA, elementwise and head-specific, sigmoid, as Qwen3-Next ships it): Y' = Y ⊙ σ(X W_θ)
  with X the layer's attention input (after the pre-norm), W_θ [C, C] (one gate per head and dimension), Y the
  attention output of every head before the output projection. Read for this file: the authors' code
  (qiuzh20/gated_attention ``modeling_qwen3.py``, ``elementwise_attn_output_gate``: the gate is a second half of
  q_proj per head, ``attn_output * sigmoid(gate_score)`` before o_proj; its QK-norm, too, is Qwen3's RMSNorm
  before the rotation) and transformers' ``Qwen3NextAttention``. W_θ has no bias, as the paper's X W_θ and
  Qwen3-Next (``attention_bias`` false); the headwise variant (one gate per head) is not here.
"""
from __future__ import annotations

import math

import torch
from torch import nn

#: the options as ``extrapolab schemes`` lists them: model field -> (what it does, paper)
OPTIONS = {
    "sinks": ("a learned sink logit s_h per layer and head in the softmax denominator (no value)",
              "gpt-oss (OpenAI 2025), transformers' GptOssAttention"),
    "ssmax": ("logits times s_h·log n (n = keys the query sees), s learned per layer and head",
              "Nakanishi 2025 (Scalable-Softmax), arXiv 2501.19399 eq. 2"),
    "qk_norm": ("q, k RMS-normalised per head (sqrt(d)·x/|x|) times learned scales, before the rotation",
                "Henry et al. 2020 (QKNorm); Qwen3 / Gemma 3 / OLMo 2 q_norm, k_norm"),
    "gate": ("the attention output times σ(x W) per head and dimension, before the output projection",
             "Qiu et al. 2025 (Gated Attention), arXiv 2505.06708: position G1, elementwise"),
}

#: eps of the QK RMS normalisation (Qwen3's ``rms_norm_eps``)
QK_EPS = 1e-6


def rms_normalize(x: torch.Tensor, w: torch.Tensor, eps: float = QK_EPS) -> torch.Tensor:
    """w ⊙ x / sqrt(mean(x², last dim) + eps), the mean and root in fp32 (x [..., D], w [D])."""
    dt = x.dtype
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., D]
    return w * xf.to(dt)


class AttnExtras(nn.Module):
    """One layer's attention options (module doc). ``heads``, ``head_dim``, ``dim``: the layer's sizes;
    ``train_length``: L_tr (SSMax's initial s = 1 / log L_tr)."""

    def __init__(self, *, heads: int, head_dim: int, dim: int, train_length: int, sinks: bool = False,
                 ssmax: bool = False, qk_norm: bool = False, gate: bool = False) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None  # [H] sink logits
        s0 = 1.0 / math.log(max(int(train_length), 2))
        self.ssmax = nn.Parameter(torch.full((heads,), s0)) if ssmax else None  # [H] SSMax's s
        self.q_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None  # [D]
        self.k_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None  # [D]
        self.gate = nn.Linear(dim, dim, bias=False) if gate else None  # X W_θ: one gate per head and dim

    def normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm of q [B, H, Lq, D] and k [B, H, Lk, D] (identity when off); call before the rotation."""
        if self.q_norm is None:
            return q, k
        return rms_normalize(q, self.q_norm), rms_normalize(k, self.k_norm)

    def attend_kwargs(self) -> dict:
        """The keywords this layer passes to :func:`.attention.attend` (sinks, SSMax's s)."""
        return {"sinks": self.sinks, "ssmax": self.ssmax}

    def gated(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [B, L, C] (the heads' outputs, head-major) times σ(x W_θ), x [B, L, C] the attention input."""
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))

    def extra_repr(self) -> str:
        on = [n for n in ("sinks", "ssmax", "q_norm", "gate") if getattr(self, n) is not None]
        return ", ".join(on) or "off"

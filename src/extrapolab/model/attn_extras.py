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
  q and k with a learned scale), RMS form: x ← w ⊙ x / sqrt(mean(x²) + eps) (that is sqrt(n)·x/|x| over the n
  entries normalised, times a learned per-entry scale w initialised at 1; mean and root in fp32 as
  transformers' ``Qwen3RMSNorm``), one w for q and one for k per layer. ``model.qk_norm`` picks over what
  (read in transformers 5.23's modeling files):

  - ``head`` (and ``true``, the only form before there were two, so old configs and checkpoints mean it): each
    head's q over its head dimension D, w [D] shared by the heads: Qwen3 (``Qwen3RMSNorm(head_dim)``), Gemma 3
    (``Gemma3RMSNorm(head_dim)``, which scales by 1 + w with w from 0), Llama 4 (``Llama4TextL2Norm``: the same
    normalisation with no w, eps ``rms_norm_eps`` 1e-5, on its RoPE layers only, after the rotation -- without a
    w the order does not matter).
  - ``all``: q over all heads at once, the whole H·D projection before the head split, w [H·D]: OLMo 2 and
    OLMo 3 (``Olmo2RMSNorm(num_attention_heads * head_dim)`` on ``q_proj``'s output), OLMoE likewise.

  eps is ``model.qk_norm_eps`` (1e-6, Qwen3's and Gemma 3's ``rms_norm_eps``; transformers' Llama 4, OLMo 2 and
  OLMo 3 configs default to 1e-5). Applied to q and k BEFORE the scheme rotates them, as Qwen3, Gemma 3 and
  OLMo 2 do (``q_norm`` then ``apply_rotary_pos_emb``): a rotation keeps each head's norm, so the two orders
  differ only in where w acts, and before it the scheme's own scaling (YaRN's attention factor, xPos, log-n)
  still applies on top.
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

from ..io import UserError

#: the options as ``extrapolab schemes`` lists them: model field -> (what it does, paper)
OPTIONS = {
    "sinks": ("a learned sink logit s_h per layer and head in the softmax denominator (no value)",
              "gpt-oss (OpenAI 2025), transformers' GptOssAttention"),
    "ssmax": ("logits times s_h·log n (n = keys the query sees), s learned per layer and head",
              "Nakanishi 2025 (Scalable-Softmax), arXiv 2501.19399 eq. 2"),
    "qk_norm": ("q, k RMS-normalised (sqrt(n)·x/|x|) times learned scales, before the rotation: head = per head "
                "(true), all = over all heads jointly; eps model.qk_norm_eps",
                "Henry et al. 2020 (QKNorm); per head: Qwen3 / Gemma 3 / Llama 4; all heads: OLMo 2 / OLMo 3"),
    "gate": ("the attention output times σ(x W) per head and dimension, before the output projection",
             "Qiu et al. 2025 (Gated Attention), arXiv 2505.06708: position G1, elementwise"),
}

#: eps of the QK RMS normalisation by default (Qwen3's ``rms_norm_eps``); ``model.qk_norm_eps`` sets it
QK_EPS = 1e-6


def qk_form(value, where: str = "model.qk_norm") -> str:
    """``model.qk_norm`` as a form: "" (off: false, "", off, none), "head" (true, head) or "all"; else one line."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("", "false", "off", "none")):
        return ""
    if value is True or (isinstance(value, str) and value.lower() in ("true", "head")):
        return "head"
    if isinstance(value, str) and value.lower() == "all":
        return "all"
    raise UserError(f"{where} must be head (per head, as Qwen3; true means head), all (over all heads, as OLMo 2) "
                    f"or false, got {value!r}")


def check_qk_eps(eps, where: str = "model.qk_norm_eps") -> float:
    """The QK-norm eps as a float > 0 (it keeps the root of a zero vector finite), else one line."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise UserError(f"{where} must be a number > 0 (e.g. 1e-6, as Qwen3; transformers' Llama 4 and OLMo 2 "
                        f"default to 1e-5), got {eps!r}")
    return float(eps)


def rms_normalize(x: torch.Tensor, w: torch.Tensor, eps: float = QK_EPS) -> torch.Tensor:
    """w ⊙ x / sqrt(mean(x², last dim) + eps), the mean and root in fp32 (x [..., D], w [D])."""
    dt = x.dtype
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., D]
    return w * xf.to(dt)


class AttnExtras(nn.Module):
    """One layer's attention options (module doc). ``heads``, ``head_dim``, ``dim``: the layer's sizes;
    ``train_length``: L_tr (SSMax's initial s = 1 / log L_tr); ``qk_norm``: a :func:`qk_form` value,
    ``qk_eps`` its eps."""

    def __init__(self, *, heads: int, head_dim: int, dim: int, train_length: int, sinks: bool = False,
                 ssmax: bool = False, qk_norm: bool | str = False, gate: bool = False,
                 qk_eps: float = QK_EPS) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads)) if sinks else None  # [H] sink logits
        s0 = 1.0 / math.log(max(int(train_length), 2))
        self.ssmax = nn.Parameter(torch.full((heads,), s0)) if ssmax else None  # [H] SSMax's s
        self.qk_form, self.qk_eps = qk_form(qk_norm), check_qk_eps(qk_eps)
        n = heads * head_dim if self.qk_form == "all" else head_dim  # what one w scales: H·D or D
        self.q_norm = nn.Parameter(torch.ones(n)) if self.qk_form else None  # [D] or [H·D]
        self.k_norm = nn.Parameter(torch.ones(n)) if self.qk_form else None  # [D] or [H·D]
        self.gate = nn.Linear(dim, dim, bias=False) if gate else None  # X W_θ: one gate per head and dim

    def normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm of q [B, H, Lq, D] and k [B, H, Lk, D] (identity when off); call before the rotation."""
        if self.q_norm is None:
            return q, k
        if self.qk_form == "head":
            return rms_normalize(q, self.q_norm, self.qk_eps), rms_normalize(k, self.k_norm, self.qk_eps)
        return _over_heads(q, self.q_norm, self.qk_eps), _over_heads(k, self.k_norm, self.qk_eps)

    def attend_kwargs(self) -> dict:
        """The keywords this layer passes to :func:`.attention.attend` (sinks, SSMax's s)."""
        return {"sinks": self.sinks, "ssmax": self.ssmax}

    def gated(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [B, L, C] (the heads' outputs, head-major) times σ(x W_θ), x [B, L, C] the attention input."""
        return y if self.gate is None else y * torch.sigmoid(self.gate(x))

    def extra_repr(self) -> str:
        on = [n for n in ("sinks", "ssmax", "q_norm", "gate") if getattr(self, n) is not None]
        return ", ".join(f"q_norm={self.qk_form}" if n == "q_norm" else n for n in on) or "off"


def _over_heads(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``all`` form: x [B, H, L, D] RMS-normalised over its H·D entries at each position (OLMo 2's q_norm on
    the projection before the head split), w [H·D] head-major as the split."""
    B, H, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B, L, H * D)  # [B, L, H·D], the projection's layout
    return rms_normalize(flat, w, eps).view(B, L, H, D).transpose(1, 2)  # [B, H, L, D]

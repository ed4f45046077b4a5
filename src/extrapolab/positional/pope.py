"""PoPE, polar coordinate positional embeddings (Gopalakrishnan, Csordás, Schmidhuber, Mozer 2025, "Decoupling the
'What' and 'Where' With Polar Coordinate Positional Embeddings", arXiv 2509.10534, §3): the magnitude of each
component comes from content only, its phase from position only.

Every one of the d components c of q and k (not pairs, as RoPE) becomes a complex number:

    μ_q,c = softplus(q_c),   μ_k,c = softplus(k_c)                   magnitudes from content
    q̃_m,c = μ_q,c · e^(i m θ_c),   k̃_n,c = μ_k,c · e^(i (n θ_c + δ_c))   phases from position, θ_c = base^(−c/d)
    a_mn = Re[Σ_c q̃_m,c · conj(k̃_n,c)] / sqrt(d) = Σ_c μ_q,c μ_k,c cos((m − n) θ_c − δ_c) / sqrt(d)

with d frequencies (RoPE has d/2) and a learned phase bias δ_c per head and frequency, clamped to [−2π, 0]
(initialised at 0). The score depends on m − n only. As real vectors, q̃ and k̃ are [μ cos, μ sin]
interleaved per component, 2·d wide, and their dot product is a_mn·sqrt(d): ``rotate`` returns them (q̃ times
sqrt(2), so that attention's 1 / sqrt(2·d) of the wider head is the paper's 1 / sqrt(d)); attention pads v with
zero columns to 2·d for the fused kernels and cuts the output back (docs/attention.md), so PoPE runs on the
fused causal path, a KV cache stores k̃ (2·d wide), and no L x L tensor is built.

Read for this file: lucidrains/PoPE-pytorch (``pope.py``: θ = base^(−arange(d)/d), softplus magnitudes, the
bias added to the keys' angles, clamped to [−2π, 0], zero initialisation; ``attention.py``: softmax scale
1 / sqrt(d) of the original head size) and x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb`` (the
same, one bias [heads, d] for the whole model, which we follow: one δ shared by the layers, as ``rotate`` has
no layer; cos and sin in fp32 with autocast off). ``phase_bias=false`` drops δ (the paper's PoPE without it).
Besides the clamp in the forward, as the references, δ is projected back into [−2π, 0] after each optimizer
step (``constrain_``), so a δ at a bound still receives gradients that can move it back inside.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import PositionalScheme, SchemeError
from .registry import register


@register
class PoPE(PositionalScheme):
    name = "pope"
    kind = "rotary"
    paper = "Gopalakrishnan et al. 2025 (PoPE), arXiv 2509.10534 §3: softplus magnitudes, phases m·θ_c (+ δ_c on keys)"
    summary = "polar coordinates: |q_c|, |k_c| = softplus from content, phase m·θ_c from position, d frequencies"

    def __init__(self, num_heads: int, base: float = 10000.0, phase_bias: bool = True, head_dim: int = 32) -> None:
        super().__init__(num_heads)
        if not float(base) > 1:
            raise SchemeError(f"pope base must be > 1, got {base}; e.g. base=10000")
        if int(head_dim) < 1:
            raise SchemeError(f"pope needs head_dim >= 1 (the model's dim / heads), got {head_dim}")
        self.base, self.head_dim, self.phase_bias = float(base), int(head_dim), bool(phase_bias)
        # δ [H, d]: the keys' phase bias per head and frequency (one for every layer, as x-transformers)
        self.delta = nn.Parameter(torch.zeros(self.num_heads, self.head_dim)) if self.phase_bias else None

    def inv_freq(self, d: int) -> torch.Tensor:
        """θ_c = base^(−c/d), c = 0..d−1, float64 [d]."""
        return self.base ** (-torch.arange(d, dtype=torch.float64) / d)

    def _angles(self, pos: torch.Tensor, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of pos·θ_c, [L, d], computed in float64 then cast."""
        theta = self.on_device(("theta", d), pos.device, lambda: self.inv_freq(d))  # [d] once per device
        ang = pos.to(torch.float64)[:, None] * theta  # [L, d]
        return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)

    def rotate(self, q, k, q_pos, k_pos):
        d = q.shape[-1]
        if d != self.head_dim:
            raise SchemeError(f"pope was built for head_dim={self.head_dim} but q has {d}; build it with the "
                              "model's head size (GPT passes model.dim / model.heads)")
        dt = torch.promote_types(q.dtype, torch.float32)  # softplus, cos and sin at least in fp32
        cq, sq = self._angles(q_pos, d, dt)  # [Lq, d]
        ck, sk = self._angles(k_pos, d, dt)  # [Lk, d]
        if self.delta is not None:  # keys' phase n·θ + δ: cos(a + δ) = cos a cos δ − sin a sin δ
            dl = self.delta.clamp(-2 * math.pi, 0.0).to(dt)[:, None]  # [H, 1, d]
            ck, sk = ck * dl.cos() - sk * dl.sin(), sk * dl.cos() + ck * dl.sin()  # [H, Lk, d]
        mq, mk = F.softplus(q.to(dt)), F.softplus(k.to(dt))  # [B, H, L, d] magnitudes
        qt = torch.stack((mq * cq, mq * sq), -1).flatten(-2) * math.sqrt(2.0)  # [B, H, Lq, 2d]
        kt = torch.stack((mk * ck, mk * sk), -1).flatten(-2)  # [B, H, Lk, 2d]
        return qt.to(q.dtype), kt.to(k.dtype)

    @torch.no_grad()
    def constrain_(self) -> None:
        if self.delta is not None:
            self.delta.clamp_(-2 * math.pi, 0.0)

    def options(self):
        return {"base": self.base, "phase_bias": self.phase_bias, "head_dim": self.head_dim}

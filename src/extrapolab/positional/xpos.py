"""xpos (Sun et al., ACL 2023, "A Length-Extrapolatable Transformer", arXiv 2212.10554, §3.2).

Rotary (RoFormer eq. 34, :mod:`.rotary`) with an exponential scale per rotated pair i = 0..d/2-1:

    zeta_i = (2i/d + gamma) / (1 + gamma),  gamma = 0.4             (zeta_i in [0.29, 1))
    f_q(q, n) = R(n theta) q * zeta^( n / scale_base)                query at position n
    f_k(k, n) = R(n theta) k * zeta^(-n / scale_base)                key at position n

so the logit of query m and key n is sum_i zeta_i^((m - n)/scale_base) (rotated q·k)_i: a function
of m - n only, decaying with distance on every pair whose frequency is high (small i: zeta_i far
below 1), the "attention resolution" the paper maximises; scale_base = 512.

Checked against microsoft/torchscale ``torchscale/component/xpos_relative_position.py`` (read at
commit 4d1e0e8): ``scale = (arange(0, d, 2) + 0.4 d) / (1.4 d)`` (= zeta_i), angles
``pos · 10000^(-2i/d)`` on interleaved pairs ``(x[2i], x[2i+1])`` with ``rotate_every_two`` (our
layout, so one pair sees one zeta), queries multiplied by ``scale ** (pos / scale_base)`` and keys
by its inverse (``downscale=True``). torchscale centres the scale's exponent on the middle of the
sequence (positions -L/2 .. L/2 for the scale only, 0 .. L-1 for the angles): the centre cancels in
q·k, it only keeps zeta^(±n/scale_base) inside the float range. Our KV cache stores keys rotated at
their absolute positions, so the centre must not change from call to call: it is a fixed option
``center`` (default 0, the paper's equations), and positions farther than :func:`max_offset` from it
(28,233 at scale_base 512: zeta^(±n/512) within 1e±30) are refused with a one-line error naming the fix.

xPos' other half, blockwise causal attention at test time (§3.3), is an evaluation option for every
scheme: ``eval.bca`` (eval/bca.py).
"""
from __future__ import annotations

import math

import torch

from .base import SchemeError
from .positions import inference_mode, inference_tensor, span, version
from .registry import register
from .rotary import Rotary
from .turn import turn_pair

FLOAT_RANGE = 1e30  # zeta^(±n/scale_base) stays within [1/FLOAT_RANGE, FLOAT_RANGE] (fp32/bf16 reach 3e38)
HALF_RANGE = 6e4  # float16 (CUDA autocast) reaches 65504


def zeta(d_head: int, gamma: float = 0.4) -> torch.Tensor:
    """zeta_i = (2i/d + gamma) / (1 + gamma), float64 [d_head/2] (torchscale's ``XPOS.scale``)."""
    i = torch.arange(0, d_head, 2, dtype=torch.float64)
    return (i / d_head + gamma) / (1.0 + gamma)  # [d/2]


def max_offset(scale_base: float, gamma: float = 0.4, limit: float = FLOAT_RANGE) -> int:
    """The largest |position - center| whose scales zeta_0^(±n/scale_base) stay within ``limit``."""
    return int(scale_base * math.log(limit) / -math.log(gamma / (1.0 + gamma)))


@register
class XPos(Rotary):
    name = "xpos"
    kind = "rotary"
    paper = "Sun et al. 2023 (xPos, A Length-Extrapolatable Transformer) §3.2"
    summary = "rotary with per-pair decay zeta_i^((m-n)/scale_base), zeta_i = (2i/d+0.4)/1.4"

    def __init__(self, num_heads: int, base: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4,
                 center: int = 0) -> None:
        super().__init__(num_heads, base)
        if not scale_base > 0 or not gamma > 0:
            raise SchemeError(f"xpos needs scale_base > 0 and gamma > 0, got {scale_base} and {gamma}; "
                              "the paper uses scale_base=512, gamma=0.4")
        if int(center) != center or center < 0:
            raise SchemeError(f"xpos center must be a position >= 0, got {center!r}")
        self.scale_base, self.gamma, self.center = float(scale_base), float(gamma), int(center)
        self._scales: dict = {}  # (d_head, device, dtype) -> (Cq, Sq, Ck, Sk)
        self._memo: tuple | None = None  # (positions, key, version, rows) of the last gather

    def check_length(self, length: int) -> None:
        limit = max_offset(self.scale_base, self.gamma)
        far = max(int(length) - 1 - self.center, self.center)
        if length and far > limit:
            raise SchemeError(
                f"xpos scales zeta^(±n/{self.scale_base:g}) overflow float32 {far} positions from its center "
                f"{self.center} (limit {limit}); pass --set model.scheme_params.center={max(0, int(length) // 2)} "
                "(the center cancels in q·k, Sun et al. 2023 §3.2)")

    def xpos_tables(self, n: int, d_head: int, device, dtype):
        """(Cq, Sq, Ck, Sk) [>= n, d_head]: RoFormer's C = (cos, cos), S = (-sin, +sin) per pair at
        p = 0, 1, ..., times zeta_i^(+(p - center)/scale_base) for queries and zeta_i^(-(p - center)/
        scale_base) for keys; built in float64, cast once, cached (grown by doubling, dropped on
        ``.to()``). The scale folded into the tables makes xpos cost what rotary costs."""
        key = (d_head, torch.device(device), dtype)
        hit = self._scales.get(key)
        if hit is not None and inference_tensor(hit[0]) and not inference_mode():
            hit = None  # autograd may not save inference tensors
        if hit is None or hit[0].shape[0] < n:
            size = max(n, 2 * (hit[0].shape[0] if hit is not None else 0), 256)
            p = torch.arange(size, dtype=torch.float64, device=device)  # [size]
            ang = p[:, None] * self.inv_freq(d_head, size).to(device=device, dtype=torch.float64)  # [size, d/2]
            e = ((p - self.center)[:, None] / self.scale_base) * torch.log(zeta(d_head, self.gamma).to(device))
            up, down = torch.exp(e), torch.exp(-e)  # [size, d/2]: zeta_i^(±(p - center)/scale_base)
            cos, sin = torch.cos(ang), torch.sin(ang)
            out = []
            for f in (up, down):
                out.append((cos * f).repeat_interleave(2, dim=-1))  # [size, d]: (cos, cos)·f per pair
                out.append(torch.stack((-sin * f, sin * f), dim=-1).flatten(-2))  # [size, d]: (-sin, sin)·f
            hit = tuple(t.to(dtype).contiguous() for t in (out[0], out[1], out[2], out[3]))
            self._scales[key] = hit
        return hit

    def _xpos_rows(self, pos: torch.Tensor, d_head: int, dtype) -> tuple[torch.Tensor, ...]:
        """(Cq, Sq, Ck, Sk) rows [L, d_head] of ``pos`` [L]; memoised for the same positions tensor
        (k after q, the next layer), like rotary's."""
        memo = self._memo
        ver = version(pos)
        key = (d_head, dtype, inference_mode())
        if memo is not None and memo[0] is pos and memo[1] == key and ver is not None and memo[2] == ver:
            return memo[3]
        n, p0 = span(pos)
        if dtype == torch.float16 and pos.numel():
            half = max_offset(self.scale_base, self.gamma, HALF_RANGE)
            if max(n - 1 - self.center, self.center - (p0 if p0 is not None else int(pos.min()))) > half:
                raise SchemeError(f"xpos in float16 reaches only {half} positions from its center; "
                                  "use bf16 or fp32 (--dtype bf16) or move model.scheme_params.center")
        tables = self.xpos_tables(max(1, n), d_head, pos.device, dtype)
        if p0 is not None:
            rows = tuple(t[p0:n] for t in tables)  # p0..p0+L-1 in order: views, no gather
        else:
            rows = tuple(t[pos] for t in tables)  # [L, d_head] each
        self._memo = (pos, key, ver, rows)
        return rows

    def rotate(self, q, k, q_pos, k_pos):
        d = q.shape[-1]
        if d % 2:
            raise SchemeError(f"xpos needs an even head dimension, got {d}; change model.dim or heads")
        Cq, Sq, _, _ = self._xpos_rows(q_pos, d, q.dtype)
        _, _, Ck, Sk = self._xpos_rows(k_pos, d, k.dtype)
        return turn_pair(q, k, Cq, Sq, Ck, Sk)  # [..., L, d] each: rotary's rotation, one kernel for both (.turn)

    def options(self):
        return {"base": self.base, "scale_base": self.scale_base, "gamma": self.gamma, "center": self.center}

    def _apply(self, fn, *a, **kw):  # .to()/.cuda() drop the tables
        self._scales.clear()
        self._memo = None
        return super()._apply(fn, *a, **kw)

"""rotary (Su et al. 2021 RoFormer eq. 34; ALiBi §2.2) and the machinery its extensions share.

Rotate each pair (2i, 2i+1) of q and k by angle m·theta_i, theta_i = base^(-2i/d_head):

    out[2i]   = x[2i] cos(m theta_i) - x[2i+1] sin(m theta_i)
    out[2i+1] = x[2i] sin(m theta_i) + x[2i+1] cos(m theta_i)

written as ``x * C + swap(x) * S`` with C = [cos, cos] and S = [-sin, +sin] interleaved per pair and
swap(x) exchanging the two members of each pair (:mod:`.turn`: eager, one copy and two fused multiplies;
on CUDA one Triton kernel forward and one backward), no complex numbers, no half-size strided slices. C and
S are cached per (d_head, device, dtype, scale key), built in float64 then cast (long positions keep their
precision), grown by doubling and dropped on ``.to()``; one forward gathers its rows once and reuses them for q, k and every layer.

The RoPE context-extension family (:mod:`.rope_pi`, :mod:`.rope_ntk`, :mod:`.rope_dynamic_ntk`,
:mod:`.rope_yarn`) subclasses :class:`Rotary` and overrides only ``inv_freq`` (the frequencies
theta_i, possibly as a function of the current length) and ``attention_factor`` (a factor on
both q and k, so on the logits squared; YaRN's temperature). Positions are never rewritten:
position interpolation m -> m/s is the same angle as theta_i -> theta_i/s. The two-pass
extensions (Self-Extend, ReRoPE: :mod:`.rope_twopass`) add a far pass through ``second_pass``.

log-n scaling, an option of every rotary scheme (``logn=True``, L_tr = ``original_length``):
q at position m is multiplied by max(1, log(m + 1) / log L_tr) after its rotation (Su 2021,
"Entropy-invariant scaling", kexue.fm/archives/8823, as applied in the ReRoPE patches and
Self-Extend's ``scale_base``; Llama 4 tunes the attention temperature with log position the same
way). With no bias this is a per-query softmax temperature tau_m = 1 / that factor
(docs/attention.md); :func:`logn_scale` is the one formula, shared with Hugging Face models.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch

from .base import PositionalScheme, SchemeError
from .positions import inference_mode, inference_tensor, span, top, version
from .registry import register
from .turn import turn_pair


def default_inv_freq(base: float, d_head: int) -> torch.Tensor:
    """theta_i = base^(-2i/d_head), i = 0..d_head/2-1, float64 [d_head/2] (RoFormer eq. 15)."""
    i = torch.arange(0, d_head, 2, dtype=torch.float64)
    return base ** (-i / d_head)  # [d_head/2]


def logn_scale(positions: torch.Tensor, train_length: int) -> torch.Tensor:
    """max(1, log(m + 1) / log L_tr) per position m, float64 [L]: the log-n factor on q."""
    m = positions.to(torch.float64)
    return (torch.log1p(m) / math.log(int(train_length))).clamp(min=1.0)


@register
class Rotary(PositionalScheme):
    name = "rotary"
    kind = "rotary"
    paper = "Su et al. 2021 (RoFormer) eq. 34"
    summary = "rotate q,k pairs by m·theta_i, theta_i = 10000^(-2i/d_head)"
    #: theta_i depends on the current sequence length (dynamic NTK): the cache is keyed on it too
    length_dependent: ClassVar[bool] = False

    def __init__(self, num_heads: int, base: float = 10000.0, logn: bool = False,
                 original_length: int = 512) -> None:
        super().__init__(num_heads)
        if not base > 1:
            raise SchemeError(f"rotary base must be > 1, got {base}")
        self.base = float(base)
        self.logn = bool(logn)
        self.original_length = check_original_length(self.name, original_length)
        if self.logn:
            self.relative = False  # the factor depends on the query's absolute position
        self._cs: dict = {}
        #: (positions, key, version, cos, sin) of the last two gathers: q's and k's positions (two tensors when
        #: decoding after a KV cache), each read once per forward instead of once per layer (a host sync on a GPU)
        self._rows: list = []
        self._len: tuple | None = None  # (q_pos, k_pos, versions, length) of the last length-dependent call

    # ---- the overridable steps ---------------------------------------------------------
    def inv_freq(self, d_head: int, length: int) -> torch.Tensor:
        """theta_i as float64 [d_head/2]; ``length`` = max position + 1 of the current call."""
        return default_inv_freq(self.base, d_head)

    def attention_factor(self, length: int) -> float:
        """Factor on q and k after rotation (the logits get its square); 1 for plain RoPE."""
        return 1.0

    def scale_key(self, length: int):
        """What besides (d_head, device, dtype) the tables depend on; None when only on those."""
        return None

    # ---- tables ------------------------------------------------------------------------
    def tables(self, n: int, d_head: int, device, dtype, length: int | None = None):
        """(C, S) [>= n, d_head]: C = f·cos(m theta_i), S = f·(-sin, +sin) per pair, m = 0, 1, ..."""
        length = n if length is None else length
        key = (d_head, torch.device(device), dtype, self.scale_key(length))
        hit = self._cs.get(key)
        if hit is not None and inference_tensor(hit[0]) and not inference_mode():
            hit = None  # autograd may not save inference tensors (e.g. an ERF after an evaluation)
        if hit is None or hit[0].shape[0] < n:
            size = max(n, 2 * (hit[0].shape[0] if hit is not None else 0), 256)
            theta = self.inv_freq(d_head, length).to(device=device, dtype=torch.float64)  # [d/2]
            ang = torch.arange(size, dtype=torch.float64, device=device)[:, None] * theta  # [size, d/2]
            f = float(self.attention_factor(length))
            cos, sin = torch.cos(ang) * f, torch.sin(ang) * f  # [size, d/2]
            C = cos.repeat_interleave(2, dim=-1)  # [size, d]: (cos, cos) per pair
            S = torch.stack((-sin, sin), dim=-1).flatten(-2)  # [size, d/2, 2] -> [size, d]
            if self.length_dependent:  # one scale at a time: lengths vary call to call
                self._cs = {k: v for k, v in self._cs.items() if k[3] == key[3]}
            hit = (C.to(dtype).contiguous(), S.to(dtype).contiguous())
            self._cs[key] = hit
        return hit

    def cos_sin(self, positions: torch.Tensor, d_head: int, dtype, length: int | None = None):
        """Rows of (C, S) for ``positions`` [L] -> ([L, d_head], [L, d_head])."""
        key = (d_head, dtype, length, inference_mode())
        ver = version(positions)
        for memo in self._rows:
            if memo[0] is positions and memo[1] == key and ver is not None and memo[2] == ver:
                return memo[3], memo[4]  # the same positions tensor again (k after q, the next layer)
        n, p0 = span(positions)
        C, S = self.tables(max(1, n), d_head, positions.device, dtype, length)
        if p0 is not None:
            c, s = C[p0:n], S[p0:n]  # p0..p0+L-1 in order (increasing integers): a view, no gather
        else:
            c, s = C[positions], S[positions]  # [L, d_head]
        self._rows = [(positions, key, ver, c, s)] + self._rows[:1]
        return c, s

    def _length(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> int | None:
        if not self.length_dependent:
            return None
        versions = (version(q_pos), version(k_pos))
        memo = self._len
        if memo is not None and memo[0] is q_pos and memo[1] is k_pos and None not in versions and memo[2] == versions:
            return memo[3]  # the next layer: the same positions, read once per forward
        length = max(top(q_pos), top(k_pos), 1)
        self._len = (q_pos, k_pos, versions, length)
        return length

    # ---- the hook ----------------------------------------------------------------------
    def rotate(self, q, k, q_pos, k_pos):
        length = self._length(q_pos, k_pos)
        d = q.shape[-1]
        if d % 2:
            raise SchemeError(f"rotary needs an even head dimension, got {d}; change model.dim or heads")
        Cq, Sq = self.cos_sin(q_pos, d, q.dtype, length)  # [Lq, d] each
        Ck, Sk = self.cos_sin(k_pos, d, k.dtype, length)  # [Lk, d] each
        q, k = turn_pair(q, k, Cq, Sq, Ck, Sk)  # one fused kernel for both on CUDA (.turn)
        if self.logn:  # a per-query temperature: scaling q scales that query's logits
            q = q * logn_scale(q_pos, self.original_length).to(q.dtype)[:, None]  # [Lq, 1]
        return q, k

    def logn_options(self) -> dict:
        """The log-n option as ``options()`` reports it (nothing when off: older runs read the same)."""
        return {"logn": True, "original_length": self.original_length} if self.logn else {}

    def options(self):
        return {"base": self.base, **self.logn_options()}

    def _apply(self, fn, *a, **kw):
        self._cs.clear()
        self._rows, self._len = [], None
        return super()._apply(fn, *a, **kw)


def check_factor(name: str, factor: float) -> float:
    """A context-extension factor s >= 1 (s = L_ex / L_tr), or a one-line SchemeError."""
    try:
        s = float(factor)
    except (TypeError, ValueError):
        s = float("nan")
    if not s >= 1.0 or s == float("inf"):
        raise SchemeError(f"{name} factor must be a finite number >= 1 (s = L_ex / L_tr), got {factor!r}; "
                          f"pass --set model.scheme_params.factor=4")
    return s


def check_original_length(name: str, length: int) -> int:
    if int(length) < 2:
        raise SchemeError(f"{name} original_length (the training length L_tr) must be >= 2, got {length}; "
                          "pass --set model.scheme_params.original_length=512")
    return int(length)

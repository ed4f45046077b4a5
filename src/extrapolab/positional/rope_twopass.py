"""Position rules of the two-pass RoPE extensions and the rotary base class they share.

Self-Extend and ReRoPE score a query at position m against a key at position n with plain RoPE
while the distance m - n is below a window w (the *near* pass) and, from w on, with q and k moved
to other positions (the *far* pass); the two logit sets are merged by that distance mask before
one softmax. Each rule below says where the far pass puts q and k (:class:`FarRule`):

* Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
  Tuning", arXiv 2401.01325, §3 and Algorithm 1; official code datamllab/LongLM,
  ``apply_grouped_rotary_pos_emb``): neighbour window w = w_n, group size G; far keys at
  floor(n/G), far queries at floor(m/G) + w - floor(w/G), so the grouped distance continues the
  neighbour distances at m - n = w. The largest relative position stays below L_tr up to length
  (L_tr - w)·G + w (:func:`selfextend_max_length`, the rule of the official README §4). The newer
  official patches write w - w/G (true division); it equals the floor form whenever G divides w.
* ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", github.com/bojone/rerope,
  ``rerope_patch.py``): relative position min(m - n, w); far queries at w, far keys at 0
  (unrotated).
* Leaky ReRoPE (same repository, ``leaky_rerope_patch.py``): w + (m - n - w)/k beyond w; the patch
  rotates far queries at (m + w(k - 1))/k and far keys at n/k, i.e. m/k + w - w/k and n/k here.

Both passes start from the already rotated q, k of the near pass: RoPE rotations compose,
R(p')·R(p) = R(p' + p), so rotating q by the angle (far(m) - m)·theta_i gives q at far(m) exactly,
whatever rotated it first (our interleaved pairs (2i, 2i+1) or Hugging Face's halves (i, i + d/2),
:func:`rotate_by`). That is why a KV cache of rotated keys serves both passes, and why Hugging Face
models, whose attention receives rotated q and k, need no second rotary embedding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import SchemeError
from .rotary import Rotary, check_original_length


@dataclass(frozen=True)
class FarRule:
    """Where the far pass of ``method`` puts queries and keys (see module doc); positions float64."""

    method: str  # "selfextend" | "rerope" | "rerope-leaky"
    window: int  # w: keys at distance m - n < w are scored by the near pass (plain RoPE)
    group: int = 1  # Self-Extend's G
    k: float = 1.0  # leaky ReRoPE: far distances grow by 1/k per token

    def q_pos(self, m: torch.Tensor) -> torch.Tensor:
        m = m.to(torch.float64)
        if self.method == "selfextend":
            return torch.floor(m / self.group) + (self.window - self.window // self.group)
        if self.method == "rerope":
            return torch.full_like(m, float(self.window))
        return m / self.k + self.window * (1.0 - 1.0 / self.k)

    def k_pos(self, n: torch.Tensor) -> torch.Tensor:
        n = n.to(torch.float64)
        if self.method == "selfextend":
            return torch.floor(n / self.group)
        if self.method == "rerope":
            return torch.zeros_like(n)
        return n / self.k

    def describe(self) -> dict:
        out = {"method": self.method, "w": self.window}
        if self.method == "selfextend":
            out["G"] = self.group
        if self.method == "rerope-leaky":
            out["k"] = self.k
        return out


def selfextend_max_length(train_length: int, window: int, group: int) -> int:
    """(L_tr - w)·G + w: the longest input whose grouped relative positions all stay below L_tr
    (Jin et al. 2024; datamllab/LongLM README §4). Exact when G divides w; otherwise the floor of
    w/G makes the farthest pair at that length reach L_tr itself (one position generous)."""
    return (int(train_length) - int(window)) * int(group) + int(window)


def check_rule(method: str, window: int, train_length: int, group: int = 1, k: float = 1.0,
               label: str = "") -> FarRule:
    """A :class:`FarRule` with checked parameters, or a one-line SchemeError naming the fix
    (``label``: the scheme or option named in it; default ``method``)."""
    name = label or method
    try:
        w, G, kk = int(window), int(group), float(k)
    except (TypeError, ValueError):
        raise SchemeError(f"{name} takes integers w, G and a number k; got w={window!r}, G={group!r}, "
                          f"k={k!r}") from None
    if not 1 <= w < int(train_length):
        raise SchemeError(f"{name} window w must satisfy 1 <= w < L_tr = {train_length}, got {window}; "
                          f"e.g. w = {max(1, int(train_length) // 4)}")
    if G < 1:
        raise SchemeError(f"{name} group size G must be an integer >= 1, got {group}; e.g. G=4")
    if not (kk >= 1.0 and math.isfinite(kk)):
        raise SchemeError(f"{name} k must be a finite number >= 1 (distances past w grow by 1/k), got {k}; "
                          "e.g. k=16 as in the ReRoPE repository")
    return FarRule(method, w, G, kk)


def default_settings(method: str, train_length: int, length: int) -> dict:
    """Settings a user who wants ``length`` tokens would pick: Self-Extend w = L_tr/4 (the README's
    1,024 of Llama-2's 4,096) and the smallest G whose maximum length covers ``length``; ReRoPE
    w = L_tr/8 (the repository's 512 of 4,096) and leaky k = 16 (its default)."""
    L_tr = int(train_length)
    if method == "selfextend":
        w = max(1, L_tr // 4)
        return {"w": w, "G": max(1, math.ceil((int(length) - w) / (L_tr - w)))}
    if method in ("rerope", "rerope-leaky"):
        return {"w": max(1, L_tr // 8), **({"k": 16.0} if method == "rerope-leaky" else {})}
    raise SchemeError(f"no two-pass method {method!r}; use selfextend, rerope or rerope-leaky")


def shift_angles(shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[L] position shifts x [d/2] frequencies -> float64 angles [L, d/2]."""
    return shift.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]


def rotate_by(x: torch.Tensor, angles: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Rotate the first 2·A dims of x [..., L, d] by ``angles`` [L, A] (float64, cast to x's dtype).

    ``halves=False``: pairs (2i, 2i+1) (ours, RoFormer eq. 34); ``True``: pairs (i, i + A)
    (Hugging Face's ``rotate_half`` layout). Dims past 2·A (partial rotary) pass unchanged."""
    A = angles.shape[-1]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # [L, A]
    rot, rest = x[..., :2 * A], x[..., 2 * A:]
    if halves:
        a, b = rot[..., :A], rot[..., A:]  # [..., L, A] each
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    else:
        pairs = rot.unflatten(-1, (A, 2))  # [..., L, A, 2]
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def far_rotate(rule: FarRule, inv_freq: torch.Tensor, q, k, q_pos, k_pos, halves: bool = False):
    """(q, k) rotated at their near positions -> the same vectors at the rule's far positions."""
    dq = rule.q_pos(q_pos) - q_pos.to(torch.float64)  # [Lq] how far each query moves
    dk = rule.k_pos(k_pos) - k_pos.to(torch.float64)  # [Lk]
    inv = inv_freq.to(q.device)
    return rotate_by(q, shift_angles(dq, inv), halves), rotate_by(k, shift_angles(dk, inv), halves)


class TwoPassRotary(Rotary):
    """Plain RoPE for keys nearer than w, the subclass's :class:`FarRule` beyond (see module doc).

    ``rotate`` is plain rotary (with the family's log-n option), so the KV cache keeps rotated
    keys as for ``rotary``; ``second_pass()`` tells attention to add the far pass
    (model/twopass.py, docs/attention.md)."""

    kind = "rotary"

    def __init__(self, num_heads: int, rule: FarRule, original_length: int, logn: bool, base: float) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.rule = rule
        self.original_length = check_original_length(self.name, original_length)

    def second_pass(self):
        return self.rule.window, self._far

    def _far(self, q, k, q_pos, k_pos):
        inv = self.inv_freq(q.shape[-1], None)  # [d/2] float64, the frequencies rotate() used
        return far_rotate(self.rule, inv, q, k, q_pos, k_pos, halves=False)

    def options(self):
        rule = {k: v for k, v in self.rule.describe().items() if k != "method"}
        return {**rule, "original_length": self.original_length, "logn": self.logn, "base": self.base}

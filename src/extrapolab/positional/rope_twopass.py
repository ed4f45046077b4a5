"""Position rules of the multi-pass RoPE extensions, the passes attention runs for them, and the
rotary base class they share.

Self-Extend and ReRoPE score a query at position m against a key at position n with plain RoPE
while the distance m - n is below a window w (the *near* pass) and, from w on, with q and k moved
to other positions (the *far* pass); dual chunk attention (:mod:`.rotary_dca`) does the same with
three passes chosen by chunk instead of distance. Whatever the scheme, each pass is a
:class:`Pass`: which keys it scores (a distance band and, optionally, a range of chunks) and
where it puts q and k for them; the logit sets are merged before one softmax (model/twopass.py:
fused passes merged by log-sum-exp; model/reference.py: the explicit merged logits). The far
passes of the two-pass methods (:class:`FarRule`):

* Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without
  Tuning", arXiv 2401.01325, §3 and Algorithm 1; official code datamllab/LongLM,
  ``apply_grouped_rotary_pos_emb``): neighbour window w = w_n, group size G; far keys at
  floor(n/G), far queries at floor(m/G) + w - floor(w/G), so the grouped distance continues the
  neighbour distances at m - n = w. The largest relative position stays below L_tr up to length
  (L_tr - w)·G + w (:func:`selfextend_max_length`, the rule of the official README §4). The official
  patches (datamllab/LongLM at cdbbb06) differ in that term: ``self_extend_patch/Llama_4_40.py``
  (transformers 4.40, ``self_extend_forward``), the legacy patches, Mistral, Phi and Qwen2 write the
  floor form w - floor(w/G), as we do; the older ``self_extend_patch/Llama.py`` (transformers 4.38)
  and Gemma write w - w/G (true division, a fractional position), as do both Llama patches'
  ``flash_self_extend_forward`` prefills. The two forms agree whenever G divides w.
* ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", github.com/bojone/rerope,
  ``rerope_patch.py``): relative position min(m - n, w); far queries at w, far keys at 0
  (unrotated).
* Leaky ReRoPE (same repository, ``leaky_rerope_patch.py``): w + (m - n - w)/k beyond w; the patch
  rotates far queries at (m + w(k - 1))/k and far keys at n/k, i.e. m/k + w - w/k and n/k here.

Every pass starts from the already rotated q, k of plain RoPE: rotations compose,
R(p')·R(p) = R(p' + p), so rotating q by the angle (p' - m)·theta_i gives q at p' exactly,
whatever rotated it first (our interleaved pairs (2i, 2i+1) or Hugging Face's halves (i, i + d/2),
:func:`rotate_by`). That is why a KV cache of rotated keys serves every pass, and why Hugging Face
models, whose attention receives rotated q and k, need no second rotary embedding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .base import SchemeError, causal_distance
from .rotary import Rotary, check_original_length


@dataclass(frozen=True)
class Pass:
    """One pass of a multi-pass scheme: the keys it scores and where q and k sit for them.

    A query at m scores the key at n in this pass when the distance d = m - n lies in
    [d_lo, d_hi) (d_hi None: unbounded), with a chunk length ``chunk`` = s the key's chunk
    floor(n/s) lies c_lo..c_hi chunks before the query's floor(m/s) (c_hi None: unbounded), and
    with ``keys`` = (lo, hi) the key's own position lies in [lo, hi). ``q_at`` / ``k_at`` map
    positions to the (float64) positions q and k are rotated to for this pass; None leaves them
    where plain RoPE put them. No key is in two passes of a scheme; a key in none is not seen."""

    d_lo: int = 0
    d_hi: int | None = None
    chunk: int | None = None
    c_lo: int = 0
    c_hi: int | None = None
    q_at: Callable[[torch.Tensor], torch.Tensor] | None = None
    k_at: Callable[[torch.Tensor], torch.Tensor] | None = None
    keys: tuple[int, int | None] | None = None

    def region(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[Lq, Lk] bool: True where this pass scores the key (causality aside)."""
        d = causal_distance(q_pos, k_pos)  # [Lq, Lk]
        ok = d >= self.d_lo
        if self.d_hi is not None:
            ok = ok & (d < self.d_hi)
        if self.chunk is not None:
            c = torch.div(q_pos, self.chunk, rounding_mode="floor")[:, None] \
                - torch.div(k_pos, self.chunk, rounding_mode="floor")[None, :]  # [Lq, Lk] chunks apart
            ok = ok & (c >= self.c_lo)
            if self.c_hi is not None:
                ok = ok & (c <= self.c_hi)
        if self.keys is not None:
            lo, hi = self.keys
            ok = ok & (k_pos >= lo)[None, :] & (True if hi is None else (k_pos < hi)[None, :])
        return ok


@dataclass(frozen=True)
class Passes:
    """What ``second_pass()`` returns: the passes, and ``shift(x, delta)`` rotating x [..., L, d]
    by ``delta`` [L] (float64) positions in the scheme's layout and frequencies. ``complete``: the
    passes cover every causal key (else the keys of no pass are masked: StreamingLLM's pattern)."""

    passes: tuple[Pass, ...]
    shift: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    complete: bool = True

    def moved(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """[(q_i, k_i)] per pass: q [B,H,Lq,D], k [B,H,Lk,D] moved to the pass's positions; a pass
        that moves nothing gets q, k themselves, and passes with the same rule share one tensor."""
        done: dict = {}

        def at(x, pos, f, side):
            if f is None:
                return x
            if (side, f) not in done:
                done[side, f] = self.shift(x, f(pos).to(torch.float64) - pos.to(torch.float64))
            return done[side, f]
        return [(at(q, q_pos, p.q_at, "q"), at(k, k_pos, p.k_at, "k")) for p in self.passes]


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

    def passes(self) -> tuple[Pass, ...]:
        """The near pass (0 <= m - n < w, plain RoPE) and the far pass (m - n >= w, moved)."""
        return Pass(0, self.window), Pass(self.window, None, q_at=self.q_pos, k_at=self.k_pos)

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


def shift_by(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """x [..., L, d] rotated at some positions -> the same vectors ``delta`` [L] positions further."""
    return rotate_by(x, shift_angles(delta, inv_freq.to(x.device)), halves)


class MultiPassRotary(Rotary):
    """Plain RoPE, plus the passes of the subclass's rule (see module doc): ``rule.passes()``.

    ``rotate`` is plain rotary (with the family's log-n option), so the KV cache keeps rotated
    keys as for ``rotary``; ``second_pass()`` tells attention to run the passes (model/twopass.py,
    docs/attention.md)."""

    kind = "rotary"

    def __init__(self, num_heads: int, rule, original_length: int, logn: bool, base: float) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.rule = rule
        self.original_length = check_original_length(self.name, original_length)

    def second_pass(self) -> Passes:
        return Passes(self.rule.passes(), self._shift, getattr(self.rule, "complete", True))

    def _shift(self, x, delta):
        d = x.shape[-1]  # [d/2] float64, the frequencies rotate() used, kept on x's device (no copy per layer)
        inv = self.on_device(("inv_freq", d), x.device, lambda: self.inv_freq(d, None))
        return shift_by(x, delta, inv, halves=False)

    def options(self):
        rule = {k: v for k, v in self.rule.describe().items() if k != "method"}
        return {**rule, "original_length": self.original_length, "logn": self.logn, "base": self.base}

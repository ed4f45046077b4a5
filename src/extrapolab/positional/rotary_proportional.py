"""rotary-proportional: p-RoPE (Barbero, Vitvitskyi, Perivolaropoulos, Pascanu, Velickovic 2025, "Round and
Round We Go! What makes Rotary Positional Encodings useful?", ICLR 2025, arXiv 2410.06205: p-RoPE, its
Table 2 and the paper's pseudocode ``apply_p_rope``: keep the highest fraction p of RoPE's frequencies
and remove the lowest ones, so 0-RoPE is NoPE and 1-RoPE is RoPE), as Gemma 4's global layers use it
(Hugging Face rope type ``proportional``, ``partial_rotary_factor`` 0.25, theta 10^6).

Pair i (i = 0..d/2-1, frequency theta_i = base^(-2i/d), the highest first) rotates when
i < r = floor(p·d/2) and is a NoPE pair (theta_i = 0: cos 1, sin 0, the identity) otherwise.
The exponent's denominator stays the head size d: the pairs that rotate have exactly the
frequencies they have in full RoPE. That is *not* ``partial_rotary_factor`` of Hugging Face's default
rope, which rotates the first p·d dimensions with theta_i = base^(-2i/(p·d)), i.e. a full spectrum
squeezed into fewer dimensions (lowest frequency kept). r is computed as the paper's pseudocode and
Hugging Face do, ``int(p * d // 2)``. ``factor`` s divides every frequency (Hugging Face's ``inv_freq /= factor``,
position interpolation; 1 by default); no attention factor.

Layout: Hugging Face rotates halves, so its NoPE dimensions are (r..d/2-1) and (d/2+r..d-1); ours
are the last d - 2r dimensions (pairs (2i, 2i+1), i >= r). The two differ by a fixed permutation of
each head's dimensions, which a learned projection absorbs. Options: ``p`` in [0, 1] (default
0.25, Gemma 4), ``factor`` s >= 1, ``base``, ``logn``.
"""
from __future__ import annotations

from .base import SchemeError
from .registry import register
from .rotary import Rotary, check_factor, default_inv_freq


def rotated_pairs(p: float, d_head: int) -> int:
    """r = the number of pairs that rotate, ``int(p * d // 2)`` as Hugging Face computes it."""
    return int(p * d_head // 2)


@register
class RotaryProportional(Rotary):
    name = "rotary-proportional"
    paper = "Barbero et al. 2025 (Round and Round We Go), p-RoPE (Table 2, apply_p_rope); Gemma 4 'proportional'"
    summary = "RoPE on the highest fraction p of frequencies (theta_i = base^(-2i/d)), NoPE on the rest"

    def __init__(self, num_heads: int, p: float = 0.25, factor: float = 1.0, base: float = 10000.0,
                 logn: bool = False, original_length: int = 512) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        try:
            p = float(p)
        except (TypeError, ValueError):
            p = float("nan")
        if not 0.0 <= p <= 1.0:
            raise SchemeError(f"rotary-proportional p (the fraction of frequency pairs that rotate) must be in [0, 1], "
                              f"got {p}; Gemma 4 uses --set model.scheme_params.p=0.25")
        self.p = p
        self.factor = check_factor(self.name, factor)

    def inv_freq(self, d_head, length):
        theta = default_inv_freq(self.base, d_head).clone()  # [d/2], denominator d: full RoPE's frequencies
        theta[rotated_pairs(self.p, d_head):] = 0.0  # the lowest frequencies become NoPE pairs
        return theta / self.factor

    def options(self):
        return {"p": self.p, "factor": self.factor, "base": self.base, **self.logn_options()}

"""rotary-yarn: YaRN (Peng, Quesnelle, Fan, Shippole 2023, "YaRN: Efficient Context Window Extension of
Large Language Models", §3.2 "NTK-by-parts" ramp gamma and §3.4 attention temperature
sqrt(1/t) = 0.1·ln(s) + 1).

Frequencies: pair i with wavelength lambda_i = 2·pi/theta_i turns r_i = L_tr/lambda_i times over
the training length. Pairs that turn more than beta_fast = 32 times keep theta_i (extrapolation),
pairs that turn less than beta_slow = 1 time get theta_i/s (interpolation, as in PI), and a linear
ramp in between: theta_i' = (1 - gamma_i)·theta_i/s + gamma_i·theta_i. As in the authors' code
(jquesnelle/yarn, ``find_correction_range`` / ``linear_ramp_mask``) and Hugging Face's ``yarn``
rope type, gamma is linear in the pair index between the pair indices where r = beta_fast and
r = beta_slow (floored / ceiled), which the paper's gamma(r) (linear in r) approximates.

Temperature: softmax(q·k / (t·sqrt(d))) with sqrt(1/t) = 0.1·ln(s) + 1 (eq. in §3.4), applied like
the authors and Hugging Face do: q and k are both multiplied by f = 0.1·ln(s) + 1 inside the
rotation, so the logits are multiplied by f^2 = 1/t and attention itself is untouched. As a
softmax temperature (thesis ch. 5) this is tau = 1/f^2.

Attention-factor variants, as Hugging Face's ``yarn`` rope type reads them (``_compute_yarn_parameters``):
DeepSeek-V2/V3 give ``mscale`` and ``mscale_all_dim`` (DeepSeek-AI 2024, DeepSeek-V2, arXiv 2405.04434:
YaRN with sqrt(1/t) = 0.0707·ln(s) + 1, i.e. a = 0.707; ``yarn_get_mscale`` in their modeling code), and then
f = m(s, mscale) / m(s, mscale_all_dim) with m(s, a) = 0.1·a·ln(s) + 1 (1 for s <= 1); the two are
used only together (Hugging Face ignores one alone, so we refuse it), and an explicit
``attention_factor`` wins over them (we refuse one that disagrees). DeepSeek's attention module also
multiplies its softmax scale by m(s, mscale_all_dim)^2, outside the rope function; with every
dimension rotated (our heads) the two together are logits x m(s, mscale)^2, which is this scheme with
``attention_factor`` = m(s, mscale). ``truncate`` (default true): the ramp's ends are the
floor / ceil of the fractional pair indices, as the authors' code; gpt-oss sets it false and uses
them unrounded.

Options: ``factor`` s, ``original_length`` L_tr (filled from model.train_length), ``beta_fast``,
``beta_slow``, ``attention_factor`` (f; default the rule above, 1.0 switches the temperature off),
``mscale``, ``mscale_all_dim``, ``truncate``, ``base``, ``logn`` (rotary.py).
"""
from __future__ import annotations

import math

import torch

from .base import SchemeError
from .registry import register
from .rotary import Rotary, check_factor, check_original_length, default_inv_freq


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """f = sqrt(1/t) = 0.1·ln(s) + 1 (YaRN §3.4); m(s, a) = 0.1·a·ln(s) + 1 with ``mscale`` a; 1 for s <= 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def correction_dim(turns: float, d_head: int, base: float, original_length: int) -> float:
    """The (fractional) pair index i whose theta_i turns ``turns`` times over original_length positions."""
    return d_head * math.log(original_length / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp(d_head: int, base: float, original_length: int, beta_fast: float, beta_slow: float,
              truncate: bool = True) -> torch.Tensor:
    """gamma_i in [0, 1] per pair, float64 [d_head/2]: 1 keeps theta_i, 0 divides it by s. ``truncate``:
    the ends rounded outwards to whole pair indices (floor / ceil), else kept fractional."""
    low = correction_dim(beta_fast, d_head, base, original_length)
    high = correction_dim(beta_slow, d_head, base, original_length)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_head - 1)
    span = (high - low) or 0.001  # the authors' guard against a zero-width ramp
    ramp = ((torch.arange(d_head // 2, dtype=torch.float64) - low) / span).clamp(0, 1)  # [d/2]
    return 1.0 - ramp


@register
class RotaryYaRN(Rotary):
    name = "rotary-yarn"
    paper = "Peng et al. 2023 (YaRN) §3.2 ramp gamma, §3.4 sqrt(1/t) = 0.1 ln s + 1"
    summary = "RoPE with YaRN's per-frequency ramp (beta 32/1) and q,k scaled by 0.1 ln s + 1"

    def __init__(self, num_heads: int, factor: float = 4.0, original_length: int = 512, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, attention_factor: float | None = None, base: float = 10000.0,
                 logn: bool = False, mscale: float | None = None, mscale_all_dim: float | None = None,
                 truncate: bool = True) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.factor = check_factor(self.name, factor)
        self.original_length = check_original_length(self.name, original_length)
        if not float(beta_fast) > float(beta_slow) > 0:
            raise SchemeError(f"rotary-yarn needs beta_fast > beta_slow > 0, got {beta_fast}, {beta_slow}; "
                              "the paper uses 32 and 1")
        self.beta_fast, self.beta_slow = float(beta_fast), float(beta_slow)
        self.mscale, self.mscale_all_dim = _mscales(mscale, mscale_all_dim)
        if self.mscale is not None:
            m = yarn_attention_factor
            rule = m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim)
        else:
            rule = yarn_attention_factor(self.factor)
        f = rule if attention_factor is None else float(attention_factor)
        if not f > 0:
            raise SchemeError(f"rotary-yarn attention_factor must be > 0, got {attention_factor}")
        if self.mscale is not None and not math.isclose(f, rule, rel_tol=1e-9):
            raise SchemeError(f"rotary-yarn attention_factor={attention_factor} contradicts mscale={mscale}, "
                              f"mscale_all_dim={mscale_all_dim} (which give {rule:.6g}); pass one or the other")
        self.attn_factor = f
        if not isinstance(truncate, bool):
            raise SchemeError(f"rotary-yarn truncate must be true or false, got {truncate!r}")
        self.truncate = truncate

    def inv_freq(self, d_head, length):
        theta = default_inv_freq(self.base, d_head)  # [d/2]
        keep = yarn_ramp(d_head, self.base, self.original_length, self.beta_fast, self.beta_slow,
                         self.truncate)  # [d/2]
        return theta / self.factor * (1 - keep) + theta * keep

    def attention_factor(self, length):
        return self.attn_factor

    def options(self):
        return {"factor": self.factor, "original_length": self.original_length, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "attention_factor": self.attn_factor, "base": self.base,
                **self.variant_options(), **self.logn_options()}

    def variant_options(self) -> dict:
        """mscale, mscale_all_dim and truncate as options() reports them (nothing at their defaults)."""
        out = {} if self.mscale is None else {"mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim}
        return out if self.truncate else {**out, "truncate": False}


def _mscales(mscale, mscale_all_dim) -> tuple[float | None, float | None]:
    """(mscale, mscale_all_dim) both set (> 0) or both None; one alone is a one-line SchemeError."""
    given = [v not in (None, 0, 0.0) for v in (mscale, mscale_all_dim)]
    if given[0] != given[1]:
        raise SchemeError(f"rotary-yarn takes mscale and mscale_all_dim together (f = m(s, mscale) / "
                          f"m(s, mscale_all_dim)), got mscale={mscale}, mscale_all_dim={mscale_all_dim}; pass both "
                          "(DeepSeek-V3: 1 and 1) or neither")
    if not given[0]:
        return None, None
    try:
        a, b = float(mscale), float(mscale_all_dim)
    except (TypeError, ValueError):
        a = b = float("nan")
    if not (0 < a < math.inf and 0 < b < math.inf):
        raise SchemeError(f"rotary-yarn mscale and mscale_all_dim must be numbers > 0, got {mscale}, {mscale_all_dim}")
    return a, b

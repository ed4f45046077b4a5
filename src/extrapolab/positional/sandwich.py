"""Sandwich (Chi, Fan, Rudnicky 2023 "Dissecting Transformer Length Extrapolation via the
Lens of Receptive Field Analysis", §6.1 eq. (6) and appendix E; thesis ch. 4).

Sandwich keeps only the inner product of two sinusoidal embeddings of width d̄:

    p_m·p_n = sum_i cos((m - n) / base^(2i/d̄))                 (eq. 6, first line)
    bias_h(k) = (p_m·p_n - d̄/2) / c_h,   c_h = h·8/H, h = 1..H  (eq. 6)

added to the *scaled* logits like ALiBi ("Eq. (6) is added after the scaled softmax is done in
Eq. (1)"). Index convention: eq. 6 writes i = 1..d̄/2 while the reference code of appendix E
uses ``i = np.arange(bar_d // 2)`` = 0..d̄/2-1. The default is appendix E (``convention=
"appendix"``, the authors' code); ``convention="eq6"`` gives the formula as printed. Both give
bias(0) = 0. Appendix E omits the "- d̄/2" shift; it is constant per head, so the softmax is
unchanged (tests/test_schemes_reference.py checks both statements against the transcribed code).

Options: ``dbar`` (even, > 0; 128 in all of the paper's experiments), ``base`` (1e4),
``ratios`` (explicit list of H compression ratios c_h, default h·8/H), ``convention``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import RelativeBias, SchemeError, alibi_style_ratios
from .registry import register

CONVENTIONS = ("appendix", "eq6")


def sandwich_inner_product(
    k: np.ndarray, dbar: int = 128, base: float = 1e4, convention: str = "appendix"
) -> np.ndarray:
    """float64 p_m·p_n - d̄/2 for distances ``k`` (any shape), before dividing by c_h."""
    i = np.arange(dbar // 2, dtype=np.float64) + (1.0 if convention == "eq6" else 0.0)  # [d̄/2]
    inv = base ** (-2.0 * i / dbar)  # [d̄/2]
    k = np.asarray(k, dtype=np.float64)
    return np.cos(k[..., None] * inv).sum(-1) - dbar / 2  # [...]


def check_sandwich_options(num_heads: int, dbar, base, ratios, convention) -> tuple:
    """Validate shared Sandwich options; returns (dbar, base, ratios [H] float64, convention)."""
    try:
        d = int(dbar)
        ok = not isinstance(dbar, bool) and float(dbar) == d and d > 0 and d % 2 == 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise SchemeError(f"sandwich dbar must be a positive even integer, got {dbar!r}; e.g. dbar=128")
    try:
        ok = float(base) > 1.0 and np.isfinite(float(base))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise SchemeError(f"sandwich base must be a finite number > 1, got {base!r}; e.g. base=10000")
    if convention not in CONVENTIONS:
        raise SchemeError(f"sandwich convention must be one of {CONVENTIONS}, got {convention!r}")
    if ratios is None:
        r = alibi_style_ratios(num_heads).numpy()  # [H] = h·8/H
    else:
        if isinstance(ratios, str):
            ratios = [x for x in ratios.replace(",", " ").split()]
        try:
            r = np.asarray([float(x) for x in ratios], dtype=np.float64)  # [H]
        except (TypeError, ValueError):
            raise SchemeError(f"sandwich ratios must be a list of numbers, got {ratios!r}") from None
        if r.shape != (num_heads,) or not np.all(np.isfinite(r)) or not np.all(r > 0):
            raise SchemeError(
                f"sandwich ratios must be {num_heads} finite numbers > 0 (one per head), got {list(ratios)}"
            )
    return int(dbar), float(base), r, convention


@register
class Sandwich(RelativeBias):
    name = "sandwich"
    paper = "Chi et al. 2023 (Sandwich) §6.1 eq. 6 and appendix E; thesis ch. 4"
    summary = "(sum_i cos(k/10000^(2i/d̄)) - d̄/2)/c_h, c_h = h·8/H: parameter-free, log-like decay"

    def __init__(
        self,
        num_heads: int,
        dbar: int = 128,
        base: float = 1e4,
        ratios: Sequence[float] | None = None,
        convention: str = "appendix",
    ) -> None:
        super().__init__(num_heads)
        self.dbar, self.base, r, self.convention = check_sandwich_options(
            self.num_heads, dbar, base, ratios, convention
        )
        self._explicit_ratios = ratios is not None
        self.register_buffer("ratios", torch.from_numpy(r), persistent=False)  # [H] float64

    def curve(self, k: np.ndarray) -> np.ndarray:
        """float64 bias of every head for distances k: [H, *k.shape]."""
        base = sandwich_inner_product(k, self.dbar, self.base, self.convention)  # [...]
        r = self.ratios.detach().cpu().double().numpy().reshape(-1, *([1] * base.ndim))  # [H, 1, ...]
        return base[None] / r  # [H, ...]

    def bias_from_distance(self, dist, layer=0):
        # evaluate once per distinct distance 0..max, then gather: O(H·max·d̄) not O(|dist|·d̄)
        n = int(dist.max().item()) + 1 if dist.numel() else 1
        table = torch.from_numpy(self.curve(np.arange(n))).to(dist.device)  # [H, n] float64
        return table[:, dist]  # [H, ...]

    def options(self):
        return {
            "dbar": self.dbar,
            "base": self.base,
            "ratios": [float(x) for x in self.ratios] if self._explicit_ratios else None,
            "convention": self.convention,
        }

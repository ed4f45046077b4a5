"""The temperature rules of thesis ch. 5 as plain functions: the Algorithm 1 grid and pick, the
length-only rule tau = log L_tr / log L_ex (Yao et al. 2021; Su 2021; thesis §5.5) and the closed
forms of Props. 5.1/5.2 (thesis §5.6, proofs §5.10.2-3)."""
from __future__ import annotations

import math
from typing import Sequence

from ..io import UserError

GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5 (Algorithm 1)
MODES = ("pmax", "entropy")
RULES = ("pmax", "entropy", "length", "prop51", "prop52")
ALIASES = {"max": "pmax", "max_prob": "pmax", "maxprob": "pmax", "p_max": "pmax", "h": "entropy",
           "ent": "entropy", "log": "length", "yao": "length", "none": "none"}


def canonical_rule(name: str) -> str:
    key = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in RULES and key != "none":
        raise UserError(f"unknown alignment rule {name!r}; use one of: none, {', '.join(RULES)}")
    return key


def pick_tau(target: float, taus: Sequence[float], values: Sequence[float]) -> float:
    """Grid tau whose statistic is closest to the training statistic (ties: the larger tau)."""
    diffs = [abs(v - target) for v in values]
    best = min(range(len(diffs)), key=lambda i: (diffs[i], -taus[i]))
    return float(taus[best])


def length_rule(train_length: int, length: int) -> float:
    """tau = log_{L_ex} L_tr (Yao et al. 2021; Su 2021; thesis §5.5)."""
    return math.log(train_length) / math.log(length)


def prop51_tau(pmax_tr: float, sigma_tr: float, sigma_ex: float, len_tr: float, len_ex: float) -> float:
    """Prop. 5.1: larger root of A tau^2 - B tau + C = 0 (nan if it has no real root)."""
    A = math.log(len_ex) + math.log(pmax_tr)
    B = math.log(len_tr) + math.log(pmax_tr) + sigma_tr ** 2 / 2
    C = sigma_ex ** 2 / 2
    disc = B * B - 4 * A * C
    if A <= 0 or disc < 0:
        return float("nan")
    return (B + math.sqrt(disc)) / (2 * A)


def prop52_tau(sigma_tr: float, sigma_ex: float, len_tr: float, len_ex: float) -> float:
    """Prop. 5.2: tau = sigma_ex / sqrt(sigma_tr^2 + 2 log(L_ex / L_tr))."""
    d = sigma_tr ** 2 + 2 * math.log(len_ex / len_tr)
    return sigma_ex / math.sqrt(d) if d > 0 else float("nan")

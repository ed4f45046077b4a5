"""Bookkeeping of `extrapolab extend hf:PATH` (:mod:`.study`): lengths, which cells
coincide, what holds, which methods go on, and everything measured so far (JSON-able)."""
from __future__ import annotations

import hashlib
import re

import numpy as np

from .cells import Setting, setting


class Plan:
    """The study's state: ``cells[method][str(L)][corpus]`` = E1/E3/E4 of that cell plus its setting
    (``same_as``: the method whose identical cell was computed), Algorithm 1's taus, the methods
    carried to each long length, passkey records and ERF records."""

    def __init__(self, spec, L_ctx: int) -> None:
        self.spec, self.L_ctx = spec, int(L_ctx)
        self.cells: dict = {m: {} for m in spec.methods}  # the tables' row order
        self.align_tau: dict = {}  # method -> str(L) -> tau (pmax, entropy) or [tau per layer] (pmax-layer)
        self.align: dict = {}  # str(L) -> {"global": align_global() result, "layer": align_layers() result}
        self.long: dict = {}  # str(L) -> methods evaluated there
        self.passkey: dict = {}  # method -> str(L) -> records
        self.erf: dict = {}  # method -> record

    # ---------------------------------------------------------------- lengths and cells
    def length(self, factor: float) -> int:
        return int(round(float(factor) * self.L_ctx))

    def lengths_table(self) -> dict:
        return {f"{f:g}": self.length(f) for f in [*self.spec.full_factors, *self.spec.long_factors]}

    def longest(self, corpus: str) -> int:
        """The longest length any cell reads on ``corpus`` (its windows end that far apart)."""
        fs = list(self.spec.full_factors) + (list(self.spec.long_factors) if corpus in self.spec.long_corpora else [])
        return self.length(max(fs))

    def previous(self, factor: float) -> int:
        """The length of the factor before ``factor`` (full and long factors in order)."""
        fs = sorted([*self.spec.full_factors, *self.spec.long_factors])
        return self.length(fs[fs.index(factor) - 1])

    def groups(self, L: int, methods) -> dict[str, list[str]]:
        """{setting key: methods with that setting at L}, in ``methods`` order within a group and
        ordered by ``--rope`` text (one model load per text)."""
        out: dict[str, list[str]] = {}
        for m in methods:
            out.setdefault(setting(m, L, self.L_ctx, self.align_tau).key(), []).append(m)
        return dict(sorted(out.items(), key=lambda kv: str(setting(kv[1][0], L, self.L_ctx, self.align_tau).rope)))

    def record(self, L: int, corpus: str, group: list[str], st: Setting, res: dict) -> None:
        for i, m in enumerate(group):
            self.cells.setdefault(m, {}).setdefault(str(L), {})[corpus] = {
                **res, "rope": st.rope, "tau": list(st.tau) if isinstance(st.tau, tuple) else st.tau,
                "same_as": group[0] if i else None}

    def e1(self, method: str, L: int, corpus: str) -> float | None:
        return self.cells.get(method, {}).get(str(L), {}).get(corpus, {}).get("e1")

    # ---------------------------------------------------------------- what holds
    def ratios(self, method: str, L: int) -> dict[str, float]:
        """{corpus: ppl of the last L_ctx predictions of (method, L)'s windows / plain RoPE's E1 at
        L_ctx (the same tokens)} over the corpora measured at L."""
        out = {}
        for c, cell in self.cells.get(method, {}).get(str(L), {}).items():
            a, b = cell.get("tail_ppl"), self.e1("rope", self.L_ctx, c)
            if a is not None and b:
                out[c] = a / b
        return out

    def holds(self, method: str, L: int) -> bool:
        r = self.ratios(method, L)
        return bool(r) and all(v <= self.spec.hold_ratio for v in r.values())

    def best(self, L: int, k: int) -> list[str]:
        """Up to ``k`` methods that hold at L, lowest mean ratio first; one per setting (not the copies)."""
        ok = [m for m in self.cells if self.holds(m, L)
              and not self.cells[m][str(L)][next(iter(self.cells[m][str(L)]))].get("same_as")]
        return sorted(ok, key=lambda m: float(np.mean(list(self.ratios(m, L).values()))))[:max(0, int(k))]

    def hold_table(self) -> dict:
        """{str(L): {method: {"ratio": {corpus: r}, "holds": bool}}} for every L > L_ctx measured."""
        out: dict = {}
        for m, byL in self.cells.items():
            for L in byL:
                if int(L) > self.L_ctx:
                    out.setdefault(L, {})[m] = {"ratio": self.ratios(m, int(L)), "holds": self.holds(m, int(L))}
        return out

    def erf_methods(self, names, L: int) -> list[str]:
        """``names`` with ``best`` resolved (the method that holds best at the last full factor), one
        per distinct setting at L (Algorithm 1's taus at L must be known for the aligned methods)."""
        best = self.best(self.length(self.spec.full_factors[-1]), 1)
        seen, out = set(), []
        for n in names:
            m = (best[0] if best else None) if n == "best" else n
            if m is None:
                continue
            k = setting(m, L, self.L_ctx, self.align_tau).key()
            if k not in seen:
                seen.add(k)
                out.append(m)
        return out

    # ---------------------------------------------------------------- naming and output
    @staticmethod
    def slug(corpus: str) -> str:
        """The corpus's last name part (``pydoc``, a folder's name) and a hash of the whole spec."""
        tail = re.sub(r"[^A-Za-z0-9]+", "_", re.split(r"[/:]", corpus.rstrip("/"))[-1]).strip("_")[:24]
        return f"{tail or 'corpus'}_{hashlib.sha256(corpus.encode()).hexdigest()[:6]}"

    @staticmethod
    def short(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:10]

    @staticmethod
    def tau_text(tau) -> str:
        if isinstance(tau, (tuple, list)):
            return f"per layer {min(tau):g}-{max(tau):g}"
        return f"{tau:.3f}" if tau != 1.0 else "1"

    def to_dict(self) -> dict:
        return {"cells": self.cells, "align": self.align, "align_tau": self.align_tau, "long": self.long,
                "holds": self.hold_table(), "passkey": self.passkey, "erf": self.erf}

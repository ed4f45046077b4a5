"""Bookkeeping of `extrapolab extend hf:PATH` (:mod:`.study`): lengths, which cells coincide, what
holds (on paired intervals), which methods go on, and everything measured so far (JSON-able).

Intervals. Every method reads the same windows (the same end tokens) at every length, so a method
at L and plain RoPE at L_ctx are compared window by window: d_i = the mean NLL of the last L_ctx
predictions of the method's window i minus plain RoPE's mean NLL over window i at L_ctx (the same
tokens). The ratio of their perplexities is exp(mean d), its 95% interval exp(mean d ± t·sd/√n)
(a paired Student-t interval over the n windows, eval/stats.py ``paired_interval``). A method HOLDS
at L when on every corpus measured at L the interval's upper end is at most ``hold_ratio``; it FAILS
when on some corpus the lower end exceeds it; otherwise it is UNRESOLVED (the n windows do not
tell: one window never does). Each cell's E1, and each method's ratio to the lowest method at the
same L, get the same kind of interval. Intervals are per cell at 95%, not corrected for the number
of cells.
"""
from __future__ import annotations

import hashlib
import math
import re

from ..eval.stats import paired_interval, t_interval
from .cells import Setting, setting

HOLDS, FAILS, UNRESOLVED = "holds", "fails", "unresolved"


def log_interval(st: dict) -> dict:
    """A mean-NLL (difference) interval as a perplexity (ratio) interval: exp of each end."""
    ex = lambda v: math.exp(v) if math.isfinite(v) else (math.inf if v > 0 else 0.0)  # noqa: E731
    return {"value": ex(st["mean"]), "lo": ex(st["lo"]), "hi": ex(st["hi"]), "n": st["n"],
            "half_log": st["half"]}


class Plan:
    """The study's state: ``cells[method][str(L)][corpus]`` = E1/E3/E4 of that cell, its per-window
    values and its setting (``same_as``: the method whose identical cell was computed), Algorithm 1's
    taus, the methods carried to each long length, the task records ``tasks[task][method][str(L)]``
    (passkey) and ERF records."""

    def __init__(self, spec, L_ctx: int) -> None:
        self.spec, self.L_ctx = spec, int(L_ctx)
        self.cells: dict = {m: {} for m in spec.methods}  # the tables' row order
        self.align_tau: dict = {}  # method -> str(L) -> tau (pmax, entropy) or [tau per layer] (pmax-layer)
        self.align: dict = {}  # str(L) -> {"global": align_global() result, "layer": align_layers() result}
        self.long: dict = {}  # str(L) -> methods evaluated there
        self.tasks: dict = {}  # task -> method -> str(L) -> records (each record: "same_as" when copied)
        self.erf: dict = {}  # method -> record

    # ---------------------------------------------------------------- lengths and cells
    def length(self, factor: float) -> int:
        return int(round(float(factor) * self.L_ctx))

    def lengths_table(self) -> dict:
        return {f"{f:g}": self.length(f) for f in [*self.spec.full_factors, *self.spec.long_factors]}

    def longest(self, corpus: str) -> int:
        """The longest length any cell reads on ``corpus`` (the first window ends there or later)."""
        fs = list(self.spec.full_factors) + (list(self.spec.long_factors) if corpus in self.spec.long_corpora else [])
        return self.length(max(fs))

    def spacing(self) -> int:
        """How far apart a corpus's window ends are: the longest full-factor length."""
        return self.length(max(self.spec.full_factors))

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

    def record_task(self, task: str, L: int, group: list[str], records: list[dict]) -> None:
        for i, m in enumerate(group):
            self.tasks.setdefault(task, {}).setdefault(m, {})[str(L)] = [
                {**r, "same_as": group[0] if i else None} for r in records]

    def cell(self, method: str, L: int, corpus: str) -> dict | None:
        return self.cells.get(method, {}).get(str(L), {}).get(corpus)

    def e1(self, method: str, L: int, corpus: str) -> float | None:
        return (self.cell(method, L, corpus) or {}).get("e1")

    # ---------------------------------------------------------------- intervals and what holds
    def ratio_stats(self, method: str, L: int) -> dict[str, dict]:
        """{corpus: ratio interval of (method, L)'s last-L_ctx perplexity to plain RoPE's E1 at L_ctx on
        the same windows (module doc)} over the corpora measured at L."""
        out = {}
        for c, cell in self.cells.get(method, {}).get(str(L), {}).items():
            ref = self.cell("rope", self.L_ctx, c)
            if ref and "win_tail_nll" in cell and "win_nll" in ref:
                out[c] = log_interval(paired_interval(dict(zip(cell["ends"], cell["win_tail_nll"])),
                                                      dict(zip(ref["ends"], ref["win_nll"]))))
        return out

    def ratios(self, method: str, L: int) -> dict[str, float]:
        return {c: s["value"] for c, s in self.ratio_stats(method, L).items()}

    def verdict(self, method: str, L: int) -> str | None:
        st = self.ratio_stats(method, L)
        if not st:
            return None
        lim = float(self.spec.hold_ratio)
        if all(s["hi"] <= lim for s in st.values()):
            return HOLDS
        return FAILS if any(s["lo"] > lim for s in st.values()) else UNRESOLVED

    def holds(self, method: str, L: int) -> bool:
        return self.verdict(method, L) == HOLDS

    def distinct(self, L: int) -> list[str]:
        """Methods measured at L whose cells were computed (not copies of another method's)."""
        return [m for m, byL in self.cells.items() if byL.get(str(L))
                and not next(iter(byL[str(L)].values())).get("same_as")]

    def best(self, L: int, k: int) -> list[str]:
        """Up to ``k`` methods that hold at L, lowest mean ratio first; one per setting (not the copies)."""
        ok = [m for m in self.distinct(L) if self.holds(m, L)]
        return sorted(ok, key=lambda m: sum(self.ratios(m, L).values()) / len(self.ratios(m, L)))[:max(0, int(k))]

    def e1_interval(self, method: str, L: int, corpus: str) -> dict | None:
        cell = self.cell(method, L, corpus)
        return log_interval(t_interval(cell["win_nll"])) if cell and "win_nll" in cell else None

    def versus_lowest(self, L: int, corpus: str) -> dict:
        """{method: ratio interval of its last-L_ctx perplexity to that of the method lowest at (L,
        corpus), on the same windows} for the computed cells there (the lowest is 1 exactly)."""
        cells = {m: self.cell(m, L, corpus) for m in self.distinct(L)}
        cells = {m: c for m, c in cells.items() if c and "win_tail_nll" in c}
        if not cells:
            return {}
        low = min(cells, key=lambda m: cells[m]["tail_nll"])
        ref = dict(zip(cells[low]["ends"], cells[low]["win_tail_nll"]))
        return {m: {**log_interval(paired_interval(dict(zip(c["ends"], c["win_tail_nll"])), ref)), "lowest": low}
                for m, c in cells.items()}

    def hold_table(self) -> dict:
        """{str(L): {method: {"ratio", "lo", "hi", "n" (per corpus), "verdict", "holds"}}} for every L > L_ctx."""
        out: dict = {}
        for m, byL in self.cells.items():
            for L in byL:
                if int(L) > self.L_ctx:
                    st = self.ratio_stats(m, int(L))
                    out.setdefault(L, {})[m] = {k: {c: s[k2] for c, s in st.items()} for k, k2 in
                                                (("ratio", "value"), ("lo", "lo"), ("hi", "hi"), ("n", "n"))}
                    out[L][m].update(verdict=self.verdict(m, int(L)), holds=self.holds(m, int(L)))
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
                "holds": self.hold_table(), "tasks": self.tasks, "erf": self.erf}

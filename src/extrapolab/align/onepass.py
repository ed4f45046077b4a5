"""Algorithm 1 in one forward per length, a temperature per layer (thesis ch. 5, §5.4, Algorithm 1).

Algorithm 1 as :mod:`.algorithm` runs it sets one tau in every softmax and runs the model once per
grid tau (1.0, 0.95, ..., 0.5): 11 forwards per L_ex, each reading every layer's [H, L, L] logits.
On a real model at 16,384 tokens that is hours. This module runs the same idea layer by layer in
ONE forward: when layer r attends, its logits (from the model's own q and k, through the
``extrapolab`` attention function's chooser keyword, hf/extend.py) give the statistic of
Softmax_tau for any grid tau -- one q·k matmul per block of query rows, then for each tau only
exp and two row sums:

    d = l - max(l),  Z_tau = sum exp(d / tau),  P_max = 1 / Z_tau,
    H = log Z_tau - sum(exp(d / tau) · d) / (tau · Z_tau)

-- the tau whose statistic is closest to layer r's statistic at L_tr is chosen (ties: the larger
tau, :func:`.rules.pick_tau`; found by bisection over the grid, since both statistics are monotone
in tau, or with every grid tau evaluated) and layer r attends at it through the fused kernel, so layer r + 1
already reads the sharpened layer's output (Algorithm 1's propagation: deeper layers see inputs
changed by the sharper shallower ones). The L_tr statistics per layer come from one forward at
L_tr at tau = 1. So the result is one tau per layer, greedy from the first layer up; it equals
running the block-wise statistics of :class:`extrapolab.hf.HFBlockTarget` once per layer with the
earlier layers' taus fixed (tests/test_onepass_align.py). The statistic averages over layers x
heads x query rows as Algorithm 1 does, per layer; ``rows`` > 0 reads that many query rows per
layer, evenly spaced over the positions (a stratified sample of the mean; 0 = every row), which
keeps the statistics' cost a fraction of the forward at 16k tokens.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..io import UserError
from ..model.reference import logits as block_logits
from .rules import GRID, MODES, pick_tau


def sample_rows(n: int, rows: int) -> torch.Tensor:
    """Indices of ``rows`` query rows evenly spaced over 0..n-1 (all n when rows is 0 or >= n)."""
    if rows <= 0 or rows >= n:
        return torch.arange(n)
    return torch.unique(torch.round(torch.linspace(0, n - 1, rows)).long())


MASKED = -1e30  # d of a masked key: exp(d / tau) = 0 and 0 * d = 0 (no inf, no nan)


class LayerAligner:
    """The chooser the ``extrapolab`` attention calls in every layer (hf/extend.py ``CHOOSE_KWARG``).

    ``target``: the statistic per layer at L_tr (None: record only, every layer attends at tau 1).
    Sums P_max and H of Softmax_tau per (tau, layer) over the rows it reads, in float64.
    ``search="bisect"`` (default) evaluates only the grid taus a bisection needs: each row's P_max
    falls and its entropy rises with tau, so their means are monotone in tau and the grid tau
    closest to the target lies next to where the statistic crosses it (4-5 of 11 evaluated;
    the others are NaN in the summary); ``"grid"`` evaluates every tau."""

    def __init__(self, num_layers: int, taus: Sequence[float] = GRID, mode: str = "pmax",
                 target: Sequence[float] | None = None, rows: int = 0, block: int = 64,
                 search: str = "bisect") -> None:
        if mode not in MODES:
            raise UserError(f"Algorithm 1 modes are {', '.join(MODES)}; got {mode!r}")
        if target is not None and len(target) != num_layers:
            raise UserError(f"{len(target)} L_tr statistics for a {num_layers}-layer model")
        if search not in ("bisect", "grid"):
            raise UserError(f"search is 'bisect' or 'grid', got {search!r}")
        self.taus, self.mode, self.rows, self.block = [float(t) for t in taus], mode, int(rows), int(block)
        self.target, self.search = None if target is None else [float(t) for t in target], search
        self.pmax = np.full((len(self.taus), num_layers), np.nan)
        self.ent = np.full((len(self.taus), num_layers), np.nan)
        self.count = np.zeros(num_layers)
        self.chosen: list[float | None] = [None] * num_layers
        self._d: list[torch.Tensor] = []  # the current layer's row-shifted logits, one [R, keys] per block

    @torch.no_grad()
    def add(self, layer: int, q, k, q_pos, k_pos, scheme, window=None) -> None:
        """Read layer ``layer``'s logits from rotated q [B,H,Lq,D], k [B,H,Lk,D] (keys sorted by
        position): d = l - max(l) per row, for the taus :meth:`evaluate` asks about."""
        pick = sample_rows(q.shape[2], self.rows).to(q.device)
        self._d, self.count[layer] = [], 0
        for s in range(0, pick.numel(), self.block):
            idx = pick[s:s + self.block]
            qp = q_pos[idx]
            hi = int(torch.searchsorted(k_pos, qp.max(), right=True))  # later keys are masked for these rows
            lg = block_logits(q[:, :, idx], k[:, :, :hi], qp, k_pos[:hi], scheme, layer, window)  # [B,H,b,hi]
            rows = lg.reshape(-1, lg.shape[-1]).float()  # [R, hi], -inf where masked
            d = rows.sub_(rows.max(-1, keepdim=True).values)  # <= 0
            self._d.append(d.nan_to_num_(neginf=MASKED))
            self.count[layer] += d.shape[0]

    @torch.no_grad()
    def evaluate(self, layer: int, i: int) -> float:
        """The mode's statistic of tau_i at ``layer`` (computed once from the stored logits):
        Z = sum exp(d/tau), P_max = 1/Z, H = log Z - sum(exp(d/tau)·d) / (tau·Z)."""
        if np.isnan(self.pmax[i, layer]):
            tau, pm, ent = self.taus[i], 0.0, 0.0
            for d in self._d:
                e = torch.mul(d, 1.0 / tau).exp_()  # [R, keys], 0 where masked
                z = e.sum(-1)  # [R] >= 1 (the row maximum contributes 1)
                pm += float(z.reciprocal().double().sum())
                ent += float((z.log() - torch.linalg.vecdot(e, d) / (tau * z)).double().sum())
            self.pmax[i, layer], self.ent[i, layer] = pm, ent
        table = self.pmax if self.mode == "pmax" else self.ent
        return float(table[i, layer] / max(self.count[layer], 1.0))

    def values(self, layer: int) -> list[float]:
        """The mode's statistic of layer ``layer`` for every tau (NaN where not evaluated)."""
        table = self.pmax if self.mode == "pmax" else self.ent
        return [float(v) for v in table[:, layer] / max(self.count[layer], 1.0)]

    def _choose(self, layer: int) -> float:
        n, target = len(self.taus), self.target[layer]
        if self.search == "grid" or n < 3:
            return pick_tau(target, self.taus, [self.evaluate(layer, i) for i in range(n)])
        order = sorted(range(n), key=lambda i: self.taus[i])  # the statistic is monotone along it:
        falls = self.mode == "pmax"  # P_max falls as tau grows, the entropy rises
        lo, hi = 0, n - 1  # bisect for the first position whose statistic passes the target
        while lo < hi:
            mid = (lo + hi) // 2
            v = self.evaluate(layer, order[mid])
            if (v <= target) if falls else (v >= target):
                hi = mid
            else:
                lo = mid + 1
        near = sorted({order[j] for j in (lo - 1, lo) if 0 <= j < n})
        return pick_tau(target, [self.taus[i] for i in near], [self.evaluate(layer, i) for i in near])

    def __call__(self, layer: int, q, k, q_pos, k_pos, scheme, window=None) -> float:
        self.add(layer, q, k, q_pos, k_pos, scheme, window)
        if self.target is None:
            for i in range(len(self.taus)):
                self.evaluate(layer, i)
            tau = 1.0
        else:
            tau = self._choose(layer)
        self._d, self.chosen[layer] = [], tau
        return tau

    def summary(self) -> dict:
        n = np.maximum(self.count, 1.0)
        return {"taus": self.taus, "mode": self.mode, "tau": self.chosen, "search": self.search,
                "per_layer_pmax": [[None if np.isnan(v) else round(float(v), 6) for v in row]
                                   for row in (self.pmax / n).T],  # [layer][tau]
                "per_layer_entropy": [[None if np.isnan(v) else round(float(v), 6) for v in row]
                                      for row in (self.ent / n).T],
                "rows_per_layer": self.count.astype(int).tolist(), "target": self.target}


def run_pass(model, segments, chooser: Callable) -> None:
    """One forward of ``model`` (an ``HFCausalLM`` loaded with the extrapolab attention) over
    ``segments`` [N, L] as one batch, the window prefix in front, with ``chooser`` in every layer."""
    from ..hf.extend import ATTN, CHOOSE_KWARG

    hf = model.hf
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl != ATTN:
        raise UserError(f"one-pass alignment needs attn_implementation={ATTN!r} (got {impl!r}); load the model "
                        f"with load_hf(..., attn={ATTN!r})")
    ids = torch.as_tensor(np.asarray(segments), dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids  # [N, L]
    if model.prefix:
        ids = torch.cat([torch.tensor(model.prefix, dtype=torch.long).expand(ids.shape[0], -1), ids], 1)  # [N, P+L]
    dev = next(hf.parameters()).device
    with torch.inference_mode():
        hf(input_ids=ids.to(dev), use_cache=False, logits_to_keep=1, **{CHOOSE_KWARG: chooser})


def align_layers(model, train_segments, segments: dict, *, mode: str = "pmax", taus: Sequence[float] = GRID,
                 rows: int = 256, block: int = 128, search: str = "bisect", say=lambda _m: None) -> dict:
    """Per-layer tau at every length: ``train_segments`` [N, L_tr] give each layer's statistic at
    L_tr (tau = 1), ``segments`` {L: [N, L]} one forward each. Returns {"train": summary at L_tr,
    "tau": {str(L): [tau per layer]}, "stats": {str(L): summary}} (JSON-able)."""
    from ..memory import PeakMemory

    num_layers = int(model.hf.config.num_hidden_layers)
    dev = next(model.hf.parameters()).device
    ref = LayerAligner(num_layers, [1.0], mode, rows=rows, block=block)
    say(f"Algorithm 1 (one pass): layer statistics at L_tr = {np.shape(train_segments)[-1]}")
    run_pass(model, train_segments, ref)
    target = [ref.values(r)[0] for r in range(num_layers)]
    out = {"mode": mode, "rows": int(rows), "search": search, "grid": [float(t) for t in taus], "train": ref.summary(),
           "tau": {}, "stats": {}, "peak_mib": {}}
    for L, segs in segments.items():
        say(f"Algorithm 1 (one pass): tau per layer at L = {L}")
        a = LayerAligner(num_layers, taus, mode, target=target, rows=rows, block=block, search=search)
        with PeakMemory(dev) as mem:  # the process's peak during the pass (weights included)
            run_pass(model, segs, a)
        out["tau"][str(L)] = [float(t) for t in a.chosen]
        out["stats"][str(L)] = a.summary()
        out["peak_mib"][str(L)] = mem.abs_mib
    return out

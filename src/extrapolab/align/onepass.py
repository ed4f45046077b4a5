"""Algorithm 1 on a Hugging Face causal LM in fused forwards (thesis ch. 5, §5.4, Algorithm 1).

FINDS(tau, M) sets every softmax to tau, runs the model and averages the statistic M (the maximum
probability P_max or the entropy H of Softmax_tau(l)) over every softmax it performed: N = R·H·L
logit vectors (R layers, H heads, L query rows). tau_ex is the grid value (1.0, 0.95, ..., 0.5)
whose FINDS(tau_ex) at L_ex is closest to FINDS(1) at L_tr: ONE tau for the whole model per length.
Run as :mod:`.algorithm` runs it on our GPT (every softmax on the reference path, 11 forwards per
L_ex), that is hours on a real model at 16,384 tokens. Here every layer attends through the fused
kernel of the ``extrapolab`` attention function (hf/extend.py), whose chooser keyword hands each
layer's q and k (rotated, log-n applied, scaled, GQA heads repeated) to a :class:`LayerAligner`
before the layer attends. It reads the logits of ``rows`` query rows evenly spaced over the
positions (every head, every layer, every sequence of the batch; 0 = every row) one block at a
time and, with d = l - max(l), computes for any grid tau only exp and two row sums:

    Z_tau = sum exp(d / tau),  P_max = 1 / Z_tau,  H = log Z_tau - sum(exp(d / tau) · d) / (tau · Z_tau)

:func:`align_global` is the thesis' method: :func:`finds` is ONE forward in which every layer
attends at tau and records the statistic of Softmax_tau on the sampled rows -- a stratified Monte
Carlo estimate of the average over all N logit vectors, exact at ``rows=0``
(tests/test_global_align.py checks it against the block-wise statistics of
:class:`extrapolab.hf.HFBlockTarget`). FINDS is monotone in tau in practice (each row's P_max falls
and its entropy rises with tau; deeper layers' inputs change too, so this is checked, not assumed):
:func:`grid_search` bisects over the grid, ~4 forwards per length instead of 11, and evaluates the
whole grid when two evaluated taus are out of order. One forward gives both statistics, so P_max
and entropy share their forwards.

:func:`align_layers` is a variant, not the thesis' method: a tau PER LAYER in ONE forward. Layer r
reads the statistic of every grid tau off its own logits, picks the tau closest to layer r's
statistic at L_tr (one forward at L_tr, tau = 1) by the same :func:`grid_search`, and attends at it,
so layer r + 1 already reads the sharpened layer's output; greedy from the first layer up. It
equals the block-wise statistics run once per layer with the earlier layers' taus fixed
(tests/test_onepass_align.py).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..io import UserError
from ..model.reference import logits as block_logits
from .rules import GRID, MODES, pick_tau
from .temperature import SoftmaxStats


def sample_rows(n: int, rows: int) -> torch.Tensor:
    """Indices of ``rows`` query rows evenly spaced over 0..n-1 (all n when rows is 0 or >= n)."""
    if rows <= 0 or rows >= n:
        return torch.arange(n)
    return torch.unique(torch.round(torch.linspace(0, n - 1, rows)).long())


MASKED = -1e30  # d of a masked key: exp(d / tau) = 0 and 0 * d = 0 (no inf, no nan)
SEARCHES = ("bisect", "grid")


def grid_search(taus: Sequence[float], target: float, value: Callable[[int], float], falls: bool,
                search: str = "bisect") -> tuple[float, bool]:
    """(the grid tau whose statistic ``value(i)`` is closest to ``target``, whether the whole grid
    was evaluated after a non-monotone pair). Ties go to the larger tau (:func:`.rules.pick_tau`).

    ``falls``: the statistic falls as tau grows (P_max; the entropy rises). ``"bisect"`` finds the
    first tau, in ascending order, whose statistic passes the target; for a strictly monotone
    statistic the closest grid tau is it or the one before (3-4 of 11 evaluated). If
    any two evaluated taus are out of order (or equal), every tau is evaluated and the closest
    taken, as ``"grid"`` does from the start. ``value`` is called at most once per index."""
    if search not in SEARCHES:
        raise UserError(f"search is 'bisect' or 'grid', got {search!r}")
    n, seen = len(taus), {}

    def v(i: int) -> float:
        if i not in seen:
            seen[i] = float(value(i))
        return seen[i]

    if search == "grid" or n < 3:
        return pick_tau(target, list(taus), [v(i) for i in range(n)]), False
    order = sorted(range(n), key=lambda i: taus[i])
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi) // 2
        x = v(order[mid])
        if (x <= target) if falls else (x >= target):
            hi = mid
        else:
            lo = mid + 1
    near = [order[j] for j in (lo - 1, lo) if 0 <= j < n]
    vals = [v(i) for i in near]
    got = [seen[i] for i in sorted(seen, key=lambda i: taus[i])]  # ascending tau
    if not all((a > b) if falls else (a < b) for a, b in zip(got, got[1:])):
        return pick_tau(target, list(taus), [v(i) for i in range(n)]), True
    return pick_tau(target, [taus[i] for i in near], vals), False


class LayerAligner:
    """The chooser the ``extrapolab`` attention calls in every layer (hf/extend.py ``CHOOSE_KWARG``).

    ``target``: the statistic per layer at L_tr: each layer attends at the grid tau closest to its
    target (:func:`grid_search`; ``search="bisect"`` evaluates 3-5 of 11 taus, the others are NaN
    in the summary). None: record every tau in ``taus``, every layer attends at ``attend`` (FINDS).
    Sums P_max and H of Softmax_tau per (tau, layer) over the rows it reads, in float64.
    ``layer0``: a :class:`.temperature.SoftmaxStats` (``layer0=True``) given layer 0's sampled
    tau = 1 logit rows, for the average logit vector of Props. 5.1/5.2."""

    def __init__(self, num_layers: int, taus: Sequence[float] = GRID, mode: str = "pmax",
                 target: Sequence[float] | None = None, rows: int = 0, block: int = 64,
                 search: str = "bisect", attend: float = 1.0, layer0: SoftmaxStats | None = None) -> None:
        if mode not in MODES:
            raise UserError(f"Algorithm 1 modes are {', '.join(MODES)}; got {mode!r}")
        if target is not None and len(target) != num_layers:
            raise UserError(f"{len(target)} L_tr statistics for a {num_layers}-layer model")
        if search not in SEARCHES:
            raise UserError(f"search is 'bisect' or 'grid', got {search!r}")
        self.attend, self.layer0 = float(attend), layer0
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
            if layer == 0 and self.layer0 is not None:  # before the in-place shift below
                self.layer0.add(0, lg, grid=k.shape[2])
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
        tau, _ = grid_search(self.taus, self.target[layer], lambda i: self.evaluate(layer, i),
                             falls=self.mode == "pmax", search=self.search)
        return tau

    def __call__(self, layer: int, q, k, q_pos, k_pos, scheme, window=None) -> float:
        self.add(layer, q, k, q_pos, k_pos, scheme, window)
        if self.target is None:
            for i in range(len(self.taus)):
                self.evaluate(layer, i)
            tau = self.attend
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
    say(f"Algorithm 1, per-layer variant: layer statistics at L_tr = {np.shape(train_segments)[-1]}")
    run_pass(model, train_segments, ref)
    target = [ref.values(r)[0] for r in range(num_layers)]
    out = {"mode": mode, "rows": int(rows), "search": search, "grid": [float(t) for t in taus], "train": ref.summary(),
           "tau": {}, "stats": {}, "peak_mib": {}}
    for L, segs in segments.items():
        say(f"Algorithm 1, per-layer variant: tau per layer at L = {L}")
        a = LayerAligner(num_layers, taus, mode, target=target, rows=rows, block=block, search=search)
        with PeakMemory(dev) as mem:  # the process's peak during the pass (weights included)
            run_pass(model, segs, a)
        out["tau"][str(L)] = [float(t) for t in a.chosen]
        out["stats"][str(L)] = a.summary()
        out["peak_mib"][str(L)] = mem.abs_mib
    return out


# ---------------------------------------------------------------- the thesis' global tau
def finds(model, segments, tau: float, *, rows: int = 256, block: int = 128,
          layer0: SoftmaxStats | None = None) -> dict:
    """FINDS(tau) of Algorithm 1 in ONE forward of ``segments`` [N, L]: every layer attends at
    ``tau`` (fused) and the mean P_max and entropy of Softmax_tau over the sampled rows of every
    layer and head (all of them at ``rows=0``). ``layer0``: fed layer 0's sampled tau = 1 rows."""
    num_layers = int(model.hf.config.num_hidden_layers)
    a = LayerAligner(num_layers, [tau], rows=rows, block=block, attend=tau, layer0=layer0)
    run_pass(model, segments, a)
    n = a.count  # [layer] rows read per layer (sequences x heads x sampled rows)
    total = max(float(n.sum()), 1.0)
    return {"tau": float(tau), "pmax": float(a.pmax[0].sum() / total), "entropy": float(a.ent[0].sum() / total),
            "per_layer_pmax": [round(float(v), 6) for v in a.pmax[0] / np.maximum(n, 1.0)],
            "per_layer_entropy": [round(float(v), 6) for v in a.ent[0] / np.maximum(n, 1.0)],
            "softmaxes": int(n.sum())}


def align_global(model, train_segments, segments: dict, *, modes: Sequence[str] = MODES,
                 taus: Sequence[float] = GRID, rows: int = 256, block: int = 128, search: str = "bisect",
                 layer0: bool = False, say=lambda _m: None) -> dict:
    """The thesis' Algorithm 1 (module doc): S_tr = FINDS(1) on ``train_segments`` [N, L_tr], then
    per L in ``segments`` ({L: [N, L]}) the grid tau whose FINDS is closest to S_tr for each mode,
    the modes sharing forwards. Returns (JSON-able) {"train": FINDS(1), "tau": {mode: {str(L): tau}},
    "finds": {str(L): [FINDS(tau) or None per grid tau]}, "forwards": {str(L): n}, "fallback":
    {mode: {str(L): bool}}, "peak_mib", "layer0"?: {"train" | str(L): Props. 5.1/5.2 statistics}}."""
    from ..memory import PeakMemory

    modes = list(modes)
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"Algorithm 1 modes are {', '.join(MODES)}; got {modes}")
    if search not in SEARCHES:
        raise UserError(f"search is 'bisect' or 'grid', got {search!r}")
    taus = [float(t) for t in taus]
    num_layers, dev = int(model.hf.config.num_hidden_layers), next(model.hf.parameters()).device
    sink = SoftmaxStats(num_layers, [], layer0=True) if layer0 else None
    say(f"Algorithm 1: FINDS(1) at L_tr = {np.shape(train_segments)[-1]}")
    train = finds(model, train_segments, 1.0, rows=rows, block=block, layer0=sink)
    out = {"modes": modes, "rows": int(rows), "search": search, "grid": taus, "train": train,
           "tau": {m: {} for m in modes}, "finds": {}, "forwards": {}, "fallback": {m: {} for m in modes},
           "peak_mib": {}}
    if sink is not None:
        out["layer0"] = {"train": sink.summary().get("layer0")}
    for L, segs in segments.items():
        key, runs = str(L), {}
        l0 = SoftmaxStats(num_layers, [], layer0=True) if layer0 else None

        def value(i: int, m: str, segs=segs, runs=runs, l0=l0, L=L) -> float:
            if i not in runs:  # layer 0's logits do not depend on tau: its statistics from the first forward
                say(f"Algorithm 1: FINDS({taus[i]:g}) at L = {L}")
                runs[i] = finds(model, segs, taus[i], rows=rows, block=block, layer0=None if runs else l0)
            return runs[i][m]

        with PeakMemory(dev) as mem:  # the process's peak during the forwards (weights included)
            for m in modes:
                tau, fell = grid_search(taus, train[m], lambda i, m=m: value(i, m), falls=m == "pmax", search=search)
                out["tau"][m][key], out["fallback"][m][key] = tau, fell
        out["finds"][key] = [runs.get(i) for i in range(len(taus))]
        out["forwards"][key], out["peak_mib"][key] = len(runs), mem.abs_mib
        if l0 is not None:
            out["layer0"][key] = l0.summary().get("layer0")
    return out

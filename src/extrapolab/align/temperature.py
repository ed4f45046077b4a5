"""Softmax temperature in our GPT, and per-softmax attention statistics (thesis ch. 5, §5.4).

Softmax_tau(l) = softmax(l / tau) divides the whole pre-softmax logit (scaled q·k plus bias), as
``AttnOptions.temperature`` does. :class:`GPTTarget` sets tau per layer through the model's
attention options (``AttnOptions.temperature`` takes one value per layer) and, given a
:class:`SoftmaxStats` sink, passes it as ``AttnOptions.logits_sink``: the reference attention path
(model/reference.py, docs/attention.md) hands it every layer's tau=1 logits, one query block at a
time, so no L x L per-layer tensor is kept and no second logit computation exists. Targets that only expose
probabilities (HF T5, align/hf_t5.py) report log p instead: log p = l - logsumexp(l) is l up to a
per-row constant and softmax is shift-invariant, so softmax(log p / tau) = softmax(l / tau).

:class:`SoftmaxStats` sums, per (tau, layer), P_max = max Softmax_tau(l) and the entropy
H(Softmax_tau(l)) over every logit row it is given (one row per softmax: layers x heads x query
positions); for a causal model a row holds only its unmasked keys (-inf entries get probability 0
and add nothing to H). With ``layer0=True`` it also builds layer 0's *average logit vector* for
Props. 5.1/5.2 (Assumption 5.1): each row centred and sorted; causal rows have lengths 1..L, so
(our generalisation, exact for full rows) each row's sorted values are read at G = L common
quantiles (j+0.5)/G before averaging (rows with >= 2 keys), and the row length used by the
formulas is the effective length exp(mean log n_i) (= L for an encoder).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from ..io import UserError
from .hf_t5 import T5Target, is_t5
from ..model.attention import AttnOptions, layer_temperatures


# ---------------------------------------------------------------- per-softmax statistics sink
class SoftmaxStats:
    """Sums of P_max and H of softmax(l / tau) per (tau, layer) over every logit row reported."""

    def __init__(self, num_layers: int, taus: Sequence[float], layer0: bool = False) -> None:
        self.taus = [float(t) for t in taus]
        self.pmax = np.zeros((len(self.taus), num_layers))
        self.ent = np.zeros((len(self.taus), num_layers))
        self.rows = np.zeros(num_layers)
        self.layer0 = layer0
        self.q_sum: torch.Tensor | None = None  # [G] summed row quantile vectors (layer 0, tau=1)
        self.q_rows, self.logn_sum, self.pmax0_sum = 0, 0.0, 0.0

    @torch.no_grad()
    def add(self, layer: int, logits: torch.Tensor, grid: int | None = None) -> None:
        """logits [..., Lk]: tau=1(-equivalent) logits, -inf where masked; one row per softmax."""
        rows = logits.reshape(-1, logits.shape[-1]).float()  # [R, Lk]
        rows = rows[torch.isfinite(rows).any(-1)]  # drop rows with no key (padding queries)
        self.rows[layer] += rows.shape[0]
        for i, tau in enumerate(self.taus):
            lp = torch.log_softmax(rows / tau, dim=-1)  # [R, Lk]
            p = lp.exp()
            self.pmax[i, layer] += float(p.max(-1).values.sum())
            self.ent[i, layer] -= float(torch.where(p > 0, p * lp, torch.zeros_like(p)).sum())
        if self.layer0 and layer == 0:
            self._add_quantiles(rows, grid or rows.shape[-1])

    def _add_quantiles(self, rows: torch.Tensor, G: int) -> None:
        valid = torch.isfinite(rows)  # [R, Lk]
        n = valid.sum(-1)  # [R]
        keep = n >= 2
        rows, valid, n = rows[keep], valid[keep], n[keep]
        if rows.shape[0] == 0:
            return
        nf = n.to(rows.dtype)
        mean = torch.where(valid, rows, torch.zeros_like(rows)).sum(-1) / nf  # [R]
        c = torch.where(valid, rows - mean[:, None], torch.full_like(rows, math.inf))
        s = c.sort(-1).values  # [R, Lk] valid ascending, +inf after them
        u = (torch.arange(G, dtype=rows.dtype, device=rows.device) + 0.5) / G  # [G]
        pos = torch.minimum((u[None] * nf[:, None] - 0.5).clamp(min=0), (nf - 1)[:, None])  # [R, G]
        lo = pos.floor().long()
        hi = torch.minimum(lo + 1, (n - 1)[:, None])
        w = pos - lo.to(pos.dtype)
        q = s.gather(-1, lo) * (1 - w) + s.gather(-1, hi) * w  # [R, G]
        self.q_sum = q.sum(0) if self.q_sum is None else self.q_sum + q.sum(0)
        self.q_rows += rows.shape[0]
        self.logn_sum += float(torch.log(nf).sum())
        self.pmax0_sum += float(torch.softmax(rows, -1).max(-1).values.sum())

    def summary(self) -> dict:
        """Means over all softmaxes (Algorithm 1's avg(s)), per layer too, and layer-0 stats."""
        total = max(float(self.rows.sum()), 1.0)
        out = {
            "taus": self.taus,
            "pmax": [float(v) for v in self.pmax.sum(1) / total],
            "entropy": [float(v) for v in self.ent.sum(1) / total],
            "per_layer_pmax": (self.pmax / np.maximum(self.rows, 1)).round(6).tolist(),
            "per_layer_entropy": (self.ent / np.maximum(self.rows, 1)).round(6).tolist(),
            "softmaxes": int(total),
        }
        if self.layer0 and self.q_rows:
            avg = self.q_sum / self.q_rows  # [G] the average logit vector (Assumption 5.1)
            avg = avg - avg.mean()
            out["layer0"] = {
                "sigma": float(avg.pow(2).mean().sqrt()),
                "l_max": float(avg.max()),
                "length": float(math.exp(self.logn_sum / self.q_rows)),
                "pmax": self.pmax0_sum / self.q_rows,
                "rows": int(self.q_rows),
            }
        return out


# ---------------------------------------------------------------- our GPT as an alignment target
class GPTTarget:
    """Our ``GPT`` as an alignment target: per-layer temperature and the logits sink are options
    of its attention (``AttnOptions.temperature``, ``AttnOptions.logits_sink``)."""

    def __init__(self, model, opts: AttnOptions | None = None, block_size: int = 256) -> None:
        self.model = model
        self.opts = opts or getattr(model, "attn_opts", None) or AttnOptions()
        self.block_size = int(block_size)
        self.num_layers = len(model.blocks)
        self._active: AttnOptions | None = None

    @contextmanager
    def scope(self, tau: float | Sequence[float] = 1.0, sink: SoftmaxStats | None = None):
        """Within the block the model's default attention options carry each layer's tau (an
        inner scope wins over an outer one); with a ``sink``, every layer's tau = 1 logits reach
        it from the reference attention path, ``block_size`` query rows at a time."""
        taus = layer_temperatures(tau, self.num_layers)
        kw: dict = {"temperature": tuple(taus), "logits_sink": None}
        if sink is not None:
            other = {self.model.scheme.for_layer(i).replaces_softmax for i in range(self.num_layers)} - {""}
            if other:
                raise UserError(f"temperature alignment reads softmax rows, but this model's attention uses "
                                f"{'; '.join(sorted(other))} instead; align a softmax scheme")
            kw.update(logits_sink=lambda layer, lg, keys: sink.add(layer, lg, grid=keys),
                      block_size=self.block_size)
        prev, prev_active = self.model.attn_opts, self._active
        self._active = self.model.attn_opts = replace(self.opts, **kw)
        try:
            yield self
        finally:
            self.model.attn_opts, self._active = prev, prev_active

    @torch.no_grad()
    def forward(self, ids: torch.Tensor):
        return self.model(ids, opts=self._active or self.opts)


@contextmanager
def temperature_scope(model, tau: float | Sequence[float]):
    """Run ``model`` (our GPT) with softmax temperature tau in every layer, or one tau per layer."""
    if not hasattr(model, "blocks"):
        raise UserError(f"temperature_scope needs an extrapolab GPT, got {type(model).__name__}")
    with GPTTarget(model).scope(tau):
        yield model


def as_target(model, **kw):
    if hasattr(model, "scope") and hasattr(model, "num_layers"):
        return model
    if hasattr(model, "blocks"):
        return GPTTarget(model, **kw)
    try:
        if is_t5(model):
            return T5Target(model)
    except ImportError:
        pass
    raise UserError(f"cannot align a {type(model).__name__}; pass an extrapolab GPT or a Hugging Face T5 model")

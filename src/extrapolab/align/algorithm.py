"""T1 softmax-temperature attention alignment (thesis ch. 5: §5.4, Algorithm 1, Props. 5.1/5.2, §5.10).

Algorithm 1: FINDS(tau, M) sets *all* softmaxes to tau, runs the model and averages a statistic
over every softmax it performed -- layers x heads x query positions (N = R·H·L logit vectors,
§5.4), each vector counted once -- where M is the maximum probability P_max = max Softmax_tau(l)
or the entropy H(Softmax_tau(l)). S_tr = FINDS(1) on length-L_tr inputs; tau_ex is the grid value
(1.0, 0.95, ..., 0.5) whose FINDS(tau_ex) on length-L_ex inputs is closest to S_tr. The hook
that sets tau and the per-softmax statistics live in :mod:`.temperature`; the table and the
figure in :mod:`.align_plots` (both re-exported here).

``propagate=True`` (default, Algorithm 1 as written) runs one forward per grid tau, so deeper
layers see inputs changed by the sharper shallower ones; ``propagate=False`` re-temperatures the
tau=1 logits of each softmax only (one forward, an approximation).

Props. 5.1/5.2 (§5.6, proofs §5.10.2-3) use layer 0 only: the average logit vector is
~N(0, sigma^2) (Assumption 5.1); sigma^2 is its variance. Prop. 5.1: A tau^2 - B tau + C = 0 with
A = log L_ex + log P_tr, B = log L_tr + log P_tr + sigma_tr^2/2, C = sigma_ex^2/2; the larger root.
Prop. 5.2: tau = sigma_ex / sqrt(sigma_tr^2 + 2 log(L_ex/L_tr)). P_tr is layer 0's average max
probability at L_tr; L is the effective row length (see :mod:`.temperature`).
Length-only rule (Yao et al. 2021; Su 2021): tau = log L_tr / log L_ex.

The chosen temperatures are stored as ``<run>/temperature.json`` (:func:`save_temperature`) and
read back per length by :func:`load_temperature` (``extrapolab eval --temperature auto``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..io import UserError, atomic_write_json
from .rules import GRID, MODES, canonical_rule, length_rule, pick_tau, prop51_tau, prop52_tau
from .temperature import SoftmaxStats, as_target

TEMPERATURE_FILE = "temperature.json"


# ---------------------------------------------------------------- Algorithm 1
def _batches(segments, batch_size: int, device) -> Iterator[torch.Tensor]:
    segs = torch.as_tensor(np.asarray(segments), dtype=torch.long)
    if segs.dim() == 1:
        segs = segs[None]
    for i in range(0, segs.shape[0], batch_size):
        yield segs[i:i + batch_size].to(device)  # [b, L]


def collect_logit_stats(model, segments, taus: Sequence[float] = GRID, *, propagate: bool = True,
                        layer0: bool = False, batch_size: int = 1, block_size: int = 256) -> dict:
    """FINDS(tau, M) of Algorithm 1 for every tau in ``taus`` and both modes, on ``segments``
    ([N, L] token ids). Returns ``{"taus", "pmax", "entropy", per-layer means, "layer0"?}``."""
    target = as_target(model, block_size=block_size) if hasattr(model, "blocks") else as_target(model)
    dev = next(target.model.parameters()).device
    if not propagate:
        sink = SoftmaxStats(target.num_layers, taus, layer0)
        with target.scope(1.0, sink):
            for ids in _batches(segments, batch_size, dev):
                target.forward(ids)
        return sink.summary()
    merged: dict = {"taus": [float(t) for t in taus], "pmax": [], "entropy": [],
                    "per_layer_pmax": [], "per_layer_entropy": []}
    run = [float(t) for t in taus] + ([] if (not layer0 or 1.0 in taus) else [1.0])
    for tau in run:
        sink = SoftmaxStats(target.num_layers, [tau], layer0 and tau == 1.0)
        with target.scope(tau, sink):
            for ids in _batches(segments, batch_size, dev):
                target.forward(ids)
        s = sink.summary()
        if "layer0" in s:
            merged["layer0"] = s["layer0"]
        if tau in merged["taus"] and len(merged["pmax"]) < len(merged["taus"]):
            for key in ("pmax", "entropy", "per_layer_pmax", "per_layer_entropy"):
                merged[key].append(s[key][0])
            merged["softmaxes"] = s["softmaxes"]
    return merged


# ---------------------------------------------------------------- align(): all rules at every L_ex
def segments_at(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)  # [N, L]


def window_starts(tokens, train_length: int, lengths: Sequence[int], n_segments: int, seed: int):
    """(tokens as 1-D, sorted lengths, seeded window starts): the L_tr windows are prefixes of the L_ex ones."""
    tokens = np.asarray(tokens).reshape(-1)
    lengths = sorted({int(L) for L in lengths})
    train_length = int(train_length)
    if train_length < 2 or not lengths or min(lengths) < 2:
        raise UserError(f"lengths must be >= 2 (train_length={train_length}, lengths={lengths})")
    need = max(lengths + [train_length])
    if tokens.size < need:
        raise UserError(f"only {tokens.size} tokens to align on but the longest length is {need}; "
                        "pass a bigger split or smaller --lengths")
    rng = np.random.default_rng(seed)
    return tokens, lengths, np.sort(rng.integers(0, tokens.size - need + 1, size=int(n_segments)))


def check_modes(modes: Sequence[str]) -> list[str]:
    modes = [canonical_rule(m) for m in modes]
    if any(m not in MODES for m in modes):
        raise UserError(f"alignment modes are {', '.join(MODES)}; got {', '.join(modes)}")
    return modes


def closed_form_taus(res: dict, L: int, l0_tr: dict | None, l0: dict | None) -> None:
    """The length rule and Props. 5.1/5.2 (from layer 0's statistics) at ``L`` into ``res["tau"]``."""
    key = str(L)
    res["tau"]["length"][key] = length_rule(res["train_length"], L)
    if l0 and l0_tr:
        res["tau"]["prop51"][key] = prop51_tau(l0_tr["pmax"], l0_tr["sigma"], l0["sigma"], l0_tr["length"], l0["length"])
        res["tau"]["prop52"][key] = prop52_tau(l0_tr["sigma"], l0["sigma"], l0_tr["length"], l0["length"])


def align(model, tokens, train_length: int, lengths: Sequence[int], modes: Sequence[str] = MODES, *,
          n_segments: int = 2, taus: Sequence[float] = GRID, propagate: bool = True, batch_size: int = 1,
          block_size: int = 256, seed: int = 0, progress: Callable[[str], None] | None = None) -> dict:
    """Run Algorithm 1 (and Props. 5.1/5.2, the length rule) at every L_ex in ``lengths``.

    ``tokens``: a 1-D token stream (e.g. the test split); ``n_segments`` windows per length start at
    the same seeded offsets, so the L_tr windows are prefixes of the L_ex ones. Returns a JSON-able
    dict: ``tau[rule][str(L)]`` for rules pmax, entropy, length, prop51, prop52, and the statistics.
    """
    modes = check_modes(modes)
    train_length = int(train_length)
    tokens, lengths, starts = window_starts(tokens, train_length, lengths, n_segments, seed)
    say = progress or (lambda _m: None)
    say(f"FINDS(1) at L_tr={train_length}")
    tr = collect_logit_stats(model, segments_at(tokens, starts, train_length), [1.0], propagate=True,
                             layer0=True, batch_size=batch_size, block_size=block_size)
    s_tr = {m: tr[m][0] for m in MODES}
    res = {"version": 1, "train_length": train_length, "lengths": lengths, "grid": [float(t) for t in taus],
           "modes": modes, "propagate": propagate, "segments": int(n_segments), "seed": int(seed),
           "tau": {r: {} for r in modes + ["length", "prop51", "prop52"]},
           "stats": {"train": {**s_tr, "layer0": tr.get("layer0"), "per_layer_pmax": tr["per_layer_pmax"][0],
                               "per_layer_entropy": tr["per_layer_entropy"][0]}, "ex": {}}}
    for L in lengths:
        say(f"FINDS(tau) for {len(taus)} temperatures at L_ex={L}")
        ex = collect_logit_stats(model, segments_at(tokens, starts, L), taus, propagate=propagate, layer0=True,
                                 batch_size=batch_size, block_size=block_size)
        key = str(L)
        for m in modes:
            res["tau"][m][key] = pick_tau(s_tr[m], list(taus), ex[m])
        closed_form_taus(res, L, tr.get("layer0"), ex.get("layer0"))
        res["stats"]["ex"][key] = {"pmax": ex["pmax"], "entropy": ex["entropy"], "layer0": ex.get("layer0")}
    return res


# ---------------------------------------------------------------- temperature.json
def save_temperature(run_dir: str | Path, res: dict) -> Path:
    path = Path(run_dir) / TEMPERATURE_FILE
    atomic_write_json(path, res)
    return path


def load_temperature(run_dir: str | Path, length: int, mode: str = "pmax") -> float:
    """tau for ``length`` from ``<run_dir>/temperature.json`` (written by ``extrapolab align``).

    length <= L_tr gives 1.0; a length between two aligned ones is interpolated linearly in log L;
    the ``length`` rule needs no stored value; anything else outside the aligned range is an error.
    """
    import json

    rule = canonical_rule(mode)
    if rule == "none":
        return 1.0
    path = Path(run_dir) / TEMPERATURE_FILE
    try:
        res = json.loads(path.read_text())
        train_length, table = int(res["train_length"]), res["tau"]
    except FileNotFoundError:
        raise UserError(f"no {TEMPERATURE_FILE} in {run_dir}; run `extrapolab align {run_dir} "
                        "--lengths ...` first") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is corrupt; delete it and re-run `extrapolab align {run_dir}`") from None
    length = int(length)
    if length <= train_length:
        return 1.0
    if rule == "length":
        return length_rule(train_length, length)
    row = {int(k): float(v) for k, v in table.get(rule, {}).items() if v is not None and math.isfinite(float(v))}
    if length in row:
        return row[length]
    below = [L for L in row if L < length]
    above = [L for L in row if L > length]
    if not below or not above:
        have = ", ".join(map(str, sorted(row))) or "none"
        raise UserError(f"no {rule} temperature for length {length} in {path} (aligned lengths: {have}); "
                        f"re-run `extrapolab align {run_dir} --lengths {length}`")
    lo, hi = max(below), min(above)
    w = (math.log(length) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return row[lo] + w * (row[hi] - row[lo])

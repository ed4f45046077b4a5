"""A3: pictures of the temporal bias.

* Sandwich paper (Chi, Fan, Rudnicky 2023) Fig. 8: the bias matrix of eq. (6) (c_h = 8, d̄ = 128);
  Fig. 9: its last row (m = 8192) with the least-squares log fit y = a·log(1 + |m-n|) + b
  (paper: a = -0.825, b = -0.8); Fig. 10: the last row for several d̄.
* Qin et al. 2024 Fig. 7: heat map of exp(bias) (the b_t of Theorem 0.4).
* Thesis §3.5.4, Figs. 3.2-3.4: learned kernels bias_h(k) per head, read from a model.
* Thesis §3.7.5, Fig. 3.6: effective length eff_h = min{k : bias_h(k) < -2} and the curve
  x -> Count{h : eff_h <= x} for x in 0..20480. The thesis' kernels satisfy bias(0) = 0; for a
  scheme with bias(0) != 0 (T5) we measure bias_h(k) - bias_h(0) (softmax is shift-invariant).
* FoX (Lin et al. 2025 §2): the bias depends on the text, so it is drawn from a trained model on a
  text: the per-token forget gate f_t per layer and head, and the last query's bias row
  Σ_{l=n+1..m} log f_l (``content_gates``, ``plot_gates``, ``gate_summary``).
* FIRE (Li et al. 2024 §3): the bias depends on the query position too (distances normalised by
  ψ(max(L, m))), so a "curve by distance" is the row of one query: ``distance_curve`` reads the row of
  the query at max_distance - 1 for schemes that are not ``relative``, and ``plot_query_curves`` draws
  the learned curve per layer and head at several query positions (``query_curves``).

Heat maps subsample positions (``max_points`` per axis) through ``scheme.bias`` for those
positions only, so an 8192 x 8192 picture never builds the full matrix.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import positional
from ..io import UserError
from ..positional.smoothed_sandwich import log_fit
from .common import new_figure, save_figure
from .theory import as_scheme, scheme_device

EFF_THRESHOLD = -2.0
EFF_MAX_DISTANCE = 20480


def _needs_bias(scheme) -> None:
    if not (scheme.has_bias and hasattr(scheme, "bias_from_distance")):
        raise UserError(f"scheme {scheme.name!r} has no additive relative bias to draw; pick a bias scheme "
                        "(alibi, sandwich, kerple-log, t5, qin-type1, ...)")


def distance_curve(scheme, max_distance: int, layer: int = 0) -> np.ndarray:
    """bias_h(k) for k = 0..max_distance-1 in float64: [H, K] (-inf where masked). For a scheme whose bias
    also depends on the query position (not ``relative``: FIRE), the row of the query at max_distance - 1."""
    _needs_bias(scheme)
    k = np.arange(int(max_distance))
    if hasattr(scheme, "curve"):
        return np.asarray(scheme.curve(k), dtype=np.float64)
    with torch.no_grad():
        kt = torch.from_numpy(k).to(scheme_device(scheme))
        if not scheme.relative:
            return scheme.bias(kt[-1:], kt, layer)[:, 0].flip(-1).detach().double().cpu().numpy()  # [H, K] by distance
        return scheme.bias_from_distance(kt, layer).detach().double().cpu().numpy()


def query_positions(scheme, length: int) -> list[int]:
    """Query positions to draw a position-dependent curve at: a few fractions of ``length`` and, for a scheme
    with a learned threshold L (FIRE), L itself and 2L (where its normaliser starts to move)."""
    pts = {max(1, int(length) // 8), max(1, int(length) // 2), int(length) - 1}
    rows = scheme.toeplitz_rows() if hasattr(scheme, "toeplitz_rows") else None
    if rows is not None:
        L = int(float(rows[0]))
        pts |= {x for x in (L, 2 * L) if 0 < x < int(length)}
    return sorted(pts)


def query_curves(scheme, positions, layer: int = 0) -> dict[int, np.ndarray]:
    """{m: bias of the query at position m against keys m, m-1, ..., 0, i.e. by distance 0..m: [H, m+1]}."""
    out = {}
    dev = scheme_device(scheme)
    with torch.no_grad():
        for m in positions:
            keys = torch.arange(int(m) + 1, device=dev)
            out[int(m)] = scheme.bias(keys[-1:], keys, layer)[:, 0].flip(-1).detach().double().cpu().numpy()
    return out


def plot_query_curves(scheme, length: int, path_stem, *, heads=None, layers=None,
                      title: str | None = None) -> tuple[list[str], dict]:
    """The learned bias by distance at several query positions (one panel per layer and head, one line per
    query position): FIRE's progressive interpolation shows as curves that stretch with the query position
    beyond L. Returns (files, {layer: {m: [H, m+1] list}})."""
    scheme = as_scheme(scheme)
    _needs_bias(scheme)
    heads = _head_list(scheme, heads)
    nlayers = getattr(scheme, "layers", 1) if scheme.layer_dependent else 1
    layers = list(range(nlayers)) if layers is None else [int(x) for x in layers]
    pos = query_positions(scheme, length)
    fig, axes = new_figure(3.0 * len(heads), 2.4 * len(layers), ncols=len(heads), nrows=len(layers))
    axes = np.atleast_1d(axes).reshape(len(layers), len(heads))
    data = {}
    for r, layer in enumerate(layers):
        curves = query_curves(scheme, pos, layer)
        data[layer] = {m: c.tolist() for m, c in curves.items()}
        for col, h in enumerate(heads):
            ax = axes[r, col]
            for m, c in curves.items():
                ax.plot(np.arange(c.shape[1]), c[h], lw=0.9, label=f"m = {m}")
            ax.set_title(f"layer {layer}, head {h}", fontsize=8)
            ax.set_xlabel("distance m - n", fontsize=7)
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(title or f"{scheme.name}: bias by distance at several query positions m")
    return save_figure(fig, path_stem), data


def bias_grid(scheme, length: int, layer: int = 0, max_points: int = 512):
    """(positions [P], bias [H, P, P]) on a subsampled grid of query/key positions 0..length-1."""
    _needs_bias(scheme)
    stride = max(1, math.ceil(int(length) / int(max_points)))
    pos = torch.arange(0, int(length), stride, device=scheme_device(scheme))
    with torch.no_grad():
        b = scheme.bias(pos, pos, layer)  # [H, P, P], -inf above the diagonal
    return pos.cpu().numpy(), b.detach().double().cpu().numpy()


def last_row(scheme, length: int, layer: int = 0) -> np.ndarray:
    """Bias of the last query m = length-1 against keys n = 0..length-1: [H, length]."""
    return distance_curve(scheme, length, layer)[:, ::-1]


def _head_list(scheme, heads) -> list[int]:
    heads = list(range(scheme.num_heads)) if heads is None else [int(h) for h in heads]
    for h in heads:
        if not 0 <= h < scheme.num_heads:
            raise UserError(f"head {h} out of range 0..{scheme.num_heads - 1}")
    return heads


def plot_bias_heatmap(scheme, length: int, path_stem, *, heads=None, exp: bool = False, layer: int = 0,
                      max_points: int = 512, title: str | None = None) -> list[str]:
    """Heat map of bias (Sandwich Fig. 8) or exp(bias) (Qin Fig. 7) per head; masked cells blank."""
    scheme = as_scheme(scheme)
    heads = _head_list(scheme, heads)
    pos, b = bias_grid(scheme, length, layer, max_points)
    ncols = min(4, len(heads))
    nrows = math.ceil(len(heads) / ncols)
    fig, axes = new_figure(3.2 * ncols, 2.9 * nrows, ncols=ncols, nrows=nrows)
    axes = np.atleast_1d(axes).ravel()
    for ax, h in zip(axes, heads):
        img = np.exp(b[h]) if exp else np.where(np.isfinite(b[h]), b[h], np.nan)
        img = np.where(np.triu(np.ones_like(img, dtype=bool), 1), np.nan, img)
        extent = (0, int(length) - 1, int(length) - 1, 0)
        im = ax.imshow(img, cmap="viridis", extent=extent, interpolation="nearest")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_title(f"head {h}", fontsize=8)
        ax.set_xlabel("key n", fontsize=7)
        ax.set_ylabel("query m", fontsize=7)
    for ax in axes[len(heads):]:
        ax.axis("off")
    fig.suptitle(title or f"{scheme.name}: {'exp(bias)' if exp else 'bias'}, L = {length}")
    return save_figure(fig, path_stem)


def plot_last_row_fit(scheme, length: int, path_stem, *, heads=None, layer: int = 0,
                      fit_start: int = 1) -> tuple[list[str], list[dict]]:
    """Last row of the bias matrix and its LSQ log fit a·log(1+k)+b over k >= fit_start (Fig. 9)."""
    scheme = as_scheme(scheme)
    heads = _head_list(scheme, heads)
    curve = distance_curve(scheme, length, layer)  # [H, L]
    k = np.arange(int(length))
    fits = []
    fig, ax = new_figure()
    n = k[::-1]  # key index of distance k for the query m = L-1
    for h in heads:
        y = curve[h]
        ok = np.isfinite(y) & (k >= fit_start)
        line = ax.plot(n, np.where(np.isfinite(y), y, np.nan), lw=1, label=f"head {h}")[0]
        if ok.sum() >= 2:
            a, b = log_fit(k[ok], y[ok])
            resid = y[ok] - (a * np.log1p(k[ok]) + b)
            fits.append({"head": h, "a": a, "b": b, "rmse": float(np.sqrt(np.mean(resid**2))),
                         "fit_distances": [int(k[ok].min()), int(k[ok].max())]})
            ax.plot(n, a * np.log1p(k) + b, ls="--", color=line.get_color(), lw=1,
                    label=f"fit {a:.3f}·log(1+|m-n|){b:+.3f}")
    ax.set_xlabel(f"key position n (query m = {int(length) - 1})")
    ax.set_ylabel("bias")
    ax.set_title(f"{scheme.name}: last row and least-squares log fit")
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem), fits


def plot_dbar_sweep(path_stem, *, dbars=(32, 64, 128, 256, 512), ratio: float = 8.0, length: int = 8192,
                    convention: str = "appendix") -> tuple[list[str], dict]:
    """Sandwich Fig. 10: the last row of eq. (6) for several d̄ at one compression ratio."""
    fig, ax = new_figure()
    out = {}
    n = np.arange(int(length))[::-1]
    for d in dbars:
        s = positional.build("sandwich", num_heads=1, dbar=int(d), ratios=[float(ratio)], convention=convention)
        y = distance_curve(s, length)[0]
        out[int(d)] = {"bias_at_distance": {str(k): float(y[k]) for k in (1, 10, 100, 1000) if k < length},
                       "min": float(y.min())}
        ax.plot(n, y, lw=1, label=f"d̄ = {d}")
    ax.set_xlabel(f"key position n (query m = {int(length) - 1})")
    ax.set_ylabel(f"Sandwich bias (c = {ratio:g})")
    ax.set_title("Sandwich: effect of d̄ (Fig. 10)")
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem), out


def plot_kernels(scheme, path_stem, *, max_distance: int = 2048, layer: int = 0,
                 title: str | None = None) -> list[str]:
    """Learned kernel bias_h(k) per head vs distance (thesis Figs. 3.2-3.4)."""
    scheme = as_scheme(scheme)
    curve = distance_curve(scheme, max_distance, layer)
    fig, ax = new_figure()
    k = np.arange(int(max_distance))
    for h in range(curve.shape[0]):
        ax.plot(k, np.where(np.isfinite(curve[h]), curve[h], np.nan), lw=1, label=f"head {h}")
    ax.set_xlabel("|m - n|")
    ax.set_ylabel("bias")
    ax.set_title(title or f"{scheme.name}: kernel per head")
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path_stem)


def effective_lengths(scheme, *, threshold: float = EFF_THRESHOLD, max_distance: int = EFF_MAX_DISTANCE,
                      layer: int = 0) -> list[int | None]:
    """eff_h = min{k : bias_h(k) - bias_h(0) < threshold} (thesis §3.7.5); None if not within range."""
    curve = distance_curve(as_scheme(scheme), int(max_distance) + 1, layer)  # [H, K+1]
    rel = curve - curve[:, :1]
    out = []
    for h in range(rel.shape[0]):
        hit = np.nonzero(rel[h] < threshold)[0]
        out.append(int(hit[0]) if hit.size else None)
    return out


def effective_length_counts(effs, max_distance: int = EFF_MAX_DISTANCE) -> np.ndarray:
    """y[x] = Count{h : eff_h <= x} for x = 0..max_distance (thesis Fig. 3.6)."""
    x = np.arange(int(max_distance) + 1)
    e = np.array([v for v in effs if v is not None], dtype=np.int64)
    return (e[None, :] <= x[:, None]).sum(1) if e.size else np.zeros_like(x)


def plot_effective_length(curves: dict, path_stem, *, max_distance: int = EFF_MAX_DISTANCE) -> list[str]:
    """Fig. 3.6: one count curve per entry of ``curves`` (name -> list of eff_h)."""
    fig, ax = new_figure()
    for name, effs in curves.items():
        ax.step(np.arange(int(max_distance) + 1), effective_length_counts(effs, max_distance),
                where="post", label=f"{name} ({len(effs)} heads)")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("|m - n|")
    ax.set_ylabel("heads with effective length <= |m - n|")
    ax.set_title("Effective length (first k with bias < -2)")
    ax.legend(fontsize=7)
    return save_figure(fig, path_stem)


# ---- positions from content: FoX's per-token forget gate -------------------------------------------
def content_gates(model, segment) -> dict:
    """FoX's gates on one text: per layer, f [H, L] (one segment of token ids [L]) and the bias
    D(m, n) = Σ_{l=n+1..m} log f_l of the last query m = L - 1 against every key, [H, L] (Lin et al.
    2025 §2). Layers whose scheme has no positions from content are left out."""
    from .attn import LayerCapture, capture_qkv
    from .common import as_segments

    seg = as_segments(segment)[:1]  # [1, L]
    dev = next(model.parameters()).device
    caps = capture_qkv(model, seg.to(dev))
    out = {}
    for layer, cap in enumerate(caps):
        scheme = model.scheme.for_layer(layer)
        if not isinstance(cap, LayerCapture) or not hasattr(scheme, "log_gate"):
            continue
        with torch.no_grad():
            logf = scheme.log_gate(cap.hidden, layer)[0].double()  # [H, L]
        total = logf.flip(-1).cumsum(-1).flip(-1)  # Σ_{l >= n} log f_l
        last_row = torch.cat([total[:, 1:], torch.zeros_like(total[:, :1])], -1)  # Σ_{l=n+1..L-1}: [H, L]
        out[layer] = {"gate": logf.exp().cpu().numpy(), "last_row": last_row.cpu().numpy()}
    if not out:
        raise UserError(f"scheme {model.scheme.name!r} has no forget gates to draw; this picture is for fox")
    return out


def gate_summary(gates: dict, threshold: float = EFF_THRESHOLD) -> dict:
    """Per layer and head: mean gate, and the effective length of the last row (first distance k with
    D(m, m - k) < threshold, the thesis' §3.7.5 reading applied to the content-dependent bias)."""
    res = {}
    for layer, g in gates.items():
        row = g["last_row"][:, ::-1]  # [H, L] by distance k = 0, 1, ...
        effs = [int(np.nonzero(r < threshold)[0][0]) if (r < threshold).any() else None for r in row]
        res[int(layer)] = {"mean_gate": g["gate"].mean(-1).round(4).tolist(), "effective_lengths": effs}
    return res


def plot_gates(gates: dict, path_stem, *, title: str | None = None) -> list[str]:
    """FoX's per-token gate f_t per head (one heat map per layer, tokens on x) and the last query's
    bias row per head against the key position."""
    layers = sorted(gates)
    fig, axes = new_figure(9.0, 2.2 * (len(layers) + 1), ncols=1, nrows=len(layers) + 1)
    axes = np.atleast_1d(axes).ravel()
    for ax, layer in zip(axes, layers):
        im = ax.imshow(gates[layer]["gate"], aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, shrink=0.8)
        ax.set_ylabel(f"layer {layer}\nhead", fontsize=7)
    axes[len(layers) - 1].set_xlabel("token position t (gate f_t)", fontsize=7)
    ax = axes[-1]
    for layer in layers:
        for h, row in enumerate(gates[layer]["last_row"]):
            ax.plot(np.arange(row.shape[0]), row, lw=0.8, label=f"L{layer} h{h}")
    ax.set_xlabel("key position n (query m = last token)", fontsize=7)
    ax.set_ylabel("Σ log f (bias)", fontsize=7)
    ax.legend(fontsize=5, ncol=4)
    fig.suptitle(title or "FoX forget gates and the last query's bias")
    return save_figure(fig, path_stem)

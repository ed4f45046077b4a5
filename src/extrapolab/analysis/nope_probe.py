"""A4, thesis Fig. 2.2 (§2.2, §2.8.1): a probe reads each token's position from a frozen random NoPE model.

Setup as in the thesis: the frozen random pre-LN TLM of §2.3 (``nope.random_tlm``; 12 layers,
d = 768, H = 12, L = 512, sigma = 0.02), random input vectors instead of token embeddings, and a
probe on the hidden state after l = 1..R layers followed by the final LayerNorm (Fig. 2.1). MAE of
the predicted position per position, against the midpoint baseline MAE L/4 (= 128 at L = 512).

The probe differs from the thesis' (a two-layer ReLU classifier over the L positions trained with
Adam, 5000 steps of batch 32; that took more than 36 minutes on one CPU core at this size): the
frozen model's hidden states are computed once without gradients and a *linear* probe is fitted
to them in closed form, ridge regression of the position m on phi(h) = [h, h∘h, 1]. The squares
are what a ReLU hidden layer gives the thesis' probe: Lemma 2.4 puts the position in the
per-dimension *variance* of LN(y_m), which no linear map of h alone can read (with random inputs
and no FFN, h is an odd function of the input, so E[w·h] = 0 at every m). Normal equations are
accumulated over batches in float64; the fit minimises ||Phi w - m||^2 + ridge·N·||w'||^2 (w'
excludes the intercept; N = fitted rows). Predictions are rounded and clipped to [0, L-1] before
the MAE, like the classifier's argmax. Held-out sequences (fresh random inputs) are evaluated.

Measured at the thesis' size (docs/results/nope-probe.md): this probe stays at the midpoint
baseline at every depth; the FFN output swamps the attention output after layer 1 and the
position is left in second-order structure that the thesis' MLP, trained on 160k sequences, can
learn and a linear fit on 16 sequences cannot.
"""
from __future__ import annotations

import numpy as np
import torch

from ..model.attention import AttnOptions
from .common import new_figure, save_figure
from .nope import random_tlm


def probe_features(h: torch.Tensor) -> torch.Tensor:
    """Hidden states [..., d] -> probe features [N, 2d + 1] (float64): h, h∘h and a constant 1."""
    h = h.reshape(-1, h.shape[-1]).double()  # [N, d]
    return torch.cat([h, h * h, torch.ones(h.shape[0], 1, dtype=h.dtype, device=h.device)], dim=1)  # [N, 2d+1]


class LinearProbe:
    """Ridge regression y ~ phi·w fitted from streamed batches through the normal equations."""

    def __init__(self, features: int) -> None:
        self.gram = torch.zeros(features, features, dtype=torch.float64)  # [p, p] Phi^T Phi
        self.rhs = torch.zeros(features, dtype=torch.float64)  # [p] Phi^T y
        self.rows = 0
        self.weight: torch.Tensor | None = None

    def add(self, phi: torch.Tensor, y: torch.Tensor) -> None:
        phi, y = phi.double().cpu(), y.double().cpu().reshape(-1)
        self.gram += phi.T @ phi  # [p, N] @ [N, p] -> [p, p]
        self.rhs += phi.T @ y  # [p, N] @ [N] -> [p]
        self.rows += phi.shape[0]

    def solve(self, ridge: float = 0.0) -> torch.Tensor:
        """w [p] minimising ||Phi w - y||^2 + ridge·N·||w[:-1]||^2 (the last feature, the 1, is free)."""
        penalty = torch.full((self.gram.shape[0],), float(ridge) * self.rows, dtype=torch.float64)
        penalty[-1] = 0.0
        a = self.gram + torch.diag(penalty)  # [p, p]
        self.weight = torch.linalg.lstsq(a, self.rhs[:, None], rcond=1e-12, driver="gelsd").solution[:, 0]  # [p]
        return self.weight

    def predict(self, phi: torch.Tensor) -> torch.Tensor:
        return phi.double().cpu() @ self.weight  # [N, p] @ [p] -> [N]


def hidden_states(model, x: torch.Tensor, opts: AttnOptions) -> list[torch.Tensor]:
    """ln_f of every block's output for inputs x [B, L, d]: one [B, L, d] tensor per layer."""
    outs: list = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: outs.append(model.ln_f(out[0]).detach()))
             for b in model.blocks]
    try:
        with torch.no_grad():
            model(torch.zeros(x.shape[:2], dtype=torch.long, device=x.device), inputs_embeds=x, opts=opts)
    finally:
        for h in hooks:
            h.remove()
    return outs


def position_probe(dim: int = 768, heads: int = 12, length: int = 512, sigma: float = 0.02, layers: int = 12,
                   train_samples: int = 16, eval_samples: int = 8, batch: int = 4, ridge: float = 1e-3, seed: int = 0,
                   device="cpu") -> dict:
    """Fig. 2.2: MAE per position of a closed-form linear probe after 1..``layers`` layers.

    ``train_samples`` random sequences (L rows each) fit the probes, ``eval_samples`` fresh ones
    measure them. One forward pass per batch serves every layer.
    """
    model = random_tlm(dim, heads, layers, sigma, length, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 2)
    opts = AttnOptions(impl="sdpa")
    target = torch.arange(length, dtype=torch.float64)  # [L]
    probes = [LinearProbe(2 * dim + 1) for _ in range(layers)]

    def batches(n: int):
        done = 0
        while done < n:
            b = min(batch, n - done)
            x = (torch.randn(b, length, dim, generator=gen) * sigma).to(device)  # [B, L, d], drawn on the CPU
            yield b, hidden_states(model, x, opts)
            done += b

    for b, hs in batches(train_samples):
        for probe, h in zip(probes, hs):
            probe.add(probe_features(h), target.repeat(b))
    for probe in probes:
        probe.solve(ridge)
    err = np.zeros((layers, length))
    for b, hs in batches(eval_samples):
        for layer, (probe, h) in enumerate(zip(probes, hs)):
            pred = probe.predict(probe_features(h)).round().clamp(0, length - 1).view(b, length)  # [B, L]
            err[layer] += (pred - target).abs().sum(0).numpy()
    mae = err / eval_samples
    return {"dim": dim, "heads": heads, "length": length, "sigma": sigma, "ridge": ridge,
            "train_samples": train_samples, "eval_samples": eval_samples, "probe": "linear on [h, h*h, 1]",
            "mae_per_position": mae, "mae_per_layer": mae.mean(1), "baseline_mae": length / 4}


def plot_probe(res: dict, path_stem, variance: dict | None = None) -> list[str]:
    """Fig. 2.2 (probe MAE per position for 1..R layers) beside Fig. 2.4 (layer-0 Var(o_m), Lemma 2.3)."""
    fig, axes = new_figure(width=11 if variance else 6.4, ncols=2 if variance else 1)
    ax = axes[0] if variance else axes
    mae = np.asarray(res["mae_per_position"])
    for li in range(mae.shape[0]):
        ax.plot(np.arange(mae.shape[1]), mae[li], lw=1, label=f"{li + 1} layer(s): MAE {mae[li].mean():.1f}")
    ax.axhline(res["baseline_mae"], color="gray", ls="--", lw=1, label="predict the midpoint")
    ax.set_xlabel("position")
    ax.set_ylabel("MAE of the predicted position")
    ax.set_title(f"Linear position probe, frozen random NoPE model (L = {res['length']})")
    ax.legend(fontsize=6)
    if variance:
        ax = axes[1]
        ax.loglog(variance["positions"], variance["variance"][0], lw=1,
                  label=f"simulation, layer 0 (slope {variance['fits'][0]['slope']:.2f})")
        ax.loglog(variance["positions"], variance["theory"], ls="--", lw=1, label="d²σ⁴/m (Lemma 2.3)")
        ax.set_xlabel("position m")
        ax.set_ylabel("Var(o_m)")
        ax.set_title("why: the attention output's variance falls as 1/m")
        ax.legend(fontsize=6)
    return save_figure(fig, path_stem)

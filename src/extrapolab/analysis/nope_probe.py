"""A4, thesis Fig. 2.2 (§2.2, §2.8.1): a probe reads each token's position from a frozen random NoPE model.

Setup as in the thesis: the frozen random pre-LN TLM of §2.3 (``nope.random_tlm``; 12 layers,
d = 768, H = 12, L = 512, sigma = 0.02), random input vectors instead of token embeddings, and a
probe on the hidden state after l = 1..R layers followed by the final LayerNorm (Fig. 2.1; §2.3.4
analyses LN(y_m), so the probe reads after the final LN). MAE of the predicted position per
position on held-out sequences, against the midpoint baseline MAE L/4 (= 128 at L = 512).

Default probe (``kind="mlp"``): the thesis' two-layer ReLU probe trained with Adam, lr 1e-3
(§2.8.1), but on hidden states computed ONCE without gradients for ``train_samples`` sequences and
reused at every step (the thesis draws fresh sequences: 5000 steps x 32 = 160,000 sequences, out
of a CPU budget). The model is run layer by layer over all sequences, so one layer's states are in
memory at a time. Differences, each for the CPU budget: the probe regresses log(1 + m) (one output,
MSE) instead of classifying over the L positions, and reads the states PCA-whitened with the
training set's mean and covariance (Lemma 2.3/2.4 put the position in the *second-order*
structure of LN(y_m): cov(o_m) = (W_o W_v)(W_o W_v)^T / m is anisotropic while x_m is isotropic, so
the position is in the energy ratios along the eigen-directions; whitening makes those directions
equally scaled for the ReLU units, which measure |w·h|).

``kind="linear"``: the earlier closed-form ridge regression of m on phi(h) = [h, h∘h, 1] (normal
equations accumulated in float64; ||Phi w - m||^2 + ridge·N·||w'||^2, w' without the intercept).
The squares read the variance only along the coordinate axes, where Lemma 2.4's per-dimension
differences are ~sqrt(4/d) = 7%; it stays at the midpoint baseline. Neither reproduces Fig. 2.2 at
the thesis size on 96-128 cached sequences (docs/results/nope-probe.md: the mlp probe's MAE is
105-141 against the midpoint's 128, lowest at 1-3 layers, not falling with depth as in the thesis).

Predictions are rounded and clipped to [0, L-1] before the MAE, like a classifier's argmax.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..io import UserError
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

class MLPProbe(nn.Module):
    """The thesis' two-layer ReLU probe (§2.8.1) on PCA-whitened states, regressing log(1 + m)."""

    def __init__(self, dim: int, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("white", torch.eye(dim))
        self.register_buffer("target", torch.tensor([0.0, 1.0]))  # mean, std of log(1 + m)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, d] -> predicted log(1 + m) [N]."""
        z = self.net((h - self.mean) @ self.white)[:, 0]  # [N, d] @ [d, d] -> [N, d] -> [N]
        return z * self.target[1] + self.target[0]

    def fit(self, h: torch.Tensor, m: torch.Tensor, steps: int = 700, batch: int = 512, lr: float = 1e-3,
            seed: int = 0) -> list[float]:
        """Whitening from h [N, d], then Adam on minibatches of rows; returns the loss per step."""
        h64 = h.double()
        mean = h64.mean(0)  # [d]
        evals, evecs = torch.linalg.eigh((h64 - mean).T @ (h64 - mean) / h.shape[0])  # [d], [d, d]
        # LN outputs sum to zero: one eigenvalue is ~0; clamp it instead of blowing it up
        scale = evals.clamp_min(1e-6 * float(evals.max())).rsqrt()
        self.mean.copy_(mean.float())
        self.white.copy_((evecs * scale).float())  # [d, d]: columns eigvec_i / sqrt(lambda_i)
        target = torch.log1p(m.float())
        self.target.copy_(torch.stack([target.mean(), target.std()]))  # the net regresses the z-score
        target = (target - self.target[0]) / self.target[1]
        z = (h.float() - self.mean) @ self.white  # [N, d] @ [d, d]: whitened once, not at every step
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for lin in (self.net[0], self.net[2]):
                lin.reset_parameters()
        opt = torch.optim.Adam(self.net.parameters(), lr=lr)
        losses = []
        with torch.enable_grad():
            for _ in range(steps):
                idx = torch.randint(0, h.shape[0], (batch,), generator=gen)
                loss = ((self.net(z[idx])[:, 0] - target[idx]) ** 2).mean()  # [batch, d] -> [batch]
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        return losses

    @torch.no_grad()
    def predict(self, h: torch.Tensor) -> torch.Tensor:
        """Predicted position m (float64, not rounded) for h [N, d]."""
        return torch.expm1(self(h.float()).double())


def _advance(model, block, x: torch.Tensor, opts: AttnOptions, batch: int) -> torch.Tensor:
    """One frozen block over all sequences x [N, L, d], ``batch`` sequences at a time (in place)."""
    pos = torch.arange(x.shape[1], device=x.device)
    with torch.no_grad():
        for s in range(0, x.shape[0], batch):
            x[s:s + batch] = block(x[s:s + batch], pos, model.scheme, opts)[0]  # [b, L, d]
    return x


def _fit_predict(kind, h_tr, h_ev, target, length, *, ridge, steps, hidden, seed) -> torch.Tensor:
    """Fit one probe on h_tr [N, L, d]; rounded, clipped predictions [M, L] for h_ev [M, L, d]."""
    d = h_tr.shape[-1]
    n, m = h_tr.shape[0], h_ev.shape[0]
    if kind == "linear":
        probe = LinearProbe(2 * d + 1)
        for s in range(0, n, 4):  # 4 sequences of features at a time: [4L, 2d+1] float64
            probe.add(probe_features(h_tr[s:s + 4]), target.repeat(h_tr[s:s + 4].shape[0]))
        probe.solve(ridge)
        pred = torch.cat([probe.predict(probe_features(h_ev[s:s + 4])) for s in range(0, m, 4)])  # [M*L]
    else:
        probe = MLPProbe(d, hidden)
        probe.fit(h_tr.reshape(-1, d), target.repeat(n), steps=steps, seed=seed)  # rows [N*L, d]
        pred = probe.predict(h_ev.reshape(-1, d))  # [M*L]
    return pred.round().clamp(0, length - 1).view(m, length)  # [M, L]


def position_probe(dim: int = 768, heads: int = 12, length: int = 512, sigma: float = 0.02, layers: int = 12,
                   train_samples: int = 96, eval_samples: int = 8, batch: int = 4, kind: str = "mlp",
                   steps: int = 700, hidden: int = 256, ridge: float = 1e-3, seed: int = 0, device="cpu") -> dict:
    """Fig. 2.2: MAE per position of a probe after 1..``layers`` layers (see the module docstring).

    ``train_samples`` random sequences (L rows each) fit one probe per depth, ``eval_samples`` fresh
    ones measure it. Depth l's probe reads ln_f of the residual stream after block l.
    """
    if kind not in ("mlp", "linear"):
        raise UserError(f"probe kind must be 'mlp' or 'linear', got {kind!r}")
    model = random_tlm(dim, heads, layers, sigma, length, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 2)
    opts = AttnOptions(impl="sdpa")
    # drawn on the CPU (the same numbers on any device); residual streams of all sequences
    x_tr = (torch.randn(train_samples, length, dim, generator=gen) * sigma).to(device)  # [N, L, d]
    x_ev = (torch.randn(eval_samples, length, dim, generator=gen) * sigma).to(device)  # [M, L, d]
    target = torch.arange(length, dtype=torch.float64)  # [L]
    err = np.zeros((layers, length))
    for layer, block in enumerate(model.blocks):
        _advance(model, block, x_tr, opts, batch)
        _advance(model, block, x_ev, opts, batch)
        with torch.no_grad():
            h_tr, h_ev = model.ln_f(x_tr).cpu(), model.ln_f(x_ev).cpu()  # [N, L, d], [M, L, d]
        pred = _fit_predict(kind, h_tr, h_ev, target, length, ridge=ridge, steps=steps, hidden=hidden,
                            seed=seed + layer)
        err[layer] = (pred - target).abs().mean(0).numpy()
    probe = "2-layer ReLU MLP on whitened h -> log(1+m)" if kind == "mlp" else "linear on [h, h*h, 1]"
    return {"dim": dim, "heads": heads, "length": length, "sigma": sigma, "kind": kind, "probe": probe,
            "ridge": ridge, "steps": steps, "hidden": hidden, "train_samples": train_samples,
            "eval_samples": eval_samples, "mae_per_position": err, "mae_per_layer": err.mean(1),
            "baseline_mae": length / 4}


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
    ax.set_title(f"{res.get('kind', 'linear')} position probe, frozen random NoPE model (L = {res['length']})")
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

"""A4: latent position in NoPE models (thesis ch. 2, Chi et al. 2023a).

Setup of §2.3 (defaults d = 768, H = 12, d/H = 64, L = 512, sigma = 0.02): a randomly initialised,
*frozen* pre-LN Transformer LM without positional embeddings; every weight matrix (W_q, W_k,
W_v, W_o, FFN) i.i.d. N(0, sigma^2), biases 0, LayerNorm gamma = 1, beta = 0 (GPT init, but
W_o is *not* rescaled by 1/sqrt(2R) as GPT-2 does); inputs are not token embeddings but random
vectors x_m with i.i.d. N(0, sigma^2) entries. The measured quantity is the multi-head attention
output o_m = W_o (concat_h sum_n a_mn v_n) before the residual addition; its variance is taken
over the d entries of o_m and averaged over samples ("averaged over 500 samples").
Lemma 2.3: Var(o_m) ~= d^2 sigma^4 / m (Property 2.1: sigma^4 << H/d^2 -> near-uniform
attention), so log Var vs log m has slope -1 at layer 0 (Fig. 2.4); Fig. 2.5 varies sigma.

Fig. 2.2 (§2.8.1): a trainable two-layer classifier (Linear -> ReLU -> Linear over the L
positions; Adam lr 1e-3, batch 32) probes each token's position from the frozen model's hidden
state after l layers (followed by the final LN, which precedes the classifier in Fig. 2.1);
MAE of the argmax position per position, for each l. Predicting the midpoint gives MAE L/4.

Figs. 2.6-2.7 (§2.5): the same variance and the cumulative attention of the last query
measured on a trained NoPE checkpoint with real text.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from ..eval.core import model_device
from ..io import UserError
from ..model.attention import AttnOptions
from ..model.gpt import GPT, ModelConfig
from .attn import attention_rows, capture_qkv, recording
from .common import as_segments, new_figure, save_figure


def random_tlm(dim: int = 768, heads: int = 12, layers: int = 1, sigma: float = 0.02, length: int = 512,
               seed: int = 0, ln_eps: float = 1e-12) -> GPT:
    """The frozen random pre-LN NoPE model of thesis §2.3 (see module docstring).

    ``ln_eps``: LayerNorm epsilon. §2.3.1 takes LN(x) ~ N(0, 1); with PyTorch's default 1e-5 and
    inputs of variance sigma^2 = 4e-6 (sigma = 0.002, Fig. 2.5) the epsilon dominates and shrinks
    LN(x) by sqrt(sigma^2/(sigma^2+eps)), so the default here is 1e-12 (no effect for sigma >= 0.02).
    """
    if dim % heads:
        raise UserError(f"dim={dim} must be divisible by heads={heads}")
    if not sigma > 0:
        raise UserError(f"sigma must be > 0, got {sigma}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(ModelConfig(vocab_size=2, layers=layers, heads=heads, dim=dim, scheme="none",
                                train_length=length, init_std=sigma))
        for blk in model.blocks:
            nn.init.normal_(blk.proj.weight, std=sigma)  # W_o ~ N(0, sigma^2) as in the thesis
        for mod in model.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.eps = float(ln_eps)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _fit(positions: np.ndarray, var: np.ndarray) -> dict:
    ok = var > 0
    r = stats.linregress(np.log(positions[ok]), np.log(var[ok]))
    return {"slope": float(r.slope), "intercept": float(r.intercept), "r": float(r.rvalue)}


def _variance_pass(model, idx, inputs_embeds, opts) -> torch.Tensor:
    """Per layer, sum over the batch of Var_d(o_m): [layers, L] (float64)."""
    with torch.no_grad(), recording(model, "proj") as store:
        model(idx, inputs_embeds=inputs_embeds, opts=opts)
    return torch.stack([o.double().var(dim=-1, unbiased=False).sum(0) for o in store]).cpu()  # [R, L]


def simulate_variance(dim: int = 768, heads: int = 12, length: int = 512, sigma: float = 0.02,
                      samples: int = 500, layers: int = 1, batch: int = 8, seed: int = 0, device="cpu") -> dict:
    """Var(o_m) per layer vs m for the random frozen TLM, with Lemma 2.3 and the log-log fits.
    The random inputs are drawn on the CPU (the same numbers on any ``device``), then moved."""
    model = random_tlm(dim, heads, layers, sigma, length, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    total = torch.zeros(layers, length, dtype=torch.float64)
    done = 0
    opts = AttnOptions(impl="sdpa")
    while done < samples:
        b = min(batch, samples - done)
        x = (torch.randn(b, length, dim, generator=gen) * sigma).to(device)  # [B, L, d] random inputs
        total += _variance_pass(model, torch.zeros(b, length, dtype=torch.long, device=device), x, opts)
        done += b
    var = (total / samples).numpy()  # [R, L]
    m = np.arange(1, length + 1)
    return {"dim": dim, "heads": heads, "length": length, "sigma": sigma, "samples": samples,
            "positions": m, "variance": var, "theory": dim**2 * sigma**4 / m,
            "fits": [_fit(m, v) for v in var], "property_2_1_logit_var": dim**2 * sigma**4 / heads}


def sigma_sweep(sigmas=(0.2, 0.02, 0.002), **kw) -> dict:
    """Fig. 2.5: layer-0 variance for several sigma."""
    return {float(s): simulate_variance(sigma=float(s), layers=1, **kw) for s in sigmas}


def _cumulative_attention(model, idx, inputs_embeds, opts) -> np.ndarray:
    """Per layer, cumulative attention of the last query summed over batch, mean over heads: [R, L]."""
    L = (idx if inputs_embeds is None else inputs_embeds).shape[1]
    pos = torch.arange(L, device=idx.device)
    qkv = capture_qkv(model, idx, opts, inputs_embeds=inputs_embeds)
    rows = []
    for layer, x in enumerate(qkv):
        with torch.no_grad():
            p = attention_rows(model, x, layer, torch.tensor([L - 1], device=idx.device), pos, opts)[:, :, 0]  # [B, H, L]
        rows.append(p.double().cumsum(-1).mean(1).sum(0).cpu().numpy())
    return np.stack(rows)


def model_variance(model, segments, *, opts: AttnOptions | None = None, batch: int = 4) -> dict:
    """Figs. 2.6-2.7 on a trained model: Var(o_m) and cumulative last-query attention per layer."""
    seg = as_segments(segments)
    dev = model_device(model)
    N, L = seg.shape
    opts = opts or AttnOptions(impl="auto")
    was_training = model.training
    model.eval()
    var = np.zeros((len(model.blocks), L))
    cum = np.zeros((len(model.blocks), L))
    try:
        for s in range(0, N, batch):
            idx = seg[s:s + batch].to(dev)
            var += _variance_pass(model, idx, None, opts).numpy()
            cum += _cumulative_attention(model, idx, None, opts)
    finally:
        model.train(was_training)
    var, cum = var / N, cum / N
    m = np.arange(1, L + 1)
    return {"length": L, "segments": N, "positions": m, "variance": var, "fits": [_fit(m, v) for v in var],
            "cumulative_attention": cum}


def position_probe(dim: int = 768, heads: int = 12, length: int = 512, sigma: float = 0.02, layers: int = 12,
                   steps: int = 5000, batch: int = 32, lr: float = 1e-3, hidden: int | None = None,
                   eval_samples: int = 64, seed: int = 0, device="cpu") -> dict:
    """Fig. 2.2: MAE of a 2-layer ReLU classifier probing position from each layer's hidden state."""
    model = random_tlm(dim, heads, layers, sigma, length, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 2)
    hidden = hidden or dim
    torch.manual_seed(seed + 3)
    probes = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, length))
                           for _ in range(layers)).to(device)
    optim = torch.optim.Adam(probes.parameters(), lr=lr)
    target = torch.arange(length, device=device)
    opts = AttnOptions(impl="sdpa")

    def features(b: int) -> list[torch.Tensor]:
        x = (torch.randn(b, length, dim, generator=gen) * sigma).to(device)  # drawn on the CPU: same on any device
        with torch.no_grad(), _block_outputs(model) as outs:
            model(torch.zeros(b, length, dtype=torch.long, device=device), inputs_embeds=x, opts=opts)
            return [model.ln_f(h) for h in outs]  # [B, L, d] per layer

    for _ in range(int(steps)):
        feats = features(batch)
        loss = sum(F.cross_entropy(pr(f).reshape(-1, length), target.repeat(f.shape[0]))
                   for pr, f in zip(probes, feats))
        optim.zero_grad()
        loss.backward()
        optim.step()
    err = np.zeros((layers, length))
    with torch.no_grad():
        done = 0
        while done < eval_samples:
            b = min(batch, eval_samples - done)
            for layer, f in enumerate(features(b)):
                pred = probes[layer](f).argmax(-1)  # [B, L]
                err[layer] += (pred - target).abs().double().sum(0).cpu().numpy()
            done += b
    mae = err / eval_samples
    return {"dim": dim, "heads": heads, "length": length, "sigma": sigma, "steps": steps, "batch": batch,
            "mae_per_position": mae, "mae_per_layer": mae.mean(1), "baseline_mae": length / 4}


class _block_outputs:
    """Collect every block's output hidden state x (the first element of its (x, probs) output)."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self) -> list:
        self.outs: list = []
        self.hooks = [b.register_forward_hook(lambda _m, _i, out: self.outs.append(out[0].detach()))
                      for b in self.model.blocks]
        return self.outs

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


# ---- figures ---------------------------------------------------------------------------------
def plot_variance(results: dict, path_stem, *, layer: int | None = None, theory: bool = True,
                  title: str = "Variance of the attention output vs position") -> list[str]:
    """Log-log Var(o_m) vs m (Figs. 2.4, 2.5, 2.7). ``results``: label -> simulate/model_variance dict."""
    fig, ax = new_figure()
    for label, res in results.items():
        var = np.asarray(res["variance"])
        layers = range(var.shape[0]) if layer is None else [layer]
        for li in layers:
            f = res["fits"][li]
            ax.loglog(res["positions"], var[li], lw=1, label=f"{label} layer {li} (slope {f['slope']:.2f})")
        if theory and "theory" in res:
            ax.loglog(res["positions"], res["theory"], ls="--", lw=1, label=f"{label}: d²σ⁴/m (Lemma 2.3)")
    ax.set_xlabel("position m")
    ax.set_ylabel("Var(o_m)")
    ax.set_title(title)
    ax.legend(fontsize=6)
    return save_figure(fig, path_stem)


def plot_cumulative_attention(res: dict, path_stem) -> list[str]:
    """Fig. 2.6: cumulative attention probability of the last query per layer (uniform = diagonal)."""
    fig, ax = new_figure()
    cum = np.asarray(res["cumulative_attention"])
    m = np.asarray(res["positions"])
    for li in range(cum.shape[0]):
        ax.plot(m, cum[li], lw=1, label=f"layer {li}")
    ax.plot(m, m / m[-1], ls="--", color="gray", lw=1, label="uniform")
    ax.set_xlabel("key position")
    ax.set_ylabel("cumulative attention of the last query")
    ax.legend(fontsize=6)
    return save_figure(fig, path_stem)


def plot_probe(res: dict, path_stem) -> list[str]:
    """Fig. 2.2: probe MAE per position for each number of layers, with the midpoint baseline."""
    fig, ax = new_figure()
    mae = np.asarray(res["mae_per_position"])
    for li in range(mae.shape[0]):
        ax.plot(np.arange(mae.shape[1]), mae[li], lw=1, label=f"{li + 1} layer(s): MAE {mae[li].mean():.1f}")
    ax.axhline(res["baseline_mae"], color="gray", ls="--", lw=1, label="predict the midpoint")
    ax.set_xlabel("position")
    ax.set_ylabel("MAE")
    ax.set_title("Position probe on a frozen random NoPE model")
    ax.legend(fontsize=6)
    return save_figure(fig, path_stem)

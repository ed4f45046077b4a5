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

Fig. 2.2 (§2.8.1), the position probe on the same frozen model: ``nope_probe.py``.

Figs. 2.6-2.7 (§2.5): the same variance and the cumulative attention of the last query
measured on a trained NoPE checkpoint with real text.
"""
from __future__ import annotations

import numpy as np
import torch
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


class _LastOutputSeen(Exception):
    """Raised by a hook once the last block's attention output is recorded (nothing after it is used)."""


def _stop(_module, _inputs, _output):
    raise _LastOutputSeen


def _variance_pass(model, idx, inputs_embeds, opts) -> torch.Tensor:
    """Per layer, sum over the batch of Var_d(o_m): [layers, L] (float64).

    The pass stops at the last block's W_o: its FFN, the final LN and the LM head (for the 1-layer
    simulation over half of the work) cannot change what is measured.
    """
    with torch.no_grad(), recording(model, "proj") as store:
        hook = model.blocks[-1].proj.register_forward_hook(_stop)  # registered after the recorder
        try:
            model(idx, inputs_embeds=inputs_embeds, opts=opts)
        except _LastOutputSeen:
            pass
        finally:
            hook.remove()
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

"""A4: NoPE variance vs thesis Lemma 2.3 (d^2 sigma^4 / m), the position probe, a trained-model pass.

The tests use d = 128, H = 4, L = 128 instead of the thesis' 768/12/512 for speed; Property 2.1
(sigma^4 << H/d^2) holds even better there (logit variance d^2 sigma^4/H = 6.6e-4 vs 7.9e-3), so
the layer-0 slope of -1 still holds.
"""
import numpy as np
import pytest
import torch

from extrapolab.analysis import (LinearProbe, model_variance, plot_probe, plot_variance, position_probe,
                                 probe_features, random_tlm, sigma_sweep, simulate_variance)
from extrapolab.analysis.nope_probe import MLPProbe, hidden_states
from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, ModelConfig


def test_layer0_variance_follows_lemma_2_3(tmp_path):
    d, sigma = 128, 0.02
    r = simulate_variance(dim=d, heads=4, length=128, sigma=sigma, samples=48, layers=2)
    assert r["fits"][0]["slope"] == pytest.approx(-1.0, abs=0.05)
    var0 = r["variance"][0]
    theory = d**2 * sigma**4 / np.arange(1, 129)
    assert np.median(var0 / theory) == pytest.approx(1.0, abs=0.15)  # the level, not just the slope
    assert r["fits"][1]["slope"] > -0.9  # later layers see the residual stream, not pure 1/m
    files = plot_variance({"sim": r}, tmp_path / "v", layer=0)
    assert all((tmp_path / f"v.{x}").stat().st_size > 1000 for x in ("png", "svg")) and len(files) == 2


def test_smaller_sigma_aligns_better_fig_2_5():
    """Fig. 2.5: at sigma = 0.002 simulation and Lemma 2.3 overlap (needs LN eps << sigma^2, see random_tlm)."""
    sw = sigma_sweep((0.2, 0.02, 0.002), dim=128, heads=4, length=64, samples=24)
    err = {s: abs(r["fits"][0]["slope"] + 1) for s, r in sw.items()}
    assert err[0.002] < 0.02 and err[0.02] < 0.05 < err[0.2]
    r = sw[0.002]
    assert np.median(r["variance"][0] / r["theory"]) == pytest.approx(1.0, abs=0.1)


def test_random_model_is_the_thesis_setup():
    m = random_tlm(dim=64, heads=4, layers=2, sigma=0.05, length=32)
    w = torch.cat([b.proj.weight.flatten() for b in m.blocks])
    assert w.std().item() == pytest.approx(0.05, rel=0.05)  # W_o ~ N(0, sigma^2), no 1/sqrt(2R)
    assert not any(p.requires_grad for p in m.parameters())
    assert m.scheme.name == "none"


def test_trained_model_pass_shapes_and_cumulative_attention():
    m = GPT(ModelConfig(vocab_size=40, layers=2, heads=2, dim=16, scheme="none", train_length=32))
    r = model_variance(m, torch.randint(0, 40, (3, 32)), batch=2)
    assert np.asarray(r["variance"]).shape == (2, 32) and len(r["fits"]) == 2
    cum = np.asarray(r["cumulative_attention"])
    np.testing.assert_allclose(cum[:, -1], 1.0, atol=1e-6)
    assert np.all(np.diff(cum, axis=1) >= -1e-9)


def _small_states(n_seq=6, seed=0):
    """ln_f hidden states of a small frozen random NoPE model: one [n_seq, L, d] tensor per layer."""
    m = random_tlm(dim=32, heads=2, layers=2, sigma=0.02, length=16, seed=seed)
    x = torch.randn(n_seq, 16, 32, generator=torch.Generator().manual_seed(seed + 5)) * 0.02
    return hidden_states(m, x, AttnOptions(impl="sdpa"))


@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_linear_probe_equals_numpy_lstsq(ridge):
    """The streamed normal-equation fit (3 chunks) is the least-squares solution of the stacked
    system; with ridge, of the system augmented by sqrt(ridge·N)·I rows (intercept unpenalised)."""
    h = _small_states()[1]  # [6, 16, 32]
    y = torch.arange(16, dtype=torch.float64).repeat(6)
    probe = LinearProbe(2 * 32 + 1)
    for chunk in (slice(0, 2), slice(2, 3), slice(3, 6)):
        probe.add(probe_features(h[chunk]), torch.arange(16.0).repeat(chunk.stop - chunk.start))
    w = probe.solve(ridge).numpy()
    phi = probe_features(h).numpy()  # [96, 65]
    assert phi.shape == (96, 65)
    if ridge:
        pen = np.sqrt(ridge * phi.shape[0]) * np.eye(phi.shape[1])[:-1]  # no row for the intercept
        ref = np.linalg.lstsq(np.vstack([phi, pen]), np.concatenate([y.numpy(), np.zeros(64)]), rcond=None)[0]
        np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-8)
    else:  # sum_j h_j = 0 and sum_j h_j^2 = d after LN (up to float32 rounding, singular values ~1e-8
        # of the largest): w is not unique, the fitted values are once those directions are cut
        ref = np.linalg.lstsq(phi, y.numpy(), rcond=1e-6)[0]
        np.testing.assert_allclose(phi @ w, phi @ ref, atol=1e-6)
        assert np.abs(phi @ w - y.numpy()).mean() < np.abs(y.numpy() - y.numpy().mean()).mean()


def test_probe_features_and_basis():
    h = torch.randn(3, 5, 8)
    f = probe_features(h)
    assert f.shape == (15, 17) and f.dtype == torch.float64
    np.testing.assert_allclose(f[:, 8:16], (h.reshape(15, 8) ** 2).double())
    assert torch.all(f[:, -1] == 1)


def test_mlp_probe_reads_a_trivially_readable_position():
    """Independent reference: where the position is a smooth first-order code (cos/sin of m at 4
    frequencies + small noise), the thesis' probe (2-layer ReLU, Adam 1e-3) learns it: the loss
    falls tenfold and the held-out MAE is near 0 (the midpoint baseline is L/4 = 16)."""
    L, g = 64, torch.Generator().manual_seed(0)
    m = torch.arange(L).repeat(40)  # [2560]
    w = torch.tensor([0.5, 1.0, 2.0, 4.0]) * torch.pi / L
    code = torch.cat([torch.cos(m[:, None] * w), torch.sin(m[:, None] * w)], 1)  # [N, 8]
    h = code @ torch.randn(8, 16, generator=g) + 0.01 * torch.randn(m.shape[0], 16, generator=g)  # [N, 16]
    probe = MLPProbe(16, hidden=64)
    losses = probe.fit(h[:2048], m[:2048], steps=1500, batch=128)
    assert np.mean(losses[-50:]) < np.mean(losses[:50]) / 10
    mae = (probe.predict(h[2048:]).round() - m[2048:]).abs().mean().item()
    assert mae < 1.5


def test_mlp_probe_reads_a_variance_code_a_linear_map_cannot():
    """Lemma 2.3's situation in miniature: the position is only in the *scale* of a zero-mean
    vector along 8 of 16 directions (E[w·h] = 0 at every m). A least-squares fit on h stays at the
    midpoint baseline; the MLP probe, reading |w·h| through its ReLUs, does much better."""
    L, g = 64, torch.Generator().manual_seed(1)
    m = torch.arange(L).repeat(160)  # [10240]
    scale = torch.ones(m.shape[0], 16)
    scale[:, :8] = 4.0 / torch.sqrt(1.0 + m[:, None].float())  # [N, 16]: falls like 1/sqrt(m)
    h = torch.randn(m.shape[0], 16, generator=g) * scale @ torch.linalg.qr(torch.randn(16, 16, generator=g))[0]
    tr, te = slice(0, 8192), slice(8192, None)
    probe = MLPProbe(16, hidden=64)
    probe.fit(h[tr], m[tr], steps=800, batch=256)
    mlp = (probe.predict(h[te]).round().clamp(0, L - 1) - m[te]).abs().mean().item()
    a = np.c_[h.numpy(), np.ones(m.shape[0])]
    coef = np.linalg.lstsq(a[tr], m[tr].numpy().astype(float), rcond=None)[0]
    lin = np.abs(np.clip(np.round(a[te] @ coef), 0, L - 1) - m[te].numpy()).mean()
    assert lin > 0.9 * L / 4 and mlp < 0.6 * L / 4


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_position_probe_result_and_figure(tmp_path, kind):
    """Fig. 2.2's pipeline in miniature: MAE per layer and position on held-out sequences, the
    midpoint baseline L/4, reproducible from the seed, and one figure with the probe beside the
    layer-0 variance curve of Lemma 2.3."""
    kw = dict(dim=32, heads=2, length=16, layers=2, sigma=0.02, train_samples=12, eval_samples=4, batch=4,
              kind=kind, steps=20)
    r = position_probe(**kw)
    mae = np.asarray(r["mae_per_position"])
    assert mae.shape == (2, 16) and r["baseline_mae"] == 4 and r["kind"] == kind
    assert np.all((mae >= 0) & (mae <= 15)) and np.allclose(r["mae_per_layer"], mae.mean(1))
    np.testing.assert_array_equal(position_probe(**kw)["mae_per_position"], mae)
    v = simulate_variance(dim=32, heads=2, length=16, samples=4)
    files = plot_probe(r, tmp_path / "p", variance=v)
    assert len(files) == 2 and (tmp_path / "p.svg").read_text().count("Lemma 2.3") >= 1


def test_position_probe_states_match_the_full_model():
    """The layer-by-layer pass over all sequences gives the same states as one full forward pass
    (hooks on every block): the probe reads the model it claims to read."""
    from extrapolab.analysis.nope_probe import _advance

    m = random_tlm(dim=32, heads=2, layers=2, sigma=0.02, length=16)
    x = torch.randn(5, 16, 32, generator=torch.Generator().manual_seed(3)) * 0.02
    ref = hidden_states(m, x, AttnOptions(impl="sdpa"))
    y = x.clone()
    for block, want in zip(m.blocks, ref):
        _advance(m, block, y, AttnOptions(impl="sdpa"), batch=2)
        torch.testing.assert_close(m.ln_f(y), want, rtol=1e-5, atol=1e-5)


def test_position_probe_rejects_an_unknown_kind():
    from extrapolab.io import UserError

    with pytest.raises(UserError, match="mlp"):
        position_probe(dim=32, heads=2, length=16, layers=1, kind="svm")


def test_cli_nope_variance_with_probe(tmp_path):
    """`analyze nope-variance --probe` at a small size: the variance fit, the probe and one figure."""
    import json

    from typer.testing import CliRunner

    from extrapolab.cli.analyze import app

    res = CliRunner().invoke(app, ["nope-variance", "--dim", "32", "--heads", "2", "--length", "16", "--samples", "4",
                                   "--no-sweep", "--probe", "--probe-layers", "2", "--probe-samples", "4",
                                   "--probe-eval", "2", "--probe-steps", "10", "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["probe"]["mae_per_layer"]) == 2 and out["probe"]["baseline_mae"] == 4
    assert (tmp_path / "nope_position_probe.png").stat().st_size > 1000

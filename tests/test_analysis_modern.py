"""The analyses on the schemes with new hooks: attention rows (ERF, sharpness, NoPE variance) equal the
model's own probabilities for FoX, CoPE, hybrids and the head scale; FoX's gates drawn from a model;
the TRF says when a scheme has no formula; a hybrid is read per layer."""
import math

import pytest
import torch
from typer.testing import CliRunner

from extrapolab.analysis import bias as A3
from extrapolab.analysis.attn import attention_rows, capture_qkv
from extrapolab.analysis.erf import attention_erf
from extrapolab.analysis.theory import convergence, trf
from extrapolab.cli.analyze import app
from extrapolab.model.gpt import GPT, ModelConfig


def _model(name, params=None, seed=0):
    torch.manual_seed(seed)
    m = GPT(ModelConfig(scheme=name, scheme_params=params or {}, vocab_size=50, dim=32, heads=4, layers=2,
                        train_length=64, init_std=0.1)).eval()
    with torch.no_grad():
        for p in m.scheme.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return m


@pytest.mark.parametrize("name,params", [("fox", {}), ("cope", {}), ("hybrid", {"every": 2}),
                                         ("nope-headscale", {}), ("alibi", {})])
def test_attention_rows_equal_the_models_probabilities(name, params):
    m = _model(name, params)
    idx = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(30)
    with torch.no_grad():
        probs = m(idx, return_probs=True)["probs"]  # per layer [B, H, L, L]
        for layer, x in enumerate(capture_qkv(m, idx)):
            rows = torch.tensor([0, 7, 29])
            assert (attention_rows(m, x, layer, rows, pos) - probs[layer][:, :, rows]).abs().max() < 1e-6
    erf = attention_erf(m, idx[:1], 0.01)
    assert len(erf["per_layer_head"]) == 2 and math.isfinite(erf["mean"])


def test_fox_gates_are_drawn_from_the_model_on_a_text(tmp_path):
    m = _model("fox")
    seg = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(3))
    gates = A3.content_gates(m, seg)
    assert sorted(gates) == [0, 1]
    x = m.embed(seg[None], torch.arange(40))
    with torch.no_grad():
        h = m.blocks[0].ln1(x)  # layer 0's attention input
        f = torch.sigmoid(h[0] @ m.scheme.w[0].T + m.scheme.b[0]).T.double()  # [H, L]
    assert torch.allclose(torch.from_numpy(gates[0]["gate"]), f, atol=1e-6)
    logf = f.log()
    want = torch.stack([logf[:, n + 1:].sum(-1) for n in range(40)], -1)  # Σ_{l=n+1..L-1} log f_l
    assert torch.allclose(torch.from_numpy(gates[0]["last_row"]), want, atol=1e-6)
    summary = A3.gate_summary(gates)
    assert len(summary[1]["mean_gate"]) == 4 and len(summary[1]["effective_lengths"]) == 4
    files = A3.plot_gates(gates, tmp_path / "gates")
    assert all((tmp_path / f).exists() or __import__("os").path.exists(f) for f in files) and len(files) == 2


def test_trf_says_when_there_is_no_formula_and_reads_a_hybrid_per_layer():
    for name in ("fox", "cope"):
        row = trf(name, num_heads=2)[0]
        assert row["converges"] is None and row["trf"] is None and "no formula" in row["method"]
    rope_layer = convergence("hybrid", num_heads=2, layer=0, n=2**10, rope="alibi")[0]  # layer 0: ALiBi
    nope_layer = convergence("hybrid", num_heads=2, layer=3, n=2**10, rope="alibi")[0]  # layer 3: NoPE
    assert rope_layer["converges"] is True and nope_layer["converges"] is False


def test_analyze_bias_for_fox_needs_a_run_in_one_line():
    res = CliRunner().invoke(app, ["bias", "fox", "--heads", "2"])
    assert res.exit_code == 2
    assert "give --run RUN_DIR" in res.stderr and "Traceback" not in res.stderr

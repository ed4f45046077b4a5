"""FIRE (Li et al. 2024) against the paper's equations written here as the reproduction in
chuanyang-Zheng/DAPE (``DAPE.py`` class FIRE) computes them, and the split path (queries up to L on the
Toeplitz path, the rest as dense blocks) against the dense formula, with gradients."""
import copy
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.model import attention as attn_mod
from extrapolab.model import split, tables
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.model.toeplitz import HankelSDPA
from extrapolab.positional import fire as fire_mod
from extrapolab.positional.base import SchemeError
from fire_ref import dense as _dense, fire as _fire, official_fire as _official_fire



@pytest.mark.parametrize("shared", [False, True])
def test_fire_bias_equals_the_reproduction_at_any_positions(shared):
    s = _fire(shared=shared)
    L = 60
    for layer in range(2):
        ref = _official_fire(s, layer, L, 20).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
        pos = torch.arange(L)
        torch.testing.assert_close(s.bias(pos, pos, layer), ref, rtol=0, atol=1e-12)
        for qp, kp in [(pos[30:50], pos[:50]), (pos[5:9], pos[3:40]), (pos[[3, 7, 40]], pos[[0, 2, 7, 30, 41]]),
                       (pos[:3], pos[5:9])]:  # blocks, a chunk after a cache, gaps, keys all in the future
            torch.testing.assert_close(s.bias(qp, kp, layer), ref[:, qp][:, :, kp], rtol=0, atol=1e-12)
        # queries at i <= L see the distance table f(ψ(d)/ψ(L))
        d = torch.arange(28)
        torch.testing.assert_close(s.distance_table(28, layer, dtype=torch.float64), ref[:, 27, 27 - d], rtol=0, atol=1e-12)


def test_fire_starts_as_the_reproduction_and_the_model_init_leaves_it():
    s = positional.build("fire", 4, layers=3, original_length=64)
    assert s.c.tolist() == pytest.approx([0.1] * 3) and s.L_mult.tolist() == [1.0] * 3
    assert float(s.threshold(2).detach()) == 64.0 and s.layer_dependent
    assert s.w1.abs().max() <= 1 and s.w2.abs().max() <= 32 ** -0.5  # nn.Linear's U(±1/sqrt(fan_in))
    assert not torch.equal(s.w1[0], s.w1[1])  # one MLP per layer
    shared = positional.build("fire", 4, shared=True)
    assert shared.w1.shape[0] == 1 and not shared.layer_dependent
    m = GPT(ModelConfig(vocab_size=30, dim=32, heads=4, layers=2, scheme="fire", train_length=48))
    assert m.scheme.original_length == 48 and m.scheme.layers == 2
    assert m.scheme.w1.std() > 0.3  # U(-1, 1), not the model's N(0, 0.02) of its own nn.Linear layers
    with pytest.raises(SchemeError, match="layers"):
        m.scheme.bias(torch.arange(3), torch.arange(3), 5)


@pytest.mark.parametrize("one_pass", [True, False], ids=["all-heads", "head-by-head"])
@pytest.mark.parametrize("dead", [False, True], ids=["", "units-with-w1-0"])
def test_pieces_are_the_mlp_with_its_gradients(one_pass, dead, monkeypatch):
    """The linear pieces equal the MLP as written, with every parameter's gradient: all heads at once (a distance
    table) or head by head (large inputs), and with units whose w1 is 0 (never switching: breakpoint +inf)."""
    monkeypatch.setattr(fire_mod, "_ONE_PASS", 1 << 22 if one_pass else 0)
    s = _fire()
    if dead:
        with torch.no_grad():
            s.w1[1, :4] = 0
            s.b1[1, :4] = torch.tensor([0.3, -0.2, 0.7, -1.0], dtype=s.b1.dtype)  # two always on, two always off
    t, _, _ = s.pieces(1)
    assert t.numel() == s.width and int(torch.isinf(t).sum()) == (4 if dead else 0)
    t = t[torch.isfinite(t)]  # +inf: a unit with w1 = 0 never switches
    x = torch.cat([torch.rand(200, dtype=torch.float64) * 3 - 1, t]).requires_grad_()  # breakpoints included
    a, b = s.piecewise(x, 1), s.mlp(x, 1)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    go = torch.randn_like(a)
    keep = torch.ones(x.shape[0], dtype=torch.bool)
    keep[200:] = False  # ReLU's derivative at a kink is a convention: compare elsewhere
    ga = torch.autograd.grad(a, [x, *s.parameters()], go, allow_unused=True)
    gb = torch.autograd.grad(b, [x, *s.parameters()], go, allow_unused=True)
    torch.testing.assert_close(ga[0][keep], gb[0][keep], rtol=0, atol=1e-12)
    xs = x.detach()[:200].requires_grad_()
    ga = torch.autograd.grad(s.piecewise(xs, 1), list(s.parameters()), go[:, :200], allow_unused=True)
    gb = torch.autograd.grad(s.mlp(xs, 1), list(s.parameters()), go[:, :200], allow_unused=True)
    for u, w in zip(ga, gb):
        assert (u is None) == (w is None)
        if u is not None:
            torch.testing.assert_close(u, w, rtol=0, atol=1e-10)


def _spy(monkeypatch):
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)[0]) or real(*a, **kw))
    return seen


@pytest.mark.parametrize("shared", [False, True])
def test_split_path_equals_the_dense_formula_with_gradients(shared, monkeypatch):
    """Queries on both sides of L = 27.4: rows 0..27 on the Toeplitz path, the rest dense; output and every
    gradient (q, k, v, the MLP, c, L_mult) equal the reproduction's dense formula in fp64, whole sequences,
    chunks after a cache, windows and small blocks alike."""
    s = _fire(shared=shared)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 70, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    params = [q, k, v, *s.parameters()]
    seen = _spy(monkeypatch)
    cases = [(slice(0, 70), slice(0, 70), {}), (slice(0, 70), slice(0, 70), dict(impl="blocked", block_size=9)),
             (slice(20, 70), slice(0, 70), {}), (slice(0, 70), slice(0, 70), dict(window=11))]
    for qs, ks, kw in cases:
        qp, kp = torch.arange(70)[qs], torch.arange(70)[ks]
        out, _ = attend(q[:, :, qs], k[:, :, ks], v[:, :, ks], qp, kp, s, 1, AttnOptions(**kw))
        ref = _dense(q[:, :, qs], k[:, :, ks], v[:, :, ks], qp, kp, s, 1, kw.get("window"))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        go = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(out, params, go), torch.autograd.grad(ref, params, go)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert seen == ["split"] * len(cases)
    # queries all at or below L: the Toeplitz path; all above: the split path's dense blocks alone
    for qp, want in [(torch.arange(0, 27), "toeplitz"), (torch.arange(40, 70), "split")]:
        out, _ = attend(q[:, :, qp], k, v, qp, torch.arange(70), s, 1)
        torch.testing.assert_close(out, _dense(q[:, :, qp], k, v, qp, torch.arange(70), s, 1), rtol=0, atol=1e-12)
        assert seen[-1] == want


def test_training_at_L_tr_runs_hankel_sdpa_with_the_table_gradient(monkeypatch):
    """At L_tr every query is at i <= L: the learnable distance table through the fused HankelSDPA (fp32),
    gradients to the MLP, c and L_mult equal the dense formula's."""
    s = _fire(L_mult=1.0, L_tr=64).float()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 64, 16, generator=g).requires_grad_() for _ in range(3))
    calls = []
    real = HankelSDPA.apply
    monkeypatch.setattr(HankelSDPA, "apply", lambda *a: calls.append(1) or real(*a))
    pos = torch.arange(64)
    out, _ = attend(q, k, v, pos, pos, s, 0)
    assert calls
    sd = copy.deepcopy(s).double()
    ref = _dense(q.double(), k.double(), v.double(), pos, pos, sd, 0)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, list(s.parameters()), go)
    want = torch.autograd.grad(ref, list(sd.parameters()), go.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_every_layers_table_at_once_equals_each_layers_table_with_its_gradients():
    """distance_tables batches the G layers' formulas: the same bits as each layer's distance_table, values and
    every parameter's gradient."""
    torch.manual_seed(0)
    s = positional.build("fire", num_heads=4, layers=3)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
        s.w1[1, :5] = 0.0  # units that never switch (breakpoint +inf)
    every = s.distance_tables(300)  # [G, H, n]
    per = torch.stack([s.distance_table(300, g) for g in range(3)])
    assert every.shape == (3, 4, 300) and torch.equal(every, per)
    got = torch.autograd.grad(every.sin().sum(), list(s.parameters()))
    want = torch.autograd.grad(per.sin().sum(), list(s.parameters()))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert positional.build("fire", num_heads=4, shared=True).distance_tables(10) is None


def test_a_training_forward_builds_every_layers_table_once(monkeypatch):
    """A 4-layer model's training forward asks FIRE for all layers' tables once (not each layer's MLP: FIRE's step
    on an H100 was host-bound, 2,679 launches against NoPE's 930), with the same loss and gradients as the layer by
    layer build."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fire", vocab_size=64, dim=32, heads=2, layers=4, train_length=64))
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    calls, real = [], fire_mod.FIRE.distance_tables
    monkeypatch.setattr(fire_mod.FIRE, "distance_tables", lambda self, *a: calls.append(a[0]) or real(self, *a))
    per_layer = []
    real_one = fire_mod.FIRE.distance_table
    monkeypatch.setattr(fire_mod.FIRE, "distance_table",
                        lambda self, *a, **kw: per_layer.append(1) or real_one(self, *a, **kw))
    loss = m(idx).float().square().mean()
    got = torch.autograd.grad(loss, list(m.parameters()))
    assert len(calls) == 1 and per_layer == []
    monkeypatch.setattr(fire_mod.FIRE, "distance_tables", lambda self, *a: None)
    loss2 = m(idx).float().square().mean()
    want = torch.autograd.grad(loss2, list(m.parameters()))
    assert len(per_layer) == 4 and torch.equal(loss, loss2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shared,per_forward", [(True, 1), (False, 2)])
def test_dense_rows_and_the_threshold_are_computed_once_per_forward(shared, per_forward, monkeypatch):
    """With gradients, beyond L the dense blocks are built once per forward when the layers share FIRE (twice in
    a 2-layer model otherwise); without, each layer lays its rows out by distance and ``bias`` never runs. The
    learnable L is read from the device once per forward (one synchronisation on CUDA)."""
    m = GPT(ModelConfig(vocab_size=40, dim=24, heads=3, layers=2, scheme="fire", train_length=16,
                        scheme_params={"shared": shared}))
    calls, rows, reads = [], [], []
    cls, real_floats = type(m.scheme), tables._floats
    real_bias, real_rows = cls.bias, cls.distance_rows
    monkeypatch.setattr(cls, "bias", lambda self, *a, **kw: calls.append(1) or real_bias(self, *a, **kw))
    monkeypatch.setattr(cls, "distance_rows", lambda self, *a, **kw: rows.append(1) or real_rows(self, *a, **kw))
    monkeypatch.setattr(tables, "_floats", lambda t: reads.append(1) or real_floats(t))
    x = torch.randint(0, 40, (1, 100))  # rows 17..99 beyond L = 16, in one block of 256 rows
    m(x).sum().backward()
    assert len(calls) == per_forward and len(reads) == 1 and not rows
    with torch.no_grad():
        m(x)
    assert len(calls) == per_forward and len(reads) == 2 and len(rows) == 2


def _banded(H=3, L_tr=20, seed=1):
    """FIRE whose MLP has most of its breakpoints t = -b1/w1 inside (0, 1), where x = ψ(d)/ψ(i) lives: many
    pieces per row, and bands where rows of a block change piece at different distances."""
    s = _fire(H=H, layers=2, L_tr=L_tr, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w1 = (torch.rand(2, 32, generator=g, dtype=torch.float64) + 0.5) * torch.where(
            torch.rand(2, 32, generator=g) < 0.5, -1.0, 1.0).double()
        s.w1.copy_(w1)
        s.b1.copy_(-torch.rand(2, 32, generator=g, dtype=torch.float64) * w1)
        s.w2.mul_(4)
    return s


def test_rows_by_distance_equal_the_reproduction():
    """``distance_rows`` (a block of rows by distance, the split path's layout without gradients) equals the
    reproduction's [H, L, L] bias read at (m_r, m_r - d), -inf at d < 0: long blocks whose rows change piece at
    different distances, chunks (d_lo > 0), short blocks and blocks that start before L."""
    s = _banded()
    t = s.pieces(1)[0]
    assert int(((t > 0) & (t < 1)).sum()) >= 20  # the case the bands exist for
    ref = _official_fire(s, 1, 400, s.original_length)  # [H, 400, 400]
    for q0, R, d_lo, W in [(30, 256, -255, 541), (150, 200, -199, 548), (300, 100, -20, 150), (100, 7, 40, 60),
                           (5, 40, -3, 60), (399, 1, 0, 400)]:
        qp = torch.arange(q0, q0 + R)
        G = s.distance_rows(qp, d_lo, W, 1)  # [H, R, W]
        d = d_lo + torch.arange(W)
        seen = (d[None] >= 0) & (d[None] <= qp[:, None])  # [R, W] inside the reproduction's rows
        want = ref[:, qp[:, None].expand(R, W), (qp[:, None] - d[None]).clamp(0, 399)]  # [H, R, W]
        torch.testing.assert_close(G[:, seen], want[:, seen], rtol=0, atol=1e-12)
        assert torch.isneginf(G[:, (d < 0).expand(R, W)]).all()
        out = torch.full((3, R, W), 7.0, dtype=torch.float64)
        assert s.distance_rows(qp, d_lo, W, 1, out=out) is out and torch.equal(out, G)


def test_split_path_without_gradients_reads_rows_by_distance(monkeypatch):
    """Without gradients the queries beyond L run on rows by distance (``bias`` never runs): equal to the
    reproduction's dense formula in fp64 for whole sequences, chunks after a cache, windows, small blocks and a
    temperature; and a model's evaluation forward equals its forward with gradients (the dense blocks) in fp32."""
    s = _banded()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 300, 8, generator=g, dtype=torch.float64) for _ in range(3))
    monkeypatch.setattr(type(s), "bias", lambda *a, **kw: pytest.fail("bias() ran"))
    seen = _spy(monkeypatch)
    cases = [(slice(0, 300), {}), (slice(0, 300), dict(block_size=37)), (slice(120, 300), {}),
             (slice(0, 300), dict(window=50)), (slice(0, 300), dict(temperature=0.7))]
    with torch.no_grad():
        for qs, kw in cases:
            qp, kp = torch.arange(300)[qs], torch.arange(300)
            out, _ = attend(q[:, :, qs], k, v, qp, kp, s, 1, AttnOptions(**kw))
            ref = _dense(q[:, :, qs], k, v, qp, kp, s, 1, kw.get("window"), kw.get("temperature", 1.0))
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert seen == ["split"] * len(cases)
    monkeypatch.undo()
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=50, dim=24, heads=3, layers=2, scheme="fire", train_length=16))
    with torch.no_grad():
        for layer in range(2):  # breakpoints inside (0, 1), as _banded
            w1 = m.scheme.w1[layer].abs() + 0.5
            m.scheme.w1[layer].copy_(w1)
            m.scheme.b1[layer].copy_(-torch.rand(32) * w1)
    x = torch.randint(0, 50, (2, 200))
    with torch.no_grad():
        fast = m(x)
    torch.testing.assert_close(fast, m(x).detach(), rtol=1e-5, atol=1e-5)


def test_rows_by_distance_keep_one_buffer_between_forwards(monkeypatch):
    """The buffer of rows by distance is made once and reused by later forwards, shorter ones and no-grad after
    inference mode included (its stale contents never leak into the result); one over SCRATCH_KEEP is not kept."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=50, dim=24, heads=3, layers=2, scheme="fire", train_length=16))
    x = torch.randint(0, 50, (1, 200))
    ref = m(x).detach()  # with gradients: the dense blocks

    def kept():
        return [v.data_ptr() for key, v in m.scheme._table_cache.items() if key[0] == "split_scratch"]

    with torch.inference_mode():
        a = m(x)
    ptrs = kept()
    assert len(ptrs) == 1
    with torch.no_grad():
        b, c = m(x[:, :150]), m(x)
    assert kept() == ptrs
    for got, want in ((a, ref), (b, ref[:, :150]), (c, ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(split, "SCRATCH_KEEP", 0)
    with torch.no_grad():
        d = m(x)
    assert kept() == []
    torch.testing.assert_close(d, ref, rtol=1e-5, atol=1e-5)


def test_fire_has_no_trf_formula_and_says_why():
    from extrapolab.analysis.theory import trf

    rows = trf(positional.build("fire", 2), 0.01, n=2**10)
    assert all(r["converges"] is None and "query" in r["method"] for r in rows)


def test_analyze_bias_draws_fire_per_query_position(tmp_path):
    """`extrapolab analyze bias fire`: the heat map, the last row (the row of the last query) and the learned
    curve per layer and head at several query positions; each curve is that query's row of ``bias``."""
    import json

    from typer.testing import CliRunner

    from extrapolab.analysis import bias as A3
    from extrapolab.cli.main import app

    res = CliRunner().invoke(app, ["analyze", "bias", "fire", "--heads", "2", "--length", "200", "--out",
                                   str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert any("fire_query_curves" in f for f in out["figures"])
    s = _fire()
    pos = A3.query_positions(s, 100)
    assert 27 in pos and 54 in pos and 99 in pos  # L = 27.4 and 2L among them
    curves = A3.query_curves(s, pos, 1)
    for m, c in curves.items():
        row = s.bias(torch.tensor([m]), torch.arange(m + 1), 1)[:, 0].detach()
        torch.testing.assert_close(torch.from_numpy(c), row.flip(-1).double())
    torch.testing.assert_close(torch.from_numpy(A3.distance_curve(s, 100, 1)), torch.from_numpy(curves[99]))

"""FIRE's rows by linear pieces on FlexAttention (model/flex_pieces.py, docs/attention.md row 7 on CUDA: flex-pieces):
the tiles whose range of the MLP's input spans at most flex_pieces.SPAN breakpoints are scored as α[s] + β[s]·x, the
others by the MLP (flex_bias), merged by log-sum-exp. Against the reproduction's dense formula (fire_ref.py) in fp64;
the tile bounds hold for every score; how many MLP evaluations it keeps; when attend takes it; no host read per
layer; `slow`: both calls compiled on the CPU; `gpu`: on CUDA against the plain path."""
import pytest
import torch

from extrapolab import positional
from extrapolab.model import flex, flex_pieces
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, ModelConfig
from fire_ref import dense, fire
from flexspy import CountSyncs, eager_dense_calls, stub_kernel

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention")


def _qkv(B, H, L, D, seed=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("shared", [False, True])
def test_equals_the_reproduction_in_fp64(shared):
    """Queries on both sides of L = 27.4 (whole sequence, a chunk after a cache, a window, a temperature), tiles
    of 32 (both calls score some) and 128 (at 200 tokens the MLP scores them all): the output equals the dense
    formula to fp64 rounding."""
    s = fire(shared=shared)
    q, k, v = _qkv(2, 3, 200, 8)
    pos = torch.arange(200)
    for qs, kw in ((slice(0, 200), {}), (slice(70, 200), {}), (slice(0, 200), dict(window=50)),
                   (slice(0, 200), dict(tau=0.7))):
        for block in (32, 128):
            with torch.no_grad():
                out = flex_pieces.pieces_path(q[:, :, qs], k, v, qs.start, 0, s, 1, scale=8 ** -0.5,
                                              tau=kw.get("tau", 1.0), window=kw.get("window"), block=block)
            ref = dense(q[:, :, qs], k, v, pos[qs], pos, s, 1, kw.get("window"), kw.get("tau", 1.0))
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        psi, inv, t, _, _ = s.flex_pieces(1, 0, 0, 200, 200, torch.float64)
        few = flex_pieces.tiles(psi, inv, t, 200, 200, 0, None, 32)[1]
        visible = torch.ones(7, 7, dtype=torch.bool).tril()  # [QB, KB] the tiles with a visible score
        assert 0 < int((few & visible).sum()) < int(visible.sum())  # some tiles by pieces, some by the MLP


class _HeadTau(positional.fire.FIRE):
    def temperature(self, q_pos, layer=0):
        return torch.tensor([[0.5], [1.0], [2.0]], dtype=self.c.dtype)  # [H, 1]


def test_attend_takes_it_in_evaluation_only():
    """Without gradients (evaluation) `attend` runs FIRE's rows beyond L on flex-pieces (impl="flex" here; `auto` on
    CUDA, where flex rows ran), equal to the reference path with a per-head temperature; with the parameters'
    gradients (training) flex rows; flex_pieces.ENABLED = False or AttnOptions.exact_routes = False (bench's
    SCHEME+table rows): flex rows."""
    s = fire()
    s.__class__ = _HeadTau
    q, k, v = _qkv(1, 3, 90, 8)
    pos = torch.arange(90)
    ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
    for enabled, grad, routes, want in ((True, False, True, "flex-pieces"), (True, True, True, "flex-rows"),
                                        (False, False, True, "flex-rows"), (True, False, False, "flex-rows")):
        flex_pieces.ENABLED = enabled
        try:
            paths = {}
            with torch.set_grad_enabled(grad):
                got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex", paths=paths, exact_routes=routes))
        finally:
            flex_pieces.ENABLED = True
        assert paths == {want: 1}, (enabled, grad, paths)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_tile_bounds_hold_for_every_score():
    """The piece of every visible score, bucketize(ψ[d]·ι[m], t) as the split path computes it, lies in its tile's
    [s_lo, s_hi]; a tile marked few has s_hi - s_lo <= SPAN (fp32, 700 queries after 60 cached keys, a window)."""
    torch.manual_seed(1)
    s = positional.build("fire", num_heads=4, layers=1, original_length=64)
    Lq, Lk, off, block = 700, 760, 60, 64
    for window in (None, 300):
        psi, inv, t, _, _ = s.flex_pieces(0, off, 0, Lq, off + Lq, torch.float32)
        s_lo, few = flex_pieces.tiles(psi, inv, t, Lq, Lk, off, window, block)
        d = off + torch.arange(Lq)[:, None] - torch.arange(Lk)[None]  # [Lq, Lk]
        vis = (d >= 0) if window is None else (d >= 0) & (d < window)
        piece = torch.bucketize(psi[d.clamp(0, off + Lq - 1)] * inv[:, None], t)  # [Lq, Lk]
        tile_lo = s_lo.repeat_interleave(block, 0)[:Lq].repeat_interleave(block, 1)[:, :Lk]
        tile_few = few.repeat_interleave(block, 0)[:Lq].repeat_interleave(block, 1)[:, :Lk]
        assert bool((piece[vis] >= tile_lo[vis]).all())
        assert bool((piece[vis & tile_few] <= tile_lo[vis & tile_few] + flex_pieces.SPAN).all())
        assert 0 < int(few.sum()) < few.numel()


def test_most_scores_skip_the_mlp_at_long_lengths():
    """GPT-2 small's FIRE (12 heads, 12 layers, L_tr = 512, the scheme's own initialisation, seed 0): the share of
    scores the MLP still evaluates falls with the length (per head and layer: 10.4% at 4,096 tokens, 4.7% at
    8,192 with SPAN = 2 on the CPU where this was written; flex rows evaluate it at every score)."""
    torch.manual_seed(0)
    s = positional.build("fire", num_heads=12, layers=12, original_length=512)
    share = {}
    for L in (4096, 8192):
        mlp = total = 0
        for layer in range(12):
            psi, inv, t, _, _ = s.flex_pieces(layer, 0, 0, L, L, torch.float32)
            _, few = flex_pieces.tiles(psi, inv, t, L, L, 0, None)
            m, n = flex_pieces.evaluations(L, L, 0, None, few)
            mlp, total = mlp + m, total + n
        assert total == 12 * L * (L + 1) // 2
        share[L] = mlp / total
    assert share[4096] < 0.15 and share[8192] < share[4096] / 1.8, share


def test_reads_nothing_back_per_layer(monkeypatch):
    """A FIRE forward beyond L on flex-pieces (kernel stubbed): the host reads do not grow with the layers (the
    tiles' bounds, pieces and block masks stay on the device)."""
    monkeypatch.setattr(flex, "kernel", lambda device: stub_kernel)
    counts = []
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme="fire", vocab_size=64, dim=64, heads=4, layers=layers, train_length=64))
        paths = {}
        with torch.no_grad(), CountSyncs() as c:
            m(torch.randint(0, 64, (1, 256)), opts=AttnOptions(impl="flex", paths=paths))
        counts.append(len(c.calls))
        assert paths == {"flex-pieces": layers}
    assert counts[0] == counts[1] and counts[0] <= 5, counts


@pytest.mark.slow
def test_both_calls_compile_on_the_cpu():
    """Each call's score_mod and block mask through inductor (its CPU template; CUDA compiles the same graph): equal
    to eager FlexAttention. Without the log-sum-exp, which torch 2.13's CPU template does not return."""
    from torch.nn.attention.flex_attention import flex_attention

    s = fire(L_tr=64, L_mult=1.0).float()
    q, k, v = _qkv(1, 3, 1024, 16, dtype=torch.float32)
    comp = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    with torch.no_grad():
        q2, calls = flex_pieces.calls_of(q, k, 0, 0, s, 1)
        for mod, bm, _ in calls:
            want = flex_attention(q2, k, v, score_mod=mod, block_mask=bm)
            got = comp(q2, k, v, score_mod=mod, block_mask=bm)
            assert (got - want).abs().max() < 2e-5


@pytest.mark.gpu
def test_cuda_fire_evaluation_takes_flex_pieces(monkeypatch):
    """FIRE at 8x its L_tr on CUDA (bf16, head size 64): `auto` evaluates on flex-pieces, within twice the split
    path's bf16 error (plus 1e-3) of the fp32 plain path; no eager dense FlexAttention."""
    dense_calls = eager_dense_calls(monkeypatch)
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fire", vocab_size=64, dim=256, heads=4, layers=2, train_length=256)).cuda()
    idx = torch.randint(0, 64, (1, 2048), device="cuda")
    with torch.no_grad():
        ref = m(idx, opts=AttnOptions(impl="plain")).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            paths = {}
            out = m(idx, opts=AttnOptions(paths=paths)).float()
            low = m(idx, opts=AttnOptions(impl="sdpa")).float()
    assert paths == {"flex-pieces": 2} and dense_calls == []
    err = float((out - ref).norm() / ref.norm())
    assert err <= 2 * float((low - ref).norm() / ref.norm()) + 1e-3, err


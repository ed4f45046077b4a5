"""The folded path (model/folded.py, docs/attention.md): ALiBi-form biases -s_h·(p_m - p_n) as one
extra head dimension of the fused causal kernel, at positions with gaps (randomized positions) and
with positions from content (FoX), against an independent dense formula written here; forward,
gradients (to q, k, v and to p), windows, temperatures, queries after a KV cache, 16-bit kernels,
the flash kernel running, and no L x L tensor at 8k tokens."""
import math

import pytest
import torch
from torch.profiler import profile

from extrapolab import positional
from extrapolab.memory import PeakMemory
from extrapolab.model import attention as attn_mod, folded as folded_mod
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, ModelConfig

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _dense(q, k, v, q_pos, k_pos, slopes, pq, pk, window=None, tau=1.0, tau_rows=None):
    """softmax((q·k/sqrt(d) - s_h·(p_m - p_n)) / (tau·tau_m)) v, masked causally (and by window) by
    token position: the formula, computed densely in the inputs' dtype."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Lq, Lk]
    s = s - slopes.view(1, -1, 1, 1).to(s.dtype) * (pq[..., :, None] - pk[..., None, :]).to(s.dtype)
    dist = q_pos[:, None] - k_pos[None]
    bad = (dist < 0) | ((dist >= window) if window else torch.zeros_like(dist, dtype=torch.bool))
    s = s.masked_fill(bad, -math.inf) / tau
    if tau_rows is not None:
        s = s / tau_rows[..., None].to(s.dtype)
    return torch.softmax(s, -1) @ v


def _qkv(B, H, Lq, Lk, D, seed=0, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, H, Lk, D, generator=g, dtype=dtype) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _spy_paths(monkeypatch):
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)[0]) or real(*a, **kw))
    return seen


def test_auto_evaluates_long_alibi_on_cuda_on_the_folded_path(monkeypatch):
    """On CUDA, `auto` evaluates ALiBi's form (no gradient, a whole sequence >= flex.MIN_LENGTH) on the folded flash
    path (FoX's forward there: 1.53x NoPE's at 32,768 tokens on an H100, ALiBi's FlexAttention 2.69x); training,
    shorter inputs, the CPU, impl='flex' and folded.LONG_EVAL = False keep their paths."""
    from extrapolab.model import flex, folded

    s = positional.build("alibi", num_heads=4)
    L = flex.MIN_LENGTH
    kw = dict(same_pos=False, starts=(0, 0), dense_bias=False, folded=True)

    def path(dev="cuda", impl="auto", grad=False, n=L):
        return attn_mod.select_path(dev, s, AttnOptions(impl=impl), (1, 4, n, 64), n, grad=grad, **kw)[0]
    want_flex = "flex" if flex.supported("cuda", 64, torch.float32) else "toeplitz"
    assert path() == "folded"
    assert path(grad=True) == want_flex and path(n=L // 2) == "toeplitz" and path(dev="cpu") == "toeplitz"
    assert path(impl="flex") == "flex" and path(impl="sdpa") == "toeplitz"
    monkeypatch.setattr(folded, "LONG_EVAL", False)
    assert path() == want_flex


@pytest.mark.parametrize("kw", [{}, {"window": 30}])
def test_impl_folded_runs_contiguous_alibi_on_the_folded_path(kw, monkeypatch):
    """impl='folded' (to time it beside FlexAttention, or to pick it): ALiBi at contiguous positions, which auto
    sends to the Toeplitz or flex path, takes the folded path and equals the formula; a scheme without the ALiBi
    form is a one-line error naming impl='auto'."""
    from extrapolab.io import UserError

    s = positional.build("alibi", num_heads=3)
    pos = torch.arange(70)
    q, k, v = _qkv(2, 3, 70, 70, 8)
    seen = _spy_paths(monkeypatch)
    out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="folded", **kw))
    assert seen == ["folded"]
    want = _dense(q, k, v, pos, pos, s.alibi_slopes(0), pos.double()[None, None], pos.double()[None, None], **kw)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    attend(q, k, v, pos, pos, s, 0, AttnOptions(**kw))
    assert seen[-1] == "toeplitz"
    with pytest.raises(UserError, match="impl='auto'") as err:
        attend(q, k, v, pos, pos, positional.build("t5", num_heads=3), 0, AttnOptions(impl="folded"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw", [{}, {"window": 60}, {"temperature": 0.7}, {"impl": "blocked", "block_size": 9},
                                {"impl": "sdpa", "window": 25, "temperature": 1.3}])
def test_alibi_at_random_positions_folds_into_the_fused_kernel(kw, monkeypatch):
    """Sorted positions with gaps (Ruoss et al. 2023's randomized positions): ALiBi leaves the dense
    fallback for the folded path; output and gradients equal the formula."""
    s = positional.build("alibi", num_heads=3)
    g = torch.Generator().manual_seed(1)
    pos = torch.randperm(400, generator=g)[:50].sort().values  # [50] increasing, with gaps
    q, k, v = _qkv(2, 3, 50, 50, 8)
    seen = _spy_paths(monkeypatch)
    out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(**kw))
    assert seen == ["folded"]
    p = pos.double().view(1, 1, -1)
    ref = _dense(q, k, v, pos, pos, s.slopes, p, p, kw.get("window"), kw.get("temperature", 1.0))
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), go)
    want = torch.autograd.grad(ref, (q, k, v), go)
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-10


def test_content_positions_fold_with_gradients_to_p_and_cached_queries():
    """Positions from content [B, H, L] (any non-decreasing p, as FoX's -cumsum(log f)): forward and
    gradients w.r.t. q, k, v and p equal the formula, for a whole sequence (one is_causal call), in
    blocks of 7 rows, and for the last 9 queries over every key (a KV cache)."""
    s = positional.build("fox", num_heads=3, dim=8, layers=1)
    q, k, v = _qkv(2, 3, 40, 40, 8, seed=2)
    g = torch.Generator().manual_seed(3)
    p = torch.rand(2, 3, 40, generator=g, dtype=torch.float64).mul(2.0).cumsum(-1).requires_grad_()
    pos = torch.arange(40)
    ones = torch.ones(3, dtype=torch.float64)
    for impl, bs, rows in (("auto", 1024, slice(None)), ("blocked", 7, slice(None)), ("auto", 1024, slice(31, 40))):
        qr, pq = q[:, :, rows], p[..., rows]
        out, _ = attend(qr, k, v, pos[rows], pos, s, 0, AttnOptions(impl=impl, block_size=bs), content=(pq, p))
        ref = _dense(qr, k, v, pos[rows], pos, ones, pq, p)
        go = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v, p), go)
        want = torch.autograd.grad(ref, (q, k, v, p), go)
        assert (out - ref).abs().max() < 1e-12, impl
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-10, (impl, rows)


def test_long_content_positions_stay_exact_by_recentring_and_never_build_LxL():
    """3,000 tokens of FoX-like positions growing ~0.7 per token (a gate near 0.5, the steepest a
    FoX model starts with): one fused call re-centred per group of 512 queries agrees with the fp64
    formula to fp32 rounding of numbers up to ~180·sqrt(d); 8k tokens stay O(L) memory."""
    s = positional.build("fox", num_heads=2, dim=8, layers=1)
    L = 3000
    q, k, v = _qkv(1, 2, L, L, 16, seed=4, dtype=torch.float32, grad=False)
    p = torch.rand(1, 2, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64).mul(1.4).cumsum(-1)
    pos = torch.arange(L)
    with torch.no_grad():
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(), content=(p, p))
        ref = _dense(q.double(), k.double(), v.double(), pos, pos, torch.ones(2, dtype=torch.float64), p, p)
    assert (out.double() - ref).abs().max() < 5e-5
    L = 8192  # one [H, L, L] fp32 bias would be 512 MiB
    q, k, v = _qkv(1, 2, L, L, 16, seed=6, dtype=torch.float32, grad=False)
    p = torch.rand(1, 2, L, dtype=torch.float64).cumsum(-1)
    pos = torch.arange(L)
    with torch.no_grad(), PeakMemory() as mem:
        attend(q, k, v, pos, pos, s, 0, AttnOptions(), content=(p, p))
    assert mem.mib < 96, mem.mib


def test_bf16_kernel_keeps_the_bias_to_16_more_bits():
    """Under bf16 autocast the key column is split hi + lo: positions of a fast gate (range ~350
    over 512 tokens) leave the output within bf16's own error of the fp64 formula, while one bf16
    column would round the bias near the diagonal by up to ~1 nat."""
    s = positional.build("fox", num_heads=2, dim=8, layers=1)
    q, k, v = _qkv(1, 2, 512, 512, 16, seed=7, dtype=torch.float32, grad=False)
    p = (0.69 + 0.01 * torch.rand(1, 2, 512, generator=torch.Generator().manual_seed(8), dtype=torch.float64)).cumsum(-1)
    pos = torch.arange(512)
    qb, kb, vb = (t.bfloat16().double() for t in (q, k, v))  # the inputs as the bf16 kernel sees them
    ref = _dense(qb, kb, vb, pos, pos, torch.ones(2, dtype=torch.float64), p, p)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(), content=(p, p))
        coarse = _dense(q, k, v, pos, pos, torch.ones(2), p.bfloat16().float(), p.bfloat16().float())
    err = (out.double() - ref).abs().max().item()
    assert err < 0.03, err  # bf16 output rounding
    assert (coarse.double() - ref).abs().max().item() > 3 * err  # what a single 16-bit column would cost


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("tau_rows", [False, True])
def test_padded_head_and_per_query_tau_keep_forward_and_gradients_exact(multiple, tau_rows, monkeypatch):
    """With the head padded to a multiple of 8 by zero columns (what CUDA's flash kernels need, forced here on
    the CPU) and with or without a per-query temperature (the exact and the general query columns), in one
    group and in several: forward and gradients to q, k, v and p equal the formula in fp64."""
    monkeypatch.setattr(folded_mod, "HEAD_MULTIPLE", {"cpu": multiple})
    monkeypatch.setattr(folded_mod, "FOLD_GROUP", 16)  # 40 queries: 3 groups (one-hot query columns)
    s = positional.build("fox", num_heads=3, dim=8, layers=1)
    q, k, v = _qkv(2, 3, 40, 40, 6, seed=11)
    p = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(12), dtype=torch.float64).cumsum(-1)
    p.requires_grad_()
    pos = torch.arange(40)
    tr = (0.5 + torch.rand(1, 3, 40, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
          if tau_rows else None)
    ones = torch.ones(3, dtype=torch.float64)
    for rows in (slice(None), slice(30, 40)):  # several groups (40 rows), one group (10 rows)
        out = folded_mod.folded_attention(q[:, :, rows], k, v, pos[rows], pos, ones, p[..., rows], p,
                                          base_scale=1 / math.sqrt(6), scale=1 / math.sqrt(6),
                                          tau_rows=None if tr is None else tr[..., rows], same=rows == slice(None))
        ref = _dense(q[:, :, rows], k, v, pos[rows], pos, ones, p[..., rows], p,
                     tau_rows=None if tr is None else tr[..., rows])
        go = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v, p), go)
        want = torch.autograd.grad(ref, (q, k, v, p), go)
        assert out.shape == ref.shape and (out - ref).abs().max() < 1e-12, rows
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-10, rows


def test_bf16_fold_gives_p_the_gradient_of_the_formula():
    """Under bf16 autocast the key column is split hi + lo (one column's worth of gradient, d hi): the gradient to
    FoX-like positions matches the fp64 formula's on the same bf16 inputs within bf16 rounding; counting both
    halves' gradients would double it."""
    q, k, v = _qkv(1, 2, 256, 256, 16, seed=14, dtype=torch.float32, grad=False)
    q, k, v = (t.bfloat16().float() for t in (q, k, v))  # exact in bf16: the kernel sees these
    p = (0.3 + 0.4 * torch.rand(1, 2, 256, generator=torch.Generator().manual_seed(15), dtype=torch.float64))
    p = p.cumsum(-1).requires_grad_()
    s = positional.build("fox", num_heads=2, dim=8, layers=1)
    pos = torch.arange(256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(), content=(p, p))
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(16))
    got, = torch.autograd.grad(out.float(), p, go)
    ref = _dense(q.double(), k.double(), v.double(), pos, pos, torch.ones(2, dtype=torch.float64), p, p)
    want, = torch.autograd.grad(ref, p, go.double())
    err = float((got - want).norm() / want.norm())
    assert err < 0.02, err


def test_a_training_call_builds_no_constants_and_slices_nothing_twice():
    """A one-group call (a training step) after the first: its query columns and padding are cached (no zeros,
    ones or fills), the hi/lo split's backward is one kernel, and nothing is sliced on its whole range (whose
    backward would zero-fill a copy): the folded layer's operator count, which on a GPU is its launches."""
    from flexspy import count_ops
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fox", vocab_size=50, dim=32, heads=4, layers=1, train_length=64))
    idx = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(2))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(idx)
        out.float().square().mean().backward()
    step()
    with count_ops() as ops:
        step()
    made = {n: c for n, c in ops.items() if n in ("zeros", "ones", "new_zeros", "fill_", "zero_", "ones_like")}
    assert made == {"ones_like": 1}, made  # the loss's own backward seed
    assert ops["slice_backward"] == 1  # the output's (it drops the bias columns); none of a whole range


@pytest.mark.parametrize("name", ["fox", "alibi"])
def test_folded_training_runs_the_fused_flash_kernel_forward_and_backward(name):
    """A train step of a FoX model, and of ALiBi at randomized positions, runs the CPU flash kernel
    (forward and backward), never the math fallback."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=50, dim=32, heads=4, layers=2, train_length=512))
    idx = torch.randint(0, 50, (2, 128), generator=torch.Generator().manual_seed(2))
    pos = None if name == "fox" else torch.randperm(512)[:128].sort().values
    with profile() as prof:
        m(idx, positions=pos).float().square().mean().backward()
    ops = {e.key for e in prof.key_averages()}
    assert FLASH in ops and FLASH + "_backward" in ops and MATH not in ops, sorted(o for o in ops if "dot" in o)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["fox", "alibi"])
def test_cuda_folded_forward_and_gradients_equal_plain(name, dtype):
    """On CUDA the fold pads the head size to a multiple of 8 (flash kernels) and, in bf16, splits the
    key column hi + lo: a FoX model, and ALiBi at randomized positions, at head size 64 agree with the
    plain path in fp32 (forward and gradients), within bf16 rounding under autocast."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=256, heads=4, layers=2, train_length=512,
                        init_std=0.05)).cuda()
    idx = torch.randint(0, 64, (2, 300), device="cuda")
    pos = None if name == "fox" else torch.randperm(2000, device="cuda")[:300].sort().values
    grads, outs = {}, {}
    for impl in ("plain", "auto"):
        m.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = m(idx, positions=pos, opts=AttnOptions(impl=impl)).float()
        out.square().mean().backward()
        outs[impl] = out.detach()
        grads[impl] = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    assert (outs["auto"] - outs["plain"]).abs().max() < tol * outs["plain"].abs().max()
    for n, g in grads["plain"].items():
        assert (grads["auto"][n] - g).abs().max() <= 10 * tol * g.abs().max() + 1e-6, n

"""Positions from content (FoX) on FlexAttention (model/flex_content.py): the key term's gradient kernel on Triton's
interpreter and its PyTorch form against autograd of the dense formula, the path against the reference at fp64, the
selection rule, the fallback; on a GPU, a FoX model's training step against the plain path."""
import copy
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.io import UserError
from extrapolab.model import flex, flex_content, table_grad
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, ModelConfig
from flexspy import grad_mismatches, launch_spy

pytest.importorskip("triton")


def _dense(q, k, v, c, scale, inv_tau, window):
    """softmax((q·kᵀ·scale + c_n - c_m) · inv_tau) v, causal and m - n < window: out, lse."""
    L = q.shape[2]
    d = torch.arange(L)[:, None] - torch.arange(L)[None]
    vis = (d >= 0) & (d < (window or L))
    logit = (q @ k.transpose(-1, -2) * scale + c[..., None, :] - c[..., :, None]) * inv_tau  # [B, H, L, L]
    logit = logit.masked_fill(~vis, -math.inf)
    return torch.softmax(logit, -1) @ v, torch.logsumexp(logit, -1)


@pytest.mark.parametrize("L,window,block,heads_only", [(70, None, 16, False), (50, 20, 32, False), (16, None, 16, False),
                                                        (100, 37, 16, True)])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton-interpreter"])
def test_key_term_gradient_equals_autograd_of_the_dense_formula(L, window, block, heads_only, kernel, monkeypatch):
    """q, k, v's gradients pass through untouched; c's (the key term's: the row term's is zero) equals autograd's of
    the two-sided formula, to fp64 rounding (PyTorch) or fp32's (the kernel on the interpreter); c of shape
    [B, H, L] or broadcast over the batch, values growing like FoX's cumulative sums."""
    launched = []
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        launched = launch_spy(monkeypatch, flex_content)
    dt = torch.float32 if kernel else torch.float64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, L, 12, generator=g, dtype=dt).requires_grad_() for _ in range(3))
    c = (torch.rand(1 if heads_only else 2, 3, L, generator=g, dtype=torch.float64) * 3).cumsum(-1).requires_grad_()
    w = torch.randn(2, 3, L, 12, generator=g, dtype=dt)
    out, _ = _dense(q, k, v, c.to(dt), 0.3, 0.8, window)
    want = torch.autograd.grad((out * w).sum(), [q, k, v, c])
    out, lse = _dense(q, k, v, c.detach().to(dt), 0.3, 0.8, window)
    hi = c.detach().float().expand(2, 3, L)
    lo = (c.detach() - hi.double()).float()
    out = flex_content.attach(out, lse, q, k, v, c, hi, lo, scale=0.3, inv_tau=0.8, window=window, block=block)
    got = torch.autograd.grad((out * w).sum(), [q, k, v, c])
    assert len(launched) == kernel
    for name, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), name
    assert got[3].shape == c.shape
    err = ((got[3] - want[3]).abs().max() / want[3].abs().max()).item()
    assert err < (1e-5 if kernel else 1e-12), err


def _fox():
    s = positional.build("fox", num_heads=3, dim=16, layers=2)
    with torch.no_grad():  # gates away from 0.5 and unequal across heads: a real spread of positions
        s.w.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        s.b.copy_(torch.tensor([0.5, 2.0, 4.0]))
    return s


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton-interpreter"])
def test_flex_content_path_equals_the_reference_with_the_gates_gradients(kernel, monkeypatch):
    """FoX through FlexAttention (CPU: q, k, v without gradients, the gates with them) against the plain path at
    fp64: the output and the gate's gradients (PyTorch's form in fp64 to rounding; the kernel in fp32 on the
    interpreter within 1e-3 beyond twice the fp32 plain path's own error); windows and a layer temperature; the
    path taken is flex-content."""
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = _fox()
    s64 = copy.deepcopy(s).double()
    g = torch.Generator().manual_seed(1)
    q, k, v, go = (torch.randn(2, 3, 150, 16, generator=g) for _ in range(4))
    x = torch.randn(2, 150, 16, generator=g)
    pos = torch.arange(150)
    dt_flex, sf = (torch.float32, s) if kernel else (torch.float64, s64)  # PyTorch's form: fp64 all through
    for kw in ({}, {"window": 37}, {"temperature": 0.7}):
        res = {}
        for key, impl, sch, dt in (("ref", "plain", s64, torch.float64), ("low", "plain", s, torch.float32),
                                   ("flex", "flex", sf, dt_flex)):
            p = sch.content_positions(x.to(dt), 1)
            ran = {}
            out, _ = attend(q.to(dt), k.to(dt), v.to(dt), pos, pos, sch, 1, AttnOptions(impl=impl, paths=ran, **kw),
                            content=(p, p))
            grads = torch.autograd.grad(out, [sch.w, sch.b], go.to(dt))
            res[key] = (out.double(), {n: t.float() for n, t in zip("wb", grads)}, ran)
        assert res["flex"][2] == {"flex-content": 1}, res["flex"][2]
        assert (res["flex"][0] - res["ref"][0]).abs().max() < (1e-5 if kernel else 1e-12), kw
        # fp32: the recomputed logits round relative to |c| (a cumulative sum), not to |c_n - c_m| as the plain
        # path's fp64 bias does: within 1e-3 of each gradient's norm; fp64: to rounding
        bad = grad_mismatches(res["flex"][1], res["ref"][1], 1e-3 if kernel else 1e-10, torch.float32,
                              res["low"][1] if kernel else None)
        assert not bad and res["flex"][1]["w"].abs().max() > 0, (kw, bad)


def test_selection_rule():
    """impl="flex" takes flex-content for a whole sequence of a content scheme; `auto` only on CUDA with
    flex.AUTO_CONTENT; never with a per-query temperature, sinks, blocks or after a KV cache (Lq != Lk)."""
    s = _fox()
    kw = dict(same_pos=False, starts=(0, 0), dense_bias=False, grad=True, folded=True, same_keys=True)
    shape = (2, 3, flex.MIN_LENGTH, 64)

    def path(dev="cuda", opts=AttnOptions(impl="flex"), **over):
        return select_path(dev, s, opts, shape, shape[2], **{**kw, **over})[0]

    want = "flex-content" if flex.supported("cuda", 64, torch.float32) else "folded"
    assert path() == "flex-content"
    assert path(opts=AttnOptions()) == "folded"  # AUTO_CONTENT off
    assert path(tau_rows=True) == path(same_keys=False) == "folded"
    assert path(opts=AttnOptions(impl="blocked")) == "folded"
    assert path("cpu", grad=False) == "flex-content"
    with pytest.raises(UserError, match="no backward"):
        path("cpu")
    flex.AUTO_CONTENT = True
    try:
        assert path(opts=AttnOptions()) == want
        assert path(opts=AttnOptions(), sinks=True) == path("cpu", opts=AttnOptions()) == "folded"
    finally:
        flex.AUTO_CONTENT = False


def test_a_kernel_that_cannot_run_takes_the_folded_path_with_one_line(monkeypatch):
    def full(*a, **kw):
        raise flex.RecompileLimit(3)

    monkeypatch.setattr(flex, "kernel", lambda device: full)
    s = _fox()
    q, k, v = (torch.randn(1, 3, 70, 16) for _ in range(3))
    p = s.content_positions(torch.randn(1, 70, 16), 0).detach()
    pos = torch.arange(70)
    with torch.no_grad():
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"), content=(p, p))
        with pytest.warns(RuntimeWarning, match="Lq=70 Lk=70 .* folded path instead"):
            got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"), content=(p, p))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fox_trains_through_flex_content_like_the_plain_path(dtype, monkeypatch):
    """A FoX training step on CUDA through the compiled kernel and the key-term kernel: output and every gradient
    as the plain path's (fp32: 1e-4 of each gradient's norm; bf16: within twice the plain path's own bf16 error).
    fp32 at 300 tokens only (whole blocks and a partial one): each length is a cold compile, and this test in fp32
    at two lengths took 124 s on an H200 (docs/results/gpu-h200-2026-11-27.md), the pytest stage's longest."""
    launched = launch_spy(monkeypatch, flex_content)
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fox", vocab_size=64, dim=256, heads=4, layers=2, train_length=1024)).cuda()

    def step(impl, dt):
        m.zero_grad()
        with torch.autocast("cuda", dtype=dt, enabled=dt != torch.float32):
            out = m(idx, opts=AttnOptions(impl=impl))
        out.float().square().mean().backward()
        return {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}

    for L in ((300,) if dtype == torch.float32 else (100, 300)):
        idx = torch.randint(0, 64, (2, L), device="cuda", generator=torch.Generator("cuda").manual_seed(L))
        ref = step("plain", torch.float32)
        got = step("flex", dtype)
        low = None if dtype == torch.float32 else step("plain", dtype)
        bad = grad_mismatches(got, ref, 1e-4 if low is None else 1e-3, dtype, low)
        assert not bad, (L, bad)
    assert launched and not table_grad._FAILED


@pytest.mark.slow
def test_compiled_kernel_lowers_the_content_score_mod(monkeypatch):
    """The compiled kernel CUDA uses, on the CPU (inductor's forward template): FoX's score_mod, which indexes
    captured [B, H, L] vectors by batch, head, query and key, lowers and equals the plain path; a new layer's gates
    and a temperature reuse the graph (captured tensors and 0-d values, not constants). ~25 s on 2 cores."""
    from torch._dynamo.utils import counters

    compiled = flex.Compiled()
    monkeypatch.setattr(flex, "kernel", lambda device: compiled)
    s = _fox()
    q, k, v = (torch.randn(2, 3, 256, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    x = torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(256)
    graphs = []
    with torch.no_grad():
        for layer, tau in ((1, 1.0), (0, 0.7)):
            p = s.content_positions(x, layer)
            ran = {}
            got, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="flex", temperature=tau, paths=ran),
                            content=(p, p))
            ref, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="plain", temperature=tau), content=(p, p))
            assert ran == {"flex-content": 1} and (got - ref).abs().max() < 2e-5, (layer, tau)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] and [e["status"] for e in compiled.events] == ["compiled"]

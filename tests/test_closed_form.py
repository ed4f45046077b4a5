"""Closed-form score_mods (``scheme.closed_form``, docs/attention.md "Forms of the score_mod"): KERPLE's and Qin's
bias computed per score inside FlexAttention instead of gathered from the [H, n] distance table. The formula equals
the table for every scheme that declares one (fp64 to rounding, fp32 to a few ulps); the flex forward with it equals
the dense softmax formula and the gathered table's forward (eager FlexAttention on the CPU, fp64 and fp32); training
a learnable table through it keeps table_grad's gradient; `slow`: the compiled kernel on the CPU; `gpu`: on CUDA."""
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.model import flex
from extrapolab.model.attention import AttnOptions, attend
from flexspy import eager_dense_calls

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention")
CLOSED = [n for n in positional.names() if positional.build(n, num_heads=2).closed_form() is not None]


def _scheme(name, heads=3, dtype=torch.float64, seed=3):
    s = positional.build(name, num_heads=heads).to(dtype)
    with torch.no_grad():  # learnable parameters away from their init
        for p in s.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 0.5)
    s.constrain_()
    return s


def _qkv(B, H, L, D, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(3))


def test_which_schemes_declare_one():
    """Cheap pointwise formulas only: KERPLE's additive kernels and Qin's four RPEs; not T5 (buckets: the near-far
    path), Sandwich (64 cosines a score), FIRE (an MLP), ALiBi (its own `alibi` form) nor weight kernels."""
    assert set(CLOSED) == {"kerple-log", "kerple-power", "kerple-3para-log", "kerple-gauss-2para-bias",
                           "kerple-gauss-3para-bias", "qin-type1", "qin-type2", "qin-example1", "qin-example2"}


@pytest.mark.parametrize("name", CLOSED)
def test_formula_equals_the_distance_table(name):
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 4e-7)):
        s = _scheme(name, dtype=dtype)
        d = torch.arange(5000)
        table = s.distance_table(5000, 0, None, dtype)  # [H, n]
        f = s.closed_form(0, dtype, None)
        got = torch.stack([f(torch.tensor(h), d.to(dtype)) for h in range(3)])  # [H, n], h a 0-d index as in flex
        assert got.dtype == dtype
        torch.testing.assert_close(got, table, rtol=tol, atol=tol, msg=lambda m: f"{name} {dtype}: {m}")


def _dense(q, k, v, s, q_pos, k_pos, tau=1.0, window=None):
    d = q_pos[:, None] - k_pos[None]  # [Lq, Lk]
    b = s.bias_from_distance(d.clamp(min=0)).to(q.dtype)  # [H, Lq, Lk]
    hide = (d < 0) if window is None else (d < 0) | (d >= window)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + b.masked_fill(hide, -math.inf)) / tau
    return torch.softmax(logits, -1) @ v


@pytest.mark.parametrize("name", ["kerple-log", "kerple-power", "qin-type1", "qin-example2"])
def test_flex_forward_equals_the_dense_formula_and_the_gathered_table(name, monkeypatch):
    """A whole sequence over several 128-blocks, a chunk after a cached prefix, a window, a temperature: the
    closed form's forward equals the dense formula (fp64 to rounding) and the gathered table's forward (fp64:
    to rounding; fp32: 2e-6), and `attend` counts it as flex-closed."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        s = _scheme(name, dtype=dtype)
        q, k, v = _qkv(2, 3, 300, 16, dtype=dtype)
        pos = torch.arange(300) + 4
        for qs, kw in ((slice(0, 300), {}), (slice(170, 300), {}), (slice(0, 300), dict(window=37)),
                       (slice(0, 300), dict(temperature=0.6))):
            with torch.no_grad():
                paths = {}
                got, _ = attend(q[:, :, qs], k, v, pos[qs], pos, s, 0, AttnOptions(impl="flex", paths=paths, **kw))
                monkeypatch.setattr(flex, "CLOSED_FORM", False)
                table, _ = attend(q[:, :, qs], k, v, pos[qs], pos, s, 0, AttnOptions(impl="flex", paths={}, **kw))
                monkeypatch.setattr(flex, "CLOSED_FORM", True)
            assert paths == {"flex-closed": 1}, paths
            torch.testing.assert_close(got, table, rtol=0, atol=tol)
            if dtype == torch.float64:
                ref = _dense(q[:, :, qs], k, v, s, pos[qs], pos, kw.get("temperature", 1.0), kw.get("window"))
                torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_learnable_table_trains_through_it_with_table_grads_gradient():
    """Training on the flex path (impl="flex"): the forward runs the closed form (parameters detached), the
    gradient comes from model/table_grad.py's sums over the table; equal (fp64) to the gathered table's route
    and to the Toeplitz path's (HankelSDPA: the table's gradient as anti-diagonal sums)."""
    s = _scheme("kerple-log")
    q, k, v = _qkv(2, 3, 200, 16)
    pos = torch.arange(200)
    go = torch.randn(2, 3, 200, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = {}
    for impl, closed in (("sdpa", True), ("flex", True), ("flex", False)):
        flex.CLOSED_FORM = closed
        try:
            paths = {}
            out, _ = attend(q, k, v, pos, pos, s, 1, AttnOptions(impl=impl, temperature=0.8, paths=paths))
        finally:
            flex.CLOSED_FORM = True
        assert paths == {"toeplitz" if impl == "sdpa" else "flex-closed" if closed else "flex": 1}, paths
        grads[impl, closed] = torch.autograd.grad(out, list(s.parameters()), go)
    for a, b, c in zip(grads["flex", True], grads["flex", False], grads["sdpa", True]):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_compiled_closed_forms_equal_the_toeplitz_path(monkeypatch):
    """The compiled kernel (inductor's CPU template, as torch.compile builds it on CUDA) runs each closed form:
    log1p, a power through `where`, log(log(n)) -- each a cold compile of ~5-10 s on a 2-core CPU."""
    compiled = flex.Compiled()
    monkeypatch.setattr(flex, "kernel", lambda device: compiled)
    for name in ("kerple-log", "kerple-power", "qin-example2"):
        s = _scheme(name, heads=2, dtype=torch.float32)
        q, k, v = _qkv(1, 2, 256, 16, dtype=torch.float32)
        pos = torch.arange(256)
        with torch.no_grad():
            got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
            ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
        assert (got - ref).abs().max() < 2e-5, name
    assert compiled.events and all(e["status"] == "compiled" and not e["gather"] for e in compiled.events)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kerple-log", "qin-type1"])
def test_cuda_closed_form_forward_equals_plain(name, monkeypatch):
    """`auto` evaluates them on the closed form from flex.MIN_LENGTH tokens on CUDA (bf16 at head size 64): within
    twice the Toeplitz path's bf16 error (plus 1e-3) of the fp32 plain path; no eager dense FlexAttention."""
    dense = eager_dense_calls(monkeypatch)
    s = _scheme(name, heads=4, dtype=torch.float32).cuda()
    L = 2048
    q, k, v = (t.cuda() for t in _qkv(1, 4, L, 64, dtype=torch.float32))
    pos = torch.arange(L, device="cuda")
    with torch.no_grad():
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            paths = {}
            out, _ = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos, pos, s, 0, AttnOptions(paths=paths))
            low, _ = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos, pos, s, 0, AttnOptions(impl="sdpa"))
    assert paths == {"flex-closed": 1} and dense == []
    err = float((out.float() - ref).norm() / ref.norm())
    assert err <= 2 * float((low.float() - ref).norm() / ref.norm()) + 1e-3, err

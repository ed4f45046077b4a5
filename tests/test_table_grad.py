"""The learnable table's gradient beside FlexAttention (model/table_grad.py): the Triton kernel on Triton's
interpreter and its PyTorch tiles against autograd through the dense formula, the flex path wired to it, and its
fallbacks."""
import copy
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.model import flex, table_grad
from extrapolab.model.attention import AttnOptions, attend
from flexspy import CountSyncs, grad_mismatches, launch_spy

pytest.importorskip("triton")


def _dense(q, k, v, tab, off, scale, inv_tau, window):
    """softmax((q·kᵀ·scale + tab[h, off + m - n]) · inv_tau) v over 0 <= off + m - n < min(n, window): out, lse."""
    Lq, Lk, n = q.shape[2], k.shape[2], tab.shape[-1]
    d = off + torch.arange(Lq)[:, None] - torch.arange(Lk)[None]  # [Lq, Lk]
    vis = (d >= 0) & (d < (min(n, window) if window else n))
    logit = (q @ k.transpose(-1, -2) * scale + tab[:, d.clamp(0, n - 1)]) * inv_tau  # [B, H, Lq, Lk]
    logit = logit.masked_fill(~vis, -math.inf)
    return torch.softmax(logit, -1) @ v, torch.logsumexp(logit, -1)


CASES = [  # Lq, Lk, off, window, n, block, -inf distances
    (70, 70, 0, None, 70, 16, False),  # lengths not multiples of the block
    (40, 100, 60, None, 100, 16, False),  # a chunk after a cached prefix
    (50, 50, 0, 20, 50, 32, False),  # a window shorter than a block offset
    (33, 33, 0, None, 45, 16, True),  # a longer table; -inf distances (a dilation's pattern)
    (16, 16, 0, None, 16, 16, False),  # one tile
]


def _grads(dt, case, route: bool, seed=0):
    Lq, Lk, off, window, n, block, holes = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, L, 12, generator=g, dtype=torch.float64).to(dt).requires_grad_()
               for L in (Lq, Lk, Lk))
    tab = torch.randn(3, n, generator=g, dtype=torch.float64)
    if holes:
        tab[:, 3::4] = -math.inf
    tab = tab.to(dt if dt == torch.float64 else torch.float32).requires_grad_()
    w = torch.randn(2, 3, Lq, 12, generator=g, dtype=torch.float64).to(dt)
    kw = dict(off=off, scale=0.3, inv_tau=0.8, window=window)
    if route:
        out, lse = _dense(q, k, v, tab.detach(), *kw.values())
        out = table_grad.attach(out, lse, q, k, v, tab, block=block, **kw)
    else:
        out, _ = _dense(q, k, v, tab, *kw.values())
    return torch.autograd.grad((out * w).sum(), [q, k, v, tab])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", [False, True], ids=["torch-tiles", "triton-interpreter"])
def test_table_gradient_equals_autograd_of_the_dense_formula(case, kernel, monkeypatch):
    """q, k, v's gradients pass through untouched; the table's equals autograd's to fp64 rounding (PyTorch tiles,
    fp64) or fp32 rounding (the Triton kernel on the interpreter, fp32), -inf distances included (gradient 0)."""
    launched = []
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        launched = launch_spy(monkeypatch, table_grad)
    dt = torch.float32 if kernel else torch.float64
    want, got = _grads(dt, case, route=False), _grads(dt, case, route=True)
    assert len(launched) == kernel
    for name, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), name
    tol = 1e-5 if kernel else 1e-12
    err = ((got[3] - want[3]).abs().max() / want[3].abs().max()).item()
    assert want[3].abs().max() > 0 and err < tol, (case, err)
    if case[-1]:  # masked distances get exactly zero
        assert torch.all(got[3][:, 3::4] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_with_16_bit_inputs_is_as_close_to_fp64_as_the_inputs_allow(dtype, monkeypatch):
    """16-bit q, k, v, dO (fp32 accumulation, as on the GPU): the table's gradient within 1% of fp64's on the same
    rounded inputs, 64-wide head, 150 tokens over three 64-blocks."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(2, 2, 150, 64, generator=g).to(dtype) for _ in range(4))
    tab = torch.randn(2, 150, generator=g)
    t64 = tab.double().requires_grad_()
    out, _ = _dense(*(x.double() for x in (q, k, v)), t64, 0, 0.125, 1.0, None)
    want, = torch.autograd.grad((out * w.double()).sum(), [t64])
    t32 = tab.clone().requires_grad_()
    out, lse = _dense(q.float(), k.float(), v.float(), tab, 0, 0.125, 1.0, None)
    out = table_grad.attach(out.to(dtype), lse, q, k, v, t32, off=0, scale=0.125, inv_tau=1.0)
    got, = torch.autograd.grad((out * w).sum(), [t32])
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_batch_groups_give_the_same_gradient(monkeypatch):
    """Past SCRATCH_MB the kernel sums batch entries inside each program instead of one program per entry."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = _grads(torch.float32, CASES[0], route=True)[3]
    monkeypatch.setattr(table_grad, "SCRATCH_MB", 0)
    got = _grads(torch.float32, CASES[0], route=True)[3]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fp32_operands_ask_the_kernel_for_ieee_products(monkeypatch):
    """Triton's tl.dot multiplies fp32 operands in TF32 on a GPU unless told otherwise (the fp32 GPU tests saw
    the tables' gradients 1e-3 to 1e-2 off the plain path on an H100): the launch passes input_precision
    "ieee" for fp32 inputs and Triton's default for 16-bit ones (which it ignores)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen, real = [], table_grad._kernel

    class Spy:
        def __init__(self, interp):
            self.k = real(interp)

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["PREC"]) or self.k[grid](*a, **kw)
    monkeypatch.setattr(table_grad, "_kernel", Spy)
    _grads(torch.float32, CASES[4], route=True)
    assert seen == ["ieee"]
    assert table_grad.dot_precision(torch.ones(1, dtype=torch.bfloat16)) == "tf32"


def test_a_kernel_that_does_not_compile_warns_once_and_uses_the_torch_tiles(monkeypatch):
    """Never a traceback from the backward: Triton's out-of-resources (or compile) error -> one warning, the PyTorch
    tiles from then on, the same gradient; any other error is raised."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(table_grad, "_FAILED", [])
    want = _grads(torch.float32, CASES[0], route=True)[3]
    calls = []

    def fails(*a):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(table_grad, "_launch", fails)
    with pytest.warns(RuntimeWarning, match="did not compile .*OutOfResources.* PyTorch tiles"):
        got = _grads(torch.float32, CASES[0], route=True)[3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _grads(torch.float32, CASES[0], route=True)  # no second try, no second warning
    assert calls == [1]
    monkeypatch.setattr(table_grad, "_FAILED", [])
    monkeypatch.setattr(table_grad, "_launch", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _grads(torch.float32, CASES[0], route=True)


def test_forward_and_backward_read_nothing_back():
    """No host-device synchronisation: block offsets come from the shapes, never from device values."""
    q, k, v = (torch.randn(1, 2, 90, 16, requires_grad=True) for _ in range(3))
    tab = torch.randn(2, 90, requires_grad=True)
    out, lse = _dense(q.detach(), k.detach(), v.detach(), tab.detach(), 0, 0.25, 1.0, None)
    with CountSyncs() as c:
        table_grad.attach(out, lse, q, k, v, tab, off=0, scale=0.25, inv_tau=1.0, block=32).sum().backward()
    assert c.calls == [] and tab.grad.abs().max() > 0


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-tiles", "triton-interpreter"])
@pytest.mark.parametrize("name", ["t5", "kerple-log", "sliding-dilated", "fire"])
def test_flex_path_trains_tables_through_the_route_like_the_reference(name, kernel, monkeypatch):
    """The flex path (CPU FlexAttention: tables only need gradients) reads the learnable table detached, so no
    captured tensor needs one (no atomics on a GPU), and its gradient, window and temperature included, equals
    the plain path's; the route is off with ``flex.TABLE_GRAD = False``."""
    if kernel:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    s = positional.build(name, num_heads=3, **({"original_length": 160} if name == "fire" else {}))  # FIRE: L >= 150
    g = torch.Generator().manual_seed(2)
    q, k, v, go = (torch.randn(2, 3, 150, 16, generator=g) for _ in range(4))
    pos = torch.arange(150)
    routes = []
    real = table_grad.attach
    monkeypatch.setattr(table_grad, "attach", lambda *a, **kw: routes.append(1) or real(*a, **kw))
    s64 = copy.deepcopy(s).double()
    for kw in ({"temperature": 0.8}, {"window": 37}):
        grads = {}
        for key, impl, sch, dt in (("ref", "plain", s64, torch.float64), ("low", "plain", s, torch.float32),
                                   ("flex", "flex", s, torch.float32)):
            out, _ = attend(q.to(dt), k.to(dt), v.to(dt), pos, pos, sch, 1, AttnOptions(impl=impl, **kw))
            names, params = zip(*sch.named_parameters())
            grads[key] = {n: g.float() for n, g in zip(names, torch.autograd.grad(out, params, go.to(dt)))}
        # within 1e-4 of fp64 beyond twice the fp32 plain path's own error (FIRE's b2: exactly 0, rounding noise)
        bad = grad_mismatches(grads["flex"], grads["ref"], 1e-4, torch.float32, grads["low"])
        assert not bad and any(g.abs().max() > 0 for g in grads["flex"].values()), (name, kw, bad)
    assert len(routes) == 2
    monkeypatch.setattr(flex, "TABLE_GRAD", False)
    attend(q, k, v, pos, pos, s, 1, AttnOptions(impl="flex"))
    assert len(routes) == 2

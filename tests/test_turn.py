"""The rotary rotation's fused kernel (positional/turn.py) against the eager formula in fp64: forward and the
input gradient, on Triton's interpreter here (``TRITON_INTERPRET=1``) and on CUDA where there is one.

The kernel is what rotary, its kinds and xPos run on a GPU (docs/attention.md, "The rotation"); on the CPU
they stay eager, so without these tests nothing in CI would ever execute it.
"""
import pytest
import torch

from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional import turn

triton = pytest.importorskip("triton", reason="the kernels extra (make setup installs triton)")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(shape, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, D = shape[-2], shape[-1]
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if layout == "transposed":  # q as attention gets it: [B, L, H, D] viewed as [B, H, L, D]
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "packed":  # q sliced from a fused qkv projection [B, L, 3, H, D]: not dense
        B, H = shape[0], shape[1]
        x = torch.randn(B, L, 3, H, D, generator=g, dtype=torch.float64)[:, :, 0].transpose(1, 2)
    elif layout == "strided":  # every other position: a row stride the kernel must follow
        x = torch.randn(*shape[:-2], 2 * L, D, generator=g, dtype=torch.float64)[..., ::2, :]
    C, S = (torch.randn(L, D, generator=g, dtype=torch.float64) for _ in range(2))
    return x.to(dtype), C.to(dtype), S.to(dtype)


@pytest.mark.parametrize("shape,layout", [((2, 3, 5, 6), "contiguous"), ((2, 3, 37, 80), "transposed"),
                                          ((2, 3, 21, 16), "packed"),
                                          ((1, 2, 9, 16), "strided"), ((3, 11, 10), "contiguous"),
                                          ((70, 64), "contiguous")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_rotation_in_fp64_forward_and_backward(interpret, shape, layout, dtype):
    """Any C, S (not just a rotation's: the backward's transpose must hold for xPos's decayed rows too),
    head sizes that are not powers of two, lengths that are not multiples of the block, any layout."""
    x, C, S = _inputs(shape, dtype, layout)
    assert turn.fused_applies(x, C, S)
    x = x.requires_grad_(True)
    y = turn.turn(x, C, S)
    assert y.shape == x.shape and y.dtype == dtype and (layout != "transposed" or y.stride() == x.stride())
    if layout == "packed":  # dense, in x's order: [B, L, H, D] read as [B, H, L, D], as v is
        assert y.transpose(1, 2).is_contiguous()
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    x64 = x.detach().double().requires_grad_(True)
    y64 = turn.eager(x64, C.double(), S.double())
    (gx64,) = torch.autograd.grad(y64, x64, g.double())
    # the kernel computes in fp32 and rounds once, to nearest on a GPU; Triton's interpreter truncates fp32
    # to bf16 instead (its create_fp_trunc), so here bf16 is within one unit in the last place, not half
    for out, ref in ((y, y64), (gx, gx64)):
        err, scale = (out.double() - ref).abs().max(), ref.abs().max()
        tol = 2e-6 * scale if dtype == torch.float32 else 2 ** -7 * scale
        assert err <= tol, (err, tol)


@pytest.mark.parametrize("grads", ["both", "q only", "k only"])
def test_pair_kernel_turns_q_and_k_of_other_shapes_in_one_launch(interpret, monkeypatch, grads):
    """A layer's q and k in one launch each way: other head counts (GQA), other lengths (a decoding step's one
    query over seven cached keys), other layouts; a gradient for either or both."""
    q, Cq, Sq = _inputs((2, 4, 1, 16), torch.float32, "contiguous", seed=3)
    k, Ck, Sk = _inputs((2, 2, 7, 16), torch.float32, "transposed", seed=4)
    launches = []
    real = turn.launch
    monkeypatch.setattr(turn, "launch", lambda ops, transpose: launches.append(len(ops)) or real(ops, transpose))
    q.requires_grad_(grads != "k only")
    k.requires_grad_(grads != "q only")
    yq, yk = turn.turn_pair(q, k, Cq, Sq, Ck, Sk)
    gq, gk = torch.randn_like(yq), torch.randn_like(yk)
    (yq * gq + 0).sum().add((yk * gk).sum()).backward()
    assert launches == [2, 2 if grads == "both" else 1]
    for x, C, S, y, g in ((q, Cq, Sq, yq, gq), (k, Ck, Sk, yk, gk)):
        x64 = x.detach().double().requires_grad_(True)
        y64 = turn.eager(x64, C.double(), S.double())
        (y64 * g.double()).sum().backward()
        torch.testing.assert_close(y.double(), y64, rtol=1e-6, atol=1e-6)
        if x.requires_grad:
            torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)


def test_an_expanded_gradient_and_empty_input_take_the_kernel_or_eager_correctly(interpret):
    x, C, S = _inputs((2, 2, 7, 8), torch.float32, "contiguous")
    x = x.requires_grad_(True)
    turn.turn(x, C, S).sum().backward()  # sum's backward hands over an expanded (stride 0) gradient
    x64 = x.detach().double().requires_grad_(True)
    turn.eager(x64, C.double(), S.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
    empty = torch.zeros(2, 2, 0, 8)
    assert not turn.fused_applies(empty, C[:0], S[:0]) and turn.turn(empty, C[:0], S[:0]).shape == empty.shape


def test_kernel_runs_under_inference_mode_and_without_grad(interpret):
    """Evaluation calls it under ``torch.inference_mode()`` (and ``no_grad``): the same numbers, no graph."""
    x, C, S = _inputs((1, 2, 5, 8), torch.float32, "contiguous")
    ref = turn.eager(x.double(), C.double(), S.double())
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx():
            y = turn.turn(x.clone(), C.clone(), S.clone())
        assert y.grad_fn is None
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)


def test_when_the_kernel_runs(interpret, monkeypatch):
    x, C, S = _inputs((1, 2, 4, 8), torch.float32, "contiguous")
    assert turn.fused_applies(x, C, S)
    assert not turn.fused_applies(x, C.double(), S.double())  # tables in another dtype
    assert not turn.fused_applies(x, C.requires_grad_(True), S)  # a table that takes a gradient
    assert not turn.fused_applies(x[..., :7], C[:, :7], S[:, :7])  # odd head size
    assert not turn.fused_applies(x[None], C, S)  # more than 4 dims
    monkeypatch.setattr(turn, "ENABLED", False)
    assert not turn.fused_applies(x, C, S)
    monkeypatch.setattr(turn, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not turn.fused_applies(x, C, S)  # the CPU without the interpreter: eager


@pytest.mark.parametrize("scheme,params", [("rotary", {}), ("rotary", {"logn": True, "original_length": 8}),
                                           ("rotary-yarn", {"factor": 2.0, "original_length": 16}),
                                           ("xpos", {}), ("hybrid", {})])
def test_model_with_the_kernel_equals_the_eager_model(interpret, monkeypatch, scheme, params):
    """The whole model, forward and every parameter's gradient, fused rotation vs eager (same dtype)."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=scheme, scheme_params=params, vocab_size=40, dim=32, heads=4, layers=2,
                        train_length=16))
    idx = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(2))
    calls = []
    real = turn._Turns.apply
    monkeypatch.setattr(turn._Turns, "apply", lambda *a: calls.append(len(a)) or real(*a))

    def run(enabled):
        monkeypatch.setattr(turn, "ENABLED", enabled)
        m.zero_grad()
        logits = m(idx[:, :-1])  # [B, L, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    fused, eager = run(True), run(False)
    assert calls and set(calls) == {6}, calls  # the fused kernel ran, q and k in one launch
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(fused[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rotation_takes_the_kernel_and_equals_fp64(dtype):
    x, C, S = (t.cuda() for t in _inputs((4, 12, 300, 64), dtype, "transposed"))
    assert turn.fused_applies(x, C, S)
    x = x.requires_grad_(True)
    y = turn.turn(x, C, S)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    x64 = x.detach().double().requires_grad_(True)
    y64 = turn.eager(x64, C.double(), S.double())
    (gx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8
    assert (y.double() - y64).abs().max() <= tol * y64.abs().max()
    assert (gx.double() - gx64).abs().max() <= tol * gx64.abs().max()

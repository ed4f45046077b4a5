"""FIRE beyond L on the FlexAttention path (docs/attention.md, row 7 on CUDA): the scheme's ``flex_bias``
evaluated per (query, key) inside the kernel, no mask, against the reproduction's dense formula
(fire_ref.py) in fp64, with the parameters' gradients; when attend() takes it; the recompile limit; no host
read per layer. CPU: eager FlexAttention (forward, captured-tensor gradients); `slow`: the compiled kernel
on the CPU; `gpu`: a training step on CUDA against the plain path."""
import pytest
import torch

from extrapolab.io import UserError
from extrapolab.model import flex, flex_pieces
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional.fire import FIRE
from fire_ref import dense, fire
from flexspy import CountSyncs, grad_mismatches, stub_kernel

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention")


def _qkv(B, H, L, D, seed=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(3))


def _rows_calls(monkeypatch) -> list:
    calls, real = [], flex.flex_rows_path
    monkeypatch.setattr(flex, "flex_rows_path", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("shared", [False, True])
def test_flex_rows_equal_the_reproduction_beyond_L(shared, monkeypatch):
    """Queries on both sides of L = 27.4 (whole sequence, a chunk after a cache, only rows beyond L), a
    window, a temperature: the output equals the dense formula in fp64, and the parameters' gradients
    (through c, L_mult and the MLP; eager FlexAttention on the CPU gives them while q, k, v need none)."""
    s = fire(shared=shared)
    q, k, v = _qkv(2, 3, 70, 8)
    calls = _rows_calls(monkeypatch)
    cases = [(slice(0, 70), {}), (slice(20, 70), {}), (slice(0, 70), dict(window=11)),
             (slice(0, 70), dict(temperature=0.7)), (slice(40, 70), {})]
    params = list(s.parameters())
    for qs, kw in cases:
        qp, kp = torch.arange(70)[qs], torch.arange(70)
        out, _ = attend(q[:, :, qs], k, v, qp, kp, s, 1, AttnOptions(impl="flex", **kw))
        ref = dense(q[:, :, qs], k, v, qp, kp, s, 1, kw.get("window"), kw.get("temperature", 1.0))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        go = torch.randn_like(ref)
        want = torch.autograd.grad(ref, params, go)
        g = 0 if shared else 1  # this layer's MLP and c move the output (L_mult only with rows at or below L)
        assert all(w[g].abs().max() > 0 for w in want[:5]) and (want[5][g] != 0) == (qs.start < 28), qs
        for a, b in zip(torch.autograd.grad(out, params, go), want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert len(calls) == len(cases)


class _HeadTau(FIRE):
    """FIRE with a per-head temperature: the path divides q and the bias per head."""

    def temperature(self, q_pos, layer=0):
        return torch.tensor([[0.5], [1.0], [2.0]], dtype=self.c.dtype)  # [H, 1]


def test_flex_rows_divide_q_and_the_bias_by_a_per_head_temperature(monkeypatch):
    """Against the reference path (which divides the whole logit, bias included, per head) and not equal to
    dividing q alone."""
    s = fire()
    s.__class__ = _HeadTau
    q, k, v = _qkv(1, 3, 50, 8)
    pos = torch.arange(50)
    monkeypatch.setattr(flex_pieces, "ENABLED", False)  # evaluation takes flex-pieces (tests/test_flex_pieces.py)
    calls = _rows_calls(monkeypatch)
    with torch.no_grad():
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
        q_only = dense(q / s.temperature(pos).view(1, 3, 1, 1), k, v, pos, pos, s, 0)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    assert calls and (got - q_only).abs().max() > 1e-6


def test_auto_takes_flex_rows_on_cuda_only_and_never_with_cpu_gradients():
    s = fire(H=4).float()  # L = 27.4: of the queries, 28 at or below L
    L = flex.MIN_LENGTH
    kw = dict(same_pos=True, starts=(0, 0), dense_bias=False, split=28)
    want = "flex" if flex.supported("cuda", 64, torch.float32) else "split"
    assert select_path("cuda", s, AttnOptions(), (1, 4, L, 64), L, grad=False, **kw)[0] == want
    assert select_path("cuda", s, AttnOptions(), (1, 4, L, 64), L, grad=True, **kw)[0] == "split"  # training
    assert select_path("cuda", s, AttnOptions(impl="flex"), (1, 4, L, 64), L, grad=True, **kw)[0] == want
    assert select_path("cuda", s, AttnOptions(impl="sdpa"), (1, 4, L, 64), L, grad=True, **kw)[0] == "split"
    assert select_path("cuda", s, AttnOptions(), (1, 4, L // 2, 64), L // 2, grad=True, **kw)[0] == "split"  # < MIN_LENGTH
    assert select_path("cpu", s, AttnOptions(), (1, 4, L, 64), L, grad=False, **kw)[0] == "split"
    assert select_path("cpu", s, AttnOptions(impl="flex"), (1, 4, L, 64), L, grad=False, **kw)[0] == "flex"
    with pytest.raises(UserError, match="impl='auto'"):
        select_path("cpu", s, AttnOptions(impl="flex"), (1, 4, L, 64), L, grad=True, **kw)


def test_a_full_kernel_sends_fire_rows_to_the_split_path_with_one_warning(monkeypatch):
    def full(*a, **kw):
        raise flex.RecompileLimit(3)

    monkeypatch.setattr(flex, "kernel", lambda device: full)
    s = fire()
    q, k, v = _qkv(1, 3, 70, 8)
    pos = torch.arange(70)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="Lq=70 Lk=70 .* split path instead"):
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
    torch.testing.assert_close(got, dense(q, k, v, pos, pos, s, 0), rtol=0, atol=1e-12)


def test_flex_rows_read_nothing_back_per_layer(monkeypatch):
    """A whole FIRE forward beyond L on the flex path (kernel stubbed): the host reads do not grow with
    the number of layers (the split point is read once per forward)."""
    monkeypatch.setattr(flex, "kernel", lambda device: stub_kernel)
    monkeypatch.setattr(flex_pieces, "ENABLED", False)  # evaluation takes flex-pieces (tests/test_flex_pieces.py)
    counts = []
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme="fire", vocab_size=64, dim=64, heads=4, layers=layers, train_length=64))
        calls = _rows_calls(monkeypatch)
        with torch.no_grad(), CountSyncs() as c:
            m(torch.randint(0, 64, (1, 256)), opts=AttnOptions(impl="flex"))
        counts.append(len(c.calls))
        assert len(calls) == layers
    assert counts[0] == counts[1] and counts[0] <= 5, counts


@pytest.mark.slow
def test_compiled_flex_rows_equal_the_split_path(monkeypatch):
    """The compiled kernel (inductor's CPU template; the CUDA one is the same graph) on FIRE's unrolled MLP:
    equal to the split path, fp32, 256 tokens with L = 64; a second layer reuses the graph."""
    from torch._dynamo.utils import counters

    compiled = flex.Compiled(limit=4)
    monkeypatch.setattr(flex, "kernel", lambda device: compiled)
    monkeypatch.setattr(flex_pieces, "ENABLED", False)  # flex-pieces asks for the lse, which CPU inductor lacks
    s = fire(H=2, L_tr=64, L_mult=1.0).float()
    q, k, v = _qkv(1, 2, 256, 16, dtype=torch.float32)
    pos = torch.arange(256)
    seen = []
    with torch.no_grad():
        for layer in (0, 1):
            got, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="flex"))
            ref, _ = attend(q, k, v, pos, pos, s, layer, AttnOptions(impl="auto"))
            assert (got - ref).abs().max() < 2e-5, layer
            seen.append(counters["stats"]["unique_graphs"])
    assert seen[0] == seen[1] and not compiled.full


@pytest.mark.gpu
def test_cuda_fire_beyond_L_trains_through_flex_rows(monkeypatch):
    """A training step of a FIRE model at 4x its L_tr on CUDA: the flex rows path runs in every layer and
    the output and every gradient equal the plain path's (fp32)."""
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fire", vocab_size=64, dim=256, heads=4, layers=2, train_length=128)).cuda()
    idx = torch.randint(0, 64, (2, 512), device="cuda")
    res = {}
    for impl in ("plain", "flex"):  # training takes the split path by default; flex rows when asked for
        calls = _rows_calls(monkeypatch)
        m.zero_grad()
        out = m(idx, opts=AttnOptions(impl=impl))
        out.float().square().mean().backward()
        res[impl] = (out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        assert len(calls) == (2 if impl == "flex" else 0)
    (o, g), (o_ref, g_ref) = res["flex"], res["plain"]
    assert float((o - o_ref).norm() / o_ref.norm()) < 1e-5
    bad = grad_mismatches(g, g_ref, 1e-4, torch.float32)  # FIRE's b2: exact gradient 0, rounding noise only
    assert not bad, bad

"""`train.compile` (torch.compile of the model's forward): the bias-free schemes, FoX and the distance tables on
CUDA's Toeplitz path trace into one graph.

On a GPU whose train step is host-bound (docs/results/gpu-h100-2026-11-27.md: GPT-2 small at 16 x 512, 37.8 ms a step
for 26.7 ms of kernels) a compiled model launches fused kernels instead of one per eager op, but only where the
forward is one graph: each graph break is a return to the host. A read of a device value (the positions' layout),
``tensor.is_inference()`` and ``torch.is_inference_mode_enabled()`` each broke the graph (NoPE 9 graphs, rotary 15);
the model's own positions now carry their layout on the host and those questions are not asked in traced code;
traced tables are built per forward without reading their reach back, and their Hankel view is an unfold.
Here, with the graph-capturing backend ``aot_eager`` (no code generation: seconds on the CPU), fullgraph=True
compiles the forward and the backward and both equal eager mode.
"""
import pytest
import torch

from extrapolab.model import toeplitz
from extrapolab.model.gpt import GPT, ModelConfig

ONE_GRAPH = ["none", "rotary", "xpos", "rotary-yarn", "rotary-longrope", "hybrid", "nope-headscale", "learned", "fox"]
#: distance tables on the Toeplitz path as CUDA runs it below flex.MIN_LENGTH (SDPA with the table's mask; the CPU's
#: own fused kernel with a strided mask, an autograd Function with a device probe, is not traced)
TABLES = ["alibi", "t5", "kerple-log", "qin-type1", "windowed"]


@pytest.mark.parametrize("name", ONE_GRAPH + TABLES)
def test_the_training_forward_compiles_to_one_graph_equal_to_eager(name, monkeypatch):
    if name in TABLES:
        monkeypatch.setattr(toeplitz, "hankel_ok", lambda device: False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=32, heads=2, layers=2, train_length=64))
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    want = m(idx)
    g_want = torch.autograd.grad(want.float().square().mean(), list(m.parameters()), allow_unused=True)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)  # a graph break raises here
    got = compiled(idx)
    g_got = torch.autograd.grad(got.float().square().mean(), list(m.parameters()), allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_fox_under_bf16_autocast_compiles_to_one_graph_equal_to_eager():
    """As a GPU trains FoX (bf16 autocast): the folded path's hi/lo split of the key column (an autograd Function)
    traces into the same one graph, forward and backward equal to eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="fox", vocab_size=64, dim=32, heads=2, layers=2, train_length=64))
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    outs = []
    for model in (m, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(idx)
        outs.append((out, torch.autograd.grad(out.float().square().mean(), list(m.parameters()))))
    (want, g_want), (got, g_got) = outs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-5)  # bf16 products, summed in another order
    torch._dynamo.reset()

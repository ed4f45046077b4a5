"""A training step reads nothing back from the device (positional/positions.py).

The H100 profile of GPT-2 small at 16 x 512 (docs/results/gpu-h100-2026-11-27.md) showed the step host-bound: 37.8 ms
a step for 26.7 ms of kernels with NoPE, 50.3 ms for 28.1 ms with rotary. Every read of a CUDA value (the positions'
largest, first, last, whether they increase) makes the host wait for the queued kernels; a step made 4 of them
(NoPE) to 7 (rotary, xPos). The model's own positions now carry their layout on the host, so a step with them makes
none, for every scheme outside the reference path; positions passed in are read as before, with the same result.
Nor does a step copy anything from the host (checked on the meta device): FoX's slopes were a host tensor copied to
the GPU in every layer (a blocking copy) until 2026-11-27.
"""
import pytest
import torch

from extrapolab import positional
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional.positions import arange_positions, known_start, span, top
from flexspy import CountSyncs

NAMES = [n for n in positional.names() if not positional.build(n, num_heads=2).reference_only]


def _model(name, L=64):
    torch.manual_seed(0)
    return GPT(ModelConfig(scheme=name, vocab_size=64, dim=32, heads=2, layers=3, train_length=L))


@pytest.mark.parametrize("name", NAMES)
def test_a_train_step_on_the_models_own_positions_reads_nothing_back(name):
    m = _model(name)
    idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    m(idx).float().square().mean().backward()  # first step: tables built (their one-off reads allowed)
    m.zero_grad()
    with CountSyncs() as c:
        m(idx).float().square().mean().backward()
    assert c.calls == [], (name, c.calls)


@pytest.mark.parametrize("name", ["rotary", "xpos", "rotary-dynamic", "rotary-longrope", "learned", "alibi", "t5",
                                  "fire", "fox", "cope"])
def test_known_positions_give_what_reading_them_gives(name):
    """The same logits from the model's own positions (layout on the host) and from an equal tensor passed in
    (layout read from the device), at an offset start too."""
    m = _model(name, L=48).eval()
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for start in (0, 5):
            got = m(idx, positions=arange_positions(start, 40, "cpu"))
            want = m(idx, positions=torch.arange(start, start + 40))
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_only_untouched_positions_carry_their_start():
    pos = arange_positions(3, 10, "cpu")
    assert known_start(pos) == 3 and top(pos) == 13
    assert known_start(pos[2:]) is None and known_start(pos.clone()) is None  # slices, copies: read as usual
    assert top(pos[2:5]) == 8 and top(torch.tensor([4, 1, 9])) == 10 and top(pos[:0]) == 0
    # (largest + 1, start of a contiguous range or None): from the host, or read from the device alike
    assert span(pos) == (13, 3) and span(pos[2:5]) == (8, 5) and span(torch.tensor([7])) == (8, 7)
    assert span(torch.tensor([4, 1, 9])) == (10, None) and span(torch.tensor([2, 3, 5])) == (6, None)
    assert span(torch.tensor([3, 3, 4])) == (5, None) and span(pos[:0]) == (0, None)
    pos.add_(1)  # changed in place: the host's start is stale, so it is not used
    assert known_start(pos) is None and top(pos) == 14
    with torch.inference_mode():
        inf = arange_positions(0, 4, "cpu")
    assert known_start(inf) == 0 and top(inf) == 4


class _HostToDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops that take a host tensor (not a 0-d scalar) and give a tensor on the model's device: a copy from
    the host, which on CUDA (``.to(device)`` of pageable memory) blocks until every queued kernel ran."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0
                   for a in (*args, *(kwargs or {}).values()))
        res = out if isinstance(out, (tuple, list)) else (out,)
        if host and any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in res):
            self.calls.append(func._schema.name)
        return out


class _OneOffReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Answers a read of a meta value (which has none) while the first step builds its cached tables: the largest
    distance of a 64-token input for integers, true for a flag, 1 for a float; ones for a copy to the host
    (Sandwich's ratios, read once for its table). Only shapes matter on meta."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 63
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "meta" \
                and torch.device(kwargs.get("device") or "meta").type == "cpu":
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_a_train_step_copies_nothing_from_the_host(name, monkeypatch):
    """The model on the meta device (a device that is not the host, as CUDA is; no GPU needed): a second train step
    hands no host tensor to the device. FoX's slopes were a fresh host tensor copied to the GPU in every layer of
    every step (a blocking copy: the host waited for the GPU 12 times a step), PoPE's frequencies and the two-pass
    rotaries' likewise. Reads the meta device cannot answer are the ones CUDA avoids or makes once: a table's reach
    (CUDA training builds it without, ``reach=False``) and FIRE's split row (read once per forward)."""
    from extrapolab.model import folded, tables

    real_build, real_dtype = tables.DistanceBias._build, folded.compute_dtype
    monkeypatch.setattr(tables.DistanceBias, "_build", lambda self, *a, **kw: real_build(self, *a, **{**kw, "reach": False}))
    monkeypatch.setattr(tables, "_floats", lambda t: None if t is None else [1e9] * t.numel())
    monkeypatch.setattr(folded, "compute_dtype", lambda x: x.dtype if x.device.type == "meta" else real_dtype(x))
    m = _model(name).to("meta")
    idx = torch.randint(0, 64, (2, 64), device="meta")
    with _OneOffReads():
        m(idx).float().square().mean().backward()  # first step: tables built (a one-off read answered here)
    m.zero_grad()
    with _HostToDevice() as c:
        m(idx).float().square().mean().backward()
    assert c.calls == [], (name, c.calls)

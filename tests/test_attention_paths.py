"""The Toeplitz path's kernels at their edges, the private CPU flash op we rely on, per-layer
temperature and the logits sink (model/toeplitz.py, model/reference.py, docs/attention.md)."""
import math

import pytest
import torch
import torch.nn.functional as F

from extrapolab import positional
from extrapolab.io import UserError
from extrapolab.model import toeplitz as T
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.model.reference import logits


def _scheme(name, heads=4, dtype=torch.float64):
    s = positional.build(name, num_heads=heads)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    s.constrain_()
    return s.to(dtype)


def _by_hand(q, k, scheme, q_pos, k_pos, window=None, layer=0):
    """Independent tau = 1 logits: q·k/sqrt(d) (· w) + b from the scheme's distance functions."""
    dist = q_pos[:, None] - k_pos[None]  # [Lq, Lk]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Lq, Lk]
    if scheme.has_weight:
        s = s * scheme.weight_from_distance(dist.clamp(min=0), layer).to(s.dtype)
    if scheme.has_bias:
        s = s + scheme.bias_from_distance(dist.clamp(min=0), layer).to(s.dtype)
    bad = (dist < 0) | ((dist >= window) if window else torch.zeros_like(dist, dtype=torch.bool))
    return s.masked_fill(bad, -math.inf)


@pytest.mark.parametrize("name", ["kerple-log", "kerple-bias-wht"])
def test_hankel_sdpa_backward_in_small_chunks_equals_fp64_reference(name, monkeypatch):
    """Force tiny chunks so HankelSDPA's backward walks several row chunks and batch chunks (and
    the wht forward several key tiles): output and gradients w.r.t. q, k, v and the learnable table
    (or kernel) equal autograd through an explicit fp64 softmax."""
    monkeypatch.setattr(T, "CHUNK_ELEMS", 256)  # rows per chunk -> 8, one batch row per chunk
    monkeypatch.setattr(T, "WEIGHTED_TILE", (16, 24))
    s = _scheme(name)
    g = torch.Generator().manual_seed(5)
    B, H, L, D = 3, 4, 70, 8
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    go = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    pos = torch.arange(L)
    params = [q, k, v, *s.parameters()]
    calls = []
    real = T.antidiag_sums
    monkeypatch.setattr(T, "antidiag_sums", lambda m: calls.append(m.shape) or real(m))
    for window, tau in ((None, 1.0), (23, 0.7)):
        calls.clear()
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa", window=window, temperature=tau))
        got = torch.autograd.grad(out, params, go)
        ref = torch.softmax(_by_hand(q, k, s, pos, pos, window) / tau, -1) @ v
        want = torch.autograd.grad(ref, params, go)
        assert len(calls) >= 9 and max(c[1] for c in calls) <= 8  # several row chunks ran
        assert (out - ref).abs().max() < 1e-12
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-10, (name, window, (a - b).abs().max())


def test_overlapping_stride_mask_in_fused_kernel_equals_dense_mask():
    """The stride-(1, 1) as_strided mask at sizes past the CPU flash kernel's tiles (several heads,
    non-square, offsets into the vector) gives what an explicit dense copy of it gives."""
    g = torch.Generator().manual_seed(11)
    B, H, R, C, D = 2, 3, 300, 1100, 16
    q = torch.randn(B, H, R, D, generator=g)
    k, v = (torch.randn(B, H, C, D, generator=g) for _ in range(2))
    ext = torch.randn(H, R + C + 40, generator=g)
    ext[:, ::7] = -math.inf  # masked slots inside the views, as a window or dilation makes them
    for off in (0, 17, 40):
        view = T.hankel_view(ext, off, R, C)  # [1, H, R, C]
        dense = torch.stack([ext[:, off + r:off + r + C] for r in range(R)], 1)[None]  # [1, H, R, C]
        assert view.stride()[-2:] == (1, 1) and torch.equal(view, dense)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=view)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense.contiguous())
        explicit = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + dense, -1) @ v
        assert (got - want).abs().max() < 1e-5 and (got - explicit).abs().max() < 1e-5, off


def test_private_cpu_flash_op_keeps_the_signature_we_call():
    """HankelSDPA calls aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
    is_causal, *, attn_mask, scale) -> (output, logsumexp). A torch upgrade that renames or changes
    it must fail here, not silently move learnable tables onto the dense-mask fallback."""
    assert T.CPU_FLASH is not None
    schema = T.CPU_FLASH.default._schema
    args = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
    assert args == [("query", "Tensor", False), ("key", "Tensor", False), ("value", "Tensor", False),
                    ("dropout_p", "float", False), ("is_causal", "bool", False),
                    ("attn_mask", "Optional[Tensor]", True), ("scale", "Optional[float]", True)], args
    assert [r.name for r in schema.returns] == ["output", "logsumexp"]
    q, k, v = (torch.randn(2, 3, 40, 8) for _ in range(3))
    mask = T.hankel_view(torch.randn(3, 79), 0, 40, 40)
    out, lse = T.CPU_FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=0.3)
    s = q @ k.transpose(-1, -2) * 0.3 + mask  # [2, 3, 40, 40]
    assert out.shape == q.shape and lse.shape == (2, 3, 40)
    assert torch.allclose(lse, s.logsumexp(-1), atol=1e-5) and torch.allclose(out, s.softmax(-1) @ v, atol=1e-5)


def _tiny(scheme, layers=3):
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=scheme, vocab_size=50, dim=32, heads=4, layers=layers, train_length=64)).eval()
    with torch.no_grad():
        for p in m.scheme.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    m.constrain_()
    return m


@pytest.mark.parametrize("scheme", ["none", "alibi", "kerple-bias-wht", "sliding-dilated"])
def test_per_layer_temperature_equals_each_layer_scaled_by_hand(scheme):
    """AttnOptions.temperature = (t0, t1, t2) on the fast paths == running the blocks one by one
    with each layer's own scalar temperature, and == softmax(logits / t_l) computed by hand."""
    m = _tiny(scheme)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(2))
    taus = (0.5, 1.0, 1.7)
    pos = torch.arange(40)
    with torch.no_grad():
        got = m(idx, opts=AttnOptions(temperature=taus))
        x = m.embed(idx, pos)
        for blk, t in zip(m.blocks, taus):
            x, _ = blk(x, pos, m.scheme, AttnOptions(temperature=t))
        assert torch.allclose(got, m.head(m.ln_f(x)), atol=1e-5)
        q, k, v = (torch.randn(2, 4, 40, 8, generator=torch.Generator().manual_seed(3)) for _ in range(3))
        for layer in range(3):
            out, _ = attend(q, k, v, pos, pos, m.scheme, layer, AttnOptions(temperature=taus))
            qr, kr = m.scheme.rotate(q, k, pos, pos)
            want = torch.softmax(_by_hand(qr, kr, m.scheme, pos, pos, layer=layer) / taus[layer], -1) @ v
            assert (out - want).abs().max() < 1e-5, (scheme, layer)
    with pytest.raises(UserError, match="2 per-layer temperatures for a 3-layer model; give one per layer"):
        m(idx, opts=AttnOptions(temperature=(0.5, 1.0)))


@pytest.mark.parametrize("name", ["alibi", "kerple-bias-wht", "sliding-dilated", "rotary"])
def test_logits_sink_reports_the_explicit_logits(name):
    """The sink gets, per layer and query block, the tau = 1 logits an explicit computation gives
    (window, cached prefix with offset positions); the output still divides by tau."""
    s = _scheme(name, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    Lq, Lk = 30, 50
    q = torch.randn(2, 4, Lq, 8, generator=g)
    k, v = (torch.randn(2, 4, Lk, 8, generator=g) for _ in range(2))
    k_pos = torch.arange(Lk) + 7
    q_pos = k_pos[-Lq:]
    seen = []
    opts = AttnOptions(block_size=8, window=25, temperature=0.6,
                       logits_sink=lambda layer, lg, keys: seen.append((layer, lg, keys)))
    out, _ = attend(q, k, v, q_pos, k_pos, s, 2, opts)
    assert len(seen) == 4 and all(layer == 2 and keys == Lk for layer, _, keys in seen)
    lg = torch.cat([F.pad(b, (0, Lk - b.shape[-1]), value=-math.inf) for _, b, _ in seen], 2)  # [2, 4, Lq, Lk]
    qr, kr = s.rotate(q, k, q_pos, k_pos)
    want = _by_hand(qr, kr, s, q_pos, k_pos, window=25, layer=2)
    assert torch.equal(torch.isinf(lg), torch.isinf(want))
    assert torch.allclose(lg[torch.isfinite(lg)], want[torch.isfinite(want)], atol=1e-5)
    assert torch.allclose(logits(qr, kr, q_pos, k_pos, s, 2, 25), want, atol=1e-5)
    fast, _ = attend(q, k, v, q_pos, k_pos, s, 2, AttnOptions(window=25, temperature=0.6))
    assert (out - fast).abs().max() < 1e-5


class _AbsoluteBonus(positional.PositionalScheme):
    """A bias that is not a function of m - n (ALiBi plus a bonus for the first two positions)."""

    kind = "bias"

    def __init__(self, num_heads):
        super().__init__(num_heads)
        self.alibi = positional.build("alibi", num_heads=num_heads)
        self.bonus = torch.nn.Parameter(torch.tensor(0.7))

    def bias(self, q_pos, k_pos, layer=0):
        return self.alibi.bias(q_pos, k_pos) + self.bonus * (k_pos < 2).float()  # [H, Lq, Lk]


@pytest.mark.parametrize("case", ["absolute-bias", "gapped-positions"])
def test_fallback_equals_reference_with_gradients(case):
    """Biases that are not Toeplitz, and positions that are not contiguous, take the dense-mask
    fallback in query blocks: output and gradients equal the reference path's."""
    # gapped positions: a distance table that is not of the ALiBi form (ALiBi itself takes the folded path)
    s = _AbsoluteBonus(3) if case == "absolute-bias" else positional.build("kerple-log", num_heads=3)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g).requires_grad_() for _ in range(3))
    pos = torch.arange(40) if case == "absolute-bias" else torch.arange(40) * 3 + (torch.arange(40) > 20)
    params = [q, k, v, *s.parameters()]
    ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain", window=50, temperature=0.8))
    want = torch.autograd.grad(ref.square().sum(), params)
    for impl, kw in (("sdpa", {}), ("blocked", {"block_size": 7}), ("auto", {"memory_budget_mb": 1e-6, "block_size": 9})):
        opts = AttnOptions(impl=impl, window=50, temperature=0.8, **kw)
        starts = (0, 0) if case == "absolute-bias" else (None, None)
        path, _ = select_path("cpu", s, opts, q.shape, 40, same_pos=True, starts=starts, dense_bias=False, grad=True)
        assert path == "fallback"
        out, _ = attend(q, k, v, pos, pos, s, 0, opts)
        got = torch.autograd.grad(out.square().sum(), params)
        assert (out - ref).abs().max() < 1e-5, impl
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (case, impl)


def test_docs_attention_names_only_tests_that_exist():
    """docs/attention.md's table of proofs stays true: every test it names exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "attention.md").read_text()
    sources = {p.name: p.read_text() for p in (root / "tests").glob("test_*.py")}
    named = re.findall(r"`(?:(test_\w+\.py)::)?(test_\w+)`", doc)
    assert len(named) > 15
    for f, t in named:
        pool = [sources[f]] if f else sources.values()
        assert any(f"def {t}(" in s for s in pool), (f, t)


def test_fused_mask_probe_is_not_fooled_by_ambient_autocast(monkeypatch):
    """hankel_ok caches its answer for the process: probing first under bf16 autocast (a bf16
    evaluation) must not disable the fused CPU path for everything after it."""
    from extrapolab.model import toeplitz

    monkeypatch.setattr(toeplitz, "_PROBE", {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert toeplitz.hankel_ok(torch.device("cpu"))
    assert toeplitz._PROBE == {"cpu": True}

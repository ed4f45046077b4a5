"""The hooks of the scheme interface (positional/base.py, docs/attention.md): the temperature per
head and per query on every path, and the contract of the score-level hooks (``scores`` seeing
whole rows and all heads; ``normalize`` replacing softmax) with tiny in-test schemes of the shapes
DAPE, DAPE V2 and stick-breaking need, each against an independent dense formula written here."""
import contextlib
import math

import pytest
import torch
from decoding import decode
from torch import nn

from extrapolab import positional
from extrapolab.model import attention as attn_mod
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.alibi import ALiBi
from extrapolab.positional.base import PositionalScheme
from extrapolab.positional.kerple import KerpleLog
from extrapolab.positional.registry import REGISTRY


@contextlib.contextmanager
def registered(cls):
    positional.register(cls)
    try:
        yield
    finally:
        REGISTRY.pop(cls.name)


def _qkv(B=2, H=3, L=30, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))


def _spy_paths(monkeypatch):
    seen = []
    real = attn_mod.select_path
    monkeypatch.setattr(attn_mod, "select_path", lambda *a, **kw: seen.append(real(*a, **kw)[0]) or real(*a, **kw))
    return seen


# ---- temperature per head and per query ----------------------------------------------------------
def _logn_tau(q_pos, L_tr=16):
    """1 / max(1, log(m + 1) / log L_tr): log-n scaling of q (Su 2021) as a per-query temperature."""
    return 1.0 / (torch.log1p(q_pos.double()) / math.log(L_tr)).clamp(min=1.0)


class _HeadTau:
    """Mixin: a learnable temperature per head (per_query=False) or a log-n temperature times it."""

    per_query = False

    def _init_tau(self):
        self.tau_h = nn.Parameter(torch.tensor([0.6, 1.0, 1.7], dtype=torch.float64)[: self.num_heads])

    def temperature(self, q_pos, layer=0):
        if self.per_query:
            return self.tau_h[:, None] * _logn_tau(q_pos)[None]  # [H, Lq]
        return self.tau_h[:, None]  # [H, 1]


def _tau_scheme(base, per_query):
    cls = type(f"Tau{base.__name__}{'Q' if per_query else 'H'}", (_HeadTau, base), {"per_query": per_query})
    s = cls(num_heads=3)
    s._init_tau()
    return s.double()


def _formula(q, k, v, q_pos, k_pos, scheme, tau_layer, tau_s):
    """softmax((q·k/sqrt(d) + b(m - n)) / (tau·tau_s[h, m])) v, causal, from the scheme's distance function."""
    dist = q_pos[:, None] - k_pos[None]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, Lq, Lk]
    if scheme.has_bias:
        s = s + scheme.bias_from_distance(dist.clamp(min=0)).to(s.dtype)
    s = (s / tau_layer / tau_s.reshape(1, tau_s.shape[0], -1, 1)).masked_fill(dist < 0, -math.inf)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("base,per_query,want", [
    (PositionalScheme, False, "causal"), (PositionalScheme, True, "causal"),  # bias-free: q's rows scaled
    (KerpleLog, False, "toeplitz"),  # per head: the table / tau_h stays Toeplitz
    (KerpleLog, True, "fallback"),  # per query with a distance table: dense blocks
    (ALiBi, True, "folded"),  # per query with the ALiBi form: the fold, q' / tau_m
])
def test_scheme_temperature_divides_the_whole_logit_on_every_path(base, per_query, want, monkeypatch):
    s = _tau_scheme(base, per_query)
    q, k, v = _qkv()
    pos = torch.arange(30) + 3
    seen = _spy_paths(monkeypatch)
    out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(temperature=0.8))
    assert seen == [want]
    ref = _formula(q, k, v, pos, pos, s, 0.8, s.temperature(pos))
    params = [q, k, v, s.tau_h, *[p for n, p in s.named_parameters() if n != "tau_h"]]
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, params, go)
    wanted = torch.autograd.grad(ref, params, go)
    tol = 1e-6 if want == "fallback" else 1e-12  # the dense fallback takes RelativeBias.bias in fp32
    assert (out - ref).abs().max() < tol
    for a, b in zip(got, wanted):
        assert (a - b).abs().max() < 1e4 * tol


def test_logn_scaling_of_q_is_a_per_query_temperature():
    """q_m · max(1, log(m+1)/log L_tr) (the rotary schemes' log-n option) == the per-query temperature
    tau_m = 1 / that factor: bias-free attention is the same computation."""
    s = _tau_scheme(PositionalScheme, True)
    with torch.no_grad():
        s.tau_h.fill_(1.0)
    q, k, v = _qkv(L=60)
    pos = torch.arange(60)
    out, _ = attend(q, k, v, pos, pos, s, 0)
    scaled = q * (1.0 / _logn_tau(pos))[:, None]  # [B, H, L, D]
    ref = torch.softmax((scaled @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(
        torch.ones(60, 60, dtype=torch.bool).triu(1), -math.inf), -1) @ v
    assert (out - ref).abs().max() < 1e-12


def test_sink_and_probabilities_see_the_scheme_temperature():
    """The logits sink gets the logits softmax sees at AttnOptions.temperature = 1 (the scheme's own
    temperature included), so temperature alignment's tau multiplies it."""
    s = _tau_scheme(ALiBi, True)
    q, k, v = _qkv(L=20)
    pos = torch.arange(20)
    seen = []
    out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(temperature=0.5, logits_sink=lambda l, lg, n: seen.append(lg)))
    lg = torch.cat(seen, 2)  # [B, H, L, L]
    tau_s = s.temperature(pos)
    want = (q @ k.transpose(-1, -2) / math.sqrt(8) + s.bias(pos, pos).double()) / tau_s[:, :, None]
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lg), fin) and (lg[fin] - want[fin]).abs().max() < 1e-12
    assert (out - torch.softmax(lg / 0.5, -1) @ v).abs().max() < 1e-12


# ---- score-level hooks: the contract DAPE, DAPE V2 and stick-breaking rely on -------------------
class _DapeLike(ALiBi):
    """DAPE's shape (Zheng et al. 2024): l + MLP([q·k; bias] across heads) per (m, n), over ALiBi."""

    name = "test-dape-like"
    reference_only = "an MLP over every head's logit at each (m, n)"

    def __init__(self, num_heads, hidden=5):
        super().__init__(num_heads)
        g = torch.Generator().manual_seed(7)
        self.mlp = nn.Sequential(nn.Linear(2 * num_heads, hidden), nn.ReLU(), nn.Linear(hidden, num_heads))
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.seen = []

    def scores(self, logits, block):
        self.seen.append(tuple(logits.shape))
        B = logits.shape[0]
        feats = torch.cat([block.qk, block.bias.expand(B, -1, -1, -1).to(block.qk.dtype)], 1)  # [B, 2H, bq, bk]
        return logits + self.mlp.to(feats.dtype)(feats.movedim(1, -1)).movedim(-1, 1)  # [B, H, bq, bk]


class _ConvLike(ALiBi):
    """DAPE V2's shape (Zheng et al. 2024b): a 1x3 convolution over keys, heads as channels, on the
    logits of visible keys (0 elsewhere, so no future key leaks in)."""

    name = "test-conv-like"
    reference_only = "a convolution over neighbouring keys of each row"

    def __init__(self, num_heads):
        super().__init__(num_heads)
        self.conv = nn.Conv2d(num_heads, num_heads, (1, 3), padding=(0, 1))
        with torch.no_grad():
            self.conv.weight.mul_(3.0)

    def scores(self, logits, block):
        x = torch.where(block.visible, logits, 0.0)  # [B, H, bq, bk]
        return logits + self.conv.to(x.dtype)(x)


class _StickBreaking(PositionalScheme):
    """Stick-breaking (Tan et al. 2025, shawntan/stickbreaking-attention sb_ref.py): beta = σ(l) for
    keys before the query, A_mn = beta_mn Π_{n<k<m} (1 - beta_mk), the remainder to the query itself."""

    name = "test-stick-breaking"
    kind = "score"
    reference_only = "stick-breaking weights replace softmax"

    def normalize(self, logits, block):
        before = block.visible & (block.q_pos[:, None] > block.k_pos[None])  # [bq, bk] keys n < m
        log_beta = torch.nn.functional.logsigmoid(logits).masked_fill(~before, -math.inf)
        log_1m = torch.nn.functional.logsigmoid(-logits).masked_fill(~before, 0.0)  # log(1 - beta)
        later = log_1m.flip(-1).cumsum(-1).flip(-1) - log_1m  # Σ_{k > n} log(1 - beta_mk)
        A = (log_beta + later).exp()  # [B, H, bq, bk]
        self_col = (block.q_pos[:, None] == block.k_pos[None]).to(A.dtype)  # [bq, bk]
        return A + (1 - A.sum(-1, keepdim=True)) * self_col


def _dense_logits(q, k, scheme, pos):
    dist = pos[:, None] - pos[None]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bias = scheme.bias_from_distance(dist.clamp(min=0)).to(s.dtype).masked_fill(dist < 0, 0.0) if scheme.has_bias \
        else torch.zeros_like(s[0])
    return s, bias, dist >= 0


def _dape_formula(q, k, v, scheme, pos):
    s, bias, vis = _dense_logits(q, k, scheme, pos)
    feats = torch.cat([s, bias.expand(s.shape[0], -1, -1, -1)], 1).movedim(1, -1)  # [B, L, L, 2H]
    lg = (s + bias + scheme.mlp(feats).movedim(-1, 1)).masked_fill(~vis, -math.inf)
    return torch.softmax(lg, -1) @ v


def _conv_formula(q, k, v, scheme, pos):
    s, bias, vis = _dense_logits(q, k, scheme, pos)
    lg = (s + bias).masked_fill(~vis, 0.0)
    w, b = scheme.conv.weight, scheme.conv.bias  # [H, H, 1, 3], [H]
    pad = torch.nn.functional.pad(lg, (1, 1))  # [B, H, L, L + 2]
    conv = sum(torch.einsum("gh,bhmn->bgmn", w[:, :, 0, t], pad[..., t:t + lg.shape[-1]]) for t in range(3))
    out = (s + bias + conv + b.view(1, -1, 1, 1)).masked_fill(~vis, -math.inf)
    return torch.softmax(out, -1) @ v


def _sb_formula(q, k, v, scheme, pos):
    """sb_ref.py's stickbreaking(q, k, v, mask, cum_weight) + remainder·v (attend_current=False)."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    L = logits.shape[-1]
    mask = torch.ones(L, L, dtype=torch.bool).triu(0)
    cum_weight = torch.ones(L, L, dtype=logits.dtype).tril(-1)
    log_z = torch.nn.functional.logsigmoid(logits).masked_fill(mask, -1e5)
    log_beta = torch.nn.functional.logsigmoid(-logits).masked_fill(mask, 0)
    att = (log_z + torch.einsum("bhij,jk->bhik", log_beta, cum_weight)).exp()
    return att @ v + (1 - att.sum(-1))[..., None] * v


@pytest.mark.parametrize("cls,formula", [(_DapeLike, _dape_formula), (_ConvLike, _conv_formula),
                                         (_StickBreaking, _sb_formula)])
def test_score_level_hook_contract(cls, formula, monkeypatch):
    """A scheme with score-level hooks: never a fused path whatever impl asks (block rows of
    ``block_size``, never L x L beyond one block); output and gradients equal the dense formula;
    in a GPT, a prefix gives the same outputs and KV-cache decoding equals the parallel forward."""
    s = cls(3).double()
    q, k, v = _qkv(L=30)
    pos = torch.arange(30)
    ref = formula(q, k, v, s, pos)
    seen = _spy_paths(monkeypatch)
    for impl in ("auto", "sdpa", "blocked", "plain"):
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl=impl, block_size=8))
        got = torch.autograd.grad(out.square().sum(), [q, k, v, *s.parameters()])
        want = torch.autograd.grad(ref.square().sum(), [q, k, v, *s.parameters()], retain_graph=True)
        assert (out - ref).abs().max() < 1e-12, impl
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-10, impl
    assert set(seen) == {"reference"}
    if hasattr(s, "seen"):
        assert max(shape[2] for shape in s.seen) == 8  # query blocks of block_size rows, all heads
        assert all(shape[1] == 3 for shape in s.seen)
    with registered(cls):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme=cls.name, vocab_size=40, dim=24, heads=3, layers=2, train_length=32)).eval()
        idx = torch.randint(0, 40, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            full = m(idx)
            assert (m(idx[:, :13]) - full[:, :13]).abs().max() < 1e-5
            assert (decode(m, idx, 9, KVCache(2)) - full).abs().max() < 1e-5


def test_flex_is_refused_for_reference_only_schemes_in_one_line():
    from extrapolab.io import UserError

    q, k, v = _qkv(L=10)
    with pytest.raises(UserError, match="reference path only") as err:
        attend(q, k, v, torch.arange(10), torch.arange(10), _StickBreaking(3), 0, AttnOptions(impl="flex"))
    assert "\n" not in str(err.value)


def test_per_head_temperature_on_the_flex_path():
    """FlexAttention (eager on the CPU, forward): q and the distance table divided per head."""
    from extrapolab.model import flex

    if not flex.available():
        pytest.skip("torch without FlexAttention")
    s = _tau_scheme(KerpleLog, False).float()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 3, 200, 16, generator=g) for _ in range(3))
    pos = torch.arange(200)
    with torch.no_grad():
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex", temperature=0.7))
        want = _formula(q.double(), k.double(), v.double(), pos, pos, s.double(), 0.7, s.temperature(pos))
    assert (got.double() - want).abs().max() < 2e-5

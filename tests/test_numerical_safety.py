"""Numerical safety at 32x L_tr (L_tr = 8 -> 256) for every registered scheme, and a property
test that blocked / fused / auto attention equal the plain matmul-softmax path.

Every scheme: forward and evaluation give finite logits, loss and perplexity in fp32, under bf16
autocast (the trainer's bf16 mode) and with bf16 weights, at temperature 1 and 0.5; learned APE
refuses with its one-line error instead. Stress settings: KERPLE biases of -1e4·k^2 and
-1e6·log(1+k), huge multiplicative kernels (weights ~0), windows of 1 and 10^6 keys, a
sliding-dilated level where every row sees only itself, evaluation-time windowed@4, ALiBi slopes
of 1024.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolab.eval import evaluate
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.positional import REGISTRY, SchemeError, build, names, scheme_params

V, L_TR, L_EX = 32, 8, 256
MODES = ("fp32", "bf16-autocast", "bf16-weights")
TOKENS = np.random.default_rng(0).integers(0, V, 4 * L_EX + 1)



def _model(scheme: str, **params) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=V, layers=2, heads=2, dim=16, train_length=L_TR, scheme=scheme,
                           scheme_params=params)).eval()


def _in_mode(model: GPT, mode: str) -> GPT:
    return model.to(torch.bfloat16) if mode == "bf16-weights" else model


def _finite_forward(model: GPT, mode: str, tau: float, window: int | None = None) -> float:
    x = torch.from_numpy(TOKENS[: 2 * (L_EX + 1)].reshape(2, L_EX + 1))  # [2, L+1]
    opts = AttnOptions(temperature=tau, window=window)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-autocast"):
        logits = model(x[:, :-1], opts=opts)  # [2, L, V]
    assert logits.shape == (2, L_EX, V) and torch.isfinite(logits).all()
    loss = F.cross_entropy(logits.float().reshape(-1, V), x[:, 1:].reshape(-1)).item()
    assert math.isfinite(loss) and 0 < loss < 100
    return loss


def _finite_eval(model: GPT, tau: float) -> None:
    r = evaluate(model, TOKENS, train_length=L_TR, protocols=["nonoverlapping", "last_token"], lengths=[L_TR, L_EX],
                 num_tokens=2 * L_EX, last_token_n=2, batch_size=2, temperature=tau)
    for proto in ("nonoverlapping", "last_token"):
        for L in (L_TR, L_EX):
            ppl = r[proto][str(L)].get("ppl")
            assert isinstance(ppl, float) and 1.0 < ppl < 1e6, (proto, L, r[proto][str(L)])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", names())
def test_every_scheme_is_finite_at_32x(name, mode):
    if name == "learned":
        with pytest.raises(SchemeError, match="no embedding for positions >= 8"):
            _model(name)(torch.zeros(1, L_EX, dtype=torch.long))
        return
    model = _in_mode(_model(name), mode)
    for tau in (1.0, 0.5):
        _finite_forward(model, mode, tau)
    if mode != "bf16-autocast":  # evaluation runs the model as it is (fp32 or bf16 weights)
        _finite_eval(model, 0.5)


def _set(model: GPT, **values) -> GPT:
    with torch.no_grad():
        for k, v in values.items():
            getattr(model.scheme, k).fill_(v)
    return model


STRESS = {
    "kerple-power r1=1e4, r2=2": lambda: _set(_model("kerple-power"), r1=1e4, r2=2.0),  # bias -6.5e8 at k=255
    "kerple-log r1=1e6": lambda: _set(_model("kerple-log"), r1=1e6, r2=1.0),
    "kerple-bias-wht huge": lambda: _set(_model("kerple-bias-wht"), r1=1e4, r2=2.0, r3=1e4, r4=2.0),
    "kerple-gauss-2para-wht huge": lambda: _set(_model("kerple-gauss-2para-wht"), r1=1e6, r2=2.0),
    "kerple-gauss-2para-bias big": lambda: _set(_model("kerple-gauss-2para-bias"), r1=1e4, r2=1e4),
    "windowed w=1": lambda: _model("windowed", window=1),
    "windowed w=1e6": lambda: _model("windowed", window=10**6),
    "sliding-dilated self only": lambda: _model("sliding-dilated", level=9),  # C^9 = 512 > 255
    "alibi slopes 1024": lambda: _model("alibi", equal_exponent=-10.0),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(STRESS))
def test_extreme_biases_stay_finite(case, mode):
    model = _in_mode(STRESS[case](), mode)
    for tau in (1.0, 0.5):
        _finite_forward(model, mode, tau)
        _finite_forward(model, mode, tau, window=4)  # evaluation-time windowed@4 on top


def test_self_only_rows_reduce_to_the_value():
    """A row that sees only its own key must output exactly that key's value (no NaN from -inf)."""
    q, k, v = (torch.randn(1, 2, 50, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(50)
    s = build("sliding-dilated", num_heads=2, level=9)
    for impl in ("plain", "blocked", "sdpa"):
        out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl=impl, block_size=7, temperature=0.5))
        torch.testing.assert_close(out, v, rtol=0, atol=1e-12)


# ---- blocked / fused / auto == plain --------------------------------------------------------------
def _scheme(name: str, heads: int, seed: int, head_dim: int = 8):
    torch.manual_seed(seed)
    sizes = {"dim": heads * head_dim, "layers": 2, "head_dim": head_dim}  # schemes with per-layer parameters
    s = build(name, num_heads=heads, **{k: v for k, v in sizes.items() if k in scheme_params(REGISTRY[name])})
    with torch.no_grad():
        for p in s.parameters():
            p.uniform_(0.05, 1.5)  # learned tables / kernels away from their (often zero) init
    s.constrain_()
    return s


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(names()), B=st.integers(1, 2), H=st.integers(1, 3), D=st.sampled_from([4, 8]),
       Lq=st.integers(1, 40), extra=st.integers(0, 24), offset=st.integers(0, 6), block=st.integers(1, 17),
       window=st.one_of(st.none(), st.integers(1, 30)), tau=st.sampled_from([1.0, 0.8, 0.5]),
       impl=st.sampled_from(["blocked", "sdpa", "auto"]), tiny_budget=st.booleans(), seed=st.integers(0, 99))
def test_blocked_equals_plain(name, B, H, D, Lq, extra, offset, block, window, tau, impl, tiny_budget, seed):
    scheme = _scheme(name, H, seed, D)
    Lk = Lq + extra
    k_pos = torch.arange(Lk) + offset  # keys, e.g. a KV cache that starts at `offset`
    q_pos = k_pos[extra:]  # the newest Lq positions: every query sees at least itself
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    budget = 1e-6 if tiny_budget else 512.0  # a tiny budget forces 'auto' onto the blocked path
    kw = dict(block_size=block, memory_budget_mb=budget, window=window, temperature=tau)
    content = None
    if scheme.has_content:  # positions from content: any non-decreasing p per (batch, head), keys' a prefix
        pk = torch.rand(B, H, Lk, generator=g, dtype=torch.float64).mul(3.0).cumsum(-1)  # [B, H, Lk]
        content = (pk[..., extra:], pk)
    ref, _ = attend(q, k, v, q_pos, k_pos, scheme, 1, AttnOptions(impl="plain", **kw), content=content)
    out, _ = attend(q, k, v, q_pos, k_pos, scheme, 1, AttnOptions(impl=impl, **kw), content=content)
    assert torch.isfinite(ref).all()
    # float64 activations; the plain path takes the scheme's bias in float32 (RelativeBias.bias), the
    # others a float64 distance table, so ~1e-9 differences are rounding of that bias, not error
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)

"""The near-far path (model/nearfar.py, docs/attention.md row 4c): T5's bias is its last bucket from max_distance
on, so the far keys are plain causal attention whose log-sum-exp the constant shifts, merged with a band of
max_distance keys that carries the table. Both forms (the CPU's fused flash calls; the CUDA form's FlexAttention
band, run here on eager FlexAttention, with either far kernel) against the dense softmax formula in fp64; bf16
within the Toeplitz path's own bf16 error; when `auto` takes it; the CUDA flash op's schema; `gpu`: on CUDA
against the plain path."""
import math

import pytest
import torch

from extrapolab import positional
from extrapolab.io import UserError
from extrapolab.model import flex, nearfar
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, ModelConfig
from extrapolab.model.tables import DistanceBias
from extrapolab.positional.t5 import T5Bias
from flexspy import eager_dense_calls


def _t5(heads=3, max_distance=24, seed=0, dtype=torch.float64):
    s = positional.build("t5", num_heads=heads, max_distance=max_distance).to(dtype)
    with torch.no_grad():
        s.table.copy_(torch.randn(s.table.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2)
    return s


def _qkv(B, H, L, D, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(3))


def _dense(q, k, v, s, tau=1.0, tau_h=None):
    """softmax((q·k/sqrt(d) + b_h(m - n)) / (tau·tau_h)) v over n <= m, the bias from the table at every
    distance (no constant assumed), in the inputs' precision."""
    L, D = q.shape[2], q.shape[3]
    d = torch.arange(L)[:, None] - torch.arange(L)[None]  # [L, L]
    b = s.bias_from_distance(d.clamp(min=0)).to(q.dtype).masked_fill(d < 0, -math.inf)  # [H, L, L]
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D) + b) / tau  # [B, H, L, L]
    if tau_h is not None:
        logits = logits / tau_h.view(1, -1, 1, 1)
    return torch.softmax(logits, -1) @ v


class _HeadTau(T5Bias):
    """T5 with a per-head temperature: the path divides q and the table per head."""

    def temperature(self, q_pos, layer=0):
        return torch.tensor([[0.5], [1.0], [2.0]], dtype=self.table.dtype)  # [H, 1]


@pytest.mark.parametrize("form,far", [("fused", "sdpa"), ("flex", "sdpa"), ("flex", "flex")])
def test_both_forms_equal_the_dense_formula_in_fp64(form, far, monkeypatch):
    """Blocks of 64 rows, max_distance 24 (every block has far keys and band keys), option temperatures, a
    per-head scheme temperature, batch 2: to fp64 rounding."""
    monkeypatch.setattr(nearfar, "FAR_KERNEL", far)
    s = _t5()
    q, k, v = _qkv(2, 3, 300, 8)
    with torch.no_grad():
        for tau in (1.0, 0.7):
            db = DistanceBias(s, None, torch.float64)
            out = nearfar.nearfar_attention(q, k, v, db, 0, 24, scale=1 / math.sqrt(8), tau=tau, block=64, form=form)
            torch.testing.assert_close(out, _dense(q, k, v, s, tau), rtol=0, atol=1e-12)
        s.__class__ = _HeadTau
        paths = {}
        got, _ = attend(q, k, v, torch.arange(300), torch.arange(300), s, 0, AttnOptions(impl="nearfar", paths=paths))
        assert paths == {"nearfar": 1}
        torch.testing.assert_close(got, _dense(q, k, v, s, tau_h=s.temperature(None).reshape(-1)), rtol=0, atol=1e-12)


def test_the_constant_is_the_last_bucket_from_max_distance_on():
    """What the path relies on (T5's bucket formula, thesis §3.4): every distance from max_distance on, far past
    it too, is in the last bucket; the distance just below it may share it (the path does not need that)."""
    for nb, md in ((32, 128), (32, 24), (8, 5), (33, 100)):
        s = positional.build("t5", num_heads=1, num_buckets=nb, max_distance=md)
        d = torch.arange(md, 70_000)
        b = positional.t5.t5_causal_bucket(d, nb, md)
        assert s.constant_beyond() == md and bool((b == nb - 1).all()), (nb, md)


def test_bf16_within_the_toeplitz_paths_own_bf16_error():
    s = _t5(max_distance=40, dtype=torch.float32)
    q, k, v = _qkv(2, 3, 1500, 16, dtype=torch.float32)
    pos = torch.arange(1500)
    errs = {}
    with torch.no_grad():
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
        for impl in ("sdpa", "nearfar"):
            paths = {}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, _ = attend(*(t.bfloat16() for t in (q, k, v)), pos, pos, s, 0, AttnOptions(impl=impl, paths=paths))
            assert out.dtype == torch.bfloat16 and set(paths) == {"toeplitz" if impl == "sdpa" else "nearfar"}
            errs[impl] = float((out.float() - ref).norm() / ref.norm())
    assert 0 < errs["nearfar"] <= 1.5 * errs["sdpa"], errs


def test_when_auto_takes_it(monkeypatch):
    """Evaluation of a whole sequence: CUDA where FlexAttention would run (nearfar.AUTO_CUDA), the CPU from
    nearfar.CPU_MIN_LENGTH tokens where nearfar.AUTO_CPU is set (off: slower than the Toeplitz path's blocks there);
    never with gradients, a window, decoding or short inputs; AttnOptions.exact_routes False: never."""
    monkeypatch.setattr(nearfar, "AUTO_CPU", True)
    t5 = positional.build("t5", num_heads=4)
    L = max(flex.MIN_LENGTH, nearfar.CPU_MIN_LENGTH)
    kw = dict(same_pos=False, starts=(0, 0), dense_bias=False, grad=False, far=128)

    def path(dev="cuda", opts=None, q=(1, 4, L, 64), Lk=L, **over):
        return select_path(dev, t5, opts or AttnOptions(), q, Lk, **{**kw, **over})[0]

    flexed = "flex" if flex.supported("cuda", 64, torch.float32) else "toeplitz"
    assert path() == ("nearfar" if flexed == "flex" else "toeplitz")
    assert path("cpu") == "nearfar" and path("cpu", starts=(7, 7)) == "nearfar"
    assert path("cpu", q=(1, 4, nearfar.CPU_MIN_LENGTH - 1, 64), Lk=nearfar.CPU_MIN_LENGTH - 1) == "toeplitz"
    assert path(grad=True) == "toeplitz" and path("cpu", grad=True) == "toeplitz"  # training: the dense mask's path
    assert path(opts=AttnOptions(window=300)) == flexed and path("cpu", opts=AttnOptions(window=300)) == "toeplitz"
    assert path(q=(1, 4, 1, 64), starts=(L - 1, 0)) == "toeplitz"  # decoding one token
    assert path(starts=(5, 0), q=(1, 4, L - 5, 64)) == "toeplitz"  # a chunk after a KV cache
    assert path(far=None) == flexed  # no constant: the table
    off = AttnOptions(exact_routes=False)  # bench's SCHEME+table rows
    assert path(opts=off) == flexed and path("cpu", opts=off) == "toeplitz"
    assert path("cpu", opts=AttnOptions(impl="nearfar"), q=(1, 4, 200, 64), Lk=200) == "nearfar"  # forced
    for flag in ("AUTO_CUDA", "AUTO_CPU"):  # the switches
        old = getattr(nearfar, flag)
        setattr(nearfar, flag, False)
        try:
            assert path("cuda" if flag == "AUTO_CUDA" else "cpu") == ("toeplitz" if flag == "AUTO_CPU" else flexed)
        finally:
            setattr(nearfar, flag, old)


def test_forcing_it_where_it_cannot_run_is_a_one_line_error():
    q, k, v = (t.float().requires_grad_() for t in _qkv(1, 2, 40, 8))
    pos = torch.arange(40)
    for s, grad, match in ((positional.build("alibi", num_heads=2), False, "constant beyond"),
                           (positional.build("t5", num_heads=2, max_distance=20), True, "forward only")):
        with pytest.raises(UserError, match=match) as err, torch.set_grad_enabled(grad):
            attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="nearfar"))
        assert "\n" not in str(err.value)


def test_model_evaluation_on_the_cpu_takes_it_and_equals_the_toeplitz_path(monkeypatch):
    monkeypatch.setattr(nearfar, "AUTO_CPU", True)
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme="t5", vocab_size=50, dim=32, heads=2, layers=2, train_length=64,
                        scheme_params={"max_distance": 64}))
    with torch.no_grad():
        m.scheme.table.normal_()
        idx = torch.randint(0, 50, (1, nearfar.CPU_MIN_LENGTH + 30))
        got, want = ({}, {})
        a = m(idx, opts=AttnOptions(paths=got))
        b = m(idx, opts=AttnOptions(impl="sdpa", paths=want))
    assert got == {"nearfar": 2} and want == {"toeplitz": 2}
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_cuda_flash_op_keeps_the_signature_we_call():
    """``aten::_scaled_dot_product_flash_attention`` (the CUDA far pass, positional arguments) is private to torch:
    a release that changes it fails here, on the CPU, before a GPU run."""
    schema = nearfar.CUDA_FLASH.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:6] == ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"] and "scale" in names
    assert [r.name for r in schema.returns][:2] == ["output", "logsumexp"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_nearfar_equals_plain(dtype, monkeypatch):
    """GPT-2's head size on CUDA at 2,048 tokens (far pass: SDPA's flash kernel in bf16, FlexAttention in fp32):
    `auto` takes the path and equals the plain path (fp32: to rounding; bf16: within twice the Toeplitz path's
    bf16 error plus 1e-3); torch's eager dense FlexAttention never runs."""
    dense = eager_dense_calls(monkeypatch)
    s = _t5(heads=4, max_distance=128, dtype=torch.float32).cuda()
    q, k, v = (t.cuda() for t in _qkv(1, 4, 2048, 64, dtype=torch.float32))
    pos = torch.arange(2048, device="cuda")
    with torch.no_grad():
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            paths = {}
            out, _ = attend(q.to(dtype), k.to(dtype), v.to(dtype), pos, pos, s, 0, AttnOptions(paths=paths))
            low, _ = attend(q.to(dtype), k.to(dtype), v.to(dtype), pos, pos, s, 0, AttnOptions(impl="sdpa"))
    assert paths == {"nearfar": 1} and dense == [] and not nearfar._FLASH_FAILED
    err = float((out.float() - ref).norm() / ref.norm())
    bound = 1e-5 if dtype == torch.float32 else 2 * float((low.float() - ref).norm() / ref.norm()) + 1e-3
    assert err <= bound, (dtype, err, bound)

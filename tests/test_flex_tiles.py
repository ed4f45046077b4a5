"""FlexAttention's tiles and what happens when a compile does not fit the GPU (model/flex_tiles.py,
model/flex.py, docs/attention.md "Tiles").

On an H100 (torch 2.11) every bias scheme's bf16 compile failed with inductor's
``No valid triton configs. OutOfMemoryError: out of resource ... Required: 247808 Hardware limit: 232448``
under torch's default tiles. Here, on the CPU: the tile plan against those measured figures, and the
compiled kernel driven with a stub (and with a real ``torch.compile`` whose backend fails) that raises the
real exception type: the next rung is tried once, then the call runs on the Toeplitz (or split) path with
one warning line -- never a traceback, never different numbers.
"""
import warnings

import pytest
import torch

from extrapolab import positional
from extrapolab.model import flex, flex_pieces, flex_tiles
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.flex_tiles import LADDER, Device, fwd_shared_bytes, plan

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention (needs >= 2.6)")
H100 = Device((9, 0), 232448)  # torch.cuda.get_device_properties: shared_memory_per_block_optin
OOR = ("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
       "Required: 247808 Hardware limit:232448 Reducing block sizes or `num_stages` may help.")


def _inductor_oor():
    from torch._inductor.exc import InductorError
    from torch._inductor.runtime.triton_heuristics import NoTritonConfigsError

    return InductorError(NoTritonConfigsError(OOR), None)


def test_shared_memory_estimate_matches_the_h100_failure_and_the_plan_fits():
    """torch's H100 default for bf16 at head size 64 (128 x 128, 3 stages) with a gathered table needs
    what the H100 reported (247,808 B, within 1%) > its 232,448 B; without the gather, and for fp32's
    default 128 x 32 tile, it fits (both compiled there). The plan's first rung fits with room."""
    default = fwd_shared_bytes(128, 128, 3, 64, 2, gather=True)
    assert abs(default - 247808) / 247808 < 0.01 and default > H100.shared_bytes
    assert fwd_shared_bytes(128, 128, 3, 64, 2, gather=False) < H100.shared_bytes
    assert fwd_shared_bytes(128, 32, 3, 64, 4, gather=True) < H100.shared_bytes
    first, second = plan(H100, torch.bfloat16, 64, gather=True)
    assert first == LADDER[0].options() and second == LADDER[1].options()
    assert first["fwd_BLOCK_M"] == 128 and first["fwd_BLOCK_N"] == 64 and first["bwd_BLOCK_N1"] == 64
    assert fwd_shared_bytes(*LADDER[0].fwd[:3], 64, 2, gather=True) <= H100.shared_bytes - flex_tiles.MARGIN


def test_plan_keeps_torch_defaults_where_nothing_is_gathered_and_off_cuda():
    assert plan(H100, torch.bfloat16, 64, gather=False)[0] is None  # torch's own default first
    assert plan(H100, torch.float32, 64, gather=True)[0] is None  # fp32's default tiles are small
    assert all(len(plan(H100, dt, 64, g)) == 2 for dt in (torch.bfloat16, torch.float32) for g in (True, False))
    assert plan(None, torch.bfloat16, 64, gather=True) == [None]  # eager FlexAttention: nothing to choose


def test_heavy_score_mods_start_on_small_tiles_in_every_dtype():
    """FIRE's rows beyond L (an MLP per score element) ran 4.5x slower on the (128, 64, 3, 4) rung than on 64 x 64
    tiles with 2 stages on an H100: a heavy score_mod starts there, bf16 and fp32 alike, and keeps a smaller rung."""
    for dt in (torch.bfloat16, torch.float32):
        first, second = plan(H100, dt, 64, gather=True, heavy=True)
        assert first == flex_tiles.HEAVY.options() and second == LADDER[-1].options()
        assert (first["fwd_BLOCK_M"], first["fwd_BLOCK_N"], first["fwd_num_stages"]) == (64, 64, 2)
    assert plan(None, torch.bfloat16, 64, gather=True, heavy=True) == [None]


def test_heavy_score_mods_with_gradient_keep_torchs_backward():
    """On an H200 the heavy rung's 32 x 32 backward did not compile for FIRE's rows (Triton CompilationError) where
    torch's default backward had on an H100: with a gradient a heavy score_mod takes the heavy forward tiles with
    torch's backward, then what a score_mod that is not heavy starts on (torch's default in fp32, the largest
    fitting rung in bf16: what FIRE's rows trained on before the heavy rung)."""
    for dt in (torch.bfloat16, torch.float32):
        first, second = plan(H100, dt, 64, gather=True, heavy=True, grad=True)
        assert second == plan(H100, dt, 64, gather=True)[0] and not any(k.startswith("bwd_") for k in first)
        assert first == {k: v for k, v in flex_tiles.HEAVY.options().items() if k.startswith("fwd_")}
    assert flex_tiles.describe(first) == "fwd 64x64 s2 w4 / bwd torch's default"


@pytest.mark.parametrize("shared", [101376, 166912, 232448])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_plan_fits_smaller_devices_and_larger_heads(shared, head_dim):
    """Every first choice fits the device by the estimate; a smaller device or larger head takes a smaller
    tile, never a larger one; backward blocks keep torch's divisibility constraints."""
    dev = Device((8, 6), shared)
    opts = plan(dev, torch.bfloat16, head_dim, gather=True)
    f = opts[0]
    assert fwd_shared_bytes(f["fwd_BLOCK_M"], f["fwd_BLOCK_N"], f["fwd_num_stages"], head_dim, 2, True) <= shared
    for o in opts:
        assert o["bwd_BLOCK_N1"] % o["bwd_BLOCK_M1"] == 0 and o["bwd_BLOCK_M2"] % o["bwd_BLOCK_N2"] == 0
    big = plan(H100, torch.bfloat16, 32, gather=True)[0]
    assert f["fwd_BLOCK_M"] * f["fwd_BLOCK_N"] <= big["fwd_BLOCK_M"] * big["fwd_BLOCK_N"]


def test_out_of_resource_is_recognised_and_nothing_else_is():
    assert flex_tiles.out_of_resource(_inductor_oor())
    try:
        try:
            raise RuntimeError(OOR)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert flex_tiles.out_of_resource(outer)
    assert not flex_tiles.out_of_resource(RuntimeError("CUDA error: an illegal memory access was encountered"))


def _inductor_compile_error():
    """inductor's error around Triton's CompilationError, as FIRE's rows' backward raised it on an H200."""
    import ast

    from torch._inductor.exc import InductorError
    from triton.compiler.errors import CompilationError

    node = ast.parse("dq = bwd_dq_inner(x)").body[0]
    inner = CompilationError("dq = bwd_dq_inner(x)", node, "Cannot broadcast, rank mismatch: ['1'], [32, 32]")
    return InductorError(inner, None)


def test_a_triton_compile_error_is_a_compile_failure_and_a_bug_is_not():
    pytest.importorskip("triton")
    assert flex_tiles.compile_failure(_inductor_oor()) == "out of resource"
    assert flex_tiles.compile_failure(_inductor_compile_error()) == "Triton compile error"
    assert not flex_tiles.out_of_resource(_inductor_compile_error())
    assert flex_tiles.compile_failure(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert flex_tiles.compile_failure(NotImplementedError("Using multiple indexing operations")) is None


class _Stub:
    """The compiled function of flex.Compiled: raises the real inductor error for the option sets in
    ``fail`` (or all with fail=None), else runs eager FlexAttention; records the options of each call."""

    def __init__(self, fail, error=None):
        from torch.nn.attention.flex_attention import flex_attention

        self.fail, self.calls, self.eager, self.error = fail, [], flex_attention, error or _inductor_oor

    def __call__(self, q, k, v, kernel_options=None, **kw):
        self.calls.append(kernel_options)
        if self.fail is None or kernel_options in self.fail:
            raise self.error()
        return self.eager(q, k, v, **kw)


def _compiled(monkeypatch, fail, error=None):
    monkeypatch.setattr(flex_tiles, "device_info", lambda device: H100)  # plan as on the H100
    c = flex.Compiled()
    c.fn = _Stub(fail, error)
    monkeypatch.setattr(flex, "kernel", lambda device: c)
    return c


def _qkv(L, dtype=torch.bfloat16, H=4, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, L, D, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("name", ["alibi", "kerple-log", "sandwich", "t5"])
def test_out_of_resource_first_rung_retries_once_on_the_smaller_rung(monkeypatch, name):
    """A table scheme's first choice is the plan's largest rung; ALiBi's and KERPLE's score_mods gather nothing
    (closed forms), so their first choice is torch's default; either way a failure retries the next rung, once."""
    gather = flex.table_form(positional.build(name, num_heads=4), 0) == "table"
    assert gather == (name in ("sandwich", "t5"))
    first, second = plan(H100, torch.bfloat16, 64, gather)
    assert (first is None) == (not gather)
    c = _compiled(monkeypatch, fail=[first])
    s = positional.build(name, num_heads=4)
    q, k, v = _qkv(160)
    pos = torch.arange(160)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a retry that works is not a fallback: no warning
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
    ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
    assert (got.float() - ref.float()).abs().max() < 3e-2
    assert c.fn.calls == [first, second]
    assert [e["status"] for e in c.events] == ["out of resource", "compiled"]
    assert c.events[1]["options"] == flex_tiles.describe(second)
    q2, k2, v2 = _qkv(96, seed=1)  # the next shape starts on the rung that compiled: no failing compile again
    with torch.no_grad():
        attend(q2, k2, v2, pos[:96], pos[:96], s, 0, AttnOptions(impl="flex"))
    assert c.fn.calls[2:] == [second]


@pytest.mark.parametrize("name", ["alibi", "kerple-log", "sliding-dilated"])
def test_out_of_resource_on_every_rung_runs_the_toeplitz_path_with_one_warning(monkeypatch, name):
    c = _compiled(monkeypatch, fail=None)
    s = positional.build(name, num_heads=4)
    q, k, v = _qkv(200)
    pos = torch.arange(200)
    with torch.no_grad(), pytest.warns(RuntimeWarning) as rec:
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
    msg = str(rec[0].message)
    assert len(rec) == 1 and "\n" not in msg and "shared memory" in msg and "Lq=200 Lk=200 D=64" in msg
    assert "Toeplitz path instead" in msg and flex_tiles.describe(LADDER[1].options()) in msg
    ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
    assert torch.equal(got, ref)  # exactly the Toeplitz path's numbers
    n = len(c.fn.calls)
    assert n == 2
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="shared memory"):
        attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
    assert len(c.fn.calls) == n  # known not to fit: no compile is attempted again


def test_out_of_resource_fire_rows_take_the_split_path(monkeypatch):
    """FIRE's rows beyond L ask for the heavy rungs (both tried), then run the split path with one warning."""
    monkeypatch.setattr(flex_pieces, "ENABLED", False)  # evaluation takes flex-pieces (its first call not heavy)
    c = _compiled(monkeypatch, fail=None)
    s = positional.build("fire", num_heads=4, original_length=16)
    q, k, v = _qkv(96)
    pos = torch.arange(96)  # L = 16: most queries beyond L, the flex rows' region
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="shared memory.*split path instead"):
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
    assert torch.equal(got, ref)
    assert c.fn.calls == plan(H100, torch.bfloat16, 64, gather=True, heavy=True)


def test_out_of_resource_sends_fire_pieces_to_the_split_path(monkeypatch):
    """FIRE's evaluation on flex-pieces: its first call (pieces) asks for a gathering score_mod's rungs, not the
    heavy ones; when every rung fails the call runs on the split path with one warning and that path's numbers."""
    c = _compiled(monkeypatch, fail=None)
    s = positional.build("fire", num_heads=4, original_length=16)
    q, k, v = _qkv(96)
    pos = torch.arange(96)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="shared memory.*split path instead") as rec:
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
    assert len(rec) == 1 and torch.equal(got, ref)
    assert c.fn.calls == plan(H100, torch.bfloat16, 64, gather=True, heavy=False)


def test_out_of_resource_through_a_real_dynamo_compile_retries_and_recompiles(monkeypatch):
    """A real ``torch.compile(flex_attention, fullgraph=True)`` whose backend raises inductor's error for the
    first rung's options: dynamo propagates it, flex.Compiled recognises it, and the second rung compiles
    (a new graph, the options being compile-time constants) and equals eager FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention

    seen = []

    def backend(gm, example_inputs):
        opts = [a for n in gm.graph.nodes for a in n.args if isinstance(a, dict) and "fwd_BLOCK_M" in a]
        seen.append(opts[0]["fwd_BLOCK_M"] if opts else None)
        if opts and opts[0]["fwd_BLOCK_M"] == LADDER[0].fwd[0]:
            raise _inductor_oor()
        return gm.forward

    monkeypatch.setattr(flex_tiles, "device_info", lambda device: H100)
    torch._dynamo.reset()
    c = flex.Compiled()
    c.fn = torch.compile(flex_attention, backend=backend, dynamic=False, fullgraph=True)
    q, k, v = _qkv(128, dtype=torch.float32)
    try:
        with torch.no_grad():
            got = c(q.bfloat16(), k.bfloat16(), v.bfloat16(), gather=True)
            want = flex_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    finally:
        torch._dynamo.reset()  # this backend's graphs must not count against later tests' compiles
    assert seen == [LADDER[0].fwd[0], LADDER[1].fwd[0]]
    assert torch.equal(got, want)
    assert [e["status"] for e in c.events] == ["out of resource", "compiled"]


def test_triton_compile_error_on_every_rung_runs_fire_on_the_split_path_with_one_warning(monkeypatch):
    """FIRE's rows (the H200's failure): both rungs rejected by Triton, the call runs on the split path with one
    line naming the cause, with that path's numbers."""
    pytest.importorskip("triton")
    monkeypatch.setattr(flex_pieces, "ENABLED", False)  # evaluation takes flex-pieces (its first call not heavy)
    c = _compiled(monkeypatch, fail=None, error=_inductor_compile_error)
    s = positional.build("fire", num_heads=4, original_length=16)
    q, k, v = _qkv(96)
    pos = torch.arange(96)
    with torch.no_grad(), pytest.warns(RuntimeWarning) as rec:
        got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="sdpa"))
    msg = str(rec[0].message)
    assert len(rec) == 1 and "\n" not in msg and "Triton compile error" in msg and "split path instead" in msg
    assert torch.equal(got, ref)
    assert c.fn.calls == plan(H100, torch.bfloat16, 64, gather=True, heavy=True)
    assert [e["status"] for e in c.events] == ["Triton compile error"] * 2


def test_triton_compile_error_with_gradient_tries_torchs_backward_then_gives_up_once(monkeypatch):
    """With a gradient the compiled kernel tries the heavy forward with torch's backward, then torch's defaults,
    and raises the one error attend() turns into the fallback; the next call of that key compiles nothing."""
    pytest.importorskip("triton")
    c = _compiled(monkeypatch, fail=None, error=_inductor_compile_error)
    q, k, v = _qkv(64, dtype=torch.float32)
    for _ in range(2):
        with pytest.raises(flex.OutOfResource, match="did not compile it .Triton compile error.*bwd torch's default"):
            c(q, k, v, gather=True, heavy=True)
    assert c.fn.calls == plan(H100, torch.float32, 64, gather=True, heavy=True, grad=True)

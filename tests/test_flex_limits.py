"""The compiled FlexAttention kernel never falls back silently, and the flex path never synchronises
the host with the device per layer (model/flex.py, docs/attention.md "The CUDA path").

Both are CPU tests: inductor compiles FlexAttention's forward on the CPU in torch 2.13, so the
recompile limit is driven for real; host-device synchronisations are counted with a dispatch mode
(every op that reads a device value back, or copies host data to a tensor), the kernel stubbed.
"""
import pytest
import torch

from extrapolab import positional
from extrapolab.model import flex
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, KVCache, ModelConfig

from flexspy import CountSyncs, eager_dense_calls, stub_kernel

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention (needs >= 2.6)")


def _qkv(B, H, L, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(3))


def test_compiled_kernel_past_its_recompile_limit_takes_toeplitz_never_eager_dense(monkeypatch):
    """More distinct shapes than the limit through the compiled kernel: the first ``limit`` compile,
    every later one runs on the Toeplitz path with a one-line warning naming the shape, all equal
    to the reference, and torch's eager dense implementation (math_attention) never runs."""
    dense_calls = eager_dense_calls(monkeypatch)
    compiled = flex.Compiled(limit=2)
    monkeypatch.setattr(flex, "kernel", lambda device: compiled)
    s = positional.build("alibi", num_heads=2)
    before = torch._dynamo.config.recompile_limit
    seen = []
    with torch.no_grad():
        for L in (128, 160, 192, 224):  # 4 shapes > limit 2
            q, k, v = _qkv(1, 2, L, 16, seed=L)
            pos = torch.arange(L)
            ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
            with pytest.warns(RuntimeWarning, match=f"Lq={L} Lk={L}") if L > 160 else _no_warning():
                got, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="flex"))
            assert (got - ref).abs().max() < 2e-5, L
            seen.append(compiled.full)
    assert seen == [False, False, True, True]
    assert dense_calls == [], "the eager dense FlexAttention path ran"
    assert torch._dynamo.config.recompile_limit == before  # the raised limit is scoped to the kernel's calls
    # a shape compiled before the limit was reached still runs compiled
    q, k, v = _qkv(1, 2, 128, 16, seed=128)
    with torch.no_grad(), _no_warning():
        attend(q, k, v, torch.arange(128), torch.arange(128), s, 0, AttnOptions(impl="flex"))


class _no_warning:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_recompile_limit_warning_is_one_line_naming_the_shape():
    q, k = torch.zeros(2, 4, 300, 64), torch.zeros(2, 4, 300, 64)
    msg = flex.unavailable_warning(q, k, True, flex.RecompileLimit(64))
    assert "\n" not in msg and "B=2 H=4 Lq=300 Lk=300 D=64" in msg and "RECOMPILE_LIMIT" in msg


def test_a_full_kernel_stops_the_automatic_rule(monkeypatch):
    alibi = positional.build("alibi", num_heads=4)
    kw = dict(same_pos=True, starts=(0, 0), dense_bias=False, grad=False)
    full = flex.Compiled.__new__(flex.Compiled)
    full.full, full.limit = True, 2
    assert select_path("cuda", alibi, AttnOptions(), (1, 4, 1024, 64), 1024, **kw)[0] == "flex"
    monkeypatch.setattr(flex, "_COMPILED", [full])
    assert select_path("cuda", alibi, AttnOptions(), (1, 4, 1024, 64), 1024, **kw)[0] == "toeplitz"


def test_automatic_rule_skips_short_lengths_and_old_torch(monkeypatch):
    """auto uses flex only where it pays: CUDA, Lq = Lk >= MIN_LENGTH (a smoke run at L = 32 or a
    regular-language task never compiles), and torch >= 2.6."""
    alibi = positional.build("alibi", num_heads=4)
    kw = dict(same_pos=True, starts=(0, 0), dense_bias=False, grad=True)
    L0 = flex.MIN_LENGTH
    assert select_path("cuda", alibi, AttnOptions(), (8, 4, L0, 64), L0, **kw)[0] == "flex"
    assert select_path("cuda", alibi, AttnOptions(), (8, 4, L0 - 1, 64), L0 - 1, **kw)[0] == "toeplitz"
    assert select_path("cuda", alibi, AttnOptions(), (8, 4, 32, 64), 32, **kw)[0] == "toeplitz"
    assert select_path("cuda", alibi, AttnOptions(impl="flex"), (8, 4, 32, 64), 32, **kw)[0] == "flex"  # asked for
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    assert not flex.available()
    assert select_path("cuda", alibi, AttnOptions(), (8, 4, L0, 64), L0, **kw)[0] == "toeplitz"


# ---- host-device synchronisations -----------------------------------------------------------


@pytest.mark.parametrize("name", ["alibi", "kerple-log", "t5", "sliding-dilated", "kerple-bias-wht"])
def test_flex_path_has_no_host_device_sync_per_layer(name, monkeypatch):
    """A whole forward on the flex path: the syncs do not grow with the number of layers (they are
    the few once-per-forward position checks), for fixed and learnable tables, training and not."""
    monkeypatch.setattr(flex, "kernel", lambda device: stub_kernel)
    # the stub's output carries no graph; the table-gradient route's would give the next layer's q a gradient,
    # which CPU FlexAttention refuses (its forward reads nothing back: test_table_grad.py)
    monkeypatch.setattr(flex.table_grad, "attach", lambda out, *a, **kw: out)
    counts = {}
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=64, heads=4, layers=layers, train_length=256))
        idx = torch.randint(0, 64, (2, 256))
        for n, p in m.named_parameters():  # CPU FlexAttention: table gradients only, q/k/v need none
            p.requires_grad_(n.startswith("scheme."))
        for grad in (False, True):
            with torch.set_grad_enabled(grad), CountSyncs() as c:
                m(idx, opts=AttnOptions(impl="flex"))
            counts[(layers, grad)] = len(c.calls)
    assert counts[(2, False)] == counts[(6, False)] and counts[(2, True)] == counts[(6, True)], counts
    assert max(counts.values()) <= 5, counts


@pytest.mark.parametrize("name", ["rotary", "xpos", "nope-headscale", "hybrid", "fox", "fire", "t5", "kerple-log",
                                  "rotary-dynamic", "rotary-longrope"])
def test_training_step_has_no_host_device_sync_per_layer(name):
    """The other paths a GPU trains on (causal with a rotation or a per-head temperature, folded, the learnable
    tables' per-forward Hankel build): a forward and backward synchronise a few times per step, never per layer.
    (FoX's one-hot and the learnable tables' reach read two and three values back per layer before, FIRE's pieces
    two by a boolean mask, dynamic NTK and LongRoPE their length two.)"""
    counts = {}
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=64, heads=4, layers=layers, train_length=128))
        idx = torch.randint(0, 64, (2, 128))
        with CountSyncs() as c:
            m(idx).float().sum().backward()
        counts[layers] = len(c.calls)
    limit = 9 if name in ("rotary-dynamic", "rotary-longrope") else 7  # + the length, once per forward
    assert counts[2] == counts[6] and counts[2] <= limit, counts


def test_sync_counter_sees_the_syncs_it_must_catch():
    """The counter is not blind: int() of a tensor, torch.tensor from host data and a boolean-mask index (its
    nonzero() runs inside the index kernel, where no dispatch mode sees it) are counted."""
    with CountSyncs() as c:
        x = torch.arange(5)
        int(x.sum())
        torch.tensor(3)
        bool(torch.equal(x, x))
    assert {"_local_scalar_dense", "equal"} <= set(c.calls) and any(n.startswith("lift_fresh") for n in c.calls)
    with CountSyncs() as c:
        x[x > 2]
        x[x > 2] = 0
        x[torch.tensor([0, 1])]  # an integer index: no sync
    assert [n for n in c.calls if "bool" in n] == ["index(bool mask)", "index_put_(bool mask)"], c.calls


def test_eager_dense_spy_sees_eager_flex_attention(monkeypatch):
    """The spy the recompile and gpu tests rely on is not blind: eager FlexAttention is counted."""
    from torch.nn.attention.flex_attention import flex_attention

    calls = eager_dense_calls(monkeypatch)
    q, k, v = _qkv(1, 2, 64, 16)
    with torch.no_grad():
        flex_attention(q, k, v)
    assert calls


@pytest.mark.gpu
def test_cuda_flex_forward_has_no_sync_per_layer():
    """On CUDA, torch's own sync detector: a warm flex-path training step synchronises a few times per
    forward, not once per layer: 4 more layers add fewer than 4 syncs. (An exact 2-vs-6 equality read
    {2: 5, 6: 4} on an H100: a one-time sync of the process landed in the first model's count.)"""
    import warnings

    counts = {}
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme="kerple-log", vocab_size=64, dim=256, heads=4, layers=layers,
                            train_length=1024)).cuda()
        idx = torch.randint(0, 64, (2, flex.MIN_LENGTH), device="cuda")
        opts = AttnOptions(impl="flex")  # training a learnable table: auto would take the dense mask's path
        for _ in range(2):  # compile, then one warm step: both outside the count
            m(idx, opts=opts).float().sum().backward()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m(idx, opts=opts).float().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[layers] = sum("synchroniz" in str(x.message) for x in w)
    assert counts[6] < counts[2] + (6 - 2) and counts[6] <= 6, counts


@pytest.mark.parametrize("name", ["none", "rotary", "alibi", "t5", "kerple-log", "fire", "sliding-dilated", "hybrid",
                                  "fox"])
@pytest.mark.parametrize("window", [None, 16])
def test_cached_decoding_step_has_no_host_device_sync_per_layer(name, window):
    """One token decoded with the KV cache synchronises a few times per step, never per layer: the layers' key
    positions are one shared tensor (KVCache._shared_pos: three syncs per layer before), and a learnable table's
    cached parameters are compared once per forward (one per layer before)."""
    counts = {}
    for layers in (2, 6):
        torch.manual_seed(0)
        m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=64, heads=4, layers=layers, train_length=128)).eval()
        idx = torch.randint(0, 64, (1, 42))
        cache = KVCache(layers, window=window)
        with torch.no_grad():
            m(idx[:, :40], positions=torch.arange(40), cache=cache)
            m(idx[:, 40:41], positions=torch.tensor([40]), cache=cache)  # tables and masters built
            with CountSyncs() as c:
                m(idx[:, 41:42], positions=torch.tensor([41]), cache=cache)
        counts[layers] = len(c.calls)
    assert counts[2] == counts[6] and counts[2] <= 8, counts

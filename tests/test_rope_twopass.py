"""Self-Extend, ReRoPE and leaky ReRoPE on our rotary GPT, and the log-n option of the rotary family.

The reference is written here from each paper's position rule alone: an explicit [L, L] matrix of
relative positions R[m, n] (Self-Extend: m - n below w, else floor(m/G) + w - floor(w/G) - floor(n/G);
ReRoPE: min(m - n, w); leaky: w + (m - n - w)/k beyond w), RoPE logits in complex form
Re(sum_i z_q[m, i] conj(z_k[n, i]) e^{i R[m, n] theta_i}) (RoFormer eq. 34, pairs (2i, 2i+1)),
an explicit causal softmax in float64. It shares no code with positional/rope_twopass.py or
model/twopass.py (the fused near/far passes merged by log-sum-exp).
"""
from __future__ import annotations

import math

import pytest
import torch

from extrapolab import positional as P
from extrapolab.memory import PeakMemory
from extrapolab.model import twopass as TP
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.base import SchemeError
from extrapolab.positional.rope_twopass import selfextend_max_length

H, D, L_TR = 3, 16, 32
METHODS = [
    ("rotary-selfextend", {"G": 3, "w": 8}),
    ("rotary-selfextend", {"G": 4, "w": 8, "logn": True}),
    ("rotary-rerope", {"w": 6}),
    ("rotary-rerope", {"w": 6, "logn": True}),
    ("rotary-rerope-leaky", {"w": 6, "k": 4.0}),
]


def _relative(name, opts, L):
    """The paper's relative position of every (query m, key n), float64 [L, L]."""
    m = torch.arange(L, dtype=torch.float64)[:, None]
    n = torch.arange(L, dtype=torch.float64)[None, :]
    d, w = m - n, opts["w"]
    if name == "rotary-selfextend":
        G = opts["G"]
        far = torch.floor(m / G) + w - w // G - torch.floor(n / G)
    elif name == "rotary-rerope":
        far = torch.full_like(d, float(w))
    else:
        far = w + (d - w) / opts["k"]
    return torch.where(d < w, d, far)


def _dense(q, k, v, R, logn=False, tau=1.0):
    """Explicit RoPE softmax attention with relative positions R [L, L] (see module doc), float64."""
    Dh = q.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)  # [D/2]
    zq = torch.complex(q[..., 0::2], q[..., 1::2])  # [B, H, L, D/2]
    zk = torch.complex(k[..., 0::2], k[..., 1::2])
    rot = torch.exp(1j * R[..., None] * theta)  # [L, L, D/2]
    s = torch.einsum("bhmi,bhni,mni->bhmn", zq, zk.conj(), rot).real / math.sqrt(Dh)  # [B, H, L, L]
    L = q.shape[2]
    if logn:
        s = s * (torch.log(torch.arange(1, L + 1, dtype=torch.float64)) / math.log(L_TR)).clamp(min=1)[:, None]
    s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf)
    return torch.softmax(s / tau, -1) @ v


def _qkv(L, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, H, L, D, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("name,opts", METHODS)
@pytest.mark.parametrize("block", [None, 7])
def test_forward_and_gradients_equal_the_papers_dense_rule(name, opts, block):
    L = 70
    s = P.build(name, H, original_length=L_TR, **opts)
    q, k, v = _qkv(L, grad=True)
    pos = torch.arange(L)
    o = AttnOptions(block_size=block or 1024, temperature=0.8)
    assert select_path("cpu", s, o, q.shape, L, same_pos=True, starts=(0, 0), dense_bias=False, grad=True)[0] \
        == "twopass"
    out, _ = attend(q, k, v, pos, pos, s, 0, o)
    ref = _dense(q, k, v, _relative(name, opts, L), opts.get("logn", False), tau=0.8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    plain, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain", temperature=0.8))  # reference path
    torch.testing.assert_close(plain, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,opts", METHODS)
def test_logits_equal_plain_rope_inside_the_window_and_follow_the_rule_beyond(name, opts):
    L = 60
    s = P.build(name, H, original_length=L_TR, **opts)
    rope = P.build("rotary", H, original_length=L_TR, logn=opts.get("logn", False))
    q, k, _ = _qkv(L, seed=1)
    pos = torch.arange(L)
    got = {}
    for key, scheme in (("ext", s), ("rope", rope)):
        rows = []
        opt = AttnOptions(logits_sink=lambda layer, lg, n: rows.append(lg), block_size=16)
        attend(q, k, k, pos, pos, scheme, 0, opt)
        got[key] = torch.cat([torch.nn.functional.pad(r, (0, L - r.shape[-1]), value=-math.inf) for r in rows], 2)
    d = pos[:, None] - pos[None, :]
    near, far = (d >= 0) & (d < opts["w"]), d >= opts["w"]
    assert torch.equal(got["ext"][..., near], got["rope"][..., near])  # bit for bit: the same rotated q, k
    assert (got["ext"][..., far] - got["rope"][..., far]).abs().max() > 1e-3
    R = _relative(name, opts, L)
    want = torch.log(_dense(q, k, torch.eye(L, dtype=torch.float64).expand(2, H, L, L), R, opts.get("logn", False)))
    lp = torch.log_softmax(got["ext"], -1)  # the sink's logits give the paper's probabilities
    torch.testing.assert_close(lp[..., d >= 0], want[..., d >= 0], rtol=0, atol=1e-10)


def _gpt(name, **opts):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, layers=2, heads=H, dim=H * D, scheme=name, scheme_params=opts,
                           train_length=L_TR)).eval()


@pytest.mark.parametrize("name,opts", METHODS)
def test_kv_cache_decoding_and_prefix_equal_the_parallel_forward(name, opts):
    m = _gpt(name, **opts)
    assert m.scheme.original_length == L_TR  # filled from model.train_length
    idx = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx)
        torch.testing.assert_close(m(idx[:, :23]), full[:, :23], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full, m(idx, opts=AttnOptions(impl="plain")), rtol=1e-5, atol=1e-5)
        cache = KVCache(len(m.blocks))
        steps = [m(idx[:, :10], torch.arange(10), cache=cache)]
        steps += [m(idx[:, t:t + 5], torch.arange(t, t + 5), cache=cache) for t in (10, 15)]
        steps += [m(idx[:, t:t + 1], torch.tensor([t]), cache=cache) for t in range(20, 64)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,opts", [("rotary-selfextend", {"G": 2, "w": 8}), ("rotary-dca", {"chunk": 13, "w": 2})])
def test_gpt_trains_through_the_fused_backward(name, opts):
    m = _gpt(name, **opts).train()
    idx = torch.randint(0, 50, (2, 49), generator=torch.Generator().manual_seed(5))
    m.loss(idx[:, :-1], idx[:, 1:]).backward()
    fused = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.attn_opts = AttnOptions(impl="plain")
    m.loss(idx[:, :-1], idx[:, 1:]).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name,opts", [("rotary-selfextend", {"G": 4, "w": 64}), ("rotary-rerope", {"w": 64}),
                                       ("rotary-dca", {"chunk": 192, "w": 32})])
def test_long_input_exact_and_never_materialises_LxL(name, opts):
    s = P.build(name, 4, original_length=256, **opts)
    g = torch.Generator().manual_seed(7)
    L = 1200
    q, k, v = (torch.randn(1, 4, L, 16, generator=g) for _ in range(3))
    pos = torch.arange(L)
    with torch.no_grad():
        fast, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions())
        ref, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain"))
    assert (fast - ref).abs().max() < 1e-5
    L = 8192  # one [H, L, L] fp32 score tensor would be 1 GiB
    q, k, v = (torch.randn(1, 4, L, 16, generator=g) for _ in range(3))
    pos = torch.arange(L)
    with torch.no_grad(), PeakMemory() as mem:
        attend(q, k, v, pos, pos, s, 0, AttnOptions())
    assert mem.mib < 96, (name, mem.mib)


def test_block_plan_covers_exactly_the_visible_keys():
    """Each call's key range holds every key its rows see, and every row sees one (no empty softmax)."""
    for Lq, Lk, w, window, block in ((40, 40, 6, None, 7), (5, 40, 6, None, 2), (1, 33, 8, None, 512),
                                     (40, 40, 6, 11, 9), (40, 40, 6, 4, 8), (30, 30, 29, None, 4)):
        dmax = Lk - 1
        seen = set()
        for r0, r1, (lo, hi), far in TP.plan(Lq, Lk, w, window, block):
            for r in range(r0, r1):
                vis = [j for j in range(Lk) if 0 <= dmax - r - j < min(w, window or 10**9)]
                assert vis and lo <= vis[0] and vis[-1] < hi
                seen |= {(r, j) for j in vis}
            rf = far[0] if far else r0
            for r in range(r0, r1):
                vis = [j for j in range(Lk) if w <= dmax - r - j < (window or 10**9)]
                assert bool(vis) == (r < rf), (Lq, Lk, w, window, r)
                if vis:
                    assert far[1] <= vis[0] and vis[-1] < far[2]
                    seen |= {(r, j) for j in vis}
        assert len(seen) == sum(1 for r in range(Lq) for j in range(Lk)
                                if 0 <= dmax - r - j < (window or 10**9))


def test_private_cpu_flash_backward_keeps_the_signature_we_call():
    assert TP.CPU_FLASH_BWD is not None
    args = [(a.name, a.kwarg_only) for a in TP.CPU_FLASH_BWD.default._schema.arguments]
    assert args == [("grad_out", False), ("query", False), ("key", False), ("value", False), ("out", False),
                    ("logsumexp", False), ("dropout_p", False), ("is_causal", False), ("attn_mask", True),
                    ("scale", True)], args


@pytest.mark.parametrize("L_tr,w,G", [(32, 8, 4), (4096, 1024, 4), (4096, 1024, 8), (100, 30, 3)])
def test_selfextend_max_length_rule(L_tr, w, G):
    """(L_tr - w)·G + w is the longest input whose grouped relative positions all stay below L_tr
    (G dividing w, as in the paper's settings)."""
    s = P.build("rotary-selfextend", H, G=G, w=w, original_length=L_tr)
    n_max = selfextend_max_length(L_tr, w, G)
    assert s.max_length() == n_max == (L_tr - w) * G + w
    for L, ok in ((n_max, True), (n_max + 1, False)):
        rel = math.floor((L - 1) / G) + w - w // G  # the farthest pair (m = L - 1, n = 0)
        assert (rel <= L_tr - 1) == ok
        m, n = torch.tensor([L - 1]), torch.tensor([0])  # the scheme's own far positions agree
        assert int((s.rule.q_pos(m) - s.rule.k_pos(n)).item()) == rel


def test_selfextend_max_length_is_one_position_generous_when_g_does_not_divide_w():
    """The README's own example (L_tr 4,096, w 1,024, G 5 -> 16,384): floor(w/G) < w/G, so the
    farthest pair at that length sits at L_tr, one position past the trained range."""
    s = P.build("rotary-selfextend", H, G=5, w=1024, original_length=4096)
    m, n = torch.tensor([s.max_length() - 1]), torch.tensor([0])
    assert s.max_length() == 16384 and int((s.rule.q_pos(m) - s.rule.k_pos(n)).item()) == 4096


def test_logn_is_a_per_query_temperature_and_plain_rope_up_to_l_tr():
    q, k, v = _qkv(80, seed=3)
    pos = torch.arange(80)
    for name in ("rotary", "rotary-pi", "rotary-yarn", "rotary-rerope"):
        plain = P.build(name, H, original_length=L_TR)
        logn = P.build(name, H, original_length=L_TR, logn=True)
        assert logn.options()["logn"] is True and not logn.relative
        a, _ = attend(q, k, v, pos, pos, plain, 0, AttnOptions())
        b, _ = attend(q, k, v, pos, pos, logn, 0, AttnOptions())
        torch.testing.assert_close(a[:, :, :L_TR], b[:, :, :L_TR], rtol=0, atol=1e-12)  # factor 1 below L_tr
        assert (a[:, :, L_TR:] - b[:, :, L_TR:]).abs().max() > 1e-3
        for m in (L_TR, 50, 79):  # query m alone at temperature 1 / factor equals the log-n row
            tau = math.log(L_TR) / math.log(m + 1)
            row, _ = attend(q[:, :, m:m + 1], k[:, :, :m + 1], v[:, :, :m + 1], pos[m:m + 1], pos[:m + 1], plain, 0,
                            AttnOptions(temperature=tau))
            torch.testing.assert_close(row[:, :, 0], b[:, :, m], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,opts,match", [
    ("rotary-selfextend", {"w": 32}, "1 <= w < L_tr"),
    ("rotary-selfextend", {"G": 0}, "G must be an integer >= 1"),
    ("rotary-rerope", {"w": 0}, "1 <= w < L_tr"),
    ("rotary-rerope-leaky", {"k": 0.5}, "k must be a finite number >= 1"),
    ("rotary-rerope", {"G": 2}, "has no option 'G'"),
])
def test_bad_options_fail_in_one_line(name, opts, match):
    with pytest.raises(SchemeError, match=match) as err:
        P.build(name, H, original_length=L_TR, **opts)
    assert "\n" not in str(err.value)

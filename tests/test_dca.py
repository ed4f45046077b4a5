"""Dual chunk attention (An et al. 2024, arXiv 2402.17463) on our rotary GPT and a tiny Llama.

The reference is written here from the paper alone: position lists P_k = P_q^Intra = [0..L-1] mod s
(eq. 2), P_q^Succ = [s, s+1, ..., s+w_p-1, c-1, ..., c-1] per chunk (eq. 7), P_q^Inter = c - 1
(eq. 5), and M[i][j] chosen by floor(i/s) - floor(j/s) = 0, 1, > 1 (eq. 8), in plain Python loops;
RoPE logits of M in complex form (RoFormer eq. 34), an explicit causal softmax in float64. The
settings map to the paper as s = C - w, c = C + 1, w_p = c - s (positional/rotary_dca.py), and the
same matrix is also built from ChunkLlama's tables (qc_t = (arange(s) + s).clamp(max=C), the
inter-chunk query at qc_t[s - 1]). Nothing here shares code with positional/ or model/twopass.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from extrapolab import positional as P
from extrapolab.model import twopass as TP
from extrapolab.model.attention import AttnOptions, attend, select_path
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab.positional.base import SchemeError

H, D, L_TR = 3, 16, 32
SETTINGS = [{"chunk": 24, "w": 4}, {"chunk": 13, "w": 2}, {"chunk": 16, "w": 0}, {"chunk": 31, "w": 9, "logn": True}]


def paper_relative(L: int, C: int, w: int) -> torch.Tensor:
    """M [L, L] of eq. 8 with s = C - w, c = C + 1, w_p = c - s (module doc), float64."""
    s, c = C - w, C + 1
    wp = c - s
    P_k = [j % s for j in range(L)]  # eq. 2
    P_intra = P_k
    succ_chunk = [s + i if i < wp else c - 1 for i in range(s)]  # eq. 7, the same for every chunk
    P_succ = [succ_chunk[i % s] for i in range(L)]
    P_inter = [c - 1] * L  # eq. 5
    M = torch.zeros(L, L, dtype=torch.float64)
    for i in range(L):
        for j in range(L):
            gap = i // s - j // s
            q = P_intra[i] if gap == 0 else P_succ[i] if gap == 1 else P_inter[i]
            M[i, j] = q - P_k[j]
    return M


def chunkllama_relative(L: int, C: int, w: int) -> torch.Tensor:
    """M [L, L] from ChunkLlama's position tables (chunk_size C, local_window w)."""
    s = C - w
    q_t = np.arange(s)
    qc_t = np.minimum(np.arange(s) + s, C)
    M = np.zeros((L, L))
    for i in range(L):
        for j in range(L):
            gap = i // s - j // s
            q = q_t[i % s] if gap == 0 else qc_t[i % s] if gap == 1 else qc_t[s - 1]
            M[i, j] = q - j % s
    return torch.from_numpy(M)


def dense(q, k, v, R, logn=False, tau=1.0, window=None):
    """Explicit RoPE softmax attention with relative positions R [L, L] (RoFormer eq. 34), float64."""
    Dh, L = q.shape[-1], q.shape[2]
    theta = 10000.0 ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)  # [D/2]
    zq = torch.complex(q[..., 0::2], q[..., 1::2])  # [B, H, L, D/2]
    zk = torch.complex(k[..., 0::2], k[..., 1::2])
    s = torch.einsum("bhmi,bhni,mni->bhmn", zq, zk.conj(), torch.exp(1j * R[..., None] * theta)).real / math.sqrt(Dh)
    if logn:
        s = s * (torch.log(torch.arange(1, L + 1, dtype=torch.float64)) / math.log(L_TR)).clamp(min=1)[:, None]
    d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    hide = (d < 0) if window is None else (d < 0) | (d >= window)
    return torch.softmax(s.masked_fill(hide, -math.inf) / tau, -1) @ v


def qkv(L, seed=0, grad=False, B=2, heads=H, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, L, D, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("C,w", [(24, 4), (13, 2), (16, 0), (31, 9), (9, 4), (3, 1)])
def test_the_rule_is_the_papers_and_chunkllamas(C, w):
    L = 75
    M = paper_relative(L, C, w)
    assert torch.equal(M, chunkllama_relative(L, C, w))
    d = torch.arange(L)[:, None] - torch.arange(L)[None, :]
    assert int(M[d >= 0].max()) <= C and torch.all(M[d >= 0] >= 0)  # never beyond C, never negative
    s = C - w
    same = (torch.arange(L)[:, None] // s) == (torch.arange(L)[None, :] // s)
    assert torch.equal(M[same & (d >= 0)], d[same & (d >= 0)].double())  # intra-chunk: the true distance


@pytest.mark.parametrize("opts", SETTINGS)
@pytest.mark.parametrize("block,window,tau", [(None, None, 1.0), (7, None, 0.8), (5, 23, 1.0)])
def test_forward_and_gradients_equal_the_papers_dense_rule(opts, block, window, tau):
    L = 70
    s = P.build("rotary-dca", H, original_length=L_TR, **opts)
    q, k, v = qkv(L, grad=True)
    pos = torch.arange(L)
    o = AttnOptions(block_size=block or 1024, temperature=tau, window=window)
    assert select_path("cpu", s, o, q.shape, L, same_pos=True, starts=(0, 0), dense_bias=False, grad=True)[0] \
        == "twopass"
    out, _ = attend(q, k, v, pos, pos, s, 0, o)
    ref = dense(q, k, v, paper_relative(L, opts["chunk"], opts["w"]), opts.get("logn", False), tau, window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    plain, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain", temperature=tau, window=window))
    torch.testing.assert_close(plain, ref, rtol=0, atol=1e-12)


def test_intra_chunk_logits_are_plain_rope_and_short_inputs_are_plain_rope():
    L, C, w = 60, 24, 4
    s = P.build("rotary-dca", H, original_length=L_TR, chunk=C, w=w)
    rope = P.build("rotary", H, original_length=L_TR)
    q, k, v = qkv(L, seed=1)
    pos = torch.arange(L)
    got = {}
    for key, scheme in (("dca", s), ("rope", rope)):
        rows = []
        sink = AttnOptions(logits_sink=lambda layer, lg, n: rows.append(lg), block_size=16)
        attend(q, k, k, pos, pos, scheme, 0, sink)
        got[key] = torch.cat([torch.nn.functional.pad(r, (0, L - r.shape[-1]), value=-math.inf) for r in rows], 2)
    i = torch.arange(L)
    same = (i[:, None] // (C - w) == i[None, :] // (C - w)) & (i[:, None] >= i[None, :])
    assert torch.equal(got["dca"][..., same], got["rope"][..., same])  # bit for bit: the same rotated q, k
    assert (got["dca"][..., ~same & (i[:, None] >= i[None, :])] - got["rope"][..., ~same & (i[:, None] >= i[None, :])]
            ).abs().max() > 1e-3
    a, _ = attend(q[:, :, :C - w], k[:, :, :C - w], v[:, :, :C - w], pos[:C - w], pos[:C - w], s, 0)  # one chunk
    b, _ = attend(q[:, :, :C - w], k[:, :, :C - w], v[:, :, :C - w], pos[:C - w], pos[:C - w], rope, 0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _gpt(**opts):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=50, layers=2, heads=H, dim=H * D, scheme="rotary-dca", scheme_params=opts,
                           train_length=L_TR)).eval()


@pytest.mark.parametrize("opts", SETTINGS[:2])
def test_kv_cache_decoding_and_prefix_equal_the_parallel_forward(opts):
    m = _gpt(**opts)
    assert m.scheme.original_length == L_TR and m.scheme.options()["chunk"] == opts["chunk"]
    idx = torch.randint(0, 50, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(idx)
        torch.testing.assert_close(m(idx[:, :23]), full[:, :23], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full, m(idx, opts=AttnOptions(impl="plain")), rtol=1e-5, atol=1e-5)
        cache = KVCache(len(m.blocks))
        steps = [m(idx[:, :10], torch.arange(10), cache=cache)]
        steps += [m(idx[:, t:t + 7], torch.arange(t, t + 7), cache=cache) for t in (10, 17)]  # chunks cross s
        steps += [m(idx[:, t:t + 1], torch.tensor([t]), cache=cache) for t in range(24, 64)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Lq,Lk,C,w,window,block", [(40, 40, 13, 2, None, 7), (5, 40, 13, 2, None, 2),
                                                     (1, 33, 8, 1, None, 512), (40, 40, 11, 3, 9, 16),
                                                     (37, 50, 9, 4, 25, 6), (30, 30, 16, 0, None, 4)])
def test_block_plan_scores_every_visible_key_once_in_its_own_pass(Lq, Lk, C, w, window, block):
    s = C - w
    passes = P.build("rotary-dca", H, chunk=C, w=w, original_length=64).second_pass().passes
    a = Lk - Lq  # position of the first query; keys at 0..Lk-1
    seen = {}
    for r0, r1, calls in TP.block_plan(passes, Lq, Lk, a, window, block):
        assert len({(a + Lq - 1 - r) // s for r in range(r0, r1)}) == 1 and r1 - r0 <= block  # one chunk
        for i, ra, rb, lo, hi, band in calls:
            assert r0 <= ra < rb <= r1
            for r in range(ra, rb):
                m = a + Lq - 1 - r
                for n in range(lo, hi):
                    gap = m // s - n // s
                    mine = (gap == 0, gap == 1, gap >= 2)[i] and 0 <= m - n < (window or 10**9)
                    if band is None:
                        assert mine, (i, m, n)  # no mask: every key of the call is this pass's
                    if mine:
                        assert (m, n) not in seen
                        seen[m, n] = i
            for r in range(r0, r1):  # rows left out of the call have no key in this pass
                if not ra <= r < rb:
                    m = a + Lq - 1 - r
                    assert not any((m // s - n // s in ((0,), (1,), range(2, 10**9))[i]) and
                                   0 <= m - n < (window or 10**9) for n in range(Lk))
    want = {(a + r, n) for r in range(Lq) for n in range(Lk) if 0 <= a + r - n < (window or 10**9)}
    assert set(seen) == want


@pytest.mark.parametrize("opts,match", [
    ({"chunk": 33}, "2 <= C <= L_tr"), ({"chunk": 1}, "2 <= C <= L_tr"), ({"chunk": 20, "w": 10}, "w < C - w"),
    ({"chunk": 20, "w": -1}, "0 <= w"), ({"chunk": 2.5}, "whole numbers"), ({"G": 2}, "has no option 'G'"),
])
def test_bad_options_fail_in_one_line(opts, match):
    with pytest.raises(SchemeError, match=match) as err:
        P.build("rotary-dca", H, original_length=L_TR, **opts)
    assert "\n" not in str(err.value)


def test_defaults_follow_chunkllama():
    s = P.build("rotary-dca", H, original_length=4096)
    assert s.options()["chunk"] == 3072 and s.options()["w"] == 512  # chunk_size 3/4·L_tr, local L_tr/8
    assert s.rule.s == 2560


# ---- Hugging Face models: --rope dca:C,w through the registered attention function ---------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("dca") / "llama")


def _open(folder, **kw):
    from extrapolab.hf import open_hf

    return open_hf(f"hf:{folder}", device="cpu", dtype="fp32", **kw)


def _ids(model, L):
    from hf_tiny import TEXT

    return torch.from_numpy(np.asarray(model.loaded.tokenizer(TEXT * 4)["input_ids"][:L], dtype=np.int64))[None]


def _llama_layer(attn, h, R):
    """A LlamaAttention's output for input h [1, L, C], its q, k rotated by R [L, L] (half layout), float64."""
    cfg, h = attn.config, h.double()
    L, Hq, Hkv, Dh = h.shape[1], cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    q = (h @ attn.q_proj.weight.double().T).view(1, L, Hq, Dh).transpose(1, 2)
    k = (h @ attn.k_proj.weight.double().T).view(1, L, Hkv, Dh).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
    v = (h @ attn.v_proj.weight.double().T).view(1, L, Hkv, Dh).transpose(1, 2).repeat_interleave(Hq // Hkv, 1)
    theta = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    zq, zk = torch.complex(q[..., :Dh // 2], q[..., Dh // 2:]), torch.complex(k[..., :Dh // 2], k[..., Dh // 2:])
    s = torch.einsum("bhmi,bhni,mni->bhmn", zq, zk.conj(), torch.exp(1j * R[..., None] * theta)).real / math.sqrt(Dh)
    s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), -math.inf)
    out = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(1, L, Hq * Dh)
    return out @ attn.o_proj.weight.double().T


@pytest.mark.parametrize("spec,C,w", [("dca:20,3", 20, 3), ("dca:12", 12, 2), ("dca:30,0", 30, 0)])
def test_every_hf_layer_equals_the_papers_rule(llama, spec, C, w):
    m = _open(llama, rope=spec)
    assert m.loaded.info["rope_extension"] == {"method": "dca", "chunk": C, "w": w}
    L = 110
    got, hooks = [], []
    for mod in m.hf.modules():
        if type(mod).__name__ == "LlamaAttention":
            hooks.append(mod.register_forward_hook(
                lambda mod, a, kw, out: got.append((mod, kw["hidden_states"].detach(), out[0].detach())),
                with_kwargs=True))
    try:
        with torch.no_grad():
            m(_ids(m, L))
    finally:
        for hk in hooks:
            hk.remove()
    R = paper_relative(L, C, w)
    assert len(got) == 2
    for attn, h, out in got:
        assert (out.double() - _llama_layer(attn, h, R)).abs().max() < 2e-5, spec


def test_hf_dca_defaults_follow_chunkllama(llama):  # its KV-cache decoding: test_rope_extend_hf.py
    from hf_tiny import MAXPOS

    assert _open(llama, rope="dca").loaded.info["rope_extension"] == {"method": "dca", "chunk": 3 * MAXPOS // 4,
                                                                       "w": 3 * MAXPOS // 4 // 6}


@pytest.mark.parametrize("bad,match", [("dca:100", "2 <= C <= L_tr"), ("dca:20,10", "w < C - w"),
                                       ("dca:20.5", "whole numbers"), ("dca:20,2,3", "at most 2"),
                                       ("dca:20+rerope:6", "one two-pass, dca or streaming"),
                                       ("dynamic:2+dca:20", "dynamic")])
def test_bad_dca_specs_fail_in_one_line(llama, bad, match):
    from extrapolab.io import UserError

    with pytest.raises(UserError, match=match) as err:
        _open(llama, rope=bad)
    assert "\n" not in str(err.value)


def test_align_rope_takes_dca_and_streaming_with_their_reference_defaults():
    from extrapolab.align.rope_methods import METHODS, method_setup
    from extrapolab.align.rope_report import LABELS

    s, tau = method_setup("dca", 128, 512, 4, {})
    assert (s.name, s.rule.chunk, s.rule.window, s.original_length, tau) == ("rotary-dca", 96, 16, 128, 1.0)
    s, tau = method_setup("streaming", 128, 512, 4, {})
    assert (s.name, s.rule.sinks, s.rule.window, tau) == ("rotary-streaming", 4, 124, 1.0)
    assert set(METHODS) <= set(LABELS)


def test_extension_study_takes_dca_and_streaming_when_named():
    """`extend hf:PATH --set extend.methods=[..., dca, streaming]`: their --rope settings per length;
    off by default (the published runs did not have them)."""
    from extrapolab.extend.cells import METHODS, setting
    from extrapolab.extend.spec import ExtendSpec

    L = 8192
    assert setting("dca", L, L).rope == setting("dca", 4 * L, L).rope == "dca:6144"  # differs at 1x too
    assert setting("streaming", L, L).rope is None  # 4 sinks + L - 4: every key at its own distance
    assert setting("streaming", 2 * L, L).rope == "streaming:4,8188"
    assert {"dca", "streaming"} <= set(METHODS) and not {"dca", "streaming"} & set(ExtendSpec().methods)

"""StreamingLLM in E5 (Xiao et al. 2024, arXiv 2309.17453): k attention sinks plus a rolling window,
keys cached before rotation and placed at their positions in the cache.

The reference is re-encoding: the k sinks and the last w tokens fed from scratch as one sequence at
positions 0..k+w-1. For a 1-layer model its last logits equal the rolling cache's exactly (every
key/value of a 1-layer model depends only on its own token), and the E5 perplexities agree; k = 0
is the plain windowed E5. The bug of transformers#35350 / TGI#1105 (keys cached rotated at their
absolute positions) is written out here too, to show the reference tells the two apart.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from extrapolab.eval import cached_window_ppl, nonoverlapping, recomputed_window_ppl
from extrapolab.io import UserError
from extrapolab.model.attention import AttnOptions, attend
from extrapolab.model.gpt import GPT, KVCache, ModelConfig
from extrapolab import positional as P

V = 29


def _gpt(scheme="rotary", layers=1, dtype=torch.float64, train_length=16, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, layers=layers, heads=2, dim=16, scheme=scheme, train_length=train_length,
                      init_std=0.3, **kw)
    return GPT(cfg).eval().to(dtype)


def _stream(n, seed=2):
    return np.random.RandomState(seed).randint(0, V, n)


@pytest.mark.parametrize("scheme", ["rotary", "rotary-yarn", "alibi", "rotary-selfextend"])
@pytest.mark.parametrize("sinks,window", [(4, 6), (1, 3), (0, 5), (3, 1)])
def test_rolling_cache_logits_equal_the_window_recomputed_at_positions_from_zero(scheme, sinks, window):
    m = _gpt(scheme)
    x = torch.from_numpy(_stream(40)).view(1, -1)
    cache = KVCache(1, window=window, sinks=sinks)
    n0 = sinks + window
    with torch.no_grad():
        first = m(x[:, :n0], torch.arange(n0), cache=cache)
        torch.testing.assert_close(first, m(x[:, :n0]), rtol=0, atol=1e-12)  # not full yet: plain causal
        for t in range(n0, 40):
            got = m(x[:, t:t + 1], torch.tensor([t]), cache=cache)[:, -1]  # [1, V]
            assert cache.k[0].shape[2] == n0 and cache.pos[0][:sinks].tolist() == list(range(sinks))
            window_ids = torch.cat([x[:, :sinks], x[:, t - window + 1:t + 1]], 1)  # [1, k + w]
            want = m(window_ids)[:, -1]  # re-encoded at positions 0..k+w-1
            torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_caching_rotated_keys_is_the_bug_the_reference_catches():
    """Keys rotated at their absolute positions and kept: the sinks sit t tokens behind the query
    instead of k + w - 1, and the logits leave the re-encoded ones (transformers#35350)."""
    s, (k, w, t) = P.build("rotary", 2), (2, 3, 30)
    g = torch.Generator().manual_seed(0)
    q_all, k_all, v_all = (torch.randn(1, 2, t + 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.cat([torch.arange(k), torch.arange(t - w + 1, t + 1)])  # sinks + window, absolute indices
    slots = torch.arange(k + w)
    ref, _ = attend(q_all[:, :, t:t + 1], k_all[:, :, keep], v_all[:, :, keep], slots[-1:], slots, s)
    cache = KVCache(1, window=w, sinks=k)  # ours: unrotated keys, rotated at their slots
    for i in range(t + 1):
        q_i, k_c, v_c, qp, kp, rotated = cache.update(0, s, q_all[:, :, i:i + 1], k_all[:, :, i:i + 1],
                                                        v_all[:, :, i:i + 1], torch.tensor([i]))
    ours, _ = attend(q_i, k_c, v_c, qp, kp, s, rotate=not rotated)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    qr, kr = s.rotate(q_all, k_all, torch.arange(t + 1), torch.arange(t + 1))  # the bug: rotated when written
    bug, _ = attend(qr[:, :, t:t + 1], kr[:, :, keep], v_all[:, :, keep], torch.tensor([t]), keep, s, rotate=False)
    assert (bug - ref).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", ["rotary", "alibi", "t5"])
def test_e5_with_sinks_equals_its_recomputed_reference_for_one_layer(scheme):
    g, tok = _gpt(scheme, dtype=torch.float32), _stream(3 * 40 + 1)
    c = cached_window_ppl(g, tok, 40, window=6, sinks=3, batch_size=2)
    r = recomputed_window_ppl(g, tok, 40, window=6, sinks=3, batch_size=5)
    assert c["tokens"] == r["tokens"] == 120 and c["sinks"] == r["sinks"] == 3
    assert c["nll"] == pytest.approx(r["nll"], rel=1e-6, abs=1e-7)
    plain = cached_window_ppl(g, tok, 40, window=6)  # the sinks change what is seen
    assert abs(plain["nll"] - c["nll"]) > 1e-5


@pytest.mark.parametrize("scheme", ["rotary", "rotary-rerope", "alibi", "rotary-dca"])
def test_zero_sinks_are_the_plain_windowed_e5(scheme):
    """k = 0 keeps only the window, at cache positions instead of absolute ones: the same numbers for
    relative schemes, also with several layers (rotated keys vs keys rotated at their slots); DCA
    counts its chunks from the positions, so for it the two differ."""
    params = {"chunk": 12, "w": 2} if scheme == "rotary-dca" else {}
    g, tok = _gpt(scheme, layers=3, dtype=torch.float32, scheme_params=params), _stream(2 * 48 + 1)
    a = cached_window_ppl(g, tok, 48, window=20, sinks=0)
    b = cached_window_ppl(g, tok, 48, window=20)
    assert (a["nll"] == pytest.approx(b["nll"], rel=1e-5)) == g.scheme.relative
    big = cached_window_ppl(g, tok, 48, window=48, sinks=4)  # nothing evicted: the parallel forward
    assert big["nll"] == pytest.approx(nonoverlapping(g, tok, 48)["nll"], rel=1e-5)


def test_eval_protocol_option_records_the_sinks():
    from extrapolab.eval import evaluate

    g, tok = _gpt(dtype=torch.float32), _stream(4 * 32 + 1)
    res = evaluate(g, tok, train_length=16, protocols=["cached", "recomputed"], lengths=[32], cache_window=8,
                   sinks=2, num_tokens=64, batch_size=2)
    assert res["settings"]["cache_sinks"] == 2
    assert res["cached"]["32"]["sinks"] == 2 and res["ppl"]["cached"]["32"] == pytest.approx(
        res["ppl"]["recomputed"]["32"], rel=1e-5)
    off = evaluate(g, tok, train_length=16, protocols=["cached"], lengths=[32], cache_window=8, num_tokens=64)
    assert off["settings"]["cache_sinks"] == -1 and "sinks" not in off["cached"]["32"]


@pytest.mark.parametrize("scheme,sinks,match", [("rotary", -2, "-1 \\(off\\) or"), ("rotary", 1.5, "-1 \\(off\\) or"),
                                                ("learned", 2, "takes positions from the input"),
                                                ("fox", 2, "takes positions from the input")])
def test_bad_sinks_fail_in_one_line(scheme, sinks, match):
    from extrapolab.eval import evaluate

    g, tok = _gpt(scheme, dtype=torch.float32), _stream(4 * 32 + 1)
    with pytest.raises(UserError, match=match) as err:
        evaluate(g, tok, train_length=16, protocols=["cached"], lengths=[32], cache_window=8, sinks=sinks)
    assert "\n" not in str(err.value)


def test_a_full_sink_cache_takes_one_token_per_call():
    m = _gpt()
    cache = KVCache(1, window=3, sinks=2)
    x = torch.from_numpy(_stream(10)).view(1, -1)
    with torch.no_grad():
        m(x[:, :4], torch.arange(4), cache=cache)
        with pytest.raises(ValueError, match="one token per call"):
            m(x[:, 4:6], torch.arange(4, 6), cache=cache)
    with pytest.raises(ValueError, match="need a window"):
        KVCache(1, sinks=2)
    assert AttnOptions().window is None


# ---- rotary-streaming: the same pattern in one parallel forward ----------------------------------
def streaming_relative(L: int, k: int, w: int) -> torch.Tensor:
    """R [L, L] of the rolling cache at query m: window keys at their distance, sinks from the query's
    slot min(m, k + w - 1), every other key unseen (nan), written per (m, n) from the cache's slots."""
    R = torch.full((L, L), float("nan"), dtype=torch.float64)
    for m in range(L):
        kept = list(range(m + 1)) if m < k + w else list(range(k)) + list(range(m - w + 1, m + 1))
        slot = {n: i for i, n in enumerate(kept)}  # the cache after step m: slots 0..len-1 in order
        for n in kept:
            R[m, n] = slot[m] - slot[n]
    return R


def _dense(q, k, v, R, tau=1.0):
    import math

    Dh = q.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    zq, zk = torch.complex(q[..., 0::2], q[..., 1::2]), torch.complex(k[..., 0::2], k[..., 1::2])
    s = torch.einsum("bhmi,bhni,mni->bhmn", zq, zk.conj(), torch.exp(1j * R.nan_to_num(0)[..., None] * theta)).real
    s = (s / math.sqrt(Dh)).masked_fill(R.isnan(), -math.inf)
    return torch.softmax(s / tau, -1) @ v


@pytest.mark.parametrize("sinks,w,block", [(4, 10, None), (2, 7, 5), (0, 9, 4), (5, 1, None)])
def test_streaming_scheme_equals_the_cache_slots_with_gradients(sinks, w, block):
    s = P.build("rotary-streaming", 3, sinks=sinks, w=w, original_length=32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = torch.arange(45)
    out, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(block_size=block or 1024, temperature=0.9))
    ref = _dense(q, k, v, streaming_relative(45, sinks, w), tau=0.9)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    gr = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), gr), torch.autograd.grad(ref, (q, k, v), gr)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    plain, _ = attend(q, k, v, pos, pos, s, 0, AttnOptions(impl="plain", temperature=0.9))
    torch.testing.assert_close(plain, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layers", [1, 3])
def test_e5_with_sinks_equals_one_parallel_forward_of_rotary_streaming(layers):
    """Every layer: the rolling cache's keys are those of the parallel pattern (module doc of
    positional/rotary_streaming.py), so E5 with sinks is this scheme's E1 on the same weights."""
    g, tok = _gpt(layers=layers, dtype=torch.float32, train_length=64), _stream(3 * 48 + 1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, layers=layers, heads=2, dim=16, scheme="rotary-streaming",
                      scheme_params={"sinks": 3, "w": 9}, train_length=64)
    par = GPT(cfg).eval()
    par.load_state_dict(g.state_dict())
    c = cached_window_ppl(g, tok, 48, window=9, sinks=3, batch_size=3)
    e1 = nonoverlapping(par, tok, 48)
    assert c["tokens"] == e1["tokens"] and c["nll"] == pytest.approx(e1["nll"], rel=1e-6)
    assert abs(nonoverlapping(g, tok, 48)["nll"] - e1["nll"]) > 1e-4  # the pattern restricts attention


@pytest.mark.parametrize("opts,match", [({"sinks": 4, "w": 61}, "k \\+ w <= L_tr"), ({"sinks": -1}, "k >= 0"),
                                        ({"w": 0}, "w >= 1"), ({"sinks": 1.5}, "whole numbers")])
def test_bad_streaming_options_fail_in_one_line(opts, match):
    from extrapolab.positional.base import SchemeError

    with pytest.raises(SchemeError, match=match) as err:
        P.build("rotary-streaming", 2, original_length=64, **opts)
    assert "\n" not in str(err.value)
    assert P.build("rotary-streaming", 2, original_length=64).options()["w"] == 60  # default: a cache of L_tr


def test_streaming_with_a_cache_of_l_tr_is_plain_rope_up_to_l_tr():
    """4 sinks + a window of L_tr - 4 sees every key of an input of L_tr tokens at its own distance
    (the extension study's 1x cell is plain RoPE's); one token more and the pattern acts."""
    s, rope = P.build("rotary-streaming", 2, original_length=32), P.build("rotary", 2)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(40)
    a, b = attend(q, k, v, pos, pos, s, 0)[0], attend(q, k, v, pos, pos, rope, 0)[0]
    torch.testing.assert_close(a[:, :, :32], b[:, :, :32], rtol=0, atol=1e-12)
    assert (a[:, :, 32:] - b[:, :, 32:]).abs().max() > 1e-4

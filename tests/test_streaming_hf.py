"""E5's cached window with attention sinks on Hugging Face RoPE models (hf/cached.py, StreamingLLM).

References are stock transformers, with nothing of ours in them: re-encoding the kept tokens (the
window prefix, the sinks, the last w) with the model's own sdpa attention at positions 0..n-1; and,
for the plain window (no sinks), the model's own DynamicCache of keys rotated at their absolute
positions, cut to the newest tokens between steps. A 1-layer model makes the re-encoding exact
(each key/value depends on its own token only); the GPT-NeoX model rotates half of each head.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MAXPOS, TEXT, save_tiny  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from extrapolab.config import EvalConfig  # noqa: E402
from extrapolab.eval import cached_window_ppl, nonoverlapping, recomputed_window_ppl  # noqa: E402
from extrapolab.hf import evaluate_hf, open_hf  # noqa: E402
from extrapolab.hf.extend import ATTN  # noqa: E402
from extrapolab.io import UserError  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return {"llama1": save_tiny("llama", root / "llama1", layers=1), "neox1": save_tiny("gpt_neox", root / "neox1",
                                                                                        layers=1),
            "llama": save_tiny("llama", root / "llama"), "bloom": save_tiny("bloom", root / "bloom")}


def _open(folder, **kw):
    return open_hf(f"hf:{folder}", device="cpu", dtype="fp32", **kw)


def _ids(model, n):
    return torch.from_numpy(np.asarray(model.loaded.tokenizer(TEXT * 4)["input_ids"][:n], dtype=np.int64))[None]


@pytest.mark.parametrize("name,sinks,window,prefix", [("llama1", 4, 6, "auto"), ("llama1", 0, 5, "auto"),
                                                      ("neox1", 3, 4, "auto"), ("llama1", 2, 3, [7])])
def test_rolling_cache_equals_the_kept_tokens_re_encoded_by_stock_transformers(folders, name, sinks, window, prefix):
    m = _open(folders[name], prefix=prefix)
    ref = _open(folders[name], prefix=prefix)  # sdpa, never switched to our attention
    x = _ids(m, 40)
    cache = m.new_cache(window, sinks)
    assert cache.keep == sinks + len(m.prefix)
    n0 = sinks + window
    pre = torch.tensor([m.prefix], dtype=torch.long)[:, :len(m.prefix)]
    bug = None
    with torch.no_grad():
        first = m(x[:, :n0], cache=cache)
        assert m.loaded.attn_implementation == ATTN and ref.loaded.attn_implementation != ATTN
        torch.testing.assert_close(first, ref(x[:, :n0]), rtol=0, atol=2e-5)
        for t in range(n0, 40):
            got = m(x[:, t:t + 1], cache=cache)[:, -1]  # [1, V]
            kept = torch.cat([pre, x[:, :sinks], x[:, t - window + 1:t + 1]], 1)  # [1, P + k + w]
            want = ref.hf(input_ids=kept, use_cache=False).logits[:, -1]  # positions 0..P+k+w-1
            assert (got - want).abs().max() < 2e-5, t
            if sinks and t == 39:  # the bug: keys rotated where they were written (absolute positions)
                full = torch.cat([pre, x[:, :40]], 1)
                keep = torch.cat([torch.arange(len(m.prefix) + sinks), torch.arange(full.shape[1] - window,
                                                                                    full.shape[1] - 1)])
                dyn = DynamicCache(config=ref.hf.config)
                ref.hf(input_ids=full[:, :-1], past_key_values=dyn, use_cache=True)
                for layer in dyn.layers:
                    layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
                bug = ref.hf(input_ids=full[:, -1:], position_ids=torch.tensor([[full.shape[1] - 1]]),
                             past_key_values=dyn, use_cache=True).logits[:, -1]
                assert (bug - want).abs().max() > 1e-3
    assert bug is not None or not sinks


def test_no_sinks_equals_the_stock_cache_of_rotated_keys_cut_to_the_window(folders):
    """Two layers: the plain window at cache positions == transformers' own cache of keys rotated at
    absolute positions, cut to the newest w - 1 after every step (the plain windowed E5)."""
    m, ref = _open(folders["llama"]), _open(folders["llama"])
    x, w = _ids(m, 50), 9
    cache, dyn = m.new_cache(w, 0), DynamicCache(config=ref.hf.config)
    with torch.no_grad():
        got = [m(x[:, :w], cache=cache)]
        want = [ref.hf(input_ids=x[:, :w], past_key_values=dyn, use_cache=True).logits]
        for t in range(w, 50):
            for layer in dyn.layers:
                layer.keys, layer.values = layer.keys[:, :, -(w - 1):], layer.values[:, :, -(w - 1):]
            got.append(m(x[:, t:t + 1], cache=cache))
            want.append(ref.hf(input_ids=x[:, t:t + 1], position_ids=torch.tensor([[t]]), past_key_values=dyn,
                               use_cache=True).logits)
    assert (torch.cat(got, 1) - torch.cat(want, 1)).abs().max() < 2e-5


def test_e5_protocol_with_sinks_on_hf(folders):
    m = _open(folders["llama1"])
    tok = np.asarray(m.loaded.tokenizer(TEXT * 8)["input_ids"], dtype=np.int64)
    res = evaluate_hf(m, tok, EvalConfig(protocols=["cached", "recomputed"], lengths=[40], cache_window=6, sinks=3,
                                         num_tokens=80, batch_size=2), MAXPOS)
    assert res["settings"]["cache_sinks"] == 3 and res["model"]["attn_implementation"] == ATTN
    assert res["ppl"]["cached"]["40"] == pytest.approx(res["ppl"]["recomputed"]["40"], rel=1e-5)
    two = _open(folders["llama"])  # nothing evicted: the parallel forward, with two layers
    assert cached_window_ppl(two, tok, 40, window=40, sinks=2)["nll"] == pytest.approx(
        nonoverlapping(two, tok, 40)["nll"], rel=1e-5)
    assert recomputed_window_ppl(two, tok, 40, window=40, sinks=2)["nll"] == pytest.approx(
        nonoverlapping(two, tok, 40)["nll"], rel=1e-5)


def test_models_the_cached_window_cannot_serve_fail_in_one_line(folders):
    bloom = _open(folders["bloom"])
    tok = np.asarray(bloom.loaded.tokenizer(TEXT * 4)["input_ids"], dtype=np.int64)
    with pytest.raises(UserError, match="not available for HF models without RoPE") as err:
        evaluate_hf(bloom, tok, EvalConfig(protocols=["cached"], lengths=[32], sinks=4), MAXPOS)
    assert "\n" not in str(err.value)
    dyn = _open(folders["llama"], rope="dynamic:2")
    with pytest.raises(UserError, match="fixed rotary frequencies"):
        evaluate_hf(dyn, tok, EvalConfig(protocols=["cached"], lengths=[32]), MAXPOS)
    m = _open(folders["llama"])
    cache = m.new_cache(4, 1)
    with torch.no_grad():
        m(_ids(m, 5), cache=cache)
        with pytest.raises(UserError, match="one token per call"):
            m(_ids(m, 2), cache=cache)


def test_bench_hf_times_dca_and_sinks(tmp_path, monkeypatch):
    """`bench --hf --rope dca:C,w --sinks K:W`: DCA's E1 against plain E1 in the same rounds, and E5
    decoding with sinks against transformers' rotated-key cache of the same size."""
    import extrapolab.hf.bench as hb
    from hf_tiny import write_tiny_gguf

    monkeypatch.setattr(hb, "DECODE", 6)
    path, _ = write_tiny_gguf(tmp_path / "b.gguf", "F32")
    with pytest.raises(UserError, match="--sinks takes K:W"):
        hb.bench_hf_eval(f"hf:{path}", [64], sinks="4")
    with pytest.raises(UserError, match="more than L = 16"):
        hb.bench_hf_eval(f"hf:{path}", [16], sinks="2:9")
    res = hb.bench_hf_eval(f"hf:{path}", [64], windows=1, rounds=2, cache_dir=tmp_path / "c", ropes=["dca:20,3"],
                           sinks="2:8")
    row = res["rows"]["64"]
    stream = torch.randint(0, res["meta"]["vocab"], (64 + 1,), generator=torch.Generator().manual_seed(64)).numpy()
    m = open_hf(f"hf:{path}", rope="dca:20,3", cache_dir=tmp_path / "c")
    assert row["ropes"]["dca:20,3"]["ppl"] == pytest.approx(nonoverlapping(m, stream, 64)["ppl"], rel=1e-6)
    assert row["ropes"]["dca:20,3"]["twopass"] and row["sinks"]["decoded"] == 6
    assert len(row["sinks"]["e5_s"]) == len(row["sinks"]["rotated_s"]) == 2
    text = hb.format_hf_eval(res)
    assert "three-pass --rope dca:20,3: E1" in text and "E5 with 2 sinks:" in text and "| 64 | 2 | 8 | 6 |" in text


def test_rolling_cache_equals_one_parallel_forward_with_rope_streaming(folders):
    """Two layers: the rolling cache (sinks + window, keys rotated at their slots) gives the logits of
    one forward of the same tokens with --rope streaming:K,W (positional/rotary_streaming.py)."""
    m, par = _open(folders["llama"]), _open(folders["llama"], rope="streaming:3,7")
    assert par.loaded.info["rope_extension"] == {"method": "streaming", "sinks": 3, "w": 7}
    x = _ids(m, 45)
    cache = m.new_cache(7, 3)
    with torch.no_grad():
        got = torch.cat([m(x[:, :10], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(10, 45)], 1)
        want = par(x)
    assert (got - want).abs().max() < 2e-5
    assert (want - _open(folders["llama"])(x)).abs().max() > 1e-3
    assert _open(folders["llama"], rope="streaming").loaded.info["rope_extension"]["w"] == MAXPOS - 4
    with pytest.raises(UserError, match="k \\+ w <= L_tr"):
        _open(folders["llama"], rope=f"streaming:4,{MAXPOS}")


def test_bos_is_one_of_the_parallel_sinks_and_kept_beside_the_cached_ones(folders, tmp_path):
    """With a tokenizer that starts every text with BOS (StreamingLLM's Llama: its start_size counts the BOS),
    the cached window keeps BOS + eval.sinks tokens, and --rope streaming:K,W counts BOS among its K: the cache
    with k sinks equals one forward with streaming:k+1,W, not streaming:k,W (the mapping in docs/protocols.md)."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path / "bos"
    shutil.copytree(folders["llama"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save_pretrained(folder)
    m = _open(folder)
    assert m.prefix == [0]
    x = torch.from_numpy(np.asarray(tok(TEXT * 4, add_special_tokens=False)["input_ids"][:45], dtype=np.int64))[None]
    cache = m.new_cache(7, 2)
    with torch.no_grad():
        got = torch.cat([m(x[:, :9], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(9, 45)], 1)
        plus_bos, without = _open(folder, rope="streaming:3,7")(x), _open(folder, rope="streaming:2,7")(x)
    assert cache.keep == 3 and (got - plus_bos).abs().max() < 2e-5
    assert (got - without).abs().max() > 1e-3

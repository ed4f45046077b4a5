"""The reference real models (slow; skipped until fetched): SmolLM2-135M-Instruct (`make model-smollm2`)
and Gemma 3 270M (`make model-gemma3`) through hf:FILE.gguf. E1 on one window equals the loss
transformers computes itself, reading the GGUF file directly, on the same window read the same way
(raw for SmolLM2, whose tokenizer adds no BOS; after BOS for Gemma, whose tokenizer adds one)."""
import argparse
import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from extrapolab.eval import nonoverlapping  # noqa: E402
from extrapolab.hf import open_hf  # noqa: E402
from extrapolab.hf.zoo import model_path  # noqa: E402

CACHE = Path(__file__).resolve().parents[1] / ".extrapolab-cache"  # where `make model-...` puts them
TEXT = Path(inspect.__file__).read_text() + Path(argparse.__file__).read_text()  # Python source, offline


def _fetched(name: str) -> Path:
    path = model_path(name, CACHE)
    if not path.is_file():
        pytest.skip(f"{path} is absent; run `make model-{name}` first")
    return path


def _straight(path: Path):
    """transformers reading the GGUF file itself (de-quantised to fp32), not our converted folder."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True).eval()


@pytest.mark.slow
def test_smollm2_e1_at_2048_equals_transformers_loss():
    path = _fetched("smollm2")
    m = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=CACHE)
    g = m.loaded.info["gguf"]
    assert g["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert g["quantization"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert {k: g["metadata"][k] for k in ("architecture", "block_count", "embedding_length", "head_count",
                                          "head_count_kv", "rope_freq_base", "context_length", "vocab_size")} == {
        "architecture": "llama", "block_count": 30, "embedding_length": 576, "head_count": 9, "head_count_kv": 3,
        "rope_freq_base": 100000.0, "context_length": 8192, "vocab_size": 49152}
    assert m.loaded.train_length == 8192 and m.prefix == [] and m.chunked  # raw windows, as it was trained
    ids = m.loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:2049]
    got = nonoverlapping(m, np.asarray(ids), 2048)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = math.exp(float(_straight(path)(input_ids=x, labels=x).loss))
    assert got["tokens"] == 2048 and got["ppl"] == pytest.approx(ref, rel=1e-4)
    assert got["ppl"] < 100  # a working LM on Python source (random weights: ~49,152)


@pytest.mark.slow
def test_gemma3_e1_equals_transformers_loss_after_bos():
    path = _fetched("gemma3")
    m = open_hf(f"hf:{path}", device="cpu", dtype="fp32", cache_dir=CACHE)
    tok = m.loaded.tokenizer
    assert m.loaded.family == "gemma3_text" and m.loaded.train_length == 32768 and m.chunked
    assert m.prefix == [tok.bos_token_id] == tok("x")["input_ids"][:1]
    assert m.hf.config.sliding_window == 512 and "sliding_attention" in m.hf.config.layer_types
    L = 1024  # past the 512-token sliding window; the reference's full [L, 262,144] logits stay ~1 GB
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:L + 1]
    got = nonoverlapping(m, np.asarray(ids), L)
    x = torch.tensor([[tok.bos_token_id, *ids]])
    labels = torch.tensor([[-100, -100, *ids[1:]]])  # the first window token is context, not scored
    model = _straight(path)
    with torch.no_grad():
        ref = math.exp(float(model(input_ids=x, labels=labels).loss))
        raw = math.exp(float(model(input_ids=x[:, 1:], labels=x[:, 1:]).loss))
    assert got["tokens"] == L and got["ppl"] == pytest.approx(ref, rel=1e-4)
    assert raw > ref  # without its BOS the model reads the window out of distribution


@pytest.mark.slow
def test_smollm2_passkey_fails_at_its_first_word_not_at_the_key():
    """The extension study's low in-context passkey (docs/results/extend-quick.md): after the assistant's
    "The pass key is", SmolLM2-135M-Instruct puts " a" before the separator " " the answer starts with,
    then reads every digit of the key right; without the chat template the separator comes first. The
    answer ids are the prompt's own tokenization (" " then one token per digit), so no tokenization
    mismatch is involved, and greedy decoding agrees with the teacher-forced whole-answer match."""
    from extrapolab.extend.cells import passkey_records
    from extrapolab.hf.data import HFCodec, chat_wrap
    from extrapolab.tasks.retrieval import answer_ids, greedy, make_examples

    m = open_hf(f"hf:{_fetched('smollm2')}", device="cpu", dtype="fp32", cache_dir=CACHE)
    tok, codec = m.loaded.tokenizer, HFCodec(m.loaded.tokenizer)
    a, lead = answer_ids(codec, "The pass key is", "17759")
    assert [tok.decode([i]) for i in a] == [" ", "1", "7", "7", "5", "9"] and lead == 1
    chat = make_examples("passkey", [2048], [0.1], 1, 1, tokenizer=codec, chat=chat_wrap(tok))[0]
    plain = make_examples("passkey", [2048], [0.1], 1, 1, tokenizer=codec)[0]
    assert chat.value == plain.value == "17759" and chat.answer == plain.answer == a
    (c,), (p,) = passkey_records(m, [chat], 1.0), passkey_records(m, [plain], 1.0)
    assert tok.decode(c["pred"][:1]) == " a" and c["retrieved"] and not c["correct"]
    assert p["retrieved"] and p["correct"]
    got = greedy(m, torch.tensor([chat.prompt]), len(chat.answer))[0].tolist()
    assert got[0] == c["pred"][0] and got != chat.answer  # greedy puts the same first word

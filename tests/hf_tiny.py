"""Tiny random Hugging Face causal LMs + a ByteLevel BPE tokenizer trained in the test (no download).

``save_tiny(family, folder)`` writes model + tokenizer with ``save_pretrained`` so the tests load
them back through ``hf:PATH`` exactly as a user would.
"""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        "What is the pass key? The pass key is 12345. Remember it. line 1234: value 56789\n") * 8
MAXPOS = 48  # learned positions / pre-training length of every tiny model
FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "bloom", "mpt")
ROPE_FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2")


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def config(family: str, vocab: int):
    import transformers as tr

    common = dict(vocab_size=vocab, eos_token_id=0, bos_token_id=0)
    if family == "gpt2":
        return tr.GPT2Config(n_positions=MAXPOS, n_embd=32, n_layer=2, n_head=4, **common)
    if family == "gpt_neox":
        return tr.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=MAXPOS, rotary_pct=0.5, **common)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": tr.LlamaConfig, "mistral": tr.MistralConfig, "qwen2": tr.Qwen2Config}[family]
        extra = {} if family == "llama" else {"sliding_window": None}
        return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=MAXPOS, tie_word_embeddings=False,
                   **extra, **common)
    if family == "bloom":
        return tr.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **common)
    if family == "mpt":
        return tr.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=MAXPOS, expansion_ratio=2, **common)
    raise KeyError(family)


def save_tiny(family: str, folder: Path, seed: int = 0, sharpen: float = 4.0) -> Path:
    """Random model of ``family`` (attention logits sharpened by ``sharpen``) + tokenizer -> folder."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, len(tok)))
    with torch.no_grad():  # random init gives near-uniform attention: make the softmaxes peaky
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(k in name for k in ("q_proj", "query_key_value", "c_attn", "Wqkv", "k_proj")):
                p.mul_(sharpen)
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

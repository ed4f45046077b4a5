"""A tokenizer fit for RULER's prompts, trained in the test (no download), a tiny Llama around it, and a
fixed essay text: what tests/test_ruler*.py generate samples with and score.

The tokenizer is a byte-level BPE (vocabulary 1,000) trained on RULER's templates, haystack sentences
and a few number and word forms, so every task fits a few thousand tokens (the 320-token tokenizer
of hf_tiny.py spends 500 tokens on vt's one-shot example alone). Training is deterministic: the
reference values in test_ruler_generators.py were produced from this tokenizer by NVIDIA/RULER's
own scripts.
"""
from __future__ import annotations

from pathlib import Path

import torch

from extrapolab.tasks.ruler.spec import TASKS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def essay_text() -> str:
    """A deterministic 'essay' (about 9,000 words) for the essay haystack."""
    subjects = ["The garden", "A river", "Every city", "The old library", "Our small team", "The market"]
    verbs = ["grows", "changes", "waits", "remembers", "learns", "moves"]
    objects = ["in the morning", "after the rain", "without a plan", "for many years", "when nobody looks"]
    out = []
    for i in range(1500):
        s, v, o = subjects[i % 6], verbs[(i // 6) % 6], objects[(i // 36) % 5]
        out.append(f"{s} {v} {o}, and it is item {i}. Dr. Smith said so, e.g. twice!" if i % 11 == 0
                   else f"{s} {v} {o} ({i}).")
    return " ".join(out)


def _corpus() -> str:
    parts = [t.template + t.answer_prefix for t in TASKS.values()]
    parts += [NOISE * 4, "One of the special magic numbers for happy-apple is: 1234567.", "VAR ABCDE = 12345\n",
              "VAR FGHIJ = VAR ABCDE \n", " ".join(f"{i}. word" for i in range(1, 200)), essay_text()[:20000],
              "0123456789 abcdef-0123-4567-89ab-cdef01234567 " * 20]
    return "\n".join(parts) * 2


def ruler_tokenizer(vocab: int = 1000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def save_llama(folder: Path, max_positions: int = 4096, chat: bool = False, seed: int = 0) -> Path:
    """A random 2-layer Llama whose vocabulary is :func:`ruler_tokenizer`'s, saved with it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = ruler_tokenizer()
    if chat:
        tok.chat_template = CHAT
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      eos_token_id=0, bos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

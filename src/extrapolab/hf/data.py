"""Our corpora tokenized with an HF model's own tokenizer (cached by tokenizer hash).

The documents and their split are exactly those of ``extrapolab prepare`` (``data.read_corpus``
and ``data.corpus.assign_splits``: sha256 of each document's path, ``data.valid_percent`` /
``data.test_percent``); each document of the split is encoded with the model's tokenizer
(``add_special_tokens=False``) and followed by the tokenizer's eos token, as our own streams put
EOT after every document. The stream is written once to
``<cache_dir>/data/hf-<corpus>-<key>/<split>.bin`` (key: corpus hash, tokenizer hash, split
settings) with an atomic rename and memory-mapped on every later call.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from ..io import UserError, atomic_path, atomic_write_json

FORMAT = 1
BATCH_DOCS = 64


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (fast tokenizers) or of its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        raw = backend.to_str()
    else:
        raw = json.dumps(sorted(tokenizer.get_vocab().items()))
    raw += json.dumps([type(tokenizer).__name__, tokenizer.eos_token_id])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", re.split(r"[/:]", spec.rstrip("/"))[-1] or "corpus")[:40]


def hf_split(data_cfg, tokenizer, split: str = "test", progress: bool = False) -> np.ndarray:
    """Token stream [T] of ``split`` of ``data_cfg.corpus`` in ``tokenizer``'s ids (see module doc)."""
    from ..data import SPLITS, manifest_hash, read_corpus
    from ..data.corpus import assign_splits

    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the model's tokenizer has no eos token to separate documents; set tokenizer.eos_token "
                        "and save it again")
    corpus = read_corpus(data_cfg.corpus, data_cfg.max_bytes)
    chash = manifest_hash(corpus.manifest())
    thash = tokenizer_hash(tokenizer)
    key = hashlib.sha256(json.dumps([FORMAT, chash, thash, data_cfg.valid_percent,
                                     data_cfg.test_percent]).encode()).hexdigest()[:16]
    folder = Path(data_cfg.cache_dir) / "data" / f"hf-{_slug(data_cfg.corpus)}-{key}"
    path = folder / f"{split}.bin"
    vocab = max(len(tokenizer), int(eos) + 1)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    if not path.is_file():
        docs = assign_splits(corpus.documents, data_cfg.valid_percent, data_cfg.test_percent)[split]
        if not docs:
            raise UserError(f"no document of {data_cfg.corpus} fell in the {split} split; use a bigger corpus or "
                            "raise data.test_percent")
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            for i in range(0, len(docs), BATCH_DOCS):
                texts = [d.text for d in docs[i:i + BATCH_DOCS]]
                for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
                    f.write(np.asarray([*ids, eos], dtype=dtype).tobytes())
                    total += len(ids) + 1
        atomic_write_json(folder / f"{split}.json", {
            "format": FORMAT, "corpus": data_cfg.corpus, "corpus_hash": chash, "tokenizer_hash": thash,
            "tokenizer": type(tokenizer).__name__, "eos_id": int(eos), "split": split, "documents": len(docs),
            "tokens": total, "dtype": dtype.name, "valid_percent": data_cfg.valid_percent,
            "test_percent": data_cfg.test_percent})
        if progress:
            print(f"tokenized {len(docs)} {split} documents of {data_cfg.corpus}: {total:,} tokens -> {path}")
    if path.stat().st_size == 0:
        raise UserError(f"the {split} split of {data_cfg.corpus} is empty; use a bigger corpus")
    return np.memmap(path, dtype=dtype, mode="r")


class HFCodec:
    """An HF tokenizer behind our codecs' ``encode`` / ``eot_id`` / ``vocab_size`` (retrieval prompts)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eot_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def chat_wrap(tokenizer) -> tuple[list[int], list[int]] | None:
    """(head, tail): the ids the tokenizer's chat template puts before and after one user message,
    up to the assistant's turn (``add_generation_prompt``); None when it has no chat template.
    SmolLM2-Instruct: head = its system turn + "<|im_start|>user\\n", tail = "<|im_end|>\\n<|im_start|>assistant\\n"."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    mark = "\x00EXTRAPOLAB\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(mark) != 1:
        raise UserError("the tokenizer's chat template does not place the user's message once; score without "
                        "the chat template (extend.passkey_chat=false)")
    head, tail = text.split(mark)

    def enc(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False)["input_ids"]) if s else []

    return enc(head), enc(tail)

"""How a RULER task's text becomes the ids a model reads: the tokenizer and the model template.

RULER (NVIDIA/RULER ``scripts/data/prepare.py``) builds every prompt as
``model_template.format(task_template=template) + answer_prefix``, where the model template is one
of its own strings (``base`` = none, ``meta-chat`` = ``[INST] ... [/INST]``, ...). Here the model
template is the tokenizer's own chat template, split around one user message
(``apply_chat_template(add_generation_prompt=True)``): ``head + task text + tail + answer prefix``,
so the answer prefix opens the assistant's turn. Without a chat template the text is the task text
plus the answer prefix (RULER's ``base``).

Lengths are counted in the ids the model reads (:meth:`PromptFormat.encode`): the whole prompt text
encoded at once, as RULER counts ``tokenizer.tokenize(text)``, plus the ids the tokenizer adds in
front of a text (a Llama / Gemma BOS) when there is no chat template (a chat template writes its
own). RULER's count leaves that BOS out; for tokenizers that add nothing (GPT-2 style, SmolLM2)
the two counts are the same.

Tokenizers: a Hugging Face tokenizer, or extrapolab's own (``data.tokenizer`` codecs, or the
``TokenData`` of a prepared corpus, which encodes with the corpus's codec).
"""
from __future__ import annotations

import hashlib
import json

from ...io import UserError

CHAT_MODES = ("auto", "on", "off")


def _is_hf(tokenizer) -> bool:
    return callable(tokenizer) and hasattr(tokenizer, "convert_ids_to_tokens")


def chat_text(tokenizer, chat) -> tuple[str, str] | None:
    """(head, tail) text of the tokenizer's chat template around one user message, or None.
    ``chat``: False / None / "off" (none), True / "on" (required), "auto" (where the tokenizer has
    one), or an explicit (head, tail) pair of strings."""
    if isinstance(chat, (tuple, list)):
        if len(chat) != 2 or not all(isinstance(x, str) for x in chat):
            raise UserError("chat must be auto, on, off or a (head, tail) pair of strings")
        return (chat[0], chat[1]) if any(chat) else None
    mode = {True: "on", False: "off", None: "off"}.get(chat, chat)
    if mode not in CHAT_MODES:
        raise UserError(f"--chat takes {', '.join(CHAT_MODES)}; got {chat!r}")
    has = _is_hf(tokenizer) and bool(getattr(tokenizer, "chat_template", None))
    if mode == "off" or (mode == "auto" and not has):
        return None
    if not has:
        raise UserError("--chat on needs a tokenizer with a chat template; this one has none: use --chat auto or off")
    mark = "\x00EXTRAPOLAB\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(mark) != 1:
        raise UserError("the tokenizer's chat template does not place the user's message once; use --chat off")
    head, tail = text.split(mark)
    return head, tail


class PromptFormat:
    """A tokenizer plus the model template (see module doc)."""

    def __init__(self, tokenizer, chat="off") -> None:
        if tokenizer is None or not (_is_hf(tokenizer) or callable(getattr(tokenizer, "encode", None))):
            raise UserError("the model has no tokenizer to write RULER's prompts with; save one with the model "
                            "(tokenizer.save_pretrained) or prepare the run's corpus (`extrapolab prepare`)")
        self.tokenizer = tokenizer
        self.hf = _is_hf(tokenizer)
        self.chat = chat_text(tokenizer, chat)
        self.head, self.tail = self.chat or ("", "")
        self.special = self.hf and self.chat is None  # the tokenizer's own prefix ids (BOS) without a template
        try:
            self.encode("a b")
        except UserError as e:
            raise UserError(f"the model's tokenizer cannot encode text ({e}); RULER needs a real tokenizer") from None

    def encode(self, text: str) -> list[int]:
        """The ids the model reads for ``text`` (module doc)."""
        if self.hf:
            return list(self.tokenizer(text, add_special_tokens=self.special, verbose=False)["input_ids"])
        return [int(i) for i in self.tokenizer.encode(text)]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def count_plain(self, text: str) -> int:
        """Tokens of ``text`` alone (no ids added in front): RULER's count of a one-shot example."""
        if self.hf:
            return len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        return len(self.tokenizer.encode(text))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.hf:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        eot = getattr(self.tokenizer, "eot_id", None)
        return self.tokenizer.decode([i for i in ids if i != eot])

    def wrap(self, task_text: str, prefix: str = "") -> str:
        """RULER's ``model_template.format(task_template=...) + answer_prefix``."""
        return self.head + task_text + self.tail + prefix

    def stop_ids(self, model=None) -> set[int]:
        """Ids that end greedy decoding: the tokenizer's eos / end-of-text (and an HF model's
        generation_config eos ids, e.g. an instruct model's end-of-turn)."""
        out = set()
        for v in (getattr(self.tokenizer, "eos_token_id", None), getattr(self.tokenizer, "eot_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
            out |= {int(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None}
        return out

    def identity(self) -> dict:
        """What a generated sample set depends on in the tokenizer and template (cache key)."""
        if self.hf:
            from ...hf.data import tokenizer_hash

            tok = tokenizer_hash(self.tokenizer)
        else:
            h = getattr(self.tokenizer, "hash", None)
            meta = getattr(self.tokenizer, "meta", {}) or {}
            tok = h if isinstance(h, str) else json.dumps(meta.get("tokenizer", meta.get("vocab_size")), sort_keys=True)
        return {"tokenizer": tok, "chat": list(self.chat) if self.chat else None, "special": self.special}

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]

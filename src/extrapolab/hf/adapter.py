"""An HF causal LM behind the call our evaluation protocols make on extrapolab's GPT.

``eval/core.py`` (E1-E4) calls ``model(idx [B, L], positions=None, opts=AttnOptions)`` -> logits
[B, L, V], reads ``model.cfg.vocab_size`` (vocabulary check, logits budget) and the device of the
parameters; :class:`HFCausalLM` answers exactly that, so the protocols run unchanged:

* the HF model is called as ``model(input_ids=idx, use_cache=False).logits`` (or with
  ``inputs_embeds`` for the ERF), positions 0..L-1 as the model numbers them;
* ``check_length(L)``: a model with learned absolute positions (GPT-2 ``n_positions``) refuses
  L past its table with one line; RoPE and ALiBi models take any L. HF MPT builds its ALiBi
  tensor for ``config.max_seq_len`` keys, so that is raised to L first (ALiBi is a function of
  the distance only; nothing learned depends on it);
* ``opts.temperature`` (one tau, or one per layer) runs the forward inside
  :func:`hf.temperature.hf_temperature`;
* ``opts.window`` (the windowed@L_tr reference of E4) has no equivalent in an HF model without an
  L x L mask, so it is refused with one line; ``opts.impl`` / block sizes are ours and ignored
  (the HF model's own ``attn_implementation`` decides how its attention runs).

Windows (docs/protocols.md, "Windows of a pretrained model"): every input reaches the model the
way its tokenizer starts a text. ``prefix="auto"`` takes the ids the tokenizer puts before a text
(``add_special_tokens=True`` against ``False``: Llama's / Gemma's BOS, nothing for GPT-2, Pythia,
Qwen2 or SmolLM2); they are fed before each window at positions 0..P-1 and their outputs dropped,
so the window's L tokens sit at positions P..P+L-1 and the protocols score exactly the tokens they
score on our GPT (each window's first token is context, never a prediction from the prefix
alone). A model trained with BOS at every sequence start reads a window without it as out of
distribution; a model trained on raw windows of a document stream gets raw windows, as in HF's
perplexity guide.

Vocabulary in chunks: :meth:`HFCausalLM.final_hidden` and :meth:`HFCausalLM.logits_from_hidden`
let ``eval.core`` score the vocabulary a block of positions at a time (one [L, V] logit matrix
of SmolLM2 at 16,384 tokens is 3.2 GB in fp32), for the families whose causal-LM head is exactly
``lm_head(base_model(x).last_hidden_state)`` (then Gemma's final soft-capping) -- ``CHUNKED``;
the others return full logits from ``forward``.
"""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch
from torch import nn

from ..io import UserError
from ..model.attention import temperature_record
from .cached import HFWindowCache
from .load import HFModel, load_hf
from .temperature import hf_temperature

#: model_type of the families whose logits are lm_head(base_model(x).last_hidden_state) (module doc)
CHUNKED = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "bloom", "mpt", "gemma3_text")


def window_prefix(tokenizer) -> list[int]:
    """The ids ``tokenizer`` puts before a text (its BOS where it adds one), else []."""
    plain = list(tokenizer("a b", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a b", add_special_tokens=True)["input_ids"])
    for p in range(len(full) - len(plain) + 1):
        if full[p:p + len(plain)] == plain:
            return full[:p]
    return []


class HFCausalLM(nn.Module):
    """``HFModel`` -> a module with our GPT's evaluation call (see module doc).

    ``prefix``: "auto" (the tokenizer's own, see :func:`window_prefix`), "none", or a list of ids."""

    def __init__(self, loaded: HFModel, prefix="auto") -> None:
        super().__init__()
        self.hf = loaded.model
        self.loaded = loaded
        vocab = int(getattr(self.hf.config, "vocab_size", 0) or self.hf.get_output_embeddings().weight.shape[0])
        self.cfg = SimpleNamespace(vocab_size=vocab, train_length=loaded.train_length, name=loaded.name)
        if prefix == "auto":
            prefix = window_prefix(loaded.tokenizer)
        self.prefix = [int(i) for i in (prefix if prefix not in (None, "none") else [])]
        loaded.info["window_prefix"] = {"ids": self.prefix,
                                        "tokens": loaded.tokenizer.convert_ids_to_tokens(self.prefix)}
        self.eval()  # a loaded model evaluates (dropout off) unless the caller trains it

    @property
    def name(self) -> str:
        return self.loaded.name

    def check_length(self, length: int) -> int:
        L, top = int(length), self.loaded.max_length
        P = len(self.prefix)
        if self.loaded.positions == "learned" and top and L + P > top:
            with_prefix = f" after its {P}-token prefix" if P else ""
            raise UserError(f"{self.loaded.name} ({self.loaded.family}) has learned absolute positions for {top} "
                            f"tokens and cannot encode length {L}{with_prefix}; use lengths <= {top - P}")
        if self.loaded.family == "mpt" and L + P > int(self.hf.config.max_seq_len):
            self.hf.config.max_seq_len = L + P  # HF MPT's ALiBi tensor covers max_seq_len keys
        return L

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, L, C] that ``forward(..., inputs_embeds=...)`` takes (for the ERF)."""
        return self.hf.get_input_embeddings()(idx)

    def _inputs(self, idx, inputs_embeds) -> dict:
        """HF keyword inputs with the window prefix in front ([B, P+L] ids or [B, P+L, C] embeddings)."""
        x = inputs_embeds if inputs_embeds is not None else idx
        self.check_length(x.shape[1])
        if self.prefix:
            pre = torch.tensor(self.prefix, dtype=torch.long, device=x.device).expand(x.shape[0], -1)  # [B, P]
            if inputs_embeds is not None:
                return {"inputs_embeds": torch.cat([self.embed(pre).to(x.dtype), x], dim=1)}  # [B, P+L, C]
            return {"input_ids": torch.cat([pre, idx], dim=1)}  # [B, P+L]
        return {"inputs_embeds": x} if inputs_embeds is not None else {"input_ids": x}

    def _scope(self, positions, opts):
        if positions is not None:
            raise UserError("an HF model numbers its positions 0..L-1 itself; call it with positions=None")
        tau = 1.0
        if opts is not None:
            if getattr(opts, "window", None):
                raise UserError("windowed attention (the windowed@L_tr reference) is not available for HF "
                                "models; evaluate the position-wise curve without it")
            tau = temperature_record(getattr(opts, "temperature", 1.0) or 1.0)
        return hf_temperature(self, tau) if tau != 1.0 else nullcontext()

    def new_cache(self, window: int, sinks: int | None = None) -> HFWindowCache:
        """The cache E5 decodes with (eval/cached.py): the window prefix, ``sinks`` first tokens and the newest
        ``window``, keys before rotation (hf/cached.py)."""
        return HFWindowCache(self, window, sinks)

    def forward(self, idx: torch.Tensor | None = None, positions=None, opts=None,
                inputs_embeds: torch.Tensor | None = None, cache: HFWindowCache | None = None) -> torch.Tensor:
        if cache is not None:  # E5's cached window: the cache places the tokens, not ``positions``
            self.check_length(cache.keep + cache.window)
            with self._scope(None, opts):
                return cache.step(self, idx)  # [B, L, V]
        kw = self._inputs(idx, inputs_embeds)
        with self._scope(positions, opts):
            out = self.hf(**kw, use_cache=False)
        return out.logits[:, len(self.prefix):]  # [B, L, V]

    @property
    def chunked(self) -> bool:
        return self.loaded.family in CHUNKED

    def final_hidden(self, idx: torch.Tensor | None = None, positions=None, opts=None,
                     inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, L] (or inputs_embeds [B, L, C]) -> the hidden states the output head reads [B, L, C]
        (after the final norm)."""
        if not self.chunked:
            raise UserError(f"{self.loaded.family} models are scored from full logits; call the model instead")
        kw = self._inputs(idx, inputs_embeds)
        with self._scope(positions, opts):
            h = self.hf.base_model(**kw, use_cache=False).last_hidden_state  # [B, P+L, C]
        return h[:, len(self.prefix):]

    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., C] -> logits [..., V]: the output head, then the family's final soft-cap (Gemma)."""
        logits = self.hf.get_output_embeddings()(h)  # [..., V]
        cap = getattr(self.hf.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


def open_hf(spec, prefix="auto", **kw) -> HFCausalLM:
    """``load_hf(spec, **kw)`` wrapped for the protocols (the usual entry point)."""
    return HFCausalLM(load_hf(spec, **kw), prefix=prefix)

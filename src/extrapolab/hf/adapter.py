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
"""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch
from torch import nn

from ..io import UserError
from ..model.attention import temperature_record
from .load import HFModel, load_hf
from .temperature import hf_temperature


class HFCausalLM(nn.Module):
    """``HFModel`` -> a module with our GPT's evaluation call (see module doc)."""

    def __init__(self, loaded: HFModel) -> None:
        super().__init__()
        self.hf = loaded.model
        self.loaded = loaded
        vocab = int(getattr(self.hf.config, "vocab_size", 0) or self.hf.get_output_embeddings().weight.shape[0])
        self.cfg = SimpleNamespace(vocab_size=vocab, train_length=loaded.train_length, name=loaded.name)
        self.eval()  # a loaded model evaluates (dropout off) unless the caller trains it

    @property
    def name(self) -> str:
        return self.loaded.name

    def check_length(self, length: int) -> int:
        L, top = int(length), self.loaded.max_length
        if self.loaded.positions == "learned" and top and L > top:
            raise UserError(f"{self.loaded.name} ({self.loaded.family}) has learned absolute positions for {top} "
                            f"tokens and cannot encode length {L}; use lengths <= {top}")
        if self.loaded.family == "mpt" and L > int(self.hf.config.max_seq_len):
            self.hf.config.max_seq_len = L  # HF MPT's ALiBi tensor covers max_seq_len keys
        return L

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, L, C] that ``forward(..., inputs_embeds=...)`` takes (for the ERF)."""
        return self.hf.get_input_embeddings()(idx)

    def forward(self, idx: torch.Tensor | None = None, positions=None, opts=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else idx
        self.check_length(x.shape[1])
        if positions is not None:
            raise UserError("an HF model numbers its positions 0..L-1 itself; call it with positions=None")
        tau = 1.0
        if opts is not None:
            if getattr(opts, "window", None):
                raise UserError("windowed attention (the windowed@L_tr reference) is not available for HF "
                                "models; evaluate the position-wise curve without it")
            tau = temperature_record(getattr(opts, "temperature", 1.0) or 1.0)
        scope = hf_temperature(self, tau) if tau != 1.0 else nullcontext()
        with scope:
            if inputs_embeds is not None:
                out = self.hf(inputs_embeds=inputs_embeds, use_cache=False)
            else:
                out = self.hf(input_ids=idx, use_cache=False)
        return out.logits  # [B, L, V]


def open_hf(spec, **kw) -> HFCausalLM:
    """``load_hf(spec, **kw)`` wrapped for the protocols (the usual entry point)."""
    return HFCausalLM(load_hf(spec, **kw))

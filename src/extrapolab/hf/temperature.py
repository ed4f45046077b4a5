"""Softmax temperature per layer inside a Hugging Face causal LM (thesis ch. 5, §5.4, Algorithm 1).

Softmax_tau(l) = softmax(l / tau) divides the *whole* pre-softmax logit, the scaled q·k and any
additive position bias, as ``AttnOptions.temperature`` does for our GPT. Nothing of the model's
attention maths is copied: each family's attention module already carries the factor that
multiplies q·k, and tau divides it for the duration of a ``with`` block (restored after):

* GPT-2, GPT-NeoX / Pythia, Llama, Mistral, Qwen2 (transformers 5 attention interface): the
  module's ``scaling`` is passed to eager / sdpa / flash attention as the logit scale, so
  ``scaling / tau`` gives softmax(q·k·scaling / tau). RoPE is applied to q and k before, and
  YaRN's attention factor lives in cos/sin, so both are inside the divided logit.
* BLOOM (ALiBi): ``scores = beta·alibi + inv_norm_factor·q·k`` (``alibi.baddbmm``), so both
  ``beta`` and ``inv_norm_factor`` are divided by tau.
* MPT (ALiBi): ``scores = softmax_scale·q·k + position_bias``; ``softmax_scale`` is divided and a
  forward pre-hook divides the ``position_bias`` handed to that layer (the model's shared
  tensor is not changed, so every layer gets its own tau).

The causal mask (dtype-min or -inf) is left alone: masked keys get probability 0 either way.
Models loaded with ``attn_implementation="extrapolab"`` (hf/extend.py) take the same ``scaling``
route: the registered attention function puts it into q.
Falcon (ALiBi folded into the sdpa mask and the eager logit in two different ways) and other
families are refused with one line rather than guessed.

:class:`HFTarget` is the alignment target of Algorithm 1 (see ``align.temperature.as_target``;
the hook and scope mechanics are :mod:`.hooks`, shared with T5): statistics come from each
layer's attention probabilities p, returned by eager attention (``attn_implementation="eager"``,
which materialises [B, H, L, L] per layer: O(L²) memory, fine at short alignment lengths).
:class:`HFBlockTarget` computes the same statistics without probabilities, for models loaded with
``attn_implementation="extrapolab"`` (every family whose attention goes through transformers'
attention interface: GPT-2, GPT-NeoX, Llama, Mistral, Qwen2, ...): the registered function hands
each layer's tau = 1 logits, from the model's own q and k, to the statistics sink one query block
at a time (``AttnOptions.logits_sink``, as for our GPT), so memory is O(H·block·L) per layer.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Sequence

import torch

from ..io import UserError
from ..model.attention import AttnOptions, layer_temperatures
from .extend import ATTN, OPTS_KWARG
from .hooks import ProbsTarget, divide_kwarg, hook_handles

#: model_type -> how tau enters its attention (see module doc)
KINDS = {"gpt2": "scaling", "gpt_neox": "scaling", "llama": "scaling", "mistral": "scaling",
         "qwen2": "scaling", "bloom": "bloom", "mpt": "mpt"}
_ATTRS = {"scaling": ("scaling",), "bloom": ("inv_norm_factor", "beta"), "mpt": ("softmax_scale",)}


def _hf(model):
    return getattr(model, "hf", model)  # the adapter or the HF model itself


def attention_modules(model) -> tuple[str, list]:
    """(kind, the self-attention modules in layer order) of an HF causal LM, or a one-line error."""
    hf = _hf(model)
    mt = getattr(getattr(hf, "config", None), "model_type", type(hf).__name__)
    kind = KINDS.get(mt)
    if kind is None:
        raise UserError(f"per-layer softmax temperature is not wired for {mt} models; supported: "
                        f"{', '.join(sorted(KINDS))} (see extrapolab/hf/temperature.py)")
    mods = [m for m in hf.modules() if type(m).__name__.endswith("Attention")
            and all(hasattr(m, a) for a in _ATTRS[kind])]
    n = getattr(hf.config, "num_hidden_layers", len(mods))
    if len(mods) != n:
        raise UserError(f"found {len(mods)} attention modules in a {n}-layer {mt} model; this transformers "
                        "version is not supported for temperature (see extrapolab/hf/temperature.py)")
    return kind, mods


@contextmanager
def hf_temperature(model, tau: float | Sequence[float] = 1.0):
    """Within the block every layer's softmax uses logits / tau (one tau, or one per layer)."""
    kind, mods = attention_modules(model)
    taus = layer_temperatures(tau, len(mods))
    saved = []
    try:
        with hook_handles() as handles:
            for m, t in zip(mods, taus):
                if t == 1.0:
                    continue
                for a in _ATTRS[kind]:
                    saved.append((m, a, getattr(m, a)))
                    setattr(m, a, getattr(m, a) / t)
                if kind == "mpt":  # its layers share one ALiBi position_bias [H, 1, Lk]
                    handles.append(divide_kwarg(m, "position_bias", t))
            yield model
    finally:
        for m, a, v in reversed(saved):
            setattr(m, a, v)


class HFTarget(ProbsTarget):
    """Algorithm 1 target over an HF causal LM (wrapped by ``hf.adapter.HFCausalLM``)."""

    no_probs = ("the attention returned no probabilities; load the model with "
                "attn_implementation='eager' (load_hf(..., attn='eager'))")

    def __init__(self, model) -> None:
        self.model = model
        self.num_layers = len(self.modules())

    def modules(self) -> list:
        return attention_modules(self.model)[1]

    def probs(self, output):
        return output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [B, H, Lq, Lk]

    def temperature(self, taus):
        return hf_temperature(self.model, taus)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor):
        return self.model(ids)


def block_statistics(model_type: str) -> bool:
    """Whether the family's attention goes through transformers' attention interface (its module's
    ``scaling`` reaches the attention function), so :class:`HFBlockTarget` can align it."""
    return KINDS.get(model_type) == "scaling"


class HFBlockTarget:
    """Algorithm 1 target over an HF causal LM loaded with ``attn_implementation="extrapolab"``:
    per-layer tau and the statistics sink travel as ``AttnOptions`` in the forward keyword
    ``extrapolab_opts`` to the registered attention function (hf/extend.py), which feeds the sink
    ``block_size`` query rows at a time; only the last position's logits are computed."""

    def __init__(self, model, block_size: int = 256) -> None:
        hf = _hf(model)
        impl = getattr(hf.config, "_attn_implementation", None)
        if not block_statistics(hf.config.model_type):
            raise UserError(f"{hf.config.model_type} attention does not go through transformers' attention "
                            "interface; align it with HFTarget on attn='eager'")
        if impl != ATTN:
            raise UserError(f"block-wise alignment statistics need attn_implementation={ATTN!r} (got {impl!r}); "
                            f"load the model with load_hf(..., attn={ATTN!r})")
        self.model, self.hf, self.block_size = model, hf, int(block_size)
        self.num_layers = int(hf.config.num_hidden_layers)
        self._opts: AttnOptions | None = None
        params = inspect.signature(hf.forward).parameters
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    @contextmanager
    def scope(self, tau: float | Sequence[float] = 1.0, sink=None):
        """Within the block every layer runs at its tau; with a ``sink``, each layer's tau = 1 logits
        reach ``sink.add(layer, logits, grid=keys)`` per query block."""
        taus = layer_temperatures(tau, self.num_layers)
        kw: dict = {"temperature": tuple(taus)}
        if sink is not None:
            kw.update(logits_sink=lambda layer, lg, keys: sink.add(layer, lg, grid=keys), block_size=self.block_size)
        prev, self._opts = self._opts, AttnOptions(**kw)
        try:
            yield self
        finally:
            self._opts = prev

    @torch.no_grad()
    def forward(self, ids: torch.Tensor):
        return self.hf(input_ids=ids, use_cache=False, **self._last_only, **{OPTS_KWARG: self._opts or AttnOptions()})

"""Softmax temperature for Hugging Face ``transformers`` T5 (thesis ch. 5, §5.3-5.4, Algorithm 1).

HF T5Attention (transformers 5.x) computes scores = (q·k^T)·scaling + position_bias + mask with
``scaling = 1.0`` (no 1/sqrt(d)) and softmaxes them; only the first layer of a stack owns the
relative-bias table and every later layer reuses the ``position_bias`` it returns. The hook here
makes the softmax see scores / tau, the same Softmax_tau(l) as ``AttnOptions(temperature=tau)``:

The hook and scope mechanics (handles removed on exit, the position_bias pre-hook, the alignment
target's probability grab) are shared with the causal LMs' adapter in ``hf/hooks.py``:

* a forward hook on each attention's ``q`` projection divides q by tau (so q·k^T / tau);
* the first layer's ``relative_attention_bias`` embedding output is divided by its tau;
* a pre-hook divides an incoming shared ``position_bias`` by this layer's tau, and a post-hook
  multiplies the returned one back, so the next layer receives the undivided bias (per-layer tau);
* the mask (0 or dtype-min) is left alone: masked keys get probability 0 either way.

It works with any attention implementation that consumes q, k and position_bias; collecting
attention statistics needs the probabilities, so ``load_t5`` uses ``attn_implementation="eager"``.
``transformers`` stays an optional import; ``load_t5`` never downloads (``local_files_only``).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch

from ..hf.hooks import ProbsTarget, divide_kwarg, hook_handles
from ..io import UserError
from ..model.attention import layer_temperatures

PARTS = ("encoder", "decoder", "cross")


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("the HF T5 adapter needs `transformers`; install it (pip install transformers)") from None
    return transformers


def is_t5(model) -> bool:
    return type(model).__name__.startswith("T5") and hasattr(model, "config") \
        and getattr(model.config, "model_type", "") == "t5"


def load_t5(path: str | Path, encoder_only: bool = False):
    """A T5 model from a local folder (``save_pretrained`` layout), eager attention, eval mode."""
    tr = _require_transformers()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path} holds no T5 model (config.json missing); pass the folder written by save_pretrained")
    config = tr.T5Config.from_pretrained(str(path), local_files_only=True)
    arch = (config.architectures or ["T5ForConditionalGeneration"])[0]
    cls = tr.T5EncoderModel if (encoder_only or arch == "T5EncoderModel") else tr.T5ForConditionalGeneration
    try:
        model = cls.from_pretrained(str(path), local_files_only=True, attn_implementation="eager")
    except OSError as e:
        raise UserError(f"cannot load the T5 weights in {path}: {str(e).splitlines()[0]}") from None
    return model.eval()


def attention_modules(model, part: str = "encoder") -> list:
    """T5Attention modules of one part, in layer order: encoder / decoder self-attention or cross."""
    if part not in PARTS:
        raise UserError(f"unknown T5 part {part!r}; use one of {', '.join(PARTS)}")
    stack = getattr(model, "decoder" if part in ("decoder", "cross") else "encoder", None)
    if stack is None:
        raise UserError(f"this T5 model has no {part}; load a T5ForConditionalGeneration for decoder/cross")
    out = []
    for blk in stack.block:
        if part == "cross":
            out.append(blk.layer[1].EncDecAttention)
        else:
            out.append(blk.layer[0].SelfAttention)
    return out


def _hook(attn, tau: float) -> list:
    handles = [attn.q.register_forward_hook(lambda m, i, o: o / tau)]  # q [B, L, H·D] / tau
    if attn.has_relative_attention_bias:
        handles.append(attn.relative_attention_bias.register_forward_hook(lambda m, i, o: o / tau))

    def post(module, args, kwargs, output):
        out, pb, w = output
        return out, (pb * tau if pb is not None else None), w  # next layer gets the undivided bias

    handles.append(divide_kwarg(attn, "position_bias", tau))  # [1|B, H, Lq, Lk] / tau
    handles.append(attn.register_forward_hook(post, with_kwargs=True))
    return handles


@contextmanager
def t5_temperature(model, tau: float | Sequence[float] = 1.0, parts: Sequence[str] = ("encoder",)):
    """Within the block, every softmax of ``parts`` uses scores / tau (tau per layer if a sequence)."""
    with hook_handles() as handles:
        for part in parts:
            mods = attention_modules(model, part)
            for attn, t in zip(mods, layer_temperatures(tau, len(mods), f"{len(mods)} T5 {part} layers")):
                if t != 1.0:
                    handles += _hook(attn, t)
        yield model


class T5Target(ProbsTarget):
    """Alignment target (see align.temperature.as_target): Algorithm 1 over the T5 *encoder* softmaxes.

    Statistics come from the attention probabilities p of each encoder layer; the sink gets
    tau·log p, which is l/tau·tau = l up to a per-row constant (softmax(log p) re-temperatures
    exactly, see hf/hooks.py). Padding keys (p = 0) become -inf and are not counted.
    """

    no_probs = ("T5 attention returned no probabilities; load it with attn_implementation='eager' "
                "(align.hf_t5.load_t5 does)")

    def __init__(self, model, part: str = "encoder") -> None:
        self.model = model
        self.part = part
        self.num_layers = len(self.modules())
        self.what = f"{self.num_layers} T5 {part} layers"

    def modules(self) -> list:
        return attention_modules(self.model, self.part)

    def probs(self, output):
        return output[2]  # [B, H, Lq, Lk] probabilities at this layer's tau

    def temperature(self, taus):
        return t5_temperature(self.model, taus, parts=(self.part,))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        enc = self.model.encoder if hasattr(self.model, "encoder") else self.model
        return enc(input_ids=ids, attention_mask=attention_mask)

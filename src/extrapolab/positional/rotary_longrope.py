"""rotary-longrope: LongRoPE (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million
Tokens", arXiv 2402.13753, §3: non-uniform interpolation, one searched rescale factor lambda_i per
frequency, theta_i' = theta_i / lambda_i, and a second set for short inputs) as Phi-3/4 ship it
(Abdin et al. 2024, Phi-3 technical report, arXiv 2404.14219; the model cards' ``modeling_phi3.py``
``Phi3LongRoPEScaledRotaryEmbedding``; Hugging Face rope type ``longrope``).

Frequencies: theta_i' = base^(-2i/d) / lambda_i with lambda = ``short_factor`` while the sequence
is at most L_tr = ``original_length`` long and ``long_factor`` beyond it; each list has d_head/2
entries, pair i <-> entry i (Hugging Face's pair (i, i + d/2)). The switch is a property of the
whole call: "length" is the call's largest position + 1, exactly Hugging Face's
``max(position_ids) + 1``, so one parallel forward of L > L_tr tokens rotates every position,
the first ones included, with the long factors.

Attention factor (q and k both, so the logits get its square, as YaRN's): sqrt(1 + ln s / ln L_tr)
with s = ``factor`` (Phi-3: max_position_embeddings / original_max_position_embeddings, 131072 /
4096 = 32), 1 for s <= 1; an explicit ``attention_factor`` replaces it. It does not depend on the
length: short inputs are scaled too, as in Phi-3 and Hugging Face.

KV-cache decoding (what ours does, with Hugging Face's rotary embedding under a cache as the
reference): each call rotates its new q and k with the set its own length selects, and cached keys
keep the set they were rotated with. A decode that starts at or below L_tr and crosses it therefore
mixes short-factor keys with long-factor ones, and differs from one parallel forward over the same
tokens (which uses the long set everywhere), exactly as ``LlamaRotaryEmbedding`` with rope type
``longrope`` and a ``DynamicCache`` does. Phi-3's ``generate`` avoids the mix by dropping the cache
once, when the input first exceeds L_tr, and re-encoding the prefix
(``Phi3ForCausalLM.prepare_inputs_for_generation``); the same holds here: re-encode the prefix without
a cache at the crossing and every later step equals the parallel forward (tests/test_rope_kinds.py).

Without searched factors (the defaults) short = 1 (plain RoPE up to L_tr) and long = s for every
pair, position interpolation, the first seed of LongRoPE's search. Options: ``short_factor``,
``long_factor`` (lists of d_head/2 numbers > 0), ``factor`` s >= 1, ``attention_factor``,
``original_length`` L_tr (filled from model.train_length), ``head_dim`` (filled from the model:
checks the list lengths when the scheme is built), ``base``, ``logn``.
"""
from __future__ import annotations

import math

import torch

from .base import SchemeError
from .registry import register
from .rotary import Rotary, check_factor, check_original_length, default_inv_freq

FIX = "pass --set model.scheme_params.long_factor=[...] with d_head/2 numbers"


def longrope_attention_factor(factor: float, original_length: int) -> float:
    """sqrt(1 + ln s / ln L_tr), 1 for s <= 1 (Phi-3's ``scaling_factor``)."""
    return math.sqrt(1 + math.log(factor) / math.log(original_length)) if factor > 1 else 1.0


def _factors(name: str, values) -> tuple[float, ...] | None:
    if values is None:
        return None
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        out = ()
    if not out or not all(0 < v < math.inf for v in out):
        raise SchemeError(f"rotary-longrope {name} must be a list of numbers > 0 (one per frequency pair), got "
                          f"{values!r}; {FIX.replace('long_factor', name)}")
    return out


@register
class RotaryLongRoPE(Rotary):
    name = "rotary-longrope"
    paper = "Ding et al. 2024 (LongRoPE) §3; Phi-3 (Abdin et al. 2024): short/long factor sets, sqrt(1 + ln s/ln L)"
    summary = "RoPE with per-pair factors, short set up to L_tr and long set beyond; q,k x sqrt(1 + ln s/ln L_tr)"
    length_dependent = True
    #: the set depends on the largest absolute position, so shifting all positions can change the rotation
    relative = False

    def __init__(self, num_heads: int, short_factor: list | None = None, long_factor: list | None = None,
                 factor: float = 4.0, attention_factor: float | None = None, original_length: int = 512,
                 head_dim: int | None = None, base: float = 10000.0, logn: bool = False) -> None:
        super().__init__(num_heads, base=base, logn=logn, original_length=original_length)
        self.original_length = check_original_length(self.name, original_length)
        self.factor = check_factor(self.name, factor)
        self.short_factor = _factors("short_factor", short_factor)
        self.long_factor = _factors("long_factor", long_factor)
        f = longrope_attention_factor(self.factor, self.original_length) if attention_factor is None \
            else float(attention_factor)
        if not 0 < f < math.inf:
            raise SchemeError(f"rotary-longrope attention_factor must be > 0, got {attention_factor}; leave it out "
                              "for sqrt(1 + ln s / ln L_tr)")
        self.attn_factor, self.explicit_attention = f, attention_factor is not None
        self.head_dim = None if head_dim is None else int(head_dim)
        if self.head_dim is not None:
            self._sets(self.head_dim)  # list lengths checked now, before any training

    def _sets(self, d_head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(short, long) factors as float64 [d_head/2], or a one-line SchemeError naming the right length."""
        n = d_head // 2
        out = []
        for label, given, default in (("short_factor", self.short_factor, 1.0), ("long_factor", self.long_factor,
                                                                                 self.factor)):
            if given is not None and len(given) != n:
                raise SchemeError(f"rotary-longrope {label} has {len(given)} entries but the head size {d_head} has "
                                  f"{n} frequency pairs; give {n} numbers, --set model.scheme_params.{label}=[...]")
            out.append(torch.tensor(given, dtype=torch.float64) if given is not None
                       else torch.full((n,), default, dtype=torch.float64))
        return out[0], out[1]

    def is_long(self, length: int) -> bool:
        """Whether a call whose largest position is ``length`` - 1 takes the long set."""
        return int(length) > self.original_length

    def scale_key(self, length):
        return self.is_long(length)

    def inv_freq(self, d_head, length):
        short, long = self._sets(d_head)  # [d/2] each
        return default_inv_freq(self.base, d_head) / (long if self.is_long(length) else short)

    def attention_factor(self, length):
        return self.attn_factor

    def options(self):
        out = {"short_factor": None if self.short_factor is None else list(self.short_factor),
               "long_factor": None if self.long_factor is None else list(self.long_factor),
               "factor": self.factor, "original_length": self.original_length, "base": self.base}
        if self.explicit_attention:
            out["attention_factor"] = self.attn_factor
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        return {**out, **self.logn_options()}

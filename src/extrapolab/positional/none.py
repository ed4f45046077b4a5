"""NoPE: no positional information at all (thesis ch. 2; Sandwich paper §2.2)."""
from __future__ import annotations

from .base import PositionalScheme
from .registry import register


@register
class NoPE(PositionalScheme):
    name = "none"
    kind = "none"
    paper = "thesis ch.2 (NoPE: position from causal-attention variance, Lemma 2.3)"
    summary = "no positional encoding"

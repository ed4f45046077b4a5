"""rotary-streaming: StreamingLLM's attention pattern in one parallel forward (Xiao et al. 2024,
"Efficient Streaming Language Models with Attention Sinks", ICLR 2024, arXiv 2309.17453, §3.2 and
Figure 1(d); official code mit-han-lab/streaming-llm ``StartRecentKVCache`` and ``pos_shift``).

StreamingLLM decodes with a cache of the first k tokens (the attention sinks) and the newest w,
keys stored before rotation and rotated at their slots in the cache 0..k+w-1, the query at its own
(model/cache.py, E5's ``eval.sinks``). Written per query m this is a fixed pattern over the whole
input: keys at distance m - n < w keep their true distance (the window: the slots keep the order
and the spacing of the tokens), sinks n < k further back are seen from min(m, k + w - 1) (the
query's slot), and every other key is not seen. So a parallel forward with two passes (window,
plain RoPE; sinks, the query moved to min(m, k + w - 1)) gives, layer by layer, exactly the keys and
values the rolling cache holds: the cache's key of token j was computed when j itself was the query
of this pattern (tests/test_streaming.py: E5 with sinks == this scheme's E1, every layer). The
largest relative position is k + w - 1, so k + w <= L_tr keeps every position trained. Options:
``sinks`` k (default 4, the paper's), ``w`` (default L_tr - k: a cache of L_tr tokens),
``original_length`` L_tr, ``logn``, ``base``. In StreamingLLM's own terms k = ``start_size`` (a BOS
counted among them, as on a Hugging Face model whose windows start with one) and w = ``recent_size``
+ 1 (the window holds the query): docs/protocols.md, "StreamingLLM's settings in ours".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SchemeError
from .registry import register
from .rope_twopass import MultiPassRotary, Pass
from .rotary import check_original_length


@dataclass(frozen=True)
class SinkRule:
    """StreamingLLM's pattern (module doc): k sinks, a window of w keys; the other keys unseen."""

    sinks: int
    window: int
    method: str = "streaming"
    complete: bool = False  # keys neither sink nor in the window are masked

    def q_pos(self, m: torch.Tensor) -> torch.Tensor:
        return m.to(torch.float64).clamp(max=self.sinks + self.window - 1)  # the query's slot in the cache

    def passes(self) -> tuple[Pass, ...]:
        """The window (0 <= m - n < w, plain RoPE) and the sinks beyond it (n < k, q at its slot)."""
        return Pass(0, self.window), Pass(self.window, None, q_at=self.q_pos, keys=(0, self.sinks))

    def describe(self) -> dict:
        return {"method": self.method, "sinks": self.sinks, "w": self.window}


def check_sink_rule(sinks, window, train_length: int, label: str = "rotary-streaming") -> SinkRule:
    """A :class:`SinkRule` (``window`` None: L_tr - k), or a one-line SchemeError naming the fix."""
    try:
        k = int(sinks)
        w = int(train_length) - k if window is None else int(window)
        if float(sinks) != k or (window is not None and float(window) != w):
            raise ValueError
    except (TypeError, ValueError):
        raise SchemeError(f"{label} takes whole numbers of tokens: sinks k and window w; got k={sinks!r}, "
                          f"w={window!r}") from None
    L_tr = int(train_length)
    if k < 0 or w < 1 or k + w > L_tr:
        raise SchemeError(f"{label} needs k >= 0 sinks and a window w >= 1 with k + w <= L_tr = {L_tr} (the cache's "
                          f"largest relative position is k + w - 1), got k = {k}, w = {w}; e.g. k = 4, w = {L_tr - 4}")
    return SinkRule(k, w)


@register
class RotaryStreaming(MultiPassRotary):
    name = "rotary-streaming"
    paper = "Xiao et al. 2024 (StreamingLLM) §3.2: k attention sinks + a window of w, positions in the cache"
    summary = "RoPE over the last w keys and k sinks seen from the query's cache slot; other keys unseen"
    relative = False

    def __init__(self, num_heads: int, sinks: int = 4, w: int | None = None, original_length: int = 512,
                 logn: bool = False, base: float = 10000.0) -> None:
        original_length = check_original_length(self.name, original_length)
        rule = check_sink_rule(sinks, w, original_length, label=self.name)
        super().__init__(num_heads, rule, original_length, logn, base)

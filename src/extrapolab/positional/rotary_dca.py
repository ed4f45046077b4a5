"""rotary-dca: dual chunk attention (An et al. 2024, "Training-Free Long-Context Scaling of Large
Language Models", ICML 2024, arXiv 2402.17463, §3.1-3.3, eqs. 2, 5, 7, 8 and Figure 2; official
code HKUNLP/ChunkLlama ``chunkllama_attn_replace.py``, the same rule as vLLM's
``DualChunkRotaryEmbedding`` that Qwen2.5-1M ships).

The input is cut into chunks of s tokens and every key sits at n mod s (P_k, eq. 2). A query at m
with i = m mod s scores a key of

* its own chunk (intra-chunk, eqs. 2-4) at i: the relative position is m - n, plain RoPE;
* the previous chunk (successive-chunk, eq. 7) at P_succ(i) = s + i for the first w_p queries of a
  chunk, c - 1 after them: neighbours keep their true distance;
* any earlier chunk (inter-chunk, eq. 5) at c - 1,

so no relative position exceeds c - 1 at any length (eq. 8 selects the case by floor(m/s) -
floor(n/s) = 0, 1, > 1). Options as the reference code and the engines' configs name them
(ChunkLlama ``chunk_size`` / ``local_window``, vLLM / Qwen ``dual_chunk_attention_config``
``chunk_size`` / ``local_size``): ``chunk`` = C, the largest position a query takes (the paper's
c - 1), and ``w`` = the local window; the chunk length is s = C - w, and P_succ(i) = min(s + i, C),
which is eq. 7 with c = C + 1 and w_p = c - s (the paper's choice of w_p). The paper sets s to 3/4
of L_tr with c = L_tr (Llama 2: s = 3,072, so C = 4,095, w = 1,023); the code's defaults are
C = 3/4·L_tr and w = L_tr/8 (s = 5/8·L_tr), which are ours (w defaults to C/6 for any C). Three
passes merged before one softmax (:mod:`.rope_twopass`, attention's multi-pass path); the intra
pass is plain RoPE exactly (RoPE depends on m - n only).

Left out, as vLLM's ``DualChunkRotaryEmbedding`` (the implementation Qwen2.5-1M ships with) leaves it
out: ChunkLlama's Hugging Face patch (``chunkllama_attn_replace.py``, ``get_mscale``) multiplies the
cos and sin of q and k alike by 0.05·ln(L/L_tr) + 1 once the input holds L > L_tr keys (L_tr = the
config's ``max_position_embeddings``), so every logit by its square, a temperature the paper does not
state. It depends on the length of the whole input, not on the query's position, so a prefix of a
longer input would be scored differently from the prefix alone (no causal scoring, no KV cache equal
to the parallel forward); ``logn`` (q x max(1, log(m + 1)/log L_tr), per query) is the family's
temperature option, and joins DCA as ``dca:C+logn``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SchemeError
from .registry import register
from .rope_twopass import MultiPassRotary, Pass
from .rotary import check_original_length


@dataclass(frozen=True)
class ChunkRule:
    """DCA's positions (module doc): C = ``chunk`` the largest query position, w the local window."""

    chunk: int
    window: int
    method: str = "dca"

    @property
    def s(self) -> int:
        """The chunk length C - w."""
        return self.chunk - self.window

    def k_pos(self, n: torch.Tensor) -> torch.Tensor:
        return torch.remainder(n.to(torch.float64), self.s)  # P_k = n mod s

    def succ_q(self, m: torch.Tensor) -> torch.Tensor:
        return (torch.remainder(m.to(torch.float64), self.s) + self.s).clamp(max=self.chunk)  # min(s + i, C)

    def inter_q(self, m: torch.Tensor) -> torch.Tensor:
        return torch.full_like(m, self.chunk, dtype=torch.float64)  # C = c - 1

    def passes(self) -> tuple[Pass, ...]:
        """Intra (same chunk, plain RoPE), successive (one chunk back), inter (two or more back)."""
        s = self.s
        return (Pass(chunk=s, c_lo=0, c_hi=0),
                Pass(chunk=s, c_lo=1, c_hi=1, q_at=self.succ_q, k_at=self.k_pos),
                Pass(chunk=s, c_lo=2, c_hi=None, q_at=self.inter_q, k_at=self.k_pos))

    def describe(self) -> dict:
        return {"method": self.method, "chunk": self.chunk, "w": self.window}


def default_chunk(train_length: int) -> int:
    """C = 3/4·L_tr, as ChunkLlama's ``replace_with_chunkllama``."""
    return max(2, 3 * int(train_length) // 4)


def check_chunk_rule(chunk, window, train_length: int, label: str = "rotary-dca") -> ChunkRule:
    """A :class:`ChunkRule` with checked settings (``window`` None: C/6), or a one-line SchemeError."""
    try:
        C = int(chunk)
        w = C // 6 if window is None else int(window)
        if float(chunk) != C or (window is not None and float(window) != w):
            raise ValueError
    except (TypeError, ValueError):
        raise SchemeError(f"{label} takes whole numbers of tokens: chunk C and local window w; got C={chunk!r}, "
                          f"w={window!r}") from None
    L_tr = int(train_length)
    if not 2 <= C <= L_tr:
        raise SchemeError(f"{label} chunk C (the largest query position) must satisfy 2 <= C <= L_tr = {L_tr}, "
                          f"got {C}; e.g. C = {default_chunk(L_tr)} (3/4 of L_tr, as ChunkLlama)")
    if not 0 <= w < C - w:
        raise SchemeError(f"{label} local window w must satisfy 0 <= w < C - w (the chunk length), got w = {w} "
                          f"with C = {C}; e.g. w = {C // 6}")
    return ChunkRule(C, w)


@register
class RotaryDCA(MultiPassRotary):
    name = "rotary-dca"
    paper = "An et al. 2024 (DCA) §3, eqs. 2, 5, 7, 8: intra-, successive- and inter-chunk positions"
    summary = "RoPE inside a chunk of C - w tokens, chunk-remapped positions (never past C) across chunks"
    relative = False

    def __init__(self, num_heads: int, chunk: int | None = None, w: int | None = None, original_length: int = 512,
                 logn: bool = False, base: float = 10000.0) -> None:
        original_length = check_original_length(self.name, original_length)
        chunk = default_chunk(original_length) if chunk is None else chunk
        rule = check_chunk_rule(chunk, w, original_length, label=self.name)
        super().__init__(num_heads, rule, original_length, logn, base)

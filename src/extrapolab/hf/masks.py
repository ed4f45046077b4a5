"""The attention masks transformers builds, as the ``extrapolab`` attention function takes them (hf/extend.py).

transformers (``masking_utils``) builds each layer type's mask through the mask function registered for the
model's ``attn_implementation``, handing it the mask as an index function ``mask_function(b, h, q_idx,
kv_idx)``: causal; sliding-window (Mistral, Gemma 2 / 3, Cohere2, gpt-oss; ``local_size`` = the window: keys
at distance < w); chunked (Llama 4's ``chunked_attention`` layers; ``local_size`` = attention_chunk_size C:
query and key see each other only inside one chunk [cC, (c+1)C) of indices counted from the first token); or
another (image-token overlays, packed sequences, bidirectional attention: transformers then passes
``use_vmap=True`` or ``allow_is_causal_skip=False``). :func:`model_mask`, registered as ``extrapolab``, builds
no L x L tensor: it reads which of these the function is at the indices where they differ (around 0, s and
2s) and returns None for causal and sliding (the attention function is causal by position and takes the
window from the layer's ``sliding_window`` keyword), a :class:`ChunkMask` for chunked, and refuses any
other mask, and padding, in one line.

The attention function honours a :class:`ChunkMask` by attending chunk by chunk (:func:`chunk_spans`): the
rows of attention are independent, so each chunk's queries against that chunk's keys is exactly the chunked
mask, on every path and under every multi-pass method (whose positions stay the tokens' own). What reads a
layer's logits over every key up to the query (the temperature alignment's logits sink and per-layer
chooser) cannot honour chunks and is refused on a chunked layer (hf/extend.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io import UserError

USERS = "the extrapolab attention (--rope METHOD or logn, --protocol cached, block-wise alignment)"


@dataclass(frozen=True)
class ChunkMask:
    """Llama 4's chunked mask of one forward: chunks of ``size`` indices; query i has index ``q_offset`` + i,
    key j index ``kv_offset`` + j (the cache's, so chunks are counted from the first token it holds)."""

    size: int
    q_offset: int = 0
    kv_offset: int = 0


def chunk_spans(Lq: int, Lk: int, mask: ChunkMask) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) per chunk the queries touch: queries q0..q1-1 attend to keys k0..k1-1 (then causally)."""
    C, spans, i = int(mask.size), [], 0
    while i < Lq:
        c = (mask.q_offset + i) // C
        end = min(Lq, (c + 1) * C - mask.q_offset)
        spans.append((i, end, max(0, c * C - mask.kv_offset), max(0, min(Lk, (c + 1) * C - mask.kv_offset))))
        i = end
    return spans


def _kind(mask_function, local_size) -> str | None:
    """causal | sliding | chunked: which mask ``mask_function`` is, read at the indices where they differ; None
    for another."""
    s = int(local_size) if local_size else 4
    pts = torch.tensor(sorted({0, 1, s - 1, s, s + 1, 2 * s - 1, 2 * s, 2 * s + 1}))
    q, kv = (t.reshape(-1) for t in torch.meshgrid(pts, pts, indexing="ij"))  # every pair of probe indices
    zero = torch.zeros_like(q)
    try:
        got = torch.as_tensor(mask_function(zero, zero, q, kv)).to(torch.bool).expand(q.shape)
    except Exception:  # noqa: BLE001 - an index function that is not elementwise: another mask
        return None
    causal = kv <= q
    kinds = {"causal": causal} if not local_size else {"sliding": causal & (kv > q - s),
                                                       "chunked": causal & (kv // s == q // s)}
    return next((k for k, want in kinds.items() if torch.equal(got, want)), None)


def model_mask(*args, mask_function=None, attention_mask=None, local_size=None, allow_is_causal_skip=True,
               use_vmap=False, q_offset=0, kv_offset=0, config=None, **kwargs):
    """Mask function registered with ``ATTN`` (module doc): None, a :class:`ChunkMask`, or a one-line error."""
    from transformers.masking_utils import causal_mask_function

    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise UserError(f"padded batches are not supported by {USERS}; score sequences of equal length without "
                        "an attention_mask")
    kind = "causal" if mask_function is causal_mask_function and not use_vmap else None
    if kind is None and allow_is_causal_skip and not use_vmap:
        kind = _kind(mask_function, local_size)
    if kind is None:
        model = getattr(config, "model_type", "this")
        raise UserError(f"{USERS} takes causal, sliding-window and chunked attention masks; this {model} model "
                        "builds another (image tokens, packed or bidirectional sequences): run it without them")
    if kind == "chunked":
        return ChunkMask(int(local_size), int(q_offset), int(kv_offset))
    return None


def layer_chunks(attention_mask) -> ChunkMask | None:
    """The chunked mask a layer received (None: causal or sliding); a mask tensor (a 4-D mask passed by the
    caller, never built by :func:`model_mask`) is refused in one line."""
    if attention_mask is None or isinstance(attention_mask, ChunkMask):
        return attention_mask
    raise UserError(f"{USERS} builds its masks itself; call the model without a prepared "
                    f"{type(attention_mask).__name__} attention_mask")

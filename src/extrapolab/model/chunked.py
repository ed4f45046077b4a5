"""A layer's attention when its type restricts the keys (positional/layout.py): chunked attention by
query blocks per chunk, and how many keys the KV cache keeps per layer (docs/attention.md, "Layer types").

Chunked attention (Llama 4's RoPE layers; transformers' ``chunked_overlay``): a query at position m sees
the keys n <= m with floor(n / c) = floor(m / c). The mask depends on absolute positions, so it is no
distance table; but every chunk is an ordinary causal attention over its own keys. :func:`attend_layer`
therefore rotates q and k once at their positions and calls :func:`~.attention.attend` with the chunk's
own scheme (``Chunked.inner``) once per chunk: the run of whole chunks as one call with the chunks as
the batch (their positions differ, but after rotation the keys a chunk sees and their distances are
the same in every chunk), a partial chunk at either end (a KV cache, a block of queries) on its own.
Each call takes the inner scheme's path (causal SDPA for RoPE, Toeplitz for a distance table), so no
tensor larger than [B, H, c, c] per chunk exists. Where a call must see absolute positions (a
temperature per query, a bias that is not a distance table) or asks for probabilities or a logits
sink, the chunks run one call each at their own positions; positions that do not increase take the
dense mask of ``Chunked.bias`` on attend's fallback path. Every other layer is :func:`attend` itself; with
SSMax a sliding layer's window is also the call's ``AttnOptions.window`` (the same mask), so that SSMax's n
counts the keys the layer sees (``reference.keys_seen`` reads that option), with a KV cache or without.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..positional.layout import Chunked, SlidingWindow
from .attention import AttnOptions, attend
from .tables import is_toeplitz


def cache_keep(scheme) -> int | None:
    """Newest cached keys a later query of this layer can still see (a sliding layer's window - 1, a
    chunked layer's chunk - 1), or None for every key (``KVCache.extend``'s ``keep``)."""
    return getattr(scheme, "cache_keep", None)


def attend_layer(q, k, v, q_pos, k_pos, scheme, layer: int = 0, opts: AttnOptions | None = None, bias=None,
                 rotate: bool = True, *, content=None, **extras):
    """:func:`~.attention.attend` with the same arguments, chunk by chunk for a chunked layer (module doc);
    ``extras``: the layer's model options (``sinks``, ``ssmax``), per query, so per chunk alike."""
    s = scheme.for_layer(layer)
    if isinstance(s, SlidingWindow) and extras.get("ssmax") is not None:
        # SSMax's n counts the keys within AttnOptions.window (reference.keys_seen): the layer's window is the
        # call's too (the same mask), so n = min(m + 1, w) as the layer sees, in a KV cache and without one
        opts = opts or AttnOptions()
        opts = replace(opts, window=min(opts.window or s.window, s.window))
    if not isinstance(s, Chunked):
        return attend(q, k, v, q_pos, k_pos, scheme, layer, opts, bias, rotate, content=content, **extras)
    opts = opts or AttnOptions()
    if not (_increasing(q_pos) and _increasing(k_pos)):  # the dense chunk mask (fallback path)
        return attend(q, k, v, q_pos, k_pos, s, layer, opts, bias, rotate, **extras)
    inner, c = s.inner, s.chunk
    if rotate:
        q, k = inner.rotate(q, k, q_pos, k_pos)
    ids, counts = torch.unique_consecutive(torch.div(q_pos, c, rounding_mode="floor"), return_counts=True)
    ids, counts = ids.tolist(), counts.tolist()
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    per_chunk = opts.need_probs or opts.logits_sink is not None or not _same_in_every_chunk(inner, q_pos, layer)
    outs, probs, g = [], [], 0
    while g < len(ids):
        a, b = starts[g], starts[g + 1]
        lo = int(torch.searchsorted(k_pos, ids[g] * c))
        hi = int(torch.searchsorted(k_pos, q_pos[b - 1], right=True))  # keys of the chunk up to its last query
        run = 1
        if not per_chunk and b - a == c and hi - lo == c:  # whole chunks whose queries are their keys
            while g + run < len(ids) and counts[g + run] == c and ids[g + run] == ids[g] + run:
                run += 1
            if not (run > 1 and k_pos.shape[0] >= hi + (run - 1) * c and
                    int(k_pos[hi + (run - 1) * c - 1]) == int(q_pos[starts[g + run] - 1])):
                run = 1
        e, he = starts[g + run], hi + (run - 1) * c
        out, p = _call(q[:, :, a:e], k[:, :, lo:he], v[:, :, lo:he], q_pos[a:b], k_pos[lo:hi], inner, layer, opts,
                       bias, run, (a, e, lo, he), k.shape[2], extras)
        outs.append(out)
        if p is not None:
            probs.append((a, lo, p))
        g += run
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, H, Lq, D]
    if not opts.need_probs:
        return out, None
    full = q.new_zeros(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=probs[0][2].dtype)  # [B, H, Lq, Lk]
    for a, lo, p in probs:
        full[:, :, a:a + p.shape[2], lo:lo + p.shape[3]] = p
    return out, full


def _call(q, k, v, q_pos, k_pos, inner, layer, opts, bias, run, span, num_keys, extras):
    """One attend call over ``run`` chunks: q [B, H, run·n, D] as [B·run, H, n, D] when run > 1."""
    if isinstance(bias, torch.Tensor):  # a dense [H, Lq, Lk] bias: this block of it
        a, e, lo, he = span
        bias = bias[..., a:e, lo:he]
    if opts.logits_sink is not None:  # the sink's columns start at key 0: pad the keys before the chunk
        opts = AttnOptions(**{**opts.__dict__, "logits_sink": _padded(opts.logits_sink, span[2], num_keys)})
    if run == 1:
        return attend(q, k, v, q_pos, k_pos, inner, layer, opts, bias, rotate=False, **extras)
    B, H, _, D = q.shape
    fold = lambda x: x.unflatten(2, (run, -1)).transpose(1, 2).flatten(0, 1)  # noqa: E731 [B·run, H, c, D]
    out, _ = attend(fold(q), fold(k), fold(v), q_pos, k_pos, inner, layer, opts, bias, rotate=False, **extras)
    return out.unflatten(0, (B, run)).transpose(1, 2).flatten(2, 3), None  # [B, H, run·c, D]


def _padded(sink, lo: int, num_keys: int):
    def padded(layer, logits, _n):  # logits [B, H, rows, bk] over keys lo.. -> columns from key 0
        pad = logits.new_full((*logits.shape[:-1], lo), -math.inf)  # [B, H, rows, lo]
        sink(layer, torch.cat([pad, logits], dim=-1), num_keys)
    return padded


def _same_in_every_chunk(inner, q_pos, layer: int) -> bool:
    """Whether every chunk attends alike once rotated: no bias or a distance table, and a temperature
    (if any) that does not vary over query positions."""
    if not is_toeplitz(inner):
        return False
    t = inner.temperature(q_pos[:2], layer)
    return t is None or t.shape[-1] == 1


def _increasing(pos: torch.Tensor) -> bool:
    return pos.numel() < 2 or bool(torch.all(pos[1:] > pos[:-1]))


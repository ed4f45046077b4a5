"""The KV cache of causal decoding (docs/attention.md): rotated keys, values, their positions and,
for schemes with positions from content (FoX), those positions, per layer; with a window it keeps
the newest ``window`` tokens. ``GPT.forward(cache=...)`` and ``Block.forward`` extend it
(:meth:`KVCache.update`); cached decoding equals the parallel forward (tests/test_schemes_contract.py).

With ``sinks=k`` it is StreamingLLM's cache (Xiao et al. 2024, "Efficient Streaming Language Models
with Attention Sinks", ICLR 2024, arXiv 2309.17453, §3.2 and Figure 4; mit-han-lab/streaming-llm
``StartRecentKVCache`` and ``pos_shift``): the first k tokens (the attention sinks) and the newest
``window``, with keys stored BEFORE rotation; attention then places them at their positions in the
cache, 0..n-1, and the query at its own (the last ones). Caching rotated keys instead leaves every
key at the position it had when it was written, so once tokens between the sinks and the window
are evicted the distances are no longer those of the cache (transformers#35350, TGI#1105).
"""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer cache of rotated keys, values and their positions; ``window`` evicts the oldest.

    Storage is preallocated: without a window a buffer that doubles when full, with a window a
    "double ring" of 2·window slots where token t is written at t mod w and t mod w + w, so the
    last w tokens are always one contiguous, time-ordered slice. Appending a token costs O(1)
    copies and ``extend`` returns views, so per-token decoding cost stays flat beyond w.
    ``k[layer]``, ``v[layer]``, ``pos[layer]`` are the current [B, H, Lc, D] / [Lc] views; with a
    window they alias the ring, so copy them if they must outlive the next ``extend``. Under
    autograd (k or v requiring grad) ``extend`` concatenates instead, leaving saved tensors intact.
    Schemes with positions from content (FoX) pass ``content`` [B, H, L] too: ``content[layer]``
    [B, H, Lc] then holds the cached keys' positions, and ``last_content`` continues them. Attention may
    update ``content[layer]`` in place between calls (selective attention keeps each key's accumulated
    selection there): with a window the ring first copies the view it returned onto its other half.
    Keys may be wider than values (PoPE's 2·d-wide keys). A layer whose queries see only the newest keys (a
    sliding or chunked layer type) passes ``keep`` and stores a ring of keep + 1 tokens of its own, whatever
    ``window`` is (not with ``sinks``: StreamingLLM's cache keeps its sinks and window for every layer).
    """

    def __init__(self, layers: int, window: int | None = None, sinks: int | None = None) -> None:
        if window is not None and int(window) < 1:
            raise ValueError(f"KV-cache window must be >= 1, got {window}; pass window=None for no limit")
        if sinks is not None and (window is None or int(sinks) < 0):
            raise ValueError(f"attention sinks need a window and sinks >= 0, got sinks={sinks}, window={window}")
        self.window = None if window is None else int(window)
        self.sinks = None if sinks is None else int(sinks)
        self.k: list[torch.Tensor | None] = [None] * layers  # [B, H, Lc, D]
        self.v: list[torch.Tensor | None] = [None] * layers
        self.pos: list[torch.Tensor | None] = [None] * layers  # [Lc]
        self.content: list[torch.Tensor | None] = [None] * layers  # [B, H, Lc] positions from content
        self._buf: list[tuple | None] = [None] * layers  # (kbuf, vbuf, pbuf, cbuf | None) storage
        self._count = [0] * layers  # tokens written so far
        # one positions tensor for the layers whose cached positions are equal (module doc of _shared_pos)
        self._hist = [0] * layers  # per layer: the interned history of the calls that wrote its positions
        self._intern: dict = {}  # (history, call, window) -> history
        self._call, self._last_pos = 0, None  # this call's number, and its positions tensor
        self._views: dict = {}  # history -> the positions tensor returned for it

    def update(self, layer: int, scheme, q, k, v, pos, content=None, keep: int | None = None):
        """Add this call's q, k, v [B, H, L, D] at positions ``pos`` [L]; returns what attention takes,
        ``(q, k, v, q_pos, k_pos, rotated)``. Without sinks: q and k rotated at their absolute positions,
        the cached keys (rotated when written) and their positions. With sinks (module doc): q and the
        keys unrotated, at their positions in the cache (``rotated`` False: attention rotates them).
        ``keep``: see :meth:`extend` (without sinks only)."""
        if self.sinks is None:
            q, k = scheme.rotate(q, k, pos, pos)  # cache rotated keys at their absolute positions
            k, v, kpos = self.extend(layer, k, v, pos, content, keep)
            return q, k, v, pos, kpos, True
        if content is not None or scheme.kind == "absolute":
            raise ValueError(f"attention sinks re-place cached keys by position; scheme {scheme.name!r} takes "
                             "its positions from the input (an embedding or the content), so it cannot")
        k, v, _ = self._extend_sinks(layer, k, v, pos)  # [B, H, n, D] keys before rotation
        n, L = k.shape[2], q.shape[2]
        slots = torch.arange(n, device=k.device)  # [n] positions in the cache
        return q, k, v, slots[n - L:], slots, False

    def _extend_sinks(self, layer, k, v, pos):
        """Append k, v [B, H, L, D], then keep the first ``sinks`` tokens and the newest ``window``:
        returns (k, v, absolute positions) as attention sees them."""
        L, old = k.shape[2], self.k[layer]
        if old is not None:
            k = torch.cat([old, k], dim=2)  # [B, H, n, D]
            v = torch.cat([self.v[layer], v], dim=2)
            pos = torch.cat([self.pos[layer], pos])
        n, s, w = k.shape[2], self.sinks, self.window
        if n > s + w:
            if L > 1:  # the call's earlier queries would lose keys of their own window
                raise ValueError(f"a KV cache with sinks takes one token per call once it holds sinks + window = "
                                 f"{s + w} tokens; got {L} (prefill at most that many, then step)")
            keep = torch.cat([torch.arange(s, device=k.device), torch.arange(n - w, n, device=k.device)])  # [s + w]
            k, v, pos = k[:, :, keep], v[:, :, keep], pos[keep]
        self.k[layer], self.v[layer], self.pos[layer] = k, v, pos
        return k, v, pos

    def last_content(self, layer: int) -> torch.Tensor | None:
        """[B, H] position from content of the newest cached token of ``layer``, or None."""
        c = self.content[layer]
        return None if c is None or c.shape[-1] == 0 else c[..., -1]

    def _storage(self, layer, k, pos, need, content=None, v=None, ring=False):
        """The layer's (k, v, pos, content) buffers with room for ``need`` slots (allocated / grown here; a
        ``ring`` exactly ``need``); v's head size may differ from k's (PoPE caches 2·d-wide keys)."""
        buf, n = self._buf[layer], self._count[layer]
        Dv = k.shape[3] if v is None else v.shape[3]
        if buf is not None and (buf[0].shape[:2] != k.shape[:2] or buf[0].shape[3] != k.shape[3]
                                or buf[1].shape[3] != Dv
                                or buf[0].dtype != k.dtype or buf[0].device != k.device):
            raise ValueError("KV cache reused with another batch size, head layout, dtype or device; "
                             "make a new KVCache")
        if buf is not None and buf[0].shape[2] >= need:
            return buf
        B, H, _, D = k.shape
        cap = need if ring else max(need, 256, 2 * (buf[0].shape[2] if buf else 0))
        cb = None if content is None else content.new_empty(B, H, cap)  # [B, H, cap]
        new = (k.new_empty(B, H, cap, D), k.new_empty(B, H, cap, Dv), pos.new_empty(cap), cb)  # [B,H,cap,D|Dv]
        if buf is not None:  # grow by doubling, keeping what is stored
            new[0][:, :, :n], new[1][:, :, :n], new[2][:n] = buf[0][:, :, :n], buf[1][:, :, :n], buf[2][:n]
            if cb is not None and buf[3] is not None:
                cb[..., :n] = buf[3][..., :n]
        self._buf[layer] = new
        return new

    def extend(self, layer, k, v, pos, content=None, keep: int | None = None):
        """Append k, v [B, H, L, D] at positions pos [L] (and ``content`` [B, H, L], positions from
        content); return the keys attention sees now, (k, v, pos); ``self.content[layer]`` then holds
        their positions from content. With a window the result is the newest ``window`` of
        (cached + new) tokens, in time order.

        ``keep``: no later query of this layer sees more than its newest ``keep`` keys (a sliding layer's
        window - 1, a chunked layer's chunk - 1; model/chunked.py ``cache_keep``). The layer then stores at
        most keep + 1 tokens (the same ring), and the result is every new token with the newest ``keep``
        cached ones before it, which is all its queries can see; ``window`` applies where it is smaller.
        """
        L, n = k.shape[2], self._count[layer]
        w = self.window if keep is None or (self.window is not None and self.window <= keep + 1) else int(keep) + 1
        own = w is not None and w != self.window  # the layer's own bound: queries see keep old + all new
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or (content is not None and content.requires_grad)):
            return self._extend_functional(layer, k, v, pos, content, w if own else None)  # autograd's tensors intact
        if self._buf[layer] is None and self.k[layer] is not None:  # seed from a functional extend
            k0, v0, p0 = self.k[layer].detach(), self.v[layer].detach(), self.pos[layer]
            c0 = None if self.content[layer] is None else self.content[layer].detach()
            self.k[layer] = self.v[layer] = self.pos[layer] = self.content[layer] = None
            self.extend(layer, k0, v0, p0, c0, keep)
            n = self._count[layer]
        before = None
        if own and L > 1:  # the newest w - 1 cached tokens and all new ones (a copy: the ring is rewritten below)
            before = self._before(layer, k, v, pos, content, w - 1)
        if w is None:
            kb, vb, pb, cb = self._storage(layer, k, pos, n + L, content, v)
            kb[:, :, n:n + L], vb[:, :, n:n + L], pb[n:n + L] = k, v, pos
            if content is not None:
                cb[..., n:n + L] = content
            size, start = n + L, 0
        else:
            kb, vb, pb, cb = self._storage(layer, k, pos, 2 * w, content, v, ring=True)
            keep = min(L, w)  # only the newest w incoming tokens can survive
            B, H, _, D = kb.shape
            if cb is not None and 0 < n:  # content may have changed in place (selective attention's state):
                start = n % w if n > w else 0  # ... which reads slots start..start+size of the 2w ring
                seen = (start + torch.arange(min(n, w), device=cb.device))  # [size] ring slots read
                cb[..., (seen + w) % (2 * w)] = cb[..., seen]  # the other copy of each token: equal again
            k2, v2, p2 = kb.view(B, H, 2, w, D), vb.view(B, H, 2, w, -1), pb.view(2, w)  # two halves
            c2 = None if content is None else cb.view(B, H, 2, w)
            i0, s0 = 0, (n + L - keep) % w  # kept token i0 goes to ring slot s0 (of both halves)
            while i0 < keep:  # at most two contiguous segments
                seg = min(keep - i0, w - s0)
                a0 = L - keep + i0
                k2[:, :, :, s0:s0 + seg] = k[:, :, None, a0:a0 + seg]  # [B, H, 2, seg, D]
                v2[:, :, :, s0:s0 + seg] = v[:, :, None, a0:a0 + seg]
                p2[:, s0:s0 + seg] = pos[None, a0:a0 + seg]
                if c2 is not None:
                    c2[:, :, :, s0:s0 + seg] = content[:, :, None, a0:a0 + seg]  # [B, H, 2, seg]
                i0, s0 = i0 + seg, 0
            size, start = min(n + L, w), ((n + L) % w if n + L > w else 0)
        self._count[layer] = n + L
        out = kb[:, :, start:start + size], vb[:, :, start:start + size], pb[start:start + size]
        self.k[layer], self.v[layer], self.pos[layer] = out
        self.content[layer] = None if content is None else cb[..., start:start + size]
        shared = self._shared_pos(layer, pos, w, out[2])
        if before is not None:  # (the ring above still holds the layer's own history)
            if content is not None:
                self.content[layer] = before[3]
            return before[:3]
        return out[0], out[1], shared

    def _shared_pos(self, layer: int, pos: torch.Tensor, w, view: torch.Tensor) -> torch.Tensor:
        """The positions ``view`` [Lc], or the equal tensor an earlier layer got in this call. Every layer's
        positions are the positions of the calls it stored, kept as ``w`` keeps them: layers with the same history
        hold equal positions, so they share one tensor and attention reads its start back once per forward
        (DistanceBias.starts is memoised per tensor), not once per layer (three host syncs per layer per decoded
        token on a GPU before). Each layer keeps its own view in ``pos[layer]``; the shared one is only returned."""
        if pos is not self._last_pos:  # a new call (the layers of one call get the same positions tensor)
            self._call, self._last_pos = self._call + 1, pos
        key = (self._hist[layer], self._call, w)
        hist = self._hist[layer] = self._intern.setdefault(key, len(self._intern) + 1)
        hit = self._views.get(hist)
        if hit is None:
            if len(self._views) >= 16:  # older calls' tensors
                self._views.pop(next(iter(self._views)))
            hit = self._views[hist] = view
        return hit

    def _before(self, layer, k, v, pos, content, old: int):
        """(k, v, pos, content) of the newest ``old`` cached tokens followed by the new ones (cat: copies)."""
        have = 0 if self.k[layer] is None else min(old, self.k[layer].shape[2])
        if have == 0:
            return k, v, pos, content
        ck = None if content is None else torch.cat([self.content[layer][..., -have:], content], dim=-1)
        return (torch.cat([self.k[layer][:, :, -have:], k], dim=2), torch.cat([self.v[layer][:, :, -have:], v], dim=2),
                torch.cat([self.pos[layer][-have:], pos]), ck)  # [B, H, have + L, D], ..., [have + L]

    def _extend_functional(self, layer, k, v, pos, content=None, own: int | None = None):
        if own is not None:  # the layer's own bound: see keep old + all new, store the newest w = keep + 1
            k, v, pos, content = self._before(layer, k, v, pos, content, own - 1)
            self._buf[layer], self._count[layer] = None, 0
            self.k[layer], self.v[layer], self.pos[layer] = k[:, :, -own:], v[:, :, -own:], pos[-own:]
            self.content[layer] = None if content is None else content[..., -own:]
            return k, v, pos
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)  # [B, H, Lc+L, D]
            v = torch.cat([self.v[layer], v], dim=2)
            pos = torch.cat([self.pos[layer], pos])
            if content is not None:
                content = torch.cat([self.content[layer], content], dim=-1)  # [B, H, Lc+L]
        if self.window is not None and k.shape[2] > self.window:
            k, v, pos = k[:, :, -self.window:], v[:, :, -self.window:], pos[-self.window:]
            content = None if content is None else content[..., -self.window:]
        self._buf[layer], self._count[layer] = None, 0  # buffers restart from these tensors
        self.k[layer], self.v[layer], self.pos[layer], self.content[layer] = k, v, pos, content
        return k, v, pos

"""GPT-style causal LM: pre-LN decoder, weight tying, any positional scheme (docs/architecture.md).

Positions are explicit inputs; the model has no maximum length except learned APE, whose
``check_length`` refuses longer inputs with a one-line error. One scheme instance is shared by
every layer (T5/KERPLE parameters are per head, shared across layers, as in HF T5 and the
official KERPLE code). A relative bias is computed once per forward as an O(H·L) distance table
(:class:`~.tables.DistanceBias`) shared by every layer; other biases as one [H, L, L] tensor when
it fits the memory budget. Attention itself is :func:`~.attention.attend` (docs/attention.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import positional
from ..positional.base import PositionalScheme
from .attention import AttnOptions, attend
from .tables import DistanceBias, is_toeplitz


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    layers: int = 4
    heads: int = 4
    dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    scheme: str = "alibi"
    scheme_params: dict = field(default_factory=dict)
    train_length: int = 128  # L_tr: the learned-APE table size
    tie_weights: bool = True
    init_std: float = 0.02
    #: token embeddings (GPT-2 init, std init_std) are multiplied by this on input; 0 = sqrt(dim)
    #: with init std dim^-0.5 (Vaswani et al. §3.4 / fairseq convention)
    embed_scale: float = 1.0
    #: "gpt" (this file) or "regulargpt": RegularGPT as an LM (model/regular_lm.py, Chi 2024 thesis
    #: §6.2, §6.5): eq. 6.1 sliding-dilated attention, ceil(log_C T) levels of K shared sub-layers;
    #: ``layers`` and ``scheme`` do not apply to it (its scheme is sliding-dilated with C, K)
    arch: str = "gpt"
    C: int = 8  # RegularGPT chunk size (eq. 6.1), >= 2
    K: int = 1  # RegularGPT thickness: sub-layers per level, shared across levels (§6.2.2)
    #: RegularGPT readout: "position" (position m after its own ceil(log_C (m+1)) levels; causal,
    #: a prefix gives the same outputs) or "sequence" (every position after ceil(log_C T) levels of
    #: the whole input, as the thesis' nanoGPT model; training then sees one depth only)
    depth: str = "position"

    def to_dict(self) -> dict:
        return asdict(self)


def model_fields(cfg: ModelConfig) -> dict:
    """The model sizes a scheme may take as options (its constructor names them): width ``dim``,
    depth ``layers``, ``head_dim``, the weights' ``init_std``."""
    return {"dim": cfg.dim, "layers": cfg.layers, "head_dim": cfg.dim // cfg.heads, "init_std": cfg.init_std}


def build_scheme(cfg: ModelConfig) -> PositionalScheme:
    if cfg.arch == "regulargpt":  # its attention is eq. 6.1 itself (C, K from the model config)
        return positional.build("sliding-dilated", num_heads=cfg.heads, C=cfg.C, K=cfg.K)
    params = dict(cfg.scheme_params or {})
    if cfg.scheme == "learned":
        params.setdefault("max_length", cfg.train_length)
        params.setdefault("dim", cfg.dim)
        params.setdefault("std", cfg.init_std if cfg.embed_scale else cfg.dim ** -0.5)  # as the tokens
    accepted = positional.scheme_params(positional.REGISTRY.get(cfg.scheme, PositionalScheme))
    if "original_length" in accepted:
        params.setdefault("original_length", cfg.train_length)  # RoPE extensions: L_tr is the trained length
    for key, value in model_fields(cfg).items():  # schemes with per-layer parameters (FoX, CoPE, hybrids)
        if key in accepted:
            params.setdefault(key, value)
    if cfg.scheme == "sinusoidal":  # same rms as the token embeddings and a learned APE at init
        params.setdefault("scale", math.sqrt(2) * cfg.init_std if cfg.embed_scale else 1.0)
    return positional.build(cfg.scheme, num_heads=cfg.heads, **params)


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
    [B, H, Lc] then holds the cached keys' positions, and ``last_content`` continues them.
    """

    def __init__(self, layers: int, window: int | None = None) -> None:
        if window is not None and int(window) < 1:
            raise ValueError(f"KV-cache window must be >= 1, got {window}; pass window=None for no limit")
        self.window = None if window is None else int(window)
        self.k: list[torch.Tensor | None] = [None] * layers  # [B, H, Lc, D]
        self.v: list[torch.Tensor | None] = [None] * layers
        self.pos: list[torch.Tensor | None] = [None] * layers  # [Lc]
        self.content: list[torch.Tensor | None] = [None] * layers  # [B, H, Lc] positions from content
        self._buf: list[tuple | None] = [None] * layers  # (kbuf, vbuf, pbuf, cbuf | None) storage
        self._count = [0] * layers  # tokens written so far

    def last_content(self, layer: int) -> torch.Tensor | None:
        """[B, H] position from content of the newest cached token of ``layer``, or None."""
        c = self.content[layer]
        return None if c is None or c.shape[-1] == 0 else c[..., -1]

    def _storage(self, layer, k, pos, need, content=None):
        """The layer's (k, v, pos, content) buffers with room for ``need`` slots (allocated / grown here)."""
        buf, n = self._buf[layer], self._count[layer]
        if buf is not None and (buf[0].shape[:2] != k.shape[:2] or buf[0].shape[3] != k.shape[3]
                                or buf[0].dtype != k.dtype or buf[0].device != k.device):
            raise ValueError("KV cache reused with another batch size, head layout, dtype or device; "
                             "make a new KVCache")
        if buf is not None and buf[0].shape[2] >= need:
            return buf
        B, H, _, D = k.shape
        cap = need if self.window is not None else max(need, 256, 2 * (buf[0].shape[2] if buf else 0))
        cb = None if content is None else content.new_empty(B, H, cap)  # [B, H, cap]
        new = (k.new_empty(B, H, cap, D), k.new_empty(B, H, cap, D), pos.new_empty(cap), cb)  # [B,H,cap,D]
        if buf is not None:  # grow by doubling, keeping what is stored
            new[0][:, :, :n], new[1][:, :, :n], new[2][:n] = buf[0][:, :, :n], buf[1][:, :, :n], buf[2][:n]
            if cb is not None and buf[3] is not None:
                cb[..., :n] = buf[3][..., :n]
        self._buf[layer] = new
        return new

    def extend(self, layer, k, v, pos, content=None):
        """Append k, v [B, H, L, D] at positions pos [L] (and ``content`` [B, H, L], positions from
        content); return the keys attention sees now, (k, v, pos); ``self.content[layer]`` then holds
        their positions from content. With a window the result is the newest ``window`` of
        (cached + new) tokens, in time order.
        """
        L, n, w = k.shape[2], self._count[layer], self.window
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or (content is not None and content.requires_grad)):
            return self._extend_functional(layer, k, v, pos, content)  # keep autograd's saved tensors intact
        if self._buf[layer] is None and self.k[layer] is not None:  # seed from a functional extend
            k0, v0, p0 = self.k[layer].detach(), self.v[layer].detach(), self.pos[layer]
            c0 = None if self.content[layer] is None else self.content[layer].detach()
            self.k[layer] = self.v[layer] = self.pos[layer] = self.content[layer] = None
            self.extend(layer, k0, v0, p0, c0)
            n = self._count[layer]
        if w is None:
            kb, vb, pb, cb = self._storage(layer, k, pos, n + L, content)
            kb[:, :, n:n + L], vb[:, :, n:n + L], pb[n:n + L] = k, v, pos
            if content is not None:
                cb[..., n:n + L] = content
            size, start = n + L, 0
        else:
            kb, vb, pb, cb = self._storage(layer, k, pos, 2 * w, content)
            keep = min(L, w)  # only the newest w incoming tokens can survive
            B, H, _, D = kb.shape
            k2, v2, p2 = kb.view(B, H, 2, w, D), vb.view(B, H, 2, w, D), pb.view(2, w)  # two halves
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
        return out

    def _extend_functional(self, layer, k, v, pos, content=None):
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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(), nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, pos, scheme, opts, bias=None, cache: KVCache | None = None):
        B, L, C = x.shape
        scheme = scheme.for_layer(self.index)  # per-layer hybrids: this layer's scheme, here and in attend
        h = self.ln1(x)  # [B, L, C] the attention input
        qkv = self.qkv(h).view(B, L, 3, self.heads, C // self.heads)  # [B, L, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        p = None  # positions from content (FoX), continued from the cache's last key
        if scheme.has_content:
            p = scheme.content_positions(h, self.index, None if cache is None else cache.last_content(self.index))
        if cache is None:
            out, probs = attend(q, k, v, pos, pos, scheme, self.index, opts, bias,
                                content=None if p is None else (p, p))
        else:
            q, k = scheme.rotate(q, k, pos, pos)  # cache rotated keys at their absolute positions
            k, v, kpos = cache.extend(self.index, k, v, pos, p)
            out, probs = attend(q, k, v, pos, kpos, scheme, self.index, opts, bias, rotate=False,
                                content=None if p is None else (p, cache.content[self.index]))
        y = self.proj(out.transpose(1, 2).reshape(B, L, C))  # [B, L, C]
        x = x + self.drop(y)
        x = x + self.drop(self.mlp(self.ln2(x)))
        return x, probs


class GPT(nn.Module):
    block_cls = Block  # subclasses (model/regular_lm.py) choose their block

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"model.dim={cfg.dim} must be divisible by model.heads={cfg.heads}")
        self.cfg = cfg
        self.scheme = build_scheme(cfg)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(self.block_cls(cfg, i) for i in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2 scaled init of residual projections
            nn.init.normal_(b.proj.weight, std=cfg.init_std / math.sqrt(2 * cfg.layers))
        if cfg.tie_weights:
            self.head.weight = self.tok.weight
        self.attn_opts = AttnOptions()

    def _init(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            # fairseq transformer_lm (the ALiBi codebase): std dim^-0.5, times sqrt(dim) on input,
            # so token embeddings have unit scale like the sinusoidal APE they are added to
            std = self.cfg.dim ** -0.5 if not self.cfg.embed_scale else self.cfg.init_std
            nn.init.normal_(m.weight, std=std)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embedding plus the scheme's absolute embedding: [B, L] -> [B, L, C]."""
        scale = self.cfg.embed_scale or math.sqrt(self.cfg.dim)
        x = self.tok(idx) if scale == 1.0 else self.tok(idx) * scale  # [B, L, C]
        pe = self.scheme.embed(positions, self.cfg.dim)
        return x if pe is None else x + pe.to(x.dtype)[None]

    def forward(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        opts: AttnOptions | None = None,
        cache: KVCache | None = None,
        return_probs: bool = False,
        return_hidden: bool = False,
    ):
        """idx [B, L] -> logits [B, L, V] (and per-layer probs / final hidden if asked)."""
        L = idx.shape[1] if inputs_embeds is None else inputs_embeds.shape[1]
        dev = idx.device if inputs_embeds is None else inputs_embeds.device
        if positions is None:
            positions = torch.arange(L, device=dev)
        self.scheme.check_length(int(positions.max()) + 1 if positions.numel() else 0)
        opts = opts or self.attn_opts
        self.check_opts(opts)
        if return_probs:
            opts = AttnOptions(**{**opts.__dict__, "need_probs": True})
        x = self.embed(idx, positions) if inputs_embeds is None else inputs_embeds
        x = self.drop(x)
        bias = self.shared_bias(positions, opts, cache is not None)  # shared by every layer's attend()
        all_probs = []
        for blk in self.blocks:
            x, p = blk(x, positions, self.scheme, opts, bias, cache)
            all_probs.append(p)
        h = self.ln_f(x)
        logits = self.head(h)  # [B, L, V]
        if not (return_probs or return_hidden):
            return logits
        out = {"logits": logits}
        if return_probs:
            out["probs"] = all_probs
        if return_hidden:
            out["hidden"] = h
        return out

    def shared_bias(self, positions: torch.Tensor, opts: AttnOptions, cached: bool = False):
        """What one forward shares across its layers' ``attend``: one [H, L, L] bias for a bias that
        is neither a distance table nor of the ALiBi form (when it fits the memory budget), else a
        :class:`DistanceBias` (O(H·L) tables, position checks; per sub-scheme for hybrids)."""
        s, L = self.scheme, positions.numel()
        if not cached and s.has_bias and not s.layer_dependent and not is_toeplitz(s, allow_weight=True) \
                and s.alibi_slopes(0) is None and not s.reference_only \
                and opts.impl in ("sdpa", "auto") and not self._too_big(L, opts):
            return s.bias(positions, positions, 0)  # [H, L, L] once for all layers
        tdt = torch.float64 if self.tok.weight.dtype == torch.float64 else torch.float32
        return DistanceBias(s, positions.device, tdt)

    def check_opts(self, opts: AttnOptions) -> None:
        """A one-line UserError unless ``opts`` fit this model: a per-layer temperature has one tau
        per block (evaluation calls it once up front, so a bad list fails before any length runs)."""
        opts.check_layers(len(self.blocks))

    def _too_big(self, L: int, opts: AttnOptions) -> bool:
        return opts.impl == "auto" and self.cfg.heads * L * L * 4 / 2**20 > opts.memory_budget_mb \
            and L > opts.block_size

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, positions=None) -> torch.Tensor:
        logits = self(idx, positions)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def constrain_(self) -> None:
        """Re-project constrained positional parameters (call after each optimizer step)."""
        self.scheme.constrain_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

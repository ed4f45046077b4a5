"""GPT-style causal LM: pre-LN decoder, weight tying, any positional scheme (docs/architecture.md).

Positions are explicit inputs; the model has no maximum length except learned APE, whose
``check_length`` refuses longer inputs with a one-line error. One scheme instance is shared by
every layer (T5/KERPLE parameters are per head, shared across layers, as in HF T5 and the
official KERPLE code); with layer types (``layer_types``, ``types``, ``layout``) it is a
:class:`~..positional.layout.Layout`, one scheme per type, and each block attends with its type's
(``for_layer``; a chunked type chunk by chunk, :mod:`.chunked`). A relative bias is computed once per
forward as an O(H·L) distance table (:class:`~.tables.DistanceBias`) shared by every layer; other biases
as one [H, L, L] tensor when it fits the memory budget. Attention itself is :func:`~.attention.attend`
(docs/attention.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import positional
from ..positional.base import PositionalScheme
from ..positional.layout import LayerType
from ..positional.positions import arange_positions, top
from .attention import AttnOptions
from .attn_extras import AttnExtras
from .cache import KVCache  # (also importable from here, as before the split)
from .chunked import attend_layer, cache_keep
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
    #: attention options any scheme combines with (model/attn_extras.py, docs/attention.md "Model options"):
    #: a learned sink logit per layer and head in the softmax denominator (gpt-oss)
    sinks: bool = False
    #: SSMax (Nakanishi 2025): logits times s_h·log n (n = keys seen), s learned per layer and head
    ssmax: bool = False
    #: QK-norm: q and k RMS-normalised with learned scales, before the scheme rotates them: "head" (per head, as
    #: Qwen3 / Gemma 3; true means head), "all" (over all heads jointly, as OLMo 2), false = off
    qk_norm: bool | str = False
    #: the QK-norm's eps (1e-6 as Qwen3; Llama 4 and OLMo 2's transformers configs default to 1e-5)
    qk_norm_eps: float = 1e-6
    #: output gate (Qiu et al. 2025): the attention output times σ(x W) per head and dimension
    gate: bool = False
    #: layer types (docs/attention.md, "Layer types"): one type name per layer, or a pattern repeated
    #: over the layers (its length dividing ``layers``); [] = ``scheme`` in every layer
    layer_types: list[str] = field(default_factory=list)
    #: each type's scheme, options and window or chunk: {name: LayerType}; "full" needs no entry (``scheme``)
    types: dict[str, LayerType] = field(default_factory=dict)
    #: a published layout at these sizes (positional/layouts.py: gemma3, rnope-swa, irope, smollm3);
    #: ``layer_types`` / ``types`` given as well replace its own
    layout: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def model_fields(cfg: ModelConfig) -> dict:
    """The model sizes a scheme may take as options (its constructor names them): width ``dim``,
    depth ``layers``, ``head_dim``, the weights' ``init_std``."""
    return {"dim": cfg.dim, "layers": cfg.layers, "head_dim": cfg.dim // cfg.heads, "init_std": cfg.init_std}


def build_scheme(cfg: ModelConfig) -> PositionalScheme:
    if cfg.arch == "regulargpt":  # its attention is eq. 6.1 itself (C, K from the model config)
        return positional.build("sliding-dilated", num_heads=cfg.heads, C=cfg.C, K=cfg.K)
    if cfg.layer_types or cfg.types or cfg.layout:
        return build_layout(cfg)
    params = scheme_defaults(cfg, cfg.scheme, dict(cfg.scheme_params or {}))
    return positional.build(cfg.scheme, num_heads=cfg.heads, **params)


def scheme_defaults(cfg: ModelConfig, name: str, params: dict) -> dict:
    """``params`` of scheme ``name`` with the model's sizes and L_tr where it takes them and they are unset."""
    if name == "learned":
        params.setdefault("max_length", cfg.train_length)
        params.setdefault("dim", cfg.dim)
        params.setdefault("std", cfg.init_std if cfg.embed_scale else cfg.dim ** -0.5)  # as the tokens
    accepted = positional.scheme_params(positional.REGISTRY.get(name, PositionalScheme))
    if "original_length" in accepted:
        params.setdefault("original_length", cfg.train_length)  # RoPE extensions: L_tr is the trained length
    for key, value in model_fields(cfg).items():  # schemes with per-layer parameters (FoX, CoPE, hybrids)
        if key in accepted:
            params.setdefault(key, value)
    if name == "sinusoidal":  # same rms as the token embeddings and a learned APE at init
        params.setdefault("scale", math.sqrt(2) * cfg.init_std if cfg.embed_scale else 1.0)
    return params


def build_layout(cfg: ModelConfig) -> PositionalScheme:
    """The :class:`~..positional.layout.Layout` of ``model.layout`` / ``layer_types`` / ``types``: a
    published layout's types, updated field by field by the config's own (a scheme given replaces the
    layout's scheme and its options), over ``model.scheme`` for a type naming none."""
    from ..positional.layout import Layout, as_layer_type, expand_types
    from ..positional.layouts import published

    kinds, types = published(cfg.layout, cfg.layers, cfg.train_length) if cfg.layout else ([], {})
    for name, spec in (cfg.types or {}).items():  # the fields set here replace the layout's own
        spec, base = as_layer_type(spec, f"model.types.{name}"), types.get(name)
        types[name] = spec if base is None else LayerType(
            spec.scheme or base.scheme, {**(base.scheme_params if not spec.scheme else {}), **spec.scheme_params},
            spec.window or base.window, spec.chunk or base.chunk)
    kinds = expand_types(cfg.layer_types, cfg.layers) if cfg.layer_types else kinds or ["full"] * cfg.layers
    sizes = {**model_fields(cfg), "original_length": cfg.train_length}
    return Layout(cfg.heads, kinds, types, default=(cfg.scheme, dict(cfg.scheme_params or {})), sizes=sizes,
                  context=cfg.train_length)


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
        self.extras = AttnExtras(heads=cfg.heads, head_dim=cfg.dim // cfg.heads, dim=cfg.dim,
                                 train_length=cfg.train_length, sinks=cfg.sinks, ssmax=cfg.ssmax,
                                 qk_norm=cfg.qk_norm, gate=cfg.gate, qk_eps=cfg.qk_norm_eps)

    def forward(self, x, pos, scheme, opts, bias=None, cache: KVCache | None = None):
        B, L, C = x.shape
        scheme = scheme.for_layer(self.index)  # per-layer hybrids: this layer's scheme, here and in attend
        h = self.ln1(x)  # [B, L, C] the attention input
        qkv = self.qkv(h).view(B, L, 3, self.heads, C // self.heads)  # [B, L, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        q, k = self.extras.normalize(q, k)  # QK-norm (model.qk_norm), before the rotation
        ex = self.extras.attend_kwargs()  # sinks, SSMax (model.sinks, model.ssmax)
        p = None  # positions from content (FoX), continued from the cache's last key
        if scheme.has_content:
            p = scheme.content_positions(h, self.index, None if cache is None else cache.last_content(self.index))
        if cache is None:
            out, probs = attend_layer(q, k, v, pos, pos, scheme, self.index, opts, bias,
                                      content=None if p is None else (p, p), **ex)
        else:  # the cache says where its keys sit and whether it rotated them (sink tokens: not yet); a
            # sliding or chunked layer keeps only the keys it can see again (cache_keep)
            q, k, v, qpos, kpos, rotated = cache.update(self.index, scheme, q, k, v, pos, p, keep=cache_keep(scheme))
            out, probs = attend_layer(q, k, v, qpos, kpos, scheme, self.index, opts, bias, rotate=not rotated,
                                      content=None if p is None else (p, cache.content[self.index]), **ex)
        y = self.proj(self.extras.gated(out.transpose(1, 2).reshape(B, L, C), h))  # [B, L, C]; gate: model.gate
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
            positions = arange_positions(0, L, dev)  # [L], its layout known on the host (no device reads)
        self.scheme.check_length(top(positions))
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
        is neither a distance table (not even up to a position: FIRE) nor of the ALiBi form (when it fits
        the memory budget), else a
        :class:`DistanceBias` (O(H·L) tables, position checks; per sub-scheme for hybrids)."""
        s, L = self.scheme, positions.numel()
        if not cached and s.has_bias and not s.layer_dependent and not is_toeplitz(s, allow_weight=True) \
                and s.alibi_slopes(0) is None and not s.reference_only and s.toeplitz_rows() is None \
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

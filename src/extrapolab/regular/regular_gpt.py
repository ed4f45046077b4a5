"""RegularGPT (Chi 2024 thesis ch. 6, §6.2): sliding-dilated attention (eq. 6.1, the sliding-dilated scheme),
adaptive depth ceil(log_C T) and weight sharing with thickness K.

Efficient path (``forward``), the one used for training and evaluation: the model only ever
reads the last position, and under eq. 6.1 the last token at level l needs only the positions
T-1 - j·C^l, j < C, each of which recursively needs C positions one level down. So each level
is a chunking: left-pad the current sequence to a multiple of C with a learned pad vector,
cut it into non-overlapping chunks of C (thesis §6.2.1, footnote 1), run the K shared layers
inside each chunk and keep the chunk's last element. Level l costs O(n_l·C) with n_l = T/C^l,
the whole model O(T·C·K) instead of O(T²·K·log T).

``pad="once"`` instead left-pads the input once to C^L (L = levels) with the pad vector; then the
efficient path equals the dense eq. 6.1 computation over the full sequence (``forward_full``,
built on ``model.attention.attend`` with the sliding-dilated scheme), which the tests check. ``pad="level"``
(default) pads every level with the learned vector, like the authors' reference code (a learned pad
vector extrapolated; masking the pad slots instead did not); both paths agree when T = C^L.

``forward_prefixes`` runs the *sliding* form of eq. 6.1 (every row of the mask, Fig. 6.1) in
one O(T·C·log T) pass and returns the logits of every prefix, each equal to ``forward`` on that
prefix (own depth, same pads); ``supervision="prefix"`` trains on them.

With K > 1 the chunks are non-overlapping (thesis §6.2.1 text); eq. 6.1's *sliding* mask would
let lower sublayers read across chunk borders, so ``forward_full`` matches only for K = 1.
Design defaults follow the authors' reference code structure: post-LN, ReLU FFN, embeddings × sqrt(D), no
other positional information.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import positional
from ..io import UserError
from ..model.attention import AttnOptions, attend
from ..positional.sliding_dilated import num_levels  # noqa: F401 (re-exported: regular.num_levels)


@dataclass
class RegularGPTConfig:
    vocab_size: int = 2
    num_classes: int = 2
    dim: int = 64
    heads: int = 8
    C: int = 2
    K: int = 1
    mlp_ratio: int = 4
    pad: str = "level"  # "level" | "once"
    norm: str = "post"  # "post" | "pre"
    emb_init: float = 0.02

    def to_dict(self) -> dict:
        return asdict(self)


class SharedLayer(nn.Module):
    """One transformer layer (attention + ReLU FFN), post-LN by default."""

    def __init__(self, cfg: RegularGPTConfig, index: int) -> None:
        super().__init__()
        self.index, self.heads, self.norm = index, cfg.heads, cfg.norm
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.ReLU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))

    def forward(self, x, q_pos, k_pos, scheme, layer: int, bias=None, last_only: bool = False):
        """x [N, L, D] -> [N, L, D] (or [N, 1, D] with ``last_only``); positions [L] in tokens.

        ``bias`` [H, L, L] given: the chunk path (``chunk_attention``, O(L) per query, L = C);
        ``bias=None``: dense attention through ``model.attention.attend`` with the sliding-dilated scheme.
        """
        N, L, D = x.shape
        h = self.ln1(x) if self.norm == "pre" else x
        if bias is None:
            qkv = self.qkv(h).view(N, L, 3, self.heads, D // self.heads)  # [N, L, 3, H, Dh]
            q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [N, H, L, Dh]
            out, _ = attend(q, k, v, q_pos, k_pos, scheme, layer, AttnOptions(impl="sdpa"))
            out = out.transpose(1, 2)  # [N, L, H, Dh]
        else:
            lq = 1 if last_only else L
            w, b = self.qkv.weight, self.qkv.bias  # [3D, D], [3D]
            q = F.linear(h[:, L - lq:], w[:D], b[:D]).view(N, lq, self.heads, -1)  # [N, Lq, H, Dh]
            kv = F.linear(h, w[D:], b[D:]).view(N, L, 2, self.heads, -1)  # [N, L, 2, H, Dh]
            out = chunk_attention(q, kv[:, :, 0], kv[:, :, 1], bias[:, L - lq:])  # [N, Lq, H, Dh]
            x = x[:, L - lq:]
        return self._finish(x, out)

    def forward_sliding(self, x: torch.Tensor, pad: torch.Tensor, shift: int, bias: torch.Tensor):
        """Eq. 6.1 at every position: query i attends keys i - j·shift (j < C), the pad vector
        standing in where i - j·shift < 0 (as the chunk path's left pad does); O(T·C).

        x [N, T, D], pad [D], bias [H, C] (for j = 0..C-1) -> [N, T, D].
        """
        N, T, D = x.shape
        C = bias.shape[1]
        h = torch.cat([pad.expand(N, 1, D), x], dim=1)  # [N, 1 + T, D]: slot 0 is the pad
        if self.norm == "pre":
            h = self.ln1(h)
        w, b = self.qkv.weight, self.qkv.bias  # [3D, D], [3D]
        q = F.linear(h[:, 1:], w[:D], b[:D]).view(N, T, self.heads, -1)  # [N, T, H, Dh]
        kv = F.linear(h, w[D:], b[D:]).view(N, T + 1, 2, self.heads, -1)  # [N, 1+T, 2, H, Dh]
        src = torch.arange(T, device=x.device)[:, None] - torch.arange(C, device=x.device) * shift  # [T, C]
        kvj = kv[:, (src + 1).clamp(min=0)]  # [N, T, C, 2, H, Dh]
        s = (q[:, :, None] * kvj[:, :, :, 0]).sum(-1) / math.sqrt(q.shape[-1])  # [N, T, C, H]
        p = torch.softmax(s + bias.t(), dim=2)  # [N, T, C, H]
        out = (p[..., None] * kvj[:, :, :, 1]).sum(2)  # [N, T, H, Dh]
        return self._finish(x, out)

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals, norms and FFN: x [N, Lq, D], out [N, Lq, H, Dh]."""
        N, Lq, D = x.shape
        y = self.proj(out.reshape(N, Lq, D))  # [N, Lq, D]
        if self.norm == "pre":
            x = x + y
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + y)
        return self.ln2(x + self.ffn(x))


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention over a handful of keys without matmul kernels (cheap when L = C is tiny).

    q [N, Lq, H, Dh], k/v [N, L, H, Dh], bias [H, Lq, L] (-inf masked) -> [N, Lq, H, Dh].
    Same order as ``attend``: scale q·k by 1/sqrt(Dh), add the bias, softmax over keys.
    """
    s = (q[:, :, None] * k[:, None]).sum(-1) / math.sqrt(q.shape[-1])  # [N, Lq, L, H]
    p = torch.softmax(s + bias.permute(1, 2, 0), dim=2)  # [N, Lq, L, H]
    return (p[..., None] * v[:, None]).sum(2)  # [N, Lq, H, Dh]


class RegularGPT(nn.Module):
    kind = "regulargpt"

    def __init__(self, cfg: RegularGPTConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise UserError(f"dim={cfg.dim} must be divisible by heads={cfg.heads}")
        if cfg.pad not in ("level", "once") or cfg.norm not in ("post", "pre"):
            raise UserError(f"pad must be level|once and norm post|pre, got {cfg.pad!r}, {cfg.norm!r}")
        self.cfg = cfg
        self.scheme = positional.build("sliding-dilated", num_heads=cfg.heads, C=cfg.C, K=cfg.K)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        nn.init.normal_(self.tok.weight, std=cfg.emb_init)
        self.pad = nn.Parameter(torch.randn(cfg.dim) * cfg.emb_init)  # [D], scaled like tokens
        self.layers = nn.ModuleList(SharedLayer(cfg, k) for k in range(cfg.K))
        self.ln_f = nn.LayerNorm(cfg.dim) if cfg.norm == "pre" else nn.Identity()
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) * math.sqrt(self.cfg.dim)  # [B, T, D]

    def _pad_vec(self) -> torch.Tensor:
        return self.pad * math.sqrt(self.cfg.dim)  # [D]

    def _left_pad(self, x: torch.Tensor, to: int) -> torch.Tensor:
        B, n, D = x.shape
        if to == n:
            return x
        return torch.cat([self._pad_vec().expand(B, to - n, D), x], dim=1)  # [B, to, D]

    def chunk_bias(self, level: int, layer: int, device) -> torch.Tensor:
        """[H, C, C] eq. 6.1 bias between the C chunk members (distances j·C^level), -inf above."""
        j = torch.arange(self.cfg.C, device=device)
        dist = (j[:, None] - j[None, :]) * self.cfg.C ** level  # [C, C]
        b = self.scheme.bias_from_distance(dist.clamp(min=0), layer)  # [H, C, C]
        return b.masked_fill(dist < 0, -math.inf)

    def forward(self, idx: torch.Tensor, return_levels: bool = False):
        """idx [B, T] -> logits [B, classes] (+ per-level outputs and their token spans)."""
        B, T = idx.shape
        C, K = self.cfg.C, self.cfg.K
        levels = num_levels(T, C)
        x = self.embed(idx)  # [B, T, D]
        start = np.arange(T)  # token span [start, end) of every element, pads are empty
        end = start + 1
        if self.cfg.pad == "once":
            x, start, end = self._left_pad(x, C ** levels), *_pad_spans(start, end, C ** levels)
        outs, spans = [], []
        j = torch.arange(C, device=idx.device)
        for level in range(levels):
            n = x.shape[1]
            m = -(-n // C) * C
            x, (start, end) = self._left_pad(x, m), _pad_spans(start, end, m)
            x = x.reshape(B * m // C, C, -1)  # [B·m/C, C, D]
            pos = j * C ** level  # chunk members' token offsets
            for k, layer in enumerate(self.layers):
                idx_l = level * K + k
                bias = self.chunk_bias(level, idx_l, idx.device)  # [H, C, C]
                x = layer(x, pos, pos, self.scheme, idx_l, bias, last_only=(k == K - 1))
            x = x.reshape(B, m // C, -1)  # [B, m/C, D]
            start, end = _merge_spans(start, end, C)
            if return_levels:
                outs.append(x)
                spans.append((start.copy(), end.copy()))
        logits = self.head(self.ln_f(x[:, -1]))  # [B, classes]
        if return_levels:
            return {"logits": logits, "levels": outs, "spans": spans}
        return logits

    def _depths(self, T: int, device) -> torch.Tensor:
        """num_levels(t) = max(1, #{l : C^l < t}) of each prefix length t = 1..T, [T], computed on ``device`` (a list
        made on the host is a blocking copy to a GPU in every forward)."""
        t = torch.arange(1, T + 1, device=device)  # [T]
        reach = self.cfg.C ** torch.arange(num_levels(T, self.cfg.C), device=device)  # [L] C^0 .. C^(L-1)
        return (t[:, None] > reach).sum(-1).clamp(min=1)  # [T]

    def forward_prefixes(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every prefix at once: [B, T] -> [B, T, classes], where [:, i] equals
        ``forward(idx[:, :i+1])`` (its own depth ceil(log_C (i+1)), pads where the chunk path pads).

        The sliding form of eq. 6.1 (thesis Fig. 6.1, every row of the mask, not only the last):
        level l lets position i read i - j·C^l; position i is read out after its own last level.
        Costs O(T·C) per level and log_C T levels. Needs K = 1: with K > 1 the thesis' chunks do
        not overlap, so the sliding positions would see across chunk borders.
        """
        if self.cfg.K != 1:
            raise UserError(f"prefix outputs need thickness K=1 (got K={self.cfg.K}); "
                            "use supervision=last for K > 1")
        B, T = idx.shape
        C = self.cfg.C
        x = self.embed(idx)  # [B, T, D]
        pad = self._pad_vec()  # [D]
        depth = self._depths(T, idx.device)  # [T]
        out = x
        j = torch.arange(C, device=idx.device)
        for level in range(num_levels(T, C)):
            bias = self.scheme.bias_from_distance(j * C ** level, level)  # [H, C]
            x = self.layers[0].forward_sliding(x, pad, C ** level, bias)  # [B, T, D]
            out = torch.where((depth == level + 1)[None, :, None], x, out)  # [B, T, D]
        return self.head(self.ln_f(out))  # [B, T, classes]

    def forward_full(self, idx: torch.Tensor) -> torch.Tensor:
        """Dense reference: the whole (once-padded) sequence through L·K layers with the eq. 6.1 mask."""
        B, T = idx.shape
        levels = num_levels(T, self.cfg.C)
        x = self._left_pad(self.embed(idx), self.cfg.C ** levels)  # [B, C^L, D]
        pos = torch.arange(x.shape[1], device=idx.device)
        for level in range(levels):
            for k, layer in enumerate(self.layers):
                x = layer(x, pos, pos, self.scheme, level * self.cfg.K + k)  # bias from the scheme
        return self.head(self.ln_f(x[:, -1]))  # [B, classes]

    def loss(self, idx, labels):
        return F.cross_entropy(self(idx), labels)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _pad_spans(start: np.ndarray, end: np.ndarray, to: int):
    extra = to - start.size
    if extra <= 0:
        return start, end
    z = np.zeros(extra, dtype=start.dtype)
    return np.concatenate([z, start]), np.concatenate([z, end])  # pads: empty span [0, 0)


def _merge_spans(start: np.ndarray, end: np.ndarray, C: int):
    s, e = start.reshape(-1, C), end.reshape(-1, C)  # [m/C, C]
    nonempty = e > s
    big = np.iinfo(np.int64).max
    lo = np.where(nonempty, s, big).min(axis=1)
    hi = np.where(nonempty, e, -1).max(axis=1)
    empty = ~nonempty.any(axis=1)
    return np.where(empty, 0, lo), np.where(empty, 0, hi)

"""RegularGPT as a causal language model (Chi 2024 thesis ch. 6: §6.2.1 eq. 6.1, §6.2.2, §6.5).

Eq. 6.1 at level l (the bias r_j is learned per head, one row shared by all levels):

    M^(l)_mn = r_{(m-n)/C^l}   if (m-n)/C^l ∈ [C] = {0, ..., C-1},   -inf otherwise,

applied causally at *every* position m: the query at m attends to the keys m - j·C^l, j < C,
that are >= 0. Each level is a "thickened" layer of K pre-LN sub-layers whose weights are shared
across the levels (§6.2.2: SA^(l·K+k) = SA^(k), FFN^(l·K+k) = FFN^(k)); after levels 0..l-1 a
position has read the C^l most recent positions (base-C digits of the distance), so
ceil(log_C T) levels cover a context of T tokens. At T_ex > T_tr the depth grows with the same
weights; that is where the thesis sees C = 32 explode past C^ceil(log_C 512) = 1,024 tokens.

Readout depth (``model.depth``). "position" (default): the prediction at position m has a
context of m + 1 tokens and is read out after its own ceil(log_C (m+1)) levels (at least 1);
every position still runs every level of the sequence, so the keys a query reads at level l are
the level-l states of earlier positions. Any prefix of an input then gives the same outputs as the
whole input (the state of position m at level l depends only on tokens <= m), whatever the depth
of the whole input, and training reads positions out at every depth up to ceil(log_C L_tr).
"sequence": every position is read out after ceil(log_C T) levels of the whole input T, as the
thesis' nanoGPT model ("an adaptive depth log_C T", §6.2.2); training at L_tr then sees that one
depth only, and an output depends on the input's length through the depth. For the last token
both are the thesis' model at depth ceil(log_C T) (last-token perplexity, Tables 6.3/6.4); they
differ in what training asks of the shared layer.

Cost: each level is a causal window of C over every residue class mod C^l, computed in blocks of
C queries against 2C keys with batched matmuls (no T x T tensor), O(T·C·d) time and memory; the
model O(T·C·K·d·log_C T).
Pre-LN and GELU like our GPT: the thesis builds the LM on nanoGPT and "follows all the other
details of GPT2" (§6.2), which is pre-LN (the classifier in regular/ is post-LN like the authors'
regular-language code). No KV cache (the cached protocol E5 is refused with one line) and no
L x L probabilities (``return_probs`` is refused): the attention rows have C entries per level.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..io import UserError
from ..positional.sliding_dilated import SlidingDilated, num_levels
from .attention import AttnOptions
from .attn_extras import qk_form
from .gpt import GPT, Block, ModelConfig


def sliding_dilated_attention(q, k, v, scheme: SlidingDilated, level: int,
                              opts: AttnOptions | None = None, sublayer: int = 0) -> torch.Tensor:
    """Eq. 6.1 at ``level`` for every query: q, k, v [B, T, H, Dh] -> [B, T, H, Dh].

    Same order as ``model.attention.attend``: q·k / sqrt(Dh) + r_j, window mask, then the
    temperature of shared sub-layer ``sublayer`` (``opts.tau(sublayer)``, see :class:`RegularLM`)
    divides the whole logit, softmax over the (at most C) keys of each query.
    Layout: with s = C^l, position m = a·s + b reads (a - j)·s + b, j < W = min(C, ceil(T/s)):
    a causal window of W over each residue class b. Each class is cut into blocks of W queries
    that read their own and the previous block (2W keys, batched matmuls): O(T·W·d), no T x T.
    """
    opts = opts or AttnOptions()
    B, T, H, Dh = q.shape
    s = scheme.C ** int(level)
    W = scheme.level_offsets(level, T).numel()  # keys per query that can lie at positions >= 0
    if W == 1 and opts.window is None:  # only the query itself is in reach: softmax over one key
        return v
    n = -(-T // s)  # positions per residue class
    nb = -(-n // W)  # blocks of W per class

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, Dh] -> [B, s, H, nb, W, Dh]
        t = F.pad(t, (0, 0, 0, 0, 0, n * s - T)).view(B, n, s, H, Dh)  # [B, n, s, H, Dh]: m = a·s + b
        t = F.pad(t.permute(0, 2, 3, 1, 4), (0, 0, 0, nb * W - n))  # [B, s, H, nb·W, Dh]
        return t.reshape(B, s, H, nb, W, Dh)

    def with_previous(t: torch.Tensor) -> torch.Tensor:  # [.., nb, W, Dh] -> [.., nb, 2W, Dh]
        prev = F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :, :nb]  # block t-1 (zeros before block 0)
        return torch.cat([prev, t], dim=4)

    sc = torch.matmul(blocks(q), with_previous(blocks(k)).transpose(-1, -2)) / math.sqrt(Dh)  # [B,s,H,nb,W,2W]
    i = torch.arange(W, device=q.device)
    u = torch.arange(2 * W, device=q.device)
    j = W + i[:, None] - u[None, :]  # [W, 2W]: distance in units of s (key slot u, query i)
    ok = (j >= 0) & (j < W)
    if opts.window is not None:
        ok = ok & (j * s < int(opts.window))
    first = torch.arange(nb, device=q.device)[:, None, None] > 0  # [nb, 1, 1]: block 0 has no previous
    ok = ok[None] & (first | (u >= W)[None, None, :])  # [nb, W, 2W]
    bias = scheme.r[:, j.clamp(0, W - 1)].to(sc.dtype)  # [H, W, 2W] r_j
    bias = bias[:, None].masked_fill(~ok[None], -math.inf)  # [H, nb, W, 2W]
    sc = sc + bias
    tau = opts.tau(sublayer)
    if tau != 1.0:
        sc = sc / tau
    p = torch.softmax(sc if sc.dtype == torch.float64 else sc.float(), dim=-1).to(v.dtype)  # [B,s,H,nb,W,2W]
    out = torch.matmul(p, with_previous(blocks(v)))  # [B, s, H, nb, W, Dh]
    out = out.reshape(B, s, H, nb * W, Dh)[:, :, :, :n]  # [B, s, H, n, Dh]
    return out.permute(0, 3, 1, 2, 4).reshape(B, n * s, H, Dh)[:, :T]  # [B, T, H, Dh]


def check_depth(depth: str) -> None:
    """``model.depth`` is RegularGPT's readout: position or sequence (module docstring), else one line."""
    if depth not in ("position", "sequence"):
        raise UserError(f"model.depth must be position or sequence (RegularGPT's readout), got {depth!r}")


def check_attention_options(cfg: ModelConfig) -> None:
    """The attention options of our GPT (model.sinks, ssmax, qk_norm, gate) act in its blocks; RegularGPT's
    eq. 6.1 attention takes none of them: a one-line UserError naming the one set."""
    on = [n for n in ("sinks", "ssmax", "gate") if getattr(cfg, n, False)]
    if qk_form(getattr(cfg, "qk_norm", False)):  # "off" is a string, yet off
        on.insert(2, "qk_norm")
    if cfg.arch == "regulargpt" and on:
        raise UserError(f"model.arch=regulargpt attends with eq. 6.1 and takes no attention options; drop "
                        f"{', '.join('model.' + n for n in on)} or use model.arch=gpt")


class SlidingBlock(Block):
    """One sub-layer k of the thickened layer: pre-LN sliding-dilated attention + GELU MLP."""

    def forward(self, x: torch.Tensor, level: int, scheme: SlidingDilated, opts: AttnOptions) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads)  # [B, T, 3, H, Dh]
        q, k, v = qkv.unbind(2)  # each [B, T, H, Dh]
        out = sliding_dilated_attention(q, k, v, scheme, level, opts, self.index)  # [B, T, H, Dh]
        x = x + self.drop(self.proj(out.reshape(B, T, D)))  # [B, T, D]
        return x + self.drop(self.mlp(self.ln2(x)))


class RegularLM(GPT):
    """RegularGPT LM (module docstring); built by ``build_model`` for ``model.arch=regulargpt``.

    ``blocks`` holds the K shared sub-layers; ``cfg.layers`` is K. Same call as ``GPT``:
    ``model(idx, positions=None, inputs_embeds=..., opts=...)`` -> logits [B, T, V].

    A per-layer ``opts.temperature`` has one tau per *shared sub-layer* k (K values, like
    ``len(model.blocks)``, the layer count alignment targets see), and sub-layer k divides its logits
    by tau_k at every level. Layers are indexed by weights, not by depth, because the depth
    K·ceil(log_C T) changes with the input length while the weights, and so the softmax statistics
    Algorithm 1 aligns per layer, belong to the K sub-layers. Another length is a one-line error.
    """

    block_cls = SlidingBlock
    dense_attention = False  # no L x L rows to analyse (analysis.erf.attention_erf reports NaN)

    def __init__(self, cfg: ModelConfig) -> None:
        check_depth(cfg.depth)
        check_attention_options(replace(cfg, arch="regulargpt"))
        cfg = replace(cfg, arch="regulargpt", scheme="sliding-dilated", scheme_params={}, layers=cfg.K)
        super().__init__(cfg)  # build_scheme -> SlidingDilated(C, K), raises SchemeError on bad C/K
        depth = cfg.K * num_levels(cfg.train_length, cfg.C)  # sub-layers applied at L_tr
        for b in self.blocks:  # GPT-2 scaled init over the depth actually stacked in training
            torch.nn.init.normal_(b.proj.weight, std=cfg.init_std / math.sqrt(2 * depth))

    def check_opts(self, opts: AttnOptions) -> None:
        """A per-layer temperature has one tau per shared sub-layer (class doc), else one line; no
        logits sink (the temperature alignment reads L x L logit rows, which eq. 6.1 does not form)."""
        if opts.logits_sink is not None:
            raise UserError("RegularGPT reads C keys per query per level, not L x L attention logits, so the "
                            "temperature alignment (extrapolab align) does not apply to model.arch=regulargpt")
        opts.check_layers(len(self.blocks), f"RegularGPT's K={len(self.blocks)} shared sub-layers "
                          "(one tau per sub-layer, used at every level)")

    def levels(self, length: int) -> int:
        """Levels run for an input of ``length`` tokens: ceil(log_C T), at least 1."""
        return num_levels(length, self.cfg.C)

    def forward(self, idx, positions=None, *, inputs_embeds=None, opts=None, cache=None,
                return_probs: bool = False, return_hidden: bool = False):
        """idx [B, T] -> logits [B, T, V] (and the final hidden state [B, T, D] if asked)."""
        if cache is not None:
            raise UserError("RegularGPT (model.arch=regulargpt) has no KV cache, so the cached protocol does "
                            "not apply; evaluate it with nonoverlapping, sliding, last_token or positionwise")
        if return_probs:
            raise UserError("RegularGPT reads C keys per query per level, not an L x L attention matrix; "
                            "attention probabilities are not available for model.arch=regulargpt")
        T = idx.shape[1] if inputs_embeds is None else inputs_embeds.shape[1]
        dev = idx.device if inputs_embeds is None else inputs_embeds.device
        pos = torch.arange(T, device=dev)
        if positions is not None and not torch.equal(positions.to(dev), pos):
            raise UserError("RegularGPT reads positions 0..T-1 of its input only (its depth follows each "
                            "position's context); pass positions=None")
        opts = opts or self.attn_opts
        self.check_opts(opts)
        x = self.drop(self.embed(idx, pos) if inputs_embeds is None else inputs_embeds)  # [B, T, D]
        pieces, done = [], 0
        for level in range(self.levels(T)):
            for blk in self.blocks:  # the K shared sub-layers, at dilation C^level
                x = blk(x, level, self.scheme, opts)  # [B, T, D]
            if self.cfg.depth == "position":  # positions whose context fits C^(level+1) are read out
                end = min(T, self.cfg.C ** (level + 1))
                pieces.append(x[:, done:end])  # [B, end - done, D] after their own last level
                done = end
        h = self.ln_f(x if self.cfg.depth == "sequence" else torch.cat(pieces, dim=1))  # [B, T, D]
        logits = self.head(h)  # [B, T, V]
        return {"logits": logits, "hidden": h} if return_hidden else logits


def build_model(cfg: ModelConfig) -> GPT:
    """The model of ``model.arch``: ``GPT`` (gpt) or ``RegularLM`` (regulargpt)."""
    if cfg.arch == "gpt":
        return GPT(cfg)
    if cfg.arch == "regulargpt":
        return RegularLM(cfg)
    raise UserError(f"unknown model.arch {cfg.arch!r}; use gpt or regulargpt")

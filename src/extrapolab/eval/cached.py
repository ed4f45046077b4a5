"""E5 cached sliding-window inference (Sandwich, Chi et al. 2023, appendix B, Table 5).

Appendix B: "we can still cache all q_m, k_m, and v_m vectors for m in [1, 2048]. When it comes to
generating the w̄+1-th token, we simply discard the first cached q_1, k_1, and v_1 and use the rest
of w̄-1 tokens along with the newly added token to perform self-attention. [...] the complexity is
O(w̄ x L_ex) instead of O(L_ex^2). [...] better than that of an APE model, which is O(w̄^2 x L_ex)
since an APE model needs to completely re-encode the previous w̄ vectors".

* :func:`cached_window_ppl` — the cached process: ``model.KVCache(layers, window=w̄)`` keeps the
  keys/values (rotated at their absolute positions) of the last w̄ tokens in every layer; tokens
  are fed one at a time at their absolute positions after a one-shot prefill of the first w̄
  (which is exactly what w̄ single steps would compute). Subsequences as in E1 (L+1 tokens, L
  predictions), so with w̄ >= L it equals :func:`nonoverlapping`.
* :func:`recomputed_window_ppl` — the re-encoding process: each prediction re-encodes its last w̄
  tokens from position 0 (the APE way).

They agree exactly for a 1-layer model with a relative scheme: the layer-1 key/value of a token
depends only on that token. With >= 2 layers they differ: a cached layer->=2 key/value was computed
when its token could still see tokens that have since left the window, so the cache carries
information from evicted tokens (as x-transformers' cached generation does); re-encoding does not.
:func:`compare_cached` measures the gap. APE models also differ because the cache keeps absolute
positions (they grow past w̄) while re-encoding restarts at 0.

``sinks=k`` (``eval.sinks``; StreamingLLM, Xiao et al. 2024, arXiv 2309.17453, §3.2): the cache keeps
the first k tokens of each subsequence (the attention sinks) besides the newest w̄, keys stored before
rotation and placed at their positions in the cache 0..k+w̄-1 (model/cache.py); the re-encoding
reference feeds exactly those k + w̄ tokens at positions 0..k+w̄-1, and for a 1-layer model the two
agree exactly again. k = 0 is the plain window at cache positions, the same numbers as without sinks
for relative schemes. An HF model brings its own cache (``model.new_cache``, hf/cached.py).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..io import UserError
from ..model.attention import AttnOptions
from ..model.gpt import KVCache
from .core import (Scores, as_tokens, check_length, evaluating, model_device, resolve_opts,
                   rows_per_batch, run_with_fallback, score_windows)
from .perplexity import _result, chunk_starts


def num_layers(model: nn.Module) -> int:
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        return len(blocks)
    layers = getattr(getattr(model, "cfg", None), "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no KV cache (no .blocks / .cfg.layers); "
                        "cached evaluation needs an extrapolab GPT")
    return int(layers)


def _logits(out):
    return out["logits"] if isinstance(out, dict) else out


def check_sinks(model: nn.Module, sinks) -> int | None:
    """``sinks`` as None (off) or an int k >= 0 the model can take, else a one-line UserError."""
    if sinks is None or int(sinks) == -1:
        return None
    if int(sinks) != sinks or sinks < 0:
        raise UserError(f"eval.sinks must be -1 (off) or a number of sink tokens >= 0, got {sinks}; e.g. 4")
    scheme = getattr(model, "scheme", None)
    if scheme is not None and (scheme.kind == "absolute" or scheme.has_content):
        raise UserError(f"eval.sinks places cached keys at their positions in the cache; scheme {scheme.name!r} "
                        "takes positions from the input (an embedding or its content); use eval.sinks=-1")
    return int(sinks)


def new_cache(model: nn.Module, window: int, sinks: int | None = None):
    """The cache E5 decodes with: the model's own (``model.new_cache``, an HF model), else a KVCache."""
    make = getattr(model, "new_cache", None)
    if make is not None:
        return make(window, sinks)
    return KVCache(num_layers(model), window=window, sinks=sinks)


def _cached_rows(model, x, window, opts, dev, sinks=None) -> torch.Tensor:
    """x [B, L+1] -> NLL [B, L]: prefill min(k + w̄, L) tokens, then one token per step."""
    B, L = x.shape[0], x.shape[1] - 1
    cache = new_cache(model, window, sinks)
    first = min(window + (sinks or 0), L)
    pos = torch.arange(first, device=dev)
    logits = _logits(model(x[:, :first], positions=pos, opts=opts, cache=cache))  # [B, first, V]
    nll = [F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:first + 1], reduction="none")]
    for t in range(first, L):
        step = _logits(model(x[:, t:t + 1], positions=pos.new_tensor([t]), opts=opts, cache=cache))
        nll.append(F.cross_entropy(step[:, 0].float(), x[:, t + 1], reduction="none")[:, None])  # [B,1]
    return torch.cat(nll, dim=1)  # [B, L]


def cached_window_ppl(
    model: nn.Module,
    tokens,
    length: int,
    *,
    window: int,
    max_tokens: int = 0,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    sinks: int | None = None,
) -> dict:
    """E5 ppl of L-token subsequences decoded with a w̄-token KV cache (and ``sinks`` first tokens,
    module doc) -> {ppl, nll, tokens, ...}."""
    tok = as_tokens(tokens)
    L, w = check_length(length), check_length(window, "cache window")
    k = check_sinks(model, sinks)
    starts = chunk_starts(len(tok), L, max_tokens, "cached evaluation")
    opts, dev = resolve_opts(opts), model_device(model)
    rows = rows_per_batch(model, min(w, L), batch_size)
    scores, t0 = Scores(), time.perf_counter()
    fail = f"cached evaluation at length {L}, window {w} does not fit in memory with batch size 1; " \
        "use a smaller window"

    def run(group):
        x = torch.from_numpy(np.stack([np.asarray(tok[s:s + L + 1], dtype=np.int64) for s in group]))
        return [(0, row) for row in _cached_rows(model, x.to(dev), w, opts, dev, k)]  # [L] each

    with evaluating(model):
        for i in range(0, len(starts), rows):
            st = starts[i:i + rows]
            run_with_fallback(lambda idx, st=st: run(st[idx]), len(st), scores, fail)
    sec = time.perf_counter() - t0
    return _result(scores, L, window=w, seconds=sec, tokens_per_s=scores.count / max(sec, 1e-9),
                   **({} if k is None else {"sinks": k}))


def recomputed_windows(length: int, window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Within one L-subsequence: (window offsets, score_from, window length) for re-encoding."""
    L, w = check_length(length), min(check_length(window, "window"), check_length(length))
    offsets = np.concatenate([[0], np.arange(w, L) - w + 1]).astype(np.int64)
    score_from = np.concatenate([[0], np.full(L - w, w - 1)]).astype(np.int64)
    return offsets, score_from, w


def recomputed_window_ppl(
    model: nn.Module,
    tokens,
    length: int,
    *,
    window: int,
    max_tokens: int = 0,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    progress: bool = False,
    sinks: int | None = None,
) -> dict:
    """Same subsequences as :func:`cached_window_ppl`; each prediction re-encodes its last w̄ tokens
    (with ``sinks``: the subsequence's first k tokens and its last w̄, at positions 0..k+w̄-1)."""
    tok = as_tokens(tokens)
    L = check_length(length)
    starts = chunk_starts(len(tok), L, max_tokens, "recomputed-window evaluation")
    k = check_sinks(model, sinks)
    if k is not None:
        return _recomputed_with_sinks(model, tok, starts, L, check_length(window, "window"), k, batch_size, opts)
    offsets, score_from, w = recomputed_windows(L, window)
    all_starts = (starts[:, None] + offsets[None]).reshape(-1)  # [chunks * windows]
    all_from = np.tile(score_from, len(starts))
    t0 = time.perf_counter()
    s = score_windows(model, tok, all_starts, w, all_from, batch_size=batch_size, opts=opts,
                      progress=progress, desc=f"recomputed L={L} w={w}")
    sec = time.perf_counter() - t0
    return _result(s, L, window=int(window), seconds=sec, tokens_per_s=s.count / max(sec, 1e-9))


def _recomputed_with_sinks(model, tok, starts, L: int, w: int, k: int, batch_size: int, opts) -> dict:
    """Each prediction t >= k + w̄ re-encodes tokens 0..k-1 and t-w̄+1..t of its subsequence (k + w̄
    tokens, positions 0..k+w̄-1) and scores the last; the first min(k + w̄, L) come from one forward."""
    opts, dev = resolve_opts(opts), model_device(model)
    n0, scores, t0 = min(k + w, L), Scores(), time.perf_counter()
    rows = rows_per_batch(model, k + w, batch_size)
    cols = [np.r_[np.arange(k), np.arange(t - w + 1, t + 1)] for t in range(n0, L)]  # token offsets per window
    jobs = [(st, t, c) for st in starts for t, c in zip(range(n0, L), cols)]
    fail = f"re-encoding {k} sinks + {w} tokens does not fit in memory with batch size 1; use a smaller window"
    with evaluating(model):
        for i in range(0, len(starts), rows):  # the first n0 predictions of each subsequence
            x = torch.from_numpy(np.stack([np.asarray(tok[st:st + n0 + 1], dtype=np.int64)
                                           for st in starts[i:i + rows]]))  # [b, n0 + 1]
            lg = _logits(model(x[:, :n0].to(dev), opts=opts))  # [b, n0, V]
            nll = F.cross_entropy(lg.float().transpose(1, 2), x[:, 1:].to(dev), reduction="none")  # [b, n0]
            for row in nll:
                scores.add(0, row)
        for i in range(0, len(jobs), rows):
            group = jobs[i:i + rows]

            def run(idx, group=group):
                x = torch.from_numpy(np.stack([np.asarray(tok[st + c], dtype=np.int64) for st, _, c in
                                               (group[j] for j in idx)])).to(dev)  # [b, k + w]
                y = torch.tensor([int(tok[st + t + 1]) for st, t, _ in (group[j] for j in idx)], device=dev)
                last = _logits(model(x, opts=opts))[:, -1]  # [b, V]
                return [(0, F.cross_entropy(last.float(), y, reduction="none"))]  # [b]
            run_with_fallback(run, len(group), scores, fail)
    sec = time.perf_counter() - t0
    return _result(scores, L, window=w, sinks=k, seconds=sec, tokens_per_s=scores.count / max(sec, 1e-9))


def compare_cached(model, tokens, length: int, *, window: int, **kw) -> dict:
    """Cached vs re-encoded window ppl on the same tokens, and their relative gap."""
    c = cached_window_ppl(model, tokens, length, window=window, **kw)
    r = recomputed_window_ppl(model, tokens, length, window=window, **kw)
    return {"cached": c, "recomputed": r,
            "rel_diff": abs(c["ppl"] - r["ppl"]) / r["ppl"] if np.isfinite(r["ppl"]) else None}


def generate(
    model: nn.Module,
    prompt_ids,
    n_new: int,
    *,
    window: int | None = None,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    opts: AttnOptions | None = None,
    return_logits: bool = False,
):
    """Decode ``n_new`` tokens with a KV cache of the last ``window`` tokens (None = keep all).

    ``prompt_ids`` [P] or [B, P] -> prompt + new ids, same rank (and, with ``return_logits``, the
    next-token logits of each step, [n_new, V] or [B, n_new, V]). ``greedy`` or temperature 0
    takes the argmax; else samples from softmax(logits / temperature), restricted to the
    ``top_k`` most likely ids when top_k > 0, with a generator seeded by ``seed``.
    """
    dev = model_device(model)
    idx = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long, device=dev)
    squeeze = idx.dim() == 1
    idx = idx[None] if squeeze else idx  # [B, P]
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise UserError("generate needs a non-empty prompt of token ids, shape [P] or [B, P]")
    if window is not None:
        check_length(window, "cache window")
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    opts = resolve_opts(opts)
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    B, P = idx.shape
    out, steps = [idx], []
    with evaluating(model):
        cache = KVCache(num_layers(model), window=window)
        first = P if window is None else min(P, window)  # prefill what fits, then step
        logits = _logits(model(idx[:, :first], positions=torch.arange(first, device=dev), opts=opts,
                               cache=cache))[:, -1]  # [B, V]
        for t in range(first, P):
            logits = _logits(model(idx[:, t:t + 1], positions=torch.tensor([t], device=dev), opts=opts,
                                   cache=cache))[:, -1]
        for i in range(int(n_new)):
            steps.append(logits.float())
            nxt = _pick(logits.float(), greedy or temperature == 0, temperature, top_k, gen)  # [B]
            out.append(nxt[:, None])
            if i + 1 < n_new:
                logits = _logits(model(nxt[:, None], positions=torch.tensor([P + i], device=dev),
                                       opts=opts, cache=cache))[:, -1]
    ids = torch.cat(out, dim=1)  # [B, P + n_new]
    ids = ids[0] if squeeze else ids
    if not return_logits:
        return ids
    lg = torch.stack(steps, dim=1) if steps else torch.zeros(B, 0, 0)  # [B, n_new, V]
    return ids, (lg[0] if squeeze else lg)


def _pick(logits, greedy, temperature, top_k, gen) -> torch.Tensor:
    if greedy:
        return logits.argmax(dim=-1)
    z = logits / temperature  # [B, V]
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, int(top_k), dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, -float("inf"))
    probs = torch.softmax(z, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]

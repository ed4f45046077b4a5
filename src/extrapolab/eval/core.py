"""Shared machinery of the evaluation protocols: score token windows with a causal LM.

A *window* starting at stream index ``s`` with length ``L`` feeds tokens ``s .. s+L-1`` (at
positions 0..L-1) and its prediction at position ``i`` is scored against token ``s+i+1``. So a
window spans L+1 stream tokens and carries L predictions; the prediction at position i has
seen i+1 tokens. Every protocol (E1-E5) is a choice of window starts, a length, and the first
position of each window whose predictions count (``score_from``).

Memory: rows per batch are capped so the [B, L, V] logits stay under ``LOGITS_BUDGET_MB``; an
out-of-memory error (CUDA or CPU allocator) makes the batch re-run one row at a time, and if a
single row still does not fit the protocol stops with a one-line ``UserError``. NLL is taken
per token in fp32 from the logits and summed in float64. A model that offers
``final_hidden(idx, positions=None, opts=...)`` -> [B, L, C] and ``logits_from_hidden(h)`` (the
Hugging Face adapter, hf/adapter.py) is scored without any [L, V] matrix: the hidden states once,
then logits + log-softmax + the target's entry per block of positions (``SCORE_CHUNK_MB`` of fp32
logits at a time), which gives the same NLL as the full logits.
"""
from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..io import UserError
from ..model.attention import AttnOptions

LOGITS_BUDGET_MB = 1024.0
SCORE_CHUNK_MB = 64.0  # fp32 logits per block of positions when a model scores from hidden states


def as_tokens(tokens) -> np.ndarray:
    """1-D integer token stream (np.ndarray / memmap / list / torch tensor) -> np.ndarray view."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise UserError(f"token stream must be 1-D, got shape {tuple(arr.shape)}; pass a flat array of ids")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"token ids must be integers, got dtype {arr.dtype}; pass the tokenized split")
    return arr


def check_vocab(model: nn.Module, tokens: np.ndarray) -> None:
    """Refuse ids outside the model's vocabulary (a tokenizer/model mismatch) with one line."""
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if vocab is None or tokens.size == 0:
        return
    hi, lo = int(tokens.max()), int(tokens.min())
    if hi >= vocab or lo < 0:
        raise UserError(
            f"token ids span [{lo}, {hi}] but the model's vocabulary has {vocab} entries; "
            "evaluate on data tokenized with the run's own tokenizer")


def check_length(length: int, what: str = "length") -> int:
    if int(length) != length or int(length) < 1:
        raise UserError(f"{what} must be a positive integer, got {length!r}")
    return int(length)


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def resolve_opts(opts: AttnOptions | None, **changes) -> AttnOptions:
    """``AttnOptions(impl='auto')`` by default (long inputs take the blocked path), with changes."""
    opts = opts if opts is not None else AttnOptions(impl="auto")
    changes = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(opts, **changes) if changes else opts


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """eval() + inference_mode for the duration; restores the model's training flag after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    msg = str(err).lower()
    return isinstance(err, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
        or isinstance(err, MemoryError))


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rows_per_batch(model: nn.Module, length: int, batch_size: int) -> int:
    """``batch_size`` capped so the batch's fp32 logits fit ``LOGITS_BUDGET_MB``."""
    batch_size = max(1, int(batch_size))
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if vocab is None:
        return batch_size
    per_row_mb = length * vocab * 4 / 2**20
    return max(1, min(batch_size, int(LOGITS_BUDGET_MB // max(per_row_mb, 1e-9))))


@dataclass
class Scores:
    """float64 sums of per-token NLL; ``pos_*`` per window position when asked for."""

    nll_sum: float = 0.0
    count: int = 0
    pos_sum: np.ndarray | None = None  # [L]
    pos_count: np.ndarray | None = None  # [L]
    batch_fallback: bool = False

    def add(self, lo: int, nll: torch.Tensor) -> None:
        """Add one window's scored NLLs (positions lo..L-1)."""
        nll = nll.double().cpu()  # [L-lo]
        self.nll_sum += float(nll.sum())
        self.count += int(nll.numel())
        if self.pos_sum is not None:
            self.pos_sum[lo:] += nll.numpy()
            self.pos_count[lo:] += 1

    @property
    def mean_nll(self) -> float:
        if self.count == 0:
            raise UserError("no token was scored; give a longer token stream or smaller lengths")
        return self.nll_sum / self.count


def chunk_positions(vocab: int, budget_mb: float | None = None) -> int:
    """Positions per block so that one block's fp32 logits [n, V] take about ``budget_mb``
    (default ``SCORE_CHUNK_MB``)."""
    budget = SCORE_CHUNK_MB if budget_mb is None else budget_mb
    return max(1, int(budget * 2**20 // (4 * max(1, int(vocab)))))


def chunked_nll(head, h: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token NLL [n] of ``targets`` [n] from hidden states ``h`` [n, C] through ``head``,
    ``chunk`` positions at a time (never more than [chunk, V] logits)."""
    out = [F.cross_entropy(head(h[a:a + chunk]).float(), targets[a:a + chunk], reduction="none")  # [<=chunk]
           for a in range(0, h.shape[0], chunk)]
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


def scores_from_hidden(model: nn.Module) -> bool:
    """True when ``model`` gives final hidden states + head (scored in position blocks, see module doc)."""
    return callable(getattr(model, "final_hidden", None)) and getattr(model, "chunked", True)


def _score_rows(model, tok, starts, score_from, length, opts, dev) -> list:
    """One forward over windows ``starts`` [B] -> [(score_from, NLL [L-score_from])] per row."""
    x = np.stack([np.asarray(tok[s:s + length + 1], dtype=np.int64) for s in starts])  # [B, L+1]
    x = torch.from_numpy(x).to(dev)
    if scores_from_hidden(model):
        h = model.final_hidden(x[:, :-1], positions=None, opts=opts)  # [B, L, C]
        chunk = chunk_positions(model.cfg.vocab_size)
        return [(int(lo), chunked_nll(model.logits_from_hidden, h[b, lo:], x[b, lo + 1:], chunk))
                for b, lo in enumerate(score_from)]
    logits = model(x[:, :-1], positions=None, opts=opts)  # [B, L, V]
    if isinstance(logits, dict):
        logits = logits["logits"]
    out = []
    for b, lo in enumerate(score_from):  # one row at a time: no [B, L, V] log-softmax copy
        out.append((int(lo), F.cross_entropy(logits[b, lo:].float(), x[b, lo + 1:], reduction="none")))
    return out


def run_with_fallback(run, n_rows: int, scores: Scores, fail_msg: str) -> None:
    """``run(row_index_array) -> [(score_from, NLL)]`` on all rows at once; on out-of-memory, on
    one row at a time (for the rest of the evaluation); a row that still fails -> UserError."""
    if not scores.batch_fallback:
        try:
            for lo, nll in run(np.arange(n_rows)):  # a list: nothing is added unless all rows ran
                scores.add(lo, nll)
            return
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            scores.batch_fallback = True
            _free_memory()
    for r in range(n_rows):
        try:
            for lo, nll in run(np.array([r])):
                scores.add(lo, nll)
        except (RuntimeError, MemoryError) as err:
            if not is_oom(err):
                raise
            _free_memory()
            raise UserError(fail_msg) from None


def score_windows(
    model: nn.Module,
    tokens: np.ndarray,
    starts: Sequence[int],
    length: int,
    score_from: Sequence[int] | int = 0,
    *,
    batch_size: int = 4,
    opts: AttnOptions | None = None,
    per_position: bool = False,
    progress: bool = False,
    desc: str = "",
) -> Scores:
    """Score windows of ``length`` inputs at ``starts``; only positions >= ``score_from`` count."""
    starts = np.asarray(starts, dtype=np.int64)
    if np.isscalar(score_from) or np.ndim(score_from) == 0:
        score_from = np.full(len(starts), int(score_from), dtype=np.int64)
    score_from = np.asarray(score_from, dtype=np.int64)
    if len(starts) and (starts.min() < 0 or starts.max() + length + 1 > len(tokens)):
        raise UserError(f"window of {length} tokens runs outside the {len(tokens)}-token stream")
    scores = Scores()
    if per_position:
        scores.pos_sum, scores.pos_count = np.zeros(length), np.zeros(length, dtype=np.int64)
    opts = resolve_opts(opts)
    dev = model_device(model)
    rows = rows_per_batch(model, length, batch_size)
    batches = range(0, len(starts), rows)
    if progress:
        from tqdm.auto import tqdm
        batches = tqdm(batches, desc=desc or f"L={length}", leave=False)
    fail = (f"length {length} does not fit in memory even with batch size 1; evaluate shorter "
            "lengths or lower AttnOptions.block_size / memory_budget_mb")
    with evaluating(model):
        for i in batches:
            st, sf = starts[i:i + rows], score_from[i:i + rows]
            def run(idx, st=st, sf=sf):
                return _score_rows(model, tokens, st[idx], sf[idx], length, opts, dev)
            run_with_fallback(run, len(st), scores, fail)
    return scores


def evenly_spaced(lo: int, hi: int, n: int) -> np.ndarray:
    """At most ``n`` distinct integers spread evenly over [lo, hi] (both ends included)."""
    if hi < lo:
        return np.zeros(0, dtype=np.int64)
    n = max(1, min(int(n), hi - lo + 1))
    if n == 1:
        return np.array([lo], dtype=np.int64)
    return np.round(np.linspace(lo, hi, n)).astype(np.int64)  # spacing >= 1 keeps them distinct

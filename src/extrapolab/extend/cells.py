"""One cell of `extrapolab extend hf:PATH` (:mod:`.study`): one method at one length L.

A method at L is a :class:`Setting`: a ``--rope`` text for :func:`extrapolab.hf.load_hf` (HF's own
rope types through ``rope_parameters``; Self-Extend / ReRoPE / log-n through the extrapolab
attention function) and a softmax temperature: one for the whole model (Algorithm 1 as the thesis
runs it, ``pmax`` / ``entropy``, and the length rule) or one per layer (``pmax-layer``, the one-forward
variant of :func:`extrapolab.align.onepass.align_layers`). The factor of every static
method is s = L / L_ctx, L_ctx being the model's context (its config's ``max_position_embeddings``):
what a user who wants L tokens would set. Cells whose settings coincide are computed once:

* at L <= L_ctx, PI / NTK-aware / YaRN with s = 1, dynamic NTK (s = max(1, L/L_ctx)), log-n
  (max(1, log(m+1)/log L_ctx) = 1 for m < L_ctx), Self-Extend with G = 1, StreamingLLM's pattern
  (4 sinks + a window of L_ctx - 4 covers every key at its own distance) and both temperature rules
  (tau = 1) ARE plain RoPE; only ReRoPE (w = L_ctx/8 caps every distance) and DCA (chunks of
  5/8·L_ctx) differ;
* dynamic NTK recomputes s from the input length (HF's ``dynamic`` type, factor 1:
  base·(L/L_ctx)^(d/(d-2))); every window here is one forward of exactly L tokens, so it is
  NTK-aware with s = L/L_ctx (tests/test_extend_study.py checks the logits), the same cell.

Per cell, on each corpus: E1, E3 and E4 from the SAME forwards (:func:`score_cell`): ``windows``
windows of L tokens ending at fixed end tokens e_1..e_n (the same for every method and at every full
factor, at least the longest full-factor L apart; a long factor reads a subset of them at least its
L apart, :func:`spaced`): E1 = perplexity of every prediction of those (disjoint) windows, E3 = perplexity of the
end tokens, each predicted from the L tokens before it (``eval.last_token`` at L_ex = L + 1), E4 =
mean NLL per position; and the perplexity of each window's last L_ctx predictions (``tail_ppl``):
the very tokens the 1x cell scores, now read after L - L_ctx more tokens -- what "holds" compares
(the first L - L_ctx predictions of a longer window are other text, so its E1 is not comparable
with the 1x E1 on one window). Passkey (:func:`passkey_records`): the prompt plus the answer in one forward
(teacher forcing). ``retrieved``: the argmax at every position of the value's own tokens (after the
answer prefix and the separator) is the value's token -- whether the model reads the key out of the
haystack; ``correct``: the argmax at every answer position, separator included, is right, which is
exact match of greedy decoding (the greedy path equals the answer iff every step's argmax is the
answer's token). The two differ by the separator alone: after the assistant's "The pass key is"
SmolLM2-135M-Instruct puts " a" / " the" first as often as " " and then every digit right
(docs/results/extend-quick.md), so ``correct`` measured the answer's first word, ``retrieved`` the
retrieval.
"""
from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..eval.core import evaluating, model_device, score_windows
from ..eval.perplexity import ppl_of
from ..io import UserError
from ..model.attention import AttnOptions

#: method -> label in the tables
METHODS = {"rope": "RoPE (plain)", "pi": "PI (Chen et al. 2023)", "ntk": "NTK-aware", "dynamic": "dynamic NTK",
           "yarn": "YaRN", "selfextend": "Self-Extend (w = L_ctx/4)", "rerope": "ReRoPE + log-n (w = L_ctx/8)",
           "dca": "DCA (C = 3/4·L_ctx, w = C/6)", "streaming": "StreamingLLM (4 sinks + L_ctx - 4)",
           "logn": "RoPE + log-n", "pmax": "τ: Alg. 1 P_max", "entropy": "τ: Alg. 1 H",
           "pmax-layer": "τ: Alg. 1 P_max per layer (variant)", "length": "τ: log L_ctx / log L"}
#: methods the study runs only when extend.methods names them (added after the published runs)
OPT_IN = ("dca", "streaming")
#: methods whose tau Algorithm 1 sets from the model's statistics at L (the thesis' one tau per length,
#: or the per-layer variant); the others need nothing measured
ALIGNED = ("pmax", "entropy", "pmax-layer")
E4_POINTS = 512  # the position-wise curve is stored as this many bin means


@dataclass(frozen=True)
class Setting:
    """How one method runs at one length: ``rope`` (``--rope`` text, None = as loaded) and ``tau``."""

    rope: str | None
    tau: float | tuple = 1.0

    def key(self) -> str:
        return json.dumps([self.rope, self.tau])


def _s(x: float) -> str:
    return f"{x:g}"


def setting(method: str, L: int, L_ctx: int, align_tau: dict | None = None) -> Setting:
    """The :class:`Setting` of ``method`` at length ``L`` (module doc); ``align_tau``: {method:
    {str(L): tau, or [tau per layer]}} from Algorithm 1 (needed by :data:`ALIGNED` beyond L_ctx)."""
    ext, s = L > L_ctx, L / L_ctx
    if method not in METHODS:
        raise UserError(f"unknown extend.methods entry {method!r}; choose from {', '.join(METHODS)}")
    if method == "rerope":  # Su's patch: w = 512 of 4,096, i.e. L_ctx/8, with log-n
        return Setting(f"rerope:{max(1, L_ctx // 8)}+logn")
    if method == "dca":  # ChunkLlama's chunk_size 3/4·L_ctx, local window C/6 (its L_ctx/8)
        return Setting(f"dca:{max(2, 3 * L_ctx // 4)}")
    if not ext or method == "rope":
        return Setting(None)
    if method in ("pi", "ntk", "dynamic", "yarn"):
        kind = {"pi": "linear", "dynamic": "ntk"}.get(method, method)  # dynamic = NTK at s = L/L_ctx (doc)
        return Setting(f"{kind}:{_s(s)}")
    if method == "selfextend":
        w = max(1, L_ctx // 4)
        G = max(1, math.ceil((L - w) / (L_ctx - w)))  # the smallest G whose (L_ctx - w)·G + w covers L
        return Setting(f"selfextend:{G},{w}")
    if method == "logn":
        return Setting("logn")
    if method == "streaming":  # a cache of L_ctx: 4 sinks (the paper's) and the newest L_ctx - 4
        return Setting(f"streaming:4,{L_ctx - 4}")
    if method == "length":
        return Setting(None, math.log(L_ctx) / math.log(L))
    taus = (align_tau or {}).get(method, {}).get(str(L))
    if taus is None:
        raise UserError(f"no Algorithm 1 temperature ({method}) for length {L}; run the alignment stage first")
    if not isinstance(taus, (list, tuple)):
        return Setting(None, float(taus))
    taus = tuple(float(t) for t in taus)
    return Setting(None, taus[0] if len(set(taus)) == 1 else taus)  # one tau for all layers: a float


class Models:
    """One loaded ``HFCausalLM`` at a time, reloaded when the ``--rope`` text or attention changes."""

    def __init__(self, spec: str, **load_kw) -> None:
        self.spec, self.load_kw, self.key, self.model = spec, load_kw, None, None
        self.loads = 0

    def get(self, rope: str | None, attn: str = "sdpa"):
        from ..hf import open_hf

        if (rope, attn) != self.key:
            self.model = None
            gc.collect()
            self.model = open_hf(self.spec, rope=rope, attn=attn, **self.load_kw)
            self.key, self.loads = (rope, attn), self.loads + 1
        return self.model


def window_ends(n_tokens: int, first: int, spacing: int, windows: int, what: str) -> np.ndarray:
    """End tokens of the cells' windows on one corpus: ``windows`` stream indices evenly spread over
    [``first``, n_tokens - 1] (``first``: the longest window read there, so every window fits), at
    least ``spacing`` apart (the longest full-factor length: one cell's windows never overlap)."""
    from ..eval.core import evenly_spaced

    if n_tokens - 1 < first:
        raise UserError(f"{what} has {n_tokens} tokens, fewer than the longest length {first} + 1; use a bigger "
                        "corpus (data.max_bytes=0) or smaller extend.factors")
    ends = evenly_spaced(first, n_tokens - 1, windows)
    if len(ends) < windows or (len(ends) > 1 and int(np.diff(ends).min()) < spacing):
        fit = 1 + (n_tokens - 1 - first) // spacing
        raise UserError(f"{what} has {n_tokens} tokens: {windows} windows {spacing} apart do not fit; use "
                        f"extend.windows <= {fit}, a bigger corpus or a larger data.test_percent")
    return ends


def spaced(ends, spacing: int, k: int) -> np.ndarray:
    """At most ``k`` of ``ends``, at least ``spacing`` apart, spread over them (the windows of a long
    factor: a subset of the corpus's ends, so they pair with the 1x cell's windows)."""
    picked: list[int] = []
    for e in ends:
        if not picked or int(e) - picked[-1] >= spacing:
            picked.append(int(e))
    idx = np.round(np.linspace(0, len(picked) - 1, min(int(k), len(picked)))).astype(int)
    return np.asarray(picked, dtype=np.int64)[np.unique(idx)]


def score_cell(model, tokens, ends: np.ndarray, L: int, tau, tail: int | None = None) -> dict:
    """E1, E3 and E4 of the windows of ``L`` tokens ending at ``ends`` (module doc), one forward each,
    the perplexity of their last ``tail`` predictions (L_ctx: the tokens the 1x cell scores), and each
    window's own mean NLL, last-``tail`` NLL and end-token NLL (``win_*``, in ``ends`` order: the
    paired intervals of :mod:`.plan`)."""
    opts = AttnOptions(temperature=list(tau) if isinstance(tau, tuple) else tau)
    curves = []
    for e in np.asarray(ends):
        s = score_windows(model, tokens, [int(e) - L], L, 0, batch_size=1, opts=opts, per_position=True)
        curves.append(s.pos_sum / s.pos_count)  # [L]
    nll = np.stack(curves)  # [n, L]
    tail = min(int(tail or L), L)
    win, win_tail, win_e3 = nll.mean(1), nll[:, L - tail:].mean(1), nll[:, -1]  # [n] each
    width = max(1, L // E4_POINTS)
    m = L // width * width
    curve = nll.mean(0)[:m].reshape(-1, width).mean(1)  # [<= E4_POINTS]
    return {"e1": ppl_of(float(win.mean())), "e1_nll": float(win.mean()), "tokens": int(nll.size), "tail": tail,
            "tail_ppl": ppl_of(float(win_tail.mean())), "tail_nll": float(win_tail.mean()),
            "e3": ppl_of(float(win_e3.mean())), "e3_nll": float(win_e3.mean()), "e3_n": int(len(ends)),
            "e4_bin": width, "e4_nll": [round(float(v), 5) for v in curve], "ends": [int(e) for e in ends],
            "win_nll": [float(v) for v in win], "win_tail_nll": [float(v) for v in win_tail],
            "win_e3_nll": [float(v) for v in win_e3]}


def niah_records(model, task: str, length: int, tokenizer, n: int, chat: bool, cache_dir) -> list[dict]:
    """``n`` samples of RULER's needle task ``task`` at ``length`` tokens (tasks/ruler: RULER's prompt and answer
    prefix, inside the chat template where ``chat``), scored teacher-forced: ``tf_exact`` (every answer token the
    argmax after the answer prefix), ``tf_mean_logprob``; the sample's ``depth``. One forward each."""
    from ..tasks.ruler import ruler_samples, score_samples

    mode = "auto" if chat else "off"
    samples = ruler_samples(task, length, tokenizer, n, chat=mode, cache_dir=cache_dir)
    recs = score_samples(model, samples, tokenizer, chat=mode, greedy=False, teacher=True)
    return [{**r, "length": int(length), "retrieved": bool(r.get("tf_exact"))} for r in recs]


def passkey_records(model, examples, tau) -> list[dict]:
    """Records of teacher-forced passkey examples (module doc), one forward each: ``retrieved`` (the
    value's tokens, after the separator), ``correct`` (the whole answer = greedy exact match),
    ``lead_ok`` (the separator first), ``value_nll`` (nats of the value's tokens); ``token_acc``: the
    fraction of the answer's tokens whose argmax (after the right ones) is right."""
    opts = AttnOptions(temperature=list(tau) if isinstance(tau, tuple) else tau)
    dev, out = model_device(model), []
    with evaluating(model):
        for ex in examples:
            ids = torch.tensor([ex.prompt + ex.answer[:-1]], device=dev)  # [1, n - 1]
            k, lead = len(ex.answer), int(getattr(ex, "lead", 0))
            if getattr(model, "chunked", False):
                h = model.final_hidden(ids, opts=opts)[:, -k:]  # [1, k, C]
                logits = model.logits_from_hidden(h)
            else:
                logits = model(ids, opts=opts)[:, -k:]  # [1, k, V]
            logp = torch.log_softmax(logits[0].float(), -1)  # [k, V]
            pred = logp.argmax(-1).tolist()
            nll = -logp[torch.arange(k), torch.tensor(ex.answer, device=logp.device)]  # [k]
            out.append({"length": ex.target_length, "tokens": ex.length, "depth": ex.depth,
                        "retrieved": bool(pred[lead:] == ex.answer[lead:]), "correct": bool(pred == ex.answer),
                        "lead_ok": bool(pred[:lead] == ex.answer[:lead]), "lead": lead,
                        "value_nll": float(nll[lead:].sum()), "pred": pred, "answer": ex.answer,
                        "token_acc": float(np.mean([a == b for a, b in zip(pred, ex.answer)]))})
    return out


def erf_record(model, segments, tau, checkpoint: bool = True) -> dict:
    """ERF (Sandwich §5.1) of the last token of ``segments`` [N, L + 1] at the cell's temperature."""
    from ..hf.erf import hf_measure_erf

    opts = AttnOptions(temperature=list(tau) if isinstance(tau, tuple) else tau)
    e = hf_measure_erf(model, segments, opts=opts, checkpoint=checkpoint)
    return {"erf_tokens": int(e["erf_tokens"]), "segments": e["segments"], "peak_memory_mb": e["peak_memory_mb"],
            "checkpointed": e["checkpointed"], "c": [round(float(v), 6) for v in e["c"]]}

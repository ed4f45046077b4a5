"""T2 long-context retrieval tasks (thesis ch. 5 §5.3, §5.5.2; docs/protocols.md).

* passkey -- Mohtashami & Jaggi (2023): a 5-digit pass key hidden at a chosen depth in repeated
  junk sentences ("The grass is green. The sky is blue. ..."), then asked for.
* kv (line retrieval) -- Li et al. (2023, LongChat lines): many "line K: value V" records with
  distinct random keys; one line's value is asked for; depth = that line's place in the list.

Topic retrieval (LongChat topics: name the *first* topic of a long multi-topic conversation) is
not generated: it needs real conversations whose topic must be inferred from their content. A
synthetic stand-in ("we talk about <word>" markers in junk text) is just passkey with
distractors, so it would measure nothing beyond the two tasks here under a misleading name.

Examples are built at token level from separately encoded pieces (preamble, junk sentences,
needle, question, answer), so a prompt's length is controlled exactly in *tokens* for any
tokenizer with ``encode(str) -> ids`` (our bytes/BPE codecs in extrapolab.data.tokenizer).
An instruct model reads the task as one user turn of its chat template: ``chat=(head, tail)``
(token ids around the user's text, e.g. from ``hf.data.chat_wrap``) puts ``head`` before the
preamble, asks the question as the user ("What is the pass key?"), closes the turn with ``tail``
and starts the assistant's answer ("The pass key is"), whose continuation is the answer.
The answer is " " + the value, tokenized as it follows the prompt in running text
(:func:`answer_ids`); ``Example.lead`` counts its tokens before the value's own (the separator, for
tokenizers that encode the space alone), so a scorer can tell retrieving the value from the
separator a model may not put first (an instruct model may continue "The pass key is" with " a
..."). Everything is a pure function of (seed, kind, length, depth, index): adding lengths never
changes other examples. Scoring: exact match of greedy decoding (full-context ``model(idx)``, no cache)
of as many tokens as the answer has, per L_ex and depth, at any temperature: a tau other than 1
is applied by the caller's ``scope(model, tau)`` context (the alignment study passes
``align.temperature_scope``; this package knows no temperature).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from ..analysis.common import save_figure
from ..data.tokenizer import BytesCodec
from ..io import UserError

KINDS = ("passkey", "kv")
JUNK = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
TEMPLATES = {  # (preamble, question, answer); the needle / lines are built per kind below
    "passkey": ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.\n",
                "\nWhat is the pass key? The pass key is", " {v}"),
    "kv": ("Below is a record of lines I want you to remember. Each line holds a key and a value. "
           "I will ask for the value of one line.\n",
           "What is the value of line {k}? The value of line {k} is", " {v}"),
}
_KIND_ID = {"passkey": 1, "kv": 2}
CHAT_QA = {"passkey": ("\nWhat is the pass key?", "The pass key is"),  # (user's question, assistant's start)
           "kv": ("\nWhat is the value of line {k}?", "The value of line {k} is")}


@dataclass
class Example:
    kind: str
    prompt: list  # token ids
    answer: list  # token ids
    depth: float  # requested needle depth in [0, 1]
    needle_pos: int  # token index where the needle starts
    length: int  # len(prompt) + len(answer)
    target_length: int
    key: str
    value: str
    lead: int = 0  # answer tokens before the value's own: the separator, where the tokenizer encodes it alone

    def to_dict(self) -> dict:
        return asdict(self)


def byte_tokenizer():
    return BytesCodec()


def _enc(tok, text: str) -> list[int]:
    return [int(i) for i in tok.encode(text)]


def answer_ids(tok, before: str, value: str) -> tuple[list[int], int]:
    """(ids of " " + ``value`` as they follow ``before`` -- the text the prompt ends with -- in running
    text, how many of them come before the value's own ids). The ids are the tail of the joint
    encoding of ``before`` + " " + ``value`` where that encoding starts with ``before``'s ids, so they
    are what a model reading the prompt would have to produce (no split of a merged token); ``lead``
    is the separator's ids when the tokenizer encodes the space apart from the digits (SmolLM2:
    ' ' then '1', '2', ...; a byte codec: b' '), else 0 (a tokenizer whose ' 12' is one token)."""
    head, joint = _enc(tok, before), _enc(tok, f"{before} {value}")
    a = joint[len(head):] if joint[:len(head)] == head else _enc(tok, f" {value}")
    sep, own = _enc(tok, " "), _enc(tok, value)
    lead = len(sep) if sep and a == sep + own else 0
    return a, lead


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"unknown retrieval task {kind!r}; use one of: {', '.join(KINDS)}")


def _question(kind: str, tok, chat, key) -> tuple[list[int], str]:
    """(the question's ids, the text the prompt ends with: the answer prefix); with ``chat`` the user
    asks, ``tail`` ends the turn, the assistant starts."""
    if chat is None:
        text = TEMPLATES[kind][1].format(k=key)
        return _enc(tok, text), text
    user, reply = CHAT_QA[kind]
    reply = reply.format(k=key)
    return _enc(tok, user.format(k=key)) + [int(i) for i in chat[1]] + _enc(tok, reply), reply


def make_example(kind: str, length: int, depth: float, rng: np.random.Generator, tok, preamble: bool = True,
                 chat=None) -> Example:
    """One example whose prompt + answer has at most ``length`` tokens (filled as far as whole
    junk sentences / lines allow); ``chat``: (head, tail) ids of a chat template (module doc)."""
    _check_kind(kind)
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"needle depth must be in [0, 1], got {depth}")
    pre_t = TEMPLATES[kind][0]
    pre = ([int(i) for i in chat[0]] if chat else []) + (_enc(tok, pre_t) if preamble else [])
    if kind == "passkey":
        v = str(int(rng.integers(10000, 100000)))
        k = "pass key"
        needle = _enc(tok, f" The pass key is {v}. Remember it. {v} is the pass key.")
        q, before = _question(kind, tok, chat, k)
        a, lead = answer_ids(tok, before, v)
        budget = length - len(pre) - len(needle) - len(q) - len(a)
        units, start = [], int(rng.integers(len(JUNK)))
        junk = [_enc(tok, " " + s) for s in JUNK]
        while budget >= len(junk[(start + len(units)) % len(JUNK)]):
            u = junk[(start + len(units)) % len(JUNK)]
            units.append(u)
            budget -= len(u)
        at = int(round(depth * len(units)))
        body_before, body_after = units[:at], units[at:]
        parts = [pre, *body_before, needle, *body_after, q]
    else:
        n_max = max(4, length // 4)
        keys = rng.choice(np.arange(1000, 10000), size=min(n_max, 9000), replace=False)
        vals = rng.integers(10000, 100000, size=keys.size)
        lines = [_enc(tok, f"line {kk}: value {vv}\n") for kk, vv in zip(keys, vals)]
        budget, n = length - len(pre), 0
        while n < len(lines) and budget >= len(lines[n]):
            budget -= len(lines[n])
            n += 1
        while True:  # drop lines until the question and answer fit as well
            at = int(round(depth * max(n - 1, 0)))
            k, v = str(keys[at]), str(vals[at])
            q, before = _question(kind, tok, chat, k)
            a, lead = answer_ids(tok, before, v)
            if n < 2 or len(pre) + sum(len(x) for x in lines[:n]) + len(q) + len(a) <= length:
                break
            n -= 1
        needle = lines[at]
        if n < 2:
            raise UserError(f"length {length} is too short for the kv task; use lengths >= {min_length(kind, tok, preamble, chat)}")
        body_before, body_after = lines[:at], lines[at + 1:n]
        parts = [pre, *body_before, needle, *body_after, q]
    prompt = [i for p in parts for i in p]
    if len(prompt) + len(a) > length:
        raise UserError(f"length {length} is too short for the {kind} task: it needs >= "
                        f"{min_length(kind, tok, preamble, chat)} tokens; use longer lengths (or no preamble)")
    needle_pos = sum(len(p) for p in [pre, *body_before])
    return Example(kind, prompt, a, float(depth), needle_pos, len(prompt) + len(a), int(length), k, v, lead)


def min_length(kind: str, tokenizer=None, preamble: bool = True, chat=None) -> int:
    """Fewest tokens an example of ``kind`` can have (no junk; two lines for kv), with slack."""
    _check_kind(kind)
    tok = tokenizer or byte_tokenizer()
    pre_t, _, a_t = TEMPLATES[kind]
    n = (len(_enc(tok, pre_t)) if preamble else 0) + (len(chat[0]) if chat else 0)
    if kind == "passkey":
        n += len(_enc(tok, " The pass key is 99999. Remember it. 99999 is the pass key."))
    else:
        n += 2 * len(_enc(tok, "line 9999: value 99999\n"))
    return n + len(_question(kind, tok, chat, 9999)[0]) + len(_enc(tok, a_t.format(v=99999))) + 4


def _rng(seed: int, kind: str, *more: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), _KIND_ID[kind], *[int(x) for x in more]])


def make_examples(kind: str, lengths: Sequence[int], depths: Sequence[float], n: int, seed: int = 0,
                  tokenizer=None, preamble: bool = True, chat=None) -> list[Example]:
    """``n`` examples per (length, depth) cell, reproducible from ``seed`` (``chat``: see make_example)."""
    _check_kind(kind)
    tok = tokenizer or byte_tokenizer()
    return [make_example(kind, int(L), float(d), _rng(seed, kind, L, round(d * 10000), i), tok, preamble, chat)
            for L in lengths for d in depths for i in range(int(n))]


def retrieval_stream(kind: str, n_tokens: int, length: int, seed: int = 0, tokenizer=None,
                     shortest: int | None = None, preamble: bool = False) -> np.ndarray:
    """A training token stream: examples (prompt + answer) of random length <= ``length`` - 1 and
    random depth, each followed by EOT, truncated to ``n_tokens``. ``kind`` may be "mix"."""
    kinds = KINDS if kind == "mix" else (kind,)
    for k in kinds:
        _check_kind(k)
    tok = tokenizer or byte_tokenizer()
    eot = getattr(tok, "eot_id", None)
    if eot is None:
        raise UserError("the tokenizer has no eot_id; pass an extrapolab.data tokenizer (bytes or bpe)")
    floor = max(min_length(k, tok, preamble) for k in kinds)
    if length - 1 < floor:
        raise UserError(f"training length {length} is too short for {kind} documents (need >= {floor + 1} tokens)")
    lo = max(floor, int(shortest or length // 4))
    lo = min(lo, length - 1)
    out, total, j = [], 0, 0
    while total < n_tokens:
        k = kinds[j % len(kinds)]
        r = _rng(seed, k, 7, j)
        doc = make_example(k, int(r.integers(lo, length)), float(r.random()), r, tok, preamble)
        ids = doc.prompt + doc.answer + [eot]
        out.append(ids)
        total += len(ids)
        j += 1
    flat = np.fromiter((i for ids in out for i in ids), dtype=np.int64)[:n_tokens]
    vocab = getattr(tok, "vocab_size", int(flat.max()) + 1)
    return flat.astype(np.uint16 if vocab <= 2**16 else np.uint32)


# ---------------------------------------------------------------- scoring
TauSpec = "float | dict[int, float] | Callable[[int], float] | None"  # None = tau 1 (no alignment)


def _tau_for(spec, length: int) -> float:
    if spec is None:
        return 1.0
    if callable(spec):
        return float(spec(length))
    if isinstance(spec, dict):
        v = spec.get(length, spec.get(str(length)))
        if v is None:
            raise UserError(f"no temperature for length {length}; align at that length first")
        return float(v)
    return float(spec)


def _last_logits(model, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    out = out["logits"] if isinstance(out, dict) else out
    return out[:, -1]  # [B, V]


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """prompts [B, L] -> greedy continuation [B, n_new] (full-context forward per token)."""
    idx = prompts
    for _ in range(n_new):
        nxt = _last_logits(model, idx).argmax(-1, keepdim=True)  # [B, 1]
        idx = torch.cat([idx, nxt], dim=1)  # [B, L+1]
    return idx[:, prompts.shape[1]:]


def score(model, examples: Sequence[Example], temperature: TauSpec = None, batch_size: int = 8,
          rule: str = "none", device=None, scope=None) -> list[dict]:
    """Exact-match records (one per example) of greedy decoding at the given temperature(s);
    ``scope(model, tau)``: the context that runs ``model`` at tau (needed for any tau other than 1)."""
    if device is None:
        p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = p.device if p is not None else "cpu"
    groups: dict[tuple, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault((len(ex.prompt), len(ex.answer), ex.target_length), []).append(i)
    records: list[dict | None] = [None] * len(examples)
    for (_, n_new, target), ids in groups.items():
        tau = _tau_for(temperature, target)
        if tau != 1.0 and scope is None:
            raise ValueError(f"score() at temperature {tau} needs scope=, the context that applies it")
        for s in range(0, len(ids), batch_size):
            chunk = ids[s:s + batch_size]
            prompts = torch.tensor([examples[i].prompt for i in chunk], dtype=torch.long, device=device)
            with scope(model, tau) if tau != 1.0 else nullcontext():
                pred = greedy(model, prompts, n_new).tolist()
            for i, p in zip(chunk, pred):
                ex = examples[i]
                records[i] = {"kind": ex.kind, "rule": rule, "tau": tau, "length": ex.target_length,
                              "depth": ex.depth, "correct": bool(p == ex.answer), "pred": p, "answer": ex.answer}
    return records  # type: ignore[return-value]


def evaluate(model, examples: Sequence[Example], rules: dict[str, TauSpec], batch_size: int = 8,
             scope=None) -> list[dict]:
    """Score ``examples`` once per alignment rule, e.g. {"none": None, "pmax": {1024: 0.85, ...}}
    (``scope``: see :func:`score`)."""
    out = []
    for rule, spec in rules.items():
        out += score(model, examples, spec, batch_size, rule, scope=scope)
    return out


def accuracy_grid(records: Sequence[dict], rule: str) -> tuple[list[int], list[float], np.ndarray]:
    """(lengths, depths, accuracy [depth, length]) for one rule; nan where a cell has no example."""
    rec = [r for r in records if r["rule"] == rule]
    Ls = sorted({r["length"] for r in rec})
    Ds = sorted({r["depth"] for r in rec})
    acc = np.full((len(Ds), len(Ls)), np.nan)
    for i, d in enumerate(Ds):
        for j, L in enumerate(Ls):
            cell = [r["correct"] for r in rec if r["depth"] == d and r["length"] == L]
            if cell:
                acc[i, j] = float(np.mean(cell))
    return Ls, Ds, acc


def retrieval_table(records: Sequence[dict]) -> str:
    """Markdown: accuracy (%) per rule x L_ex (like thesis Table 5.4), and per rule x depth."""
    rules = list(dict.fromkeys(r["rule"] for r in records))
    Ls = sorted({r["length"] for r in records})
    Ds = sorted({r["depth"] for r in records})

    def pct(sel):
        return f"{100 * np.mean(sel):.0f}" if sel else "-"

    kinds = ", ".join(sorted({r["kind"] for r in records}))
    lines = [f"Retrieval accuracy (%), task: {kinds}", "", "| rule | " + " | ".join(map(str, Ls)) + " | avg |",
             "|---" * (len(Ls) + 2) + "|"]
    for rule in rules:
        rr = [r for r in records if r["rule"] == rule]
        cells = [pct([r["correct"] for r in rr if r["length"] == L]) for L in Ls]
        lines.append(f"| {rule} | " + " | ".join(cells) + f" | {pct([r['correct'] for r in rr])} |")
    lines += ["", "| rule \\ depth | " + " | ".join(f"{d:g}" for d in Ds) + " |", "|---" * (len(Ds) + 1) + "|"]
    for rule in rules:
        rr = [r for r in records if r["rule"] == rule]
        lines.append(f"| {rule} | " + " | ".join(pct([r["correct"] for r in rr if r["depth"] == d]) for d in Ds) + " |")
    return "\n".join(lines)


def plot_heatmap(records: Sequence[dict], stem, title: str = "") -> list:
    """Depth x length accuracy heat map, one panel per rule; writes ``stem``.png and .svg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = list(dict.fromkeys(r["rule"] for r in records))
    if not rules:
        raise UserError("no retrieval records to plot")
    ncol = min(4, len(rules))
    nrow = math.ceil(len(rules) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol + 0.8, 3.0 * nrow + 0.4), squeeze=False)
    for ax in axes.flat[len(rules):]:
        ax.axis("off")
    for ax, rule in zip(axes.flat, rules):
        Ls, Ds, acc = accuracy_grid(records, rule)
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", origin="upper", aspect="auto")
        ax.set_xticks(range(len(Ls)), [str(L) for L in Ls], rotation=45, fontsize=7)
        ax.set_yticks(range(len(Ds)), [f"{d:g}" for d in Ds], fontsize=7)
        for (i, j), v in np.ndenumerate(acc):
            if not math.isnan(v):
                ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=6)
        ax.set_title(rule, fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("length (tokens)")
    fig.subplots_adjust(hspace=0.45)
    for row in axes:
        row[0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    try:
        return save_figure(fig, stem)
    finally:
        plt.close(fig)

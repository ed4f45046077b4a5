"""Scoring RULER samples: RULER's metrics on greedy output, and teacher-forced answer scores.

RULER (NVIDIA/RULER ``scripts/eval/evaluate.py``, ``scripts/eval/synthetic/constants.py`` at
c3f5e3b; Hsieh et al. 2024 §4): the model reads ``input + answer_prefix`` and decodes greedily up to
``tokens_to_generate`` tokens; the prediction is stripped, every character in ``\\x00-\\x1f``
becomes a newline, and it is stripped again (:func:`postprocess`). ``string_match_all`` = the mean
over samples of the fraction of references found in the prediction (case-insensitive substrings)
x 100, ``string_match_part`` = the mean of "any reference found" x 100, each rounded to 2 places
once, at the task's average, as RULER computes it (``sum(terms) / n * 100``; a sample's record keeps its
term unrounded, ``match``). Over-generation is not penalised.

Small base models follow no instructions, so every sample is also scored by teacher forcing: after
the same prompt, the log-probability of the target's tokens (:func:`.fit.finish`: the references
written the way the task's one-shot example or answer prefix leads into them) and whether the
argmax at each of those positions is the target token (``tf_exact``: exact match of greedy decoding
of the target's length; ``tf_token_acc``: the fraction of positions).

One prefill per sample serves both: the prompt runs once with a KV cache; the target is fed after
a copy of that cache (teacher forcing), and greedy decoding continues from the cache itself, one
token per step, until ``tokens_to_generate`` or an end id (the tokenizer's eos / end-of-text, an HF
model's ``generation_config.eos_token_id``). Hugging Face models run through their base model and
output head on the positions needed (never an [L, V] logit matrix); extrapolab's GPT through its
``KVCache``. Tested: cached decoding equals full-context greedy decoding, teacher-forced scores
equal one full forward's.
"""
from __future__ import annotations

import copy
import re
import time
from typing import Callable

import torch

from ...io import UserError
from .prompt import PromptFormat
from .spec import TASKS

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's ``postprocess_pred``."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def term_all(pred: str, refs: list[str]) -> float:
    """One sample's ``string_match_all`` term as RULER writes it: the fraction of references in ``pred``."""
    return sum([1.0 if r.lower() in pred.lower() else 0.0 for r in refs]) / len(refs)


def term_part(pred: str, refs: list[str]) -> float:
    """One sample's ``string_match_part`` term: 1 if any reference is in ``pred``."""
    return max([1.0 if r.lower() in pred.lower() else 0.0 for r in refs])


def match_all(pred: str, refs: list[str]) -> float:
    """One sample's ``string_match_all`` term x 100 (unrounded)."""
    return 100.0 * term_all(pred, refs)


def match_part(pred: str, refs: list[str]) -> float:
    """One sample's ``string_match_part`` term x 100: 100 if any reference is in ``pred``."""
    return 100.0 * term_part(pred, refs)


def task_score(terms: list[float]) -> float:
    """RULER's score of a task from its samples' terms: ``round(sum(terms) / n * 100, 2)``, rounded once
    (``scripts/eval/synthetic/constants.py``), in RULER's order of operations."""
    return round(sum(terms) / len(terms) * 100, 2)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's ``string_match_all`` (rounded to 2 places once, at the average)."""
    return task_score([term_all(p, r) for p, r in zip(preds, refs)])


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's ``string_match_part`` (rounded to 2 places once, at the average)."""
    return task_score([term_part(p, r) for p, r in zip(preds, refs)])


#: a task's metric -> its per-sample term (0-1)
METRICS = {"string_match_all": term_all, "string_match_part": term_part}


def add_terms(records: list[dict], samples: list[dict]) -> list[dict]:
    """Records scored before ``match`` was kept (their ``score`` rounded per sample): each gets its term
    again from its greedy output and its sample's references, so the task's score is rounded once."""
    for r in records:
        if "pred" in r and "match" not in r:
            s = samples[int(r["index"])]
            r["match"] = METRICS[TASKS[s["task"]].metric](r["pred"], s["outputs"])
            r["score"] = 100.0 * r["match"]
    return records


# ---------------------------------------------------------------- model drivers
class _Driver:
    """prefill(ids) -> logits of the last position [V]; extend(ids) -> logits [len(ids), V], both
    growing ``self.cache``."""

    def __init__(self, model) -> None:
        from ...hf.adapter import HFCausalLM
        from ...hf.load import HFModel

        if isinstance(model, HFModel):
            model = HFCausalLM(model, prefix="none")
        self.hf = isinstance(model, HFCausalLM)
        self.model = model
        self.device = next(model.parameters()).device
        self.cache, self.n = None, 0

    def _run(self, ids: list[int], last_only: bool) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, l]
        if self.hf:
            m = self.model
            if m.chunked:
                out = m.hf.base_model(input_ids=x, past_key_values=self.cache, use_cache=True)
                h = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]  # [l|1, C]
                logits = m.logits_from_hidden(h)  # [l|1, V]
            else:
                out = m.hf(input_ids=x, past_key_values=self.cache, use_cache=True)
                logits = out.logits[0, -1:] if last_only else out.logits[0]  # [l|1, V]
            self.cache = out.past_key_values
        else:
            from ...model.cache import KVCache

            if self.cache is None:
                self.cache = KVCache(len(self.model.blocks))
            pos = torch.arange(self.n, self.n + len(ids), device=self.device)  # [l]
            logits = self.model(x, positions=pos, cache=self.cache)[0]  # [l, V]
            logits = logits[-1:] if last_only else logits
        self.n += len(ids)
        return logits.float()

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.cache, self.n = None, 0
        return self._run(ids, True)[0]  # [V]

    def extend(self, ids: list[int]) -> torch.Tensor:
        return self._run(ids, False)  # [l, V]

    def fork(self) -> "_Driver":
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        return other


@torch.no_grad()
def score_sample(model, sample: dict, fmt: PromptFormat, *, greedy: bool = True, teacher: bool = True,
                 stop: set[int] | None = None, driver: _Driver | None = None) -> dict:
    """One sample's record: RULER's metric on greedy output and the teacher-forced scores."""
    d = driver or _Driver(model)
    t0 = time.perf_counter()
    last = d.prefill(sample["ids"])  # [V]: predicts the first answer token
    rec = {k: sample.get(k) for k in ("task", "length", "index", "tokens", "depth")}
    if teacher:
        tgt = sample["target_ids"]
        if not tgt:
            raise UserError(f"sample {sample.get('index')} of {sample.get('task')} has an empty target")
        fork = d.fork() if greedy else d
        logits = torch.cat([last[None], fork.extend(tgt[:-1])]) if len(tgt) > 1 else last[None]  # [k, V]
        logp = torch.log_softmax(logits, -1)  # [k, V]
        t = torch.tensor(tgt, device=logp.device)  # [k]
        hit = logits.argmax(-1) == t  # [k]
        tf_logp = float(logp.gather(1, t[:, None]).sum())
        rec.update(tf_logprob=round(tf_logp, 4), tf_tokens=len(tgt), tf_mean_logprob=round(tf_logp / len(tgt), 4),
                   tf_exact=bool(hit.all()), tf_token_acc=round(float(hit.float().mean()), 4))
    if greedy:
        stop = stop if stop is not None else set()
        out: list[int] = []
        nxt = int(last.argmax())
        while True:
            out.append(nxt)
            if nxt in stop or len(out) >= sample["tokens_to_generate"]:
                break
            nxt = int(d.extend([nxt])[-1].argmax())
        pred = postprocess(fmt.decode([i for i in out if i not in stop]))
        term = METRICS[TASKS[sample["task"]].metric](pred, sample["outputs"])
        rec.update(pred=pred, generated=len(out), match=term, score=100.0 * term)  # rounded at the average only
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def score_samples(model, samples: list[dict], tokenizer, *, chat="off", greedy: bool = True, teacher: bool = True,
                  say: Callable[[str], None] | None = None) -> list[dict]:
    """Score ``samples`` (from :func:`.samples.ruler_samples`) on ``model``: one record per sample
    with ``match`` (RULER's metric term, 0-1, on greedy output; ``score`` = 100 x it, unrounded) and the
    teacher-forced ``tf_*``.

    ``model``: an ``hf.HFModel`` / ``hf.HFCausalLM`` (its raw forward: the samples' ids already hold
    what the tokenizer adds in front) or extrapolab's GPT; it runs where its parameters are, under
    whatever autocast the caller set. ``tokenizer``: the one the samples were made with (a
    :class:`PromptFormat` or what :func:`ruler_samples` took), used to decode greedy output."""
    if not (greedy or teacher):
        raise UserError("score RULER samples with greedy decoding, teacher forcing or both")
    fmt = tokenizer if isinstance(tokenizer, PromptFormat) else PromptFormat(tokenizer, chat)
    d = _Driver(model)
    stop = fmt.stop_ids(d.model.hf if d.hf else None)
    if d.hf:
        d.model.check_length(max(s["length"] for s in samples))
    was = d.model.training
    d.model.eval()
    out = []
    try:
        for s in samples:
            out.append(score_sample(d.model, s, fmt, greedy=greedy, teacher=teacher, stop=stop, driver=d))
            if say:
                say(f"  {s['task']} @ {s['length']} #{s['index']}: " + ", ".join(
                    f"{k} {round(out[-1][k], 2) if k == 'score' else out[-1][k]}"  # shown rounded, kept whole
                    for k in ("score", "tf_exact", "tf_mean_logprob", "seconds") if k in out[-1]))
    finally:
        d.model.train(was)
        d.cache = None
    return out

"""Fitting a RULER sample into a length, and the sample record every generator returns.

RULER (``scripts/data/synthetic/*.py`` ``generate_samples``) fits each task the same way: estimate
the tokens per haystack unit from one draw, binary-search the largest haystack size whose prompt
plus ``tokens_to_generate`` fits ``max_seq_length`` (every probe is a fresh random draw, so the
search consumes the seeded random stream), then draw the sample at that size and, while it is
still too long, shrink it by one step (``incremental``) and draw again. Token counts are the
model's own (:class:`.prompt.PromptFormat`).

Seeds. RULER seeds Python's ``random`` (and numpy's legacy global generator) once per chunk with
``random_seed + chunk_idx`` (42 by default), runs the search once per chunk and draws the chunk's
samples one after another. Each generator is one such stream: ``fit()`` is the search (for vt the
one-shot example first, as RULER's ``main``), ``draw(i, fitted)`` one sample. By default every
sample is its own chunk (``sample(i)`` = ``draw(i, fit())`` with seed ``seed + i``): RULER's
``--chunk_amount n``, so a sample does not depend on how many are drawn; RULER's default single
stream (``--chunk_amount 1``) is ``seeding="stream"`` in :func:`.samples.ruler_samples`.

Where RULER would loop forever (a prompt that does not fit even at the smallest haystack), the
smallest size is redrawn a few times and then refused with one line naming the shortest length.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ...io import UserError
from .prompt import PromptFormat
from .spec import Task

MIN_RETRIES = 20  #: redraws at the smallest haystack before the length is refused


class TooLong(Exception):
    """A draw that cannot be made at this size (e.g. more distinct words than the pool holds)."""


@dataclass
class Draft:
    """One drawn prompt: RULER's ``input`` + ``answer_prefix`` and ``outputs``."""

    text: str  # the whole prompt: model template, task text, answer prefix
    prefix: str  # the answer prefix at its end
    outputs: list[str]
    context_from: int = 0  # where the scored context starts in ``text`` (after a one-shot example)
    extra: dict = field(default_factory=dict)


def binary_search(make: Callable[[int], Draft], fits: Callable[[Draft], bool], lo: int, hi: int) -> int | None:
    """RULER's search: the largest size in [lo, hi] whose fresh draw fits (None if none did)."""
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            ok = fits(make(mid))
        except TooLong:
            ok = False
        if ok:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


class TooShort(UserError):
    """The length cannot hold the task's smallest haystack (with its tokens to generate)."""


def draw_fitting(make, tokens, size: int, step: int, max_len: int, task: Task, unit: str) -> tuple[Draft, int, int]:
    """RULER's final loop: draw at ``size``; while too long, shrink by ``step`` (down to ``step``)
    and draw again. Returns (draft, its token count incl. tokens_to_generate, the size used)."""
    tries, smallest = 0, None
    while True:
        try:
            d = make(size)
            n = tokens(d)
        except TooLong:
            d, n = None, max_len + 1
        if n <= max_len:
            return d, n, size
        if size > step:
            size -= step
            continue
        smallest = n if smallest is None else min(smallest, n)
        tries += 1
        if tries >= MIN_RETRIES:
            raise TooShort(f"length {max_len} is too short for RULER task {task.name}: its smallest haystack "
                            f"({size} {unit}) takes {smallest} tokens ({task.tokens_to_generate} of them to generate); "
                            f"use lengths >= {smallest}")


def first_order(outputs: list[str], text: str, start: int, numbered: bool = False) -> list[str]:
    """``outputs`` in the order they first appear in ``text[start:]`` (numbered lists: as "N. word")."""
    def where(o: str) -> int:
        pat = r"(?<=\. )" + re.escape(o) + r"(?=\s|$)" if numbered else re.escape(o)
        m = re.compile(pat).search(text, start)
        return m.start() if m else len(text)

    return sorted(outputs, key=where)


def finish(task: Task, fmt: PromptFormat, d: Draft, *, index: int, seed: int, length: int, size: int,
           target: str, depth_of: str | None = None) -> dict:
    """The sample record (JSON): RULER's fields (``input``, ``outputs``, ``answer_prefix``, ``length``,
    ``token_position_answer``) plus the ids the model reads, the teacher-forced target and the
    needle depth (token position of ``depth_of`` / prompt tokens)."""
    ids = fmt.encode(d.text)
    inp = d.text[:len(d.text) - len(d.prefix)]
    pos = depth = None
    if depth_of is not None:
        at = inp.find(depth_of, d.context_from)
        if at >= 0:
            pos = fmt.count(inp[:at])
            depth = round(pos / max(1, len(ids)), 4)
    return {"task": task.name, "index": int(index), "seed": int(seed), "length": int(length),
            "tokens_to_generate": task.tokens_to_generate, "input": inp, "answer_prefix": d.prefix,
            "outputs": list(d.outputs), "target": target, "ids": ids, "target_ids": fmt_plain(fmt, target),
            "tokens": len(ids) + task.tokens_to_generate, "haystack": int(size), "token_position_answer": pos,
            "depth": depth, **d.extra}


def fmt_plain(fmt: PromptFormat, text: str) -> list[int]:
    """Ids of ``text`` on its own (the teacher-forced target after the prompt)."""
    if fmt.hf:
        return list(fmt.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return [int(i) for i in fmt.tokenizer.encode(text)]

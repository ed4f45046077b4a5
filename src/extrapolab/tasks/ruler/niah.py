"""RULER's needle-in-a-haystack family (8 configurations): NVIDIA/RULER
``scripts/data/synthetic/niah.py`` at c3f5e3b; Hsieh et al. 2024 (RULER) §3.1, Table 2.

Per sample, as RULER draws it (Python ``random`` seeded once, :mod:`.fit`):

* ``num_needle_k = max(k, q)`` keys, each with ``num_needle_v`` values; a needle per (key, value):
  "One of the special magic {type_needle_v} for {key} is: {value}." (always the plural type);
  the needles shuffled by ``random.Random(seed)``. Keys / values: ``words`` = ``random.choice``
  over the sorted adjective-noun pairs, ``numbers`` = ``randint(10**6, 10**7 - 1)``, ``uuids`` =
  ``uuid.UUID(int=getrandbits(128), version=4)``.
* Haystacks. ``essay``: the first N words of the essay text (repeated if N exceeds it), split into
  sentences; the needles go before the sentence ``int(len(sentences) * depth / 100)`` for depths
  sampled without replacement from ``round(linspace(0, 100, 40))``; everything joined by spaces.
  ``noise``: N copies of "The grass is green. ... There and back again."; ``needle``: N distractor
  needles with random keys and values; for both the needles are inserted at
  ``sorted(sample(range(N), needles), reverse=True)`` and the lines joined by newlines.
* ``num_needle_q`` of the keys are asked for ("k1, k2, and k3"); the answers are all their values.
  When q·v = 1 the template (and answer prefix) goes singular: "Some" -> "A", "are all" -> "is",
  "are" -> "is", "answers" -> "answer", and the type loses its "s".
* Fitting: haystack steps of 500 words (essay) or 25 lines (5 below 4,096 tokens), RULER's search.

The teacher-forced target is " " + the answers joined by ", " in the order they appear in the
text; the needle depth is RULER's ``token_position_answer`` (first answer) over the prompt length.
"""
from __future__ import annotations

import random
import uuid

import numpy as np

from .fit import Draft, binary_search, draw_fitting, finish, first_order
from .prompt import PromptFormat
from .spec import Task
from .text import essay_haystack, niah_words, split_sentences

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


class Niah:
    """One seeded RULER NIAH run for one sample (module doc)."""

    def __init__(self, task: Task, fmt: PromptFormat, seed: int, max_len: int, essay=None) -> None:
        self.task, self.fmt, self.seed, self.max_len = task, fmt, int(seed), int(max_len)
        a = task.args
        self.nk, self.nv, self.nq = max(a["num_needle_k"], a["num_needle_q"]), a["num_needle_v"], a["num_needle_q"]
        self.kind_k, self.kind_v, self.hay = a["type_needle_k"], a["type_needle_v"], a["type_haystack"]
        self.r = random.Random(self.seed)  # RULER: random.seed(args.random_seed)
        self.words = niah_words() if "words" in (self.kind_k, self.kind_v) else None
        self.essay = essay_haystack(essay)[0] if self.hay == "essay" else None

    def _random(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.r.randint(10 ** 6, 10 ** 7 - 1))
        if kind == "words":
            return self.r.choice(self.words)
        return str(uuid.UUID(int=self.r.getrandbits(128), version=4))

    def _context(self, num: int, needles: list[str]) -> str:
        if self.hay == "essay":
            words = self.essay
            if num > len(words):
                words = words * ((num + len(words) - 1) // len(words))
            sents = split_sentences(" ".join(words[:num]).strip())
            at = [0] + sorted(int(len(sents) * (d / 100)) for d in self.r.sample(DEPTHS, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(at)):
                parts.append(" ".join(sents[at[i - 1]:at[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            return " ".join(parts)
        if self.hay == "noise":
            lines = [NOISE] * num
        else:
            lines = [NEEDLE.format(type_needle_v=self.kind_v, key=self._random(self.kind_k),
                                   value=self._random(self.kind_v)) for _ in range(num)]
        for i, needle in zip(sorted(self.r.sample(range(num), len(needles)), reverse=True), needles):
            lines.insert(i, needle)
        return "\n".join(lines)

    def make(self, num: int) -> Draft:
        """RULER's ``generate_input_output(num_haystack)``."""
        keys, values, needles = [], [], []
        for _ in range(self.nk):
            keys.append(self._random(self.kind_k))
            vals = []
            for _ in range(self.nv):
                vals.append(self._random(self.kind_v))
                needles.append(NEEDLE.format(type_needle_v=self.kind_v, key=keys[-1], value=vals[-1]))
            values.append(vals)
        random.Random(self.seed).shuffle(needles)
        context = self._context(num, needles)
        picked = self.r.sample(range(self.nk), self.nq)
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = self.task.template, self.task.answer_prefix, self.kind_v
        if self.nq * self.nv == 1:
            template, prefix = _singular(template), _singular(prefix)
            type_v = type_v[:-1]
        prefix = prefix.format(type_needle_v=type_v, query=query)
        text = self.fmt.wrap(template.format(type_needle_v=type_v, context=context, query=query), prefix)
        return Draft(text, prefix, answers)

    def _step(self) -> int:
        return 500 if self.hay == "essay" else (5 if self.max_len < 4096 else 25)

    def fit(self) -> int:
        """RULER's estimate and binary search, once per seeded stream (:mod:`.fit`): the haystack size."""
        step, L = self._step(), self.max_len
        per_unit = self.fmt.count(self.make(step).text) / step
        tokens = lambda d: self.fmt.count(d.text) + self.task.tokens_to_generate  # noqa: E731
        return binary_search(self.make, lambda d: tokens(d) <= L, step, max(int(L / per_unit * 3), step * 2)) or step

    def draw(self, index: int, size: int) -> dict:
        """One of RULER's samples at the searched ``size``, shrunk while too long, from this stream."""
        ttg, L = self.task.tokens_to_generate, self.max_len
        tokens = lambda d: self.fmt.count(d.text) + ttg  # noqa: E731
        d, _, size = draw_fitting(self.make, tokens, size, self._step(), L, self.task,
                                  "words" if self.hay == "essay" else "lines")
        target = " " + ", ".join(first_order(d.outputs, d.text, 0))
        return finish(self.task, self.fmt, d, index=index, seed=self.seed, length=L, size=size, target=target,
                      depth_of=d.outputs[0])

    def sample(self, index: int) -> dict:
        """RULER's ``generate_samples`` for one sample in its own stream (``--chunk_amount n``, :mod:`.fit`)."""
        return self.draw(index, self.fit())


def _singular(t: str) -> str:
    return t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")

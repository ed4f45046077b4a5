"""RULER's multi-hop tracing and aggregation tasks: variable tracking (``vt``), common-words
extraction (``cwe``) and frequent-words extraction (``fwe``). NVIDIA/RULER
``scripts/data/synthetic/{variable_tracking,common_words_extraction,freq_words_extraction}.py`` at
c3f5e3b; Hsieh et al. 2024 (RULER) §3.2-3.3.

**vt** (noise haystack, 1 chain of 4 hops; Python ``random`` and numpy's legacy generator, both
seeded). Names are 5 random capitals (drawn until all are distinct); a chain is
``VAR A = <np.random.randint(10000, 99999)>``, ``VAR B = VAR A `` ...; each chain's statements go
at ``sorted(sample(range(len(lines)), len(chain)))`` + j among the noise lines (order kept).
A one-shot example comes first: the same task with 3-letter names and the value 12345, fitted to
500 tokens with no tokens to generate, followed by its answer; before use its names are replaced by
fresh random ones of the same length and 12345 by a new value. Answer: the 5 names of the chain.
Steps of 10 noise lines (5 below 4,096 tokens; 5 for the example).

**cwe**. The pool is wonderwords' nouns + adjectives + verbs, sorted, unique, shuffled by
``random.Random(seed)``; a draw samples N distinct words, repeats the first 10 30x and the rest 3x
(below 4,096 tokens 6x / 1x), shuffles with ``random.Random(seed)`` and numbers them ("1. w 2. w").
One one-shot example (40 words at 10x / 3x; below 4,096: 20 at 3x / 1x) is the whole templated
prompt with its answer, then a newline and the task. Steps of 10 words; the search starts from a
4,096-word draw and an upper bound of twice the estimate. RULER takes words from
``json/english_words.json`` when N exceeds the pool (8,166 words: around 64k tokens); that list
is not shipped, so such a draw is refused (counts as too long in the search).

**fwe** (alpha 2). A vocabulary of ``(max_seq_length - tokens_to_generate) // 50`` random
6-letter words, sorted, shuffled by ``random.Random(seed)``, the first replaced by "..." (noise);
the word of rank k appears ``int(N k^-alpha / zeta(alpha))`` times, shuffled. N starts at
``budget // 6`` and grows by ``budget // 32`` until the prompt reaches the budget, then steps
back; each sample redraws the vocabulary at that N and shrinks while too long. Answer: ranks 2-4.

Teacher-forced targets: vt " " + the names joined by spaces (the one-shot's format after the
prefix's "they are: "), cwe " 1. w 2. w ..." (its one-shot's format) in the order the words first
appear in the list, fwe " " + the three words in rank order joined by ", ".
"""
from __future__ import annotations

import random
import string

import numpy as np

from ...io import UserError
from .fit import Draft, TooLong, binary_search, draw_fitting, finish, first_order
from .niah import NOISE
from .prompt import PromptFormat
from .spec import Task
from .text import cwe_words


class VariableTracking:
    def __init__(self, task: Task, fmt: PromptFormat, seed: int, max_len: int) -> None:
        self.task, self.fmt, self.seed, self.max_len = task, fmt, int(seed), int(max_len)
        self.chains, self.hops = task.args["num_chains"], task.args["num_hops"]
        self.r = random.Random(self.seed)  # random.seed(args.random_seed)
        self.np = np.random.RandomState(self.seed)  # np.random.seed(args.random_seed)

    def _chains(self, icl: bool):
        k, hops = (3, min(10, self.hops)) if icl else (5, self.hops)
        need = (hops + 1) * self.chains
        names = ["".join(self.r.choices(string.ascii_uppercase, k=k)).upper() for _ in range(need)]
        while len(set(names)) < need:
            names.append("".join(self.r.choices(string.ascii_uppercase, k=k)).upper())
        out_names, chains = [], []
        for i in range(0, len(names), hops + 1):  # as RULER: every slice of hops + 1 names is a chain
            these = names[i:i + hops + 1]
            out_names.append(these)
            chain = [f"VAR {these[0]} = 12345" if icl else f"VAR {these[0]} = {self.np.randint(10000, 99999)}"]
            chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)]
            chains.append(chain)
        return out_names, chains

    def make(self, num: int, icl: bool = False) -> Draft:
        names, chains = self._chains(icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * num
        for chain in chains:
            for j, p in enumerate(sorted(self.r.sample(range(len(lines)), len(chain)))):
                lines.insert(p + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        prefix = self.task.answer_prefix.format(num_v=self.hops + 1, query=value)
        body = self.task.template.format(context=context, query=value)
        text = body + prefix if icl else self.fmt.wrap(body, prefix)  # the one-shot has no model template
        return Draft(text, prefix, names[0])

    @staticmethod
    def _fit(make, count, max_len: int, step: int, extra: int) -> int:
        """RULER's estimate (3x the tokens per line) and search: total = prompt + ``extra``."""
        per_unit = count(make(step).text) / step
        best = binary_search(make, lambda d: count(d.text) + extra <= max_len, step,
                             max(int(max_len / per_unit * 3), step * 2))
        return best or step

    def _example(self) -> str:
        """RULER's ``sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500)``: the one-shot."""
        make = lambda n: self.make(n, icl=True)  # noqa: E731
        size = self._fit(make, self.fmt.count_plain, 500, 5, 0)
        try:
            d, _, _ = draw_fitting(make, lambda d: self.fmt.count_plain(d.text), size, 5, 500, self.task, "lines")
        except UserError:
            raise UserError(f"RULER task vt's one-shot example (5 noise lines at the least) does not fit its "
                            f"500-token budget in this tokenizer ({self.fmt.count_plain(make(5).text)} tokens); "
                            "vt cannot be generated for it: leave vt out of --tasks") from None
        return d.text + " " + " ".join(d.outputs) + "\n"

    def _randomize(self, example: str) -> str:
        for item in example.strip().split()[-self.hops - 1:]:
            example = example.replace(item, "".join(self.r.choices(string.ascii_uppercase, k=len(item))).upper())
        return example.replace("12345", str(self.np.randint(10000, 99999)))

    def fit(self) -> tuple[str, int]:
        """Once per seeded stream, as RULER's ``main``: the one-shot example, then the search (its size)."""
        example = self._example()
        step = 5 if self.max_len < 4096 else 10
        ttg = self.task.tokens_to_generate
        return example, self._fit(self.make, self.fmt.count, self.max_len, step, self.fmt.count_plain(example) + ttg)

    def draw(self, index: int, fitted: tuple[str, int]) -> dict:
        """One sample from this stream: the example renamed and re-valued, the task at the searched size."""
        example, size = fitted
        L, ttg = self.max_len, self.task.tokens_to_generate
        step, head = 5 if L < 4096 else 10, len(self.fmt.head)

        def make(n: int) -> Draft:
            d = self.make(n)
            shot = self._randomize(example) + "\n"
            d.text = d.text[:head] + shot + d.text[head:]
            d.context_from = head + len(shot)
            return d

        d, _, size = draw_fitting(make, lambda d: self.fmt.count(d.text) + ttg, size, step, L, self.task, "lines")
        target = " " + " ".join(first_order(d.outputs, d.text, d.context_from))
        return finish(self.task, self.fmt, d, index=index, seed=self.seed, length=L, size=size, target=target,
                      depth_of=d.outputs[0])

    def sample(self, index: int) -> dict:
        return self.draw(index, self.fit())


class CommonWords:
    def __init__(self, task: Task, fmt: PromptFormat, seed: int, max_len: int) -> None:
        self.task, self.fmt, self.seed, self.max_len = task, fmt, int(seed), int(max_len)
        self.r = random.Random(self.seed)
        self.words = list(cwe_words())
        random.Random(self.seed).shuffle(self.words)
        a = task.args
        self.cw, self.ucw, self.ncw, self.shots = a["freq_cw"], a["freq_ucw"], a["num_cw"], a["num_fewshot"]

    def _example(self, num: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        if num > len(self.words):
            raise TooLong(num)  # RULER switches to english_words.json here (module doc)
        full = self.r.sample(self.words, num)
        common_w, rest = full[:self.ncw], full[self.ncw:]
        words = common_w * int(common) + rest * int(uncommon)
        random.Random(self.seed).shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common_w

    def _prompt(self, context: str) -> str:
        return self.fmt.wrap(self.task.template.format(num_cw=self.ncw, context=context, query=""),
                             self.task.answer_prefix)

    def make(self, num: int) -> Draft:
        small = self.max_len < 4096
        shots = [self._example(20, 3, 1) if small else self._example(40, 10, 3) for _ in range(self.shots)]
        context, answer = self._example(num, 6, 1) if small else self._example(num, self.cw, self.ucw, )
        shots_text = "\n".join(self._prompt(c) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a))
                               for c, a in shots)
        text = shots_text + "\n" + self._prompt(context)
        return Draft(text, self.task.answer_prefix, answer, context_from=len(shots_text) + 1)

    def fit(self) -> int:
        """RULER's estimate (a 4,096-word draw) and search, once per seeded stream: the word count."""
        L, step = self.max_len, 10
        per_word = self.fmt.count(self.make(4096).text) / 4096
        tokens = lambda d: self.fmt.count(d.text) + self.task.tokens_to_generate  # noqa: E731
        best = binary_search(self.make, lambda d: tokens(d) <= L, step, max(int(L // per_word) * 2, step * 2))
        if best is not None and best >= len(self.words):
            raise UserError(f"RULER task cwe at {L} tokens needs more than the {len(self.words)} words of wonderwords' "
                            "lists (RULER then draws from its json/english_words.json, which is not shipped); use "
                            "shorter lengths for cwe")
        return best or step

    def draw(self, index: int, size: int) -> dict:
        L, ttg, step = self.max_len, self.task.tokens_to_generate, 10
        tokens = lambda d: self.fmt.count(d.text) + ttg  # noqa: E731
        d, _, size = draw_fitting(self.make, tokens, size, step, L, self.task, "words")
        ordered = first_order(d.outputs, d.text, d.context_from, numbered=True)
        target = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ordered))
        return finish(self.task, self.fmt, d, index=index, seed=self.seed, length=L, size=size, target=target)

    def sample(self, index: int) -> dict:
        return self.draw(index, self.fit())


class FrequentWords:
    def __init__(self, task: Task, fmt: PromptFormat, seed: int, max_len: int) -> None:
        self.task, self.fmt, self.seed, self.max_len = task, fmt, int(seed), int(max_len)
        self.r = random.Random(self.seed)
        self.alpha, self.wordlen = float(task.args["alpha"]), int(task.args["coded_wordlen"])
        self.budget = self.max_len - task.tokens_to_generate
        self.vocab_size = self.budget // 50

    def _vocab(self) -> list[str]:
        letters = string.ascii_lowercase
        vocab = ["".join(self.r.choices(letters, k=self.wordlen)) for _ in range(self.vocab_size)]
        while len(set(vocab)) < self.vocab_size:
            vocab.append("".join(self.r.choices(letters, k=self.wordlen)))
        vocab = sorted(set(vocab))
        random.Random(self.seed).shuffle(vocab)
        vocab[0] = "..."  # the top rank is noise
        return vocab

    def _text(self, vocab: list[str], num: int) -> Draft:
        from scipy.special import zeta

        k = np.arange(1, len(vocab) + 1)
        counts = (num * (k ** -self.alpha) / zeta(self.alpha)).astype(int)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(self.seed).shuffle(words)
        prefix = self.task.answer_prefix
        return Draft(self.fmt.wrap(self.task.template.format(context=" ".join(words), query=""), prefix), prefix,
                     vocab[1:4])

    def _generate(self, num: int = -1) -> tuple[Draft, int]:
        """RULER's ``generate_input_output(max_len, num_words)``: (draft, the word count used)."""
        vocab, step = self._vocab(), self.budget // 32
        if num > 0:
            d = self._text(vocab, num)
            while self.fmt.count(d.text) > self.budget:
                num -= step
                if num <= 0:
                    self._too_short()
                d = self._text(vocab, num)
        else:
            num = self.budget // self.wordlen
            d = self._text(vocab, num)
            while self.fmt.count(d.text) < self.budget:
                num += step
                d = self._text(vocab, num)
            num -= step
        return self._text(vocab, num), num

    def _too_short(self):
        need = max(4 * 50 + self.task.tokens_to_generate, self.fmt.count(self._text(["..."] * 4, 0).text) * 2)
        raise UserError(f"length {self.max_len} is too short for RULER task {self.task.name}: it needs a vocabulary "
                        f"of >= 4 coded words and room for them; use lengths >= {need}")

    def fit(self) -> int:
        """RULER's ``num_example_words``, once per seeded stream: the word count that fills the budget."""
        if self.vocab_size < 4:
            self._too_short()
        return self._generate()[1]

    def draw(self, index: int, num: int) -> dict:
        """One sample from this stream: a fresh vocabulary at ``num`` words, shrunk while too long."""
        d, num = self._generate(num)
        if num <= 0 or self.fmt.count(d.text) > self.budget:
            self._too_short()
        target = " " + ", ".join(d.outputs)
        return finish(self.task, self.fmt, d, index=index, seed=self.seed, length=self.max_len, size=num,
                      target=target)

    def sample(self, index: int) -> dict:
        return self.draw(index, self.fit())

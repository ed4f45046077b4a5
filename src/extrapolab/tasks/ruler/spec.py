"""RULER's offline tasks as data: NVIDIA/RULER ``scripts/synthetic.yaml`` (each task's arguments),
``scripts/data/synthetic/constants.py`` (template, answer prefix, tokens to generate) and
``scripts/eval/synthetic/constants.py`` (metric), at commit c3f5e3b. Hsieh et al. 2024 (RULER,
arXiv 2404.06654) §3, Table 2.

``qa_1`` / ``qa_2`` (SQuAD, HotpotQA) need a data download and are not generated. The prompt is
RULER's ``model_template.format(task_template=template) + answer_prefix`` with the model's own chat
template as the model template (``base`` = none); see :mod:`.prompt`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...io import UserError

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class Task:
    """One RULER task: its generator family, synthetic.yaml arguments, template and metric."""

    name: str
    family: str  # niah | variable_tracking | common_words_extraction | freq_words_extraction
    args: dict = field(default_factory=dict)
    template: str = ""
    answer_prefix: str = ""
    tokens_to_generate: int = 0
    metric: str = "string_match_all"

    @property
    def essay(self) -> bool:
        """Whether the task reads the essay haystack (RULER's Paul Graham essays; here the substitute)."""
        return self.args.get("type_haystack") == "essay"


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> Task:
    return Task(name, "niah", {"type_haystack": haystack, "type_needle_k": k, "type_needle_v": v,
                               "num_needle_k": nk, "num_needle_v": nv, "num_needle_q": nq},
                NIAH_TEMPLATE, NIAH_PREFIX, 128)


TASKS: dict[str, Task] = {t.name: t for t in (
    _niah("niah_single_1", "noise", "words", "numbers"),
    _niah("niah_single_2", "essay", "words", "numbers"),
    _niah("niah_single_3", "essay", "words", "uuids"),
    _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
    _niah("niah_multikey_2", "needle", "words", "numbers"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids"),
    _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
    _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
    Task("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4},
         VT_TEMPLATE, VT_PREFIX, 30),
    Task("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10, "num_fewshot": 1},
         CWE_TEMPLATE, CWE_PREFIX, 120),
    Task("fwe", "freq_words_extraction", {"alpha": 2.0, "coded_wordlen": 6}, FWE_TEMPLATE, FWE_PREFIX, 50),
)}
NEEDS_DOWNLOAD = ("qa_1", "qa_2")  #: RULER's two QA tasks (SQuAD, HotpotQA): not offline


def get_task(name: str) -> Task:
    if name in TASKS:
        return TASKS[name]
    if name in NEEDS_DOWNLOAD:
        raise UserError(f"RULER task {name!r} needs a QA data set download and is not generated offline; use "
                        f"one of: {', '.join(TASKS)}")
    import difflib

    near = difflib.get_close_matches(name, list(TASKS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise UserError(f"unknown RULER task {name!r}{hint}; use one of: {', '.join(TASKS)}")


def task_names(spec) -> list[str]:
    """``all`` | ``niah`` | comma-separated names (or a list) -> validated task names, in TASKS order."""
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out: list[str] = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        group = list(TASKS) if item == "all" else [t for t in TASKS if t.startswith("niah")] if item == "niah" \
            else [get_task(item).name]
        out += [t for t in group if t not in out]
    if not out:
        raise UserError(f"no RULER task given; use all, niah or names from: {', '.join(TASKS)}")
    return out

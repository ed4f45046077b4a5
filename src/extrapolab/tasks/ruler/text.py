"""The raw material of RULER's synthetic tasks, offline: word lists, the essay haystack, sentences.

Hsieh et al. 2024 (RULER, arXiv 2404.06654) §3; NVIDIA/RULER ``scripts/data/synthetic/niah.py``,
``common_words_extraction.py`` at c3f5e3b.

* **Word lists** come from the ``wonderwords`` package (3.0.1), read the way RULER reads them
  (``wonderwords.random_word._get_words_from_text_file``: every line of the asset, right-stripped).
  NIAH's word keys are RULER's ``sorted(set(f"{adj}-{noun}"))`` over adjectives x nouns (6.17 M
  strings, 12 s and 0.8 GB to build in Python); :class:`AdjNounWords` gives the same sequence
  element by element without building it (tested equal to the built list on subsets).
* **The essay haystack** upstream is Paul Graham's essays (downloaded by a script). Here it is the
  prose of Debian's ``python3-doc`` reStructuredText sources (``tutorial/``, ``howto/``, ``faq/``,
  the corpus ``data.corpus=pydoc`` reads), with reST markup removed (:func:`rest_to_prose`),
  labelled ``RULER-essay-substitute`` wherever it shows. As upstream, the haystack is that text's
  whitespace-separated words.
* **Sentences**: RULER splits the essay haystack with nltk's punkt (a runtime download); here a
  regex (:func:`split_sentences`: ``.``, ``!`` or ``?`` before a space and a capital, a digit or
  an opening quote, except after a known abbreviation or an initial). Only the needles' insertion
  points depend on it: ``" ".join(split_sentences(text)) == text`` for whitespace-normalised text.
"""
from __future__ import annotations

import bisect
import hashlib
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from ...io import UserError

ESSAY_LABEL = "RULER-essay-substitute"
ESSAY_SECTIONS = ("tutorial", "howto", "faq")  #: python3-doc folders read, in this order (prose-heavy)
WONDERWORDS_HINT = ("RULER's word lists come from the wonderwords package; install it "
                    "(pip install -c constraints.txt wonderwords==3.0.1)")


# ---------------------------------------------------------------- word lists
@lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """One of wonderwords' asset lists (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``),
    read as RULER reads it: every line, right-stripped."""
    try:
        from importlib.resources import files

        with (files("wonderwords.assets") / name).open("r") as f:
            return tuple(w.rstrip() for w in f.readlines())
    except ModuleNotFoundError:
        raise UserError(WONDERWORDS_HINT) from None


def wonderwords_version() -> str:
    try:
        from importlib.metadata import version

        return version("wonderwords")
    except Exception:  # noqa: BLE001 - not installed: the lists themselves raise the one-line error
        raise UserError(WONDERWORDS_HINT) from None


class AdjNounWords(Sequence):
    """``sorted(set(f"{a}-{n}" for a in adjectives for n in nouns))`` without building it.

    Every string starts with its adjective. Group the sorted unique adjectives into runs whose
    first member (the root) is a prefix of all the others ("high", "high-pitched", "highfalutin");
    strings of different runs compare as their roots do (the roots differ before either ends), so
    the sorted list is the runs' blocks in root order. A run of one adjective is its sorted unique
    nouns; a longer run (at most a few adjectives) is built and sorted (duplicates such as
    "a-b" + "c" = "a" + "b-c" can only arise inside a run).
    """

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]) -> None:
        self.nouns = sorted(set(nouns))
        adjs = sorted(set(adjectives))
        self._runs: list[list[str]] = []
        for a in adjs:
            if self._runs and a.startswith(self._runs[-1][0]):
                self._runs[-1].append(a)
            else:
                self._runs.append([a])
        self._blocks: dict[int, list[str]] = {}  # run index -> its sorted strings (runs of > 1)
        self._starts, total = [], 0
        for i, run in enumerate(self._runs):
            self._starts.append(total)
            if len(run) > 1:
                self._blocks[i] = sorted({f"{a}-{n}" for a in run for n in self.nouns})
                total += len(self._blocks[i])
            else:
                total += len(self.nouns)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        r = bisect.bisect_right(self._starts, i) - 1
        off = i - self._starts[r]
        block = self._blocks.get(r)
        return block[off] if block is not None else f"{self._runs[r][0]}-{self.nouns[off]}"


@lru_cache(maxsize=1)
def niah_words() -> AdjNounWords:
    """NIAH's ``words`` keys and values: RULER's adjective-noun pairs (module doc)."""
    return AdjNounWords(wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt"))


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """Common-words extraction's pool: ``sorted(set(nouns + adjectives + verbs))`` (RULER shuffles
    it per seed)."""
    return tuple(sorted(set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt")
                            + wonderwords_list("verblist.txt"))))


def words_identity() -> str:
    """What the generated sets depend on in the word lists (part of the sample cache key)."""
    h = hashlib.sha256()
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        h.update("\n".join(wonderwords_list(name)).encode())
    return f"wonderwords-{wonderwords_version()}-{h.hexdigest()[:12]}"


# ---------------------------------------------------------------- sentences
_ABBREV = {"e.g", "i.e", "etc", "vs", "cf", "al", "approx", "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr",
           "no", "fig", "eq", "sec", "ch", "vol", "pp", "ed", "eds", "inc", "ltd", "co", "jan", "feb", "mar",
           "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "u.s", "u.k"}
_END = re.compile(r"[.!?][\"')\]]*(?= +[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of whitespace-normalised ``text`` (module doc): a regex stand-in for nltk's
    ``sent_tokenize``; the pieces are separated by single spaces in ``text``."""
    out, start = [], 0
    for m in _END.finditer(text):
        lo = text.rfind(" ", start, m.start())
        word = text[lo + 1 if lo >= 0 else start:m.start() + 1].lower().strip("\"'([")
        if word.rstrip(".") in _ABBREV or re.fullmatch(r"[a-z]\.", word):
            continue  # "e.g. Foo", "J. Smith": not a sentence end
        out.append(text[start:m.end()])
        start = m.end() + 1  # one space (the text is whitespace-normalised)
    if start < len(text):
        out.append(text[start:])
    return [s for s in out if s]


# ---------------------------------------------------------------- the essay haystack
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+<>:._])\1{2,}\s*$")
_ROLE = re.compile(r":[\w.+-]+:`([^`]*)`")
_REF = re.compile(r"`([^`<]*?)\s*(?:<[^`>]*>)?`_{1,2}")
_LITERAL = re.compile(r"``([^`]*)``")


def _inline(line: str) -> str:
    line = _ROLE.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m.group(1)).lstrip("~!"), line)
    line = _LITERAL.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = re.sub(r"\*\*?([^*\s][^*]*)\*\*?", r"\1", line)
    line = re.sub(r"\|([\w -]+)\|", r"\1", line)
    line = re.sub(r"\s*\[[#*\w]*\]_", "", line)  # footnote references
    return line.replace("`", "")


def rest_to_prose(text: str) -> str:
    """The prose of a reStructuredText page: paragraphs and list items with inline markup removed;
    section adornments, directives and their bodies, comments, literal blocks (after ``::``),
    doctest lines, tables and blocks indented 4 or more dropped."""
    out: list[str] = []
    skip = None  # drop blank lines and lines indented deeper than this (a directive's or literal block)
    literal_at = None  # indent of the paragraph line that ended with "::"
    for raw in text.splitlines():
        line = raw.rstrip()
        indent = len(line) - len(line.lstrip())
        if skip is not None:
            if not line or indent > skip:
                continue
            skip = None
        if not line:
            if literal_at is not None:
                skip, literal_at = literal_at, None
            out.append("")
            continue
        literal_at = None
        stripped = line.strip()
        if stripped.startswith(".. ") or stripped == "..":
            skip = indent
            continue
        if _ADORNMENT.match(line) or stripped.startswith((">>>", "...", "+-", "+=", "|")) or indent >= 4:
            continue
        if stripped.endswith("::"):  # "Text::" -> "Text:", "Text ::" -> "Text", "::" -> nothing
            literal_at = indent
            body = stripped[:-2]
            stripped = body.rstrip() if body.endswith(" ") or not body else body + ":"
            if not stripped:
                continue
        stripped = re.sub(r"^(?:[*+-]|\d+\.|#\.)\s+", "", stripped)  # list bullets
        out.append(_inline(stripped))
    return "\n".join(out)


def essay_root(root=None) -> Path:
    """The essay haystack's source: ``root`` (a file or folder) or python3-doc's ``_sources``."""
    from ...data.corpus import pydoc_root

    path = Path(root) if root else pydoc_root()
    if path is None or not path.exists():
        where = f"{root} does not exist" if root else "python3-doc is not installed"
        raise UserError(f"RULER's essay haystack ({ESSAY_LABEL}) is the python3-doc prose, and {where}: run "
                        "`make prose` (apt-get install python3-doc) or pass --set ruler.essay=FILE_OR_FOLDER")
    return path


@lru_cache(maxsize=4)
def essay_haystack(root=None) -> tuple[tuple[str, ...], str]:
    """(the essay haystack's words, its identity) from python3-doc's ``ESSAY_SECTIONS`` under
    ``root`` (default: the installed ``_sources``), or from a plain-text file or folder of ``.txt``
    files given as ``root`` (tests). RULER: ``re.sub(r"\\s+", " ", essay).split(" ")``."""
    path = essay_root(root)
    if path.is_file():
        files = [path]
    elif any(path.glob("*.rst.txt")) or any((path / s).is_dir() for s in ESSAY_SECTIONS):
        files = [f for s in ESSAY_SECTIONS for f in sorted((path / s).rglob("*.rst.txt"))]
    else:
        files = sorted(path.rglob("*.txt"))
    texts = []
    for f in files:
        raw = f.read_text(encoding="utf-8", errors="replace")
        texts.append(rest_to_prose(raw) if f.name.endswith(".rst.txt") else raw)
    text = re.sub(r"\s+", " ", " ".join(texts)).strip()
    if len(text.split(" ")) < 500:
        raise UserError(f"the essay haystack under {path} has fewer than 500 words; install python3-doc "
                        "(make prose) or pass a longer text")
    ident = f"{ESSAY_LABEL}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return tuple(text.split(" ")), ident

"""RULER sample sets: generated once per (tokenizer, template, task, length, n, seed), cached on disk.

:func:`ruler_samples` is the generator API: it returns ``n`` samples of a task fitted to ``length``
tokens of the given tokenizer (each a JSON dict, :func:`.fit.finish`), drawing them with RULER's
rules (:mod:`.niah`, :mod:`.aggregate`) or reading them back from
``<cache_dir>/ruler/<task>-<length>-n<n>-s<seed>-<key>.json``. The key hashes everything the
samples depend on: the generator version (``FORMAT``), the tokenizer's definition and the chat
template (:meth:`.prompt.PromptFormat.identity`), the task's arguments and templates, the word
lists and essay haystack it reads, and the seeding when it is not the default.

Seeding (``seeding``). RULER's ``prepare.py`` seeds Python's ``random`` (and numpy's) with
``random_seed + chunk_idx`` once per chunk of samples, searches the haystack size once per chunk and
draws the chunk's samples one after another from that stream. ``chunk`` (the default): every sample
is its own chunk, RULER's ``--chunk_amount n``: sample i has seed ``seed + i`` and its own search, so
it does not depend on how many are drawn. ``stream``: RULER's default ``--chunk_amount 1``: one
stream seeded ``seed``, one search, sample i the i-th draw. Both are checked byte for byte against
RULER's scripts (tests/test_ruler_generators.py); sample 0 is the same in both.

Files are written atomically with a sha256 of their samples; a
file that does not parse, belongs to another key, holds the wrong number of samples, fails its
checksum or has a sample longer than its length is refused with one line naming it (delete it to
regenerate), never used.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ...io import UserError, atomic_write_json
from .aggregate import CommonWords, FrequentWords, VariableTracking
from .niah import Niah
from .prompt import PromptFormat
from .spec import Task, get_task
from .text import essay_haystack, words_identity

FORMAT = 1  #: bump when a generator changes what it draws: every cached set is regenerated
DEFAULT_SEED = 42  #: RULER's --random_seed
SEEDINGS = ("chunk", "stream")  #: per-sample streams (--chunk_amount n) or RULER's default single stream


def _generator(task: Task, fmt: PromptFormat, seed: int, length: int, essay):
    if task.family == "niah":
        return Niah(task, fmt, seed, length, essay)
    cls = {"variable_tracking": VariableTracking, "common_words_extraction": CommonWords,
           "freq_words_extraction": FrequentWords}[task.family]
    return cls(task, fmt, seed, length)


def _identity(task: Task, fmt: PromptFormat, length: int, n: int, seed: int, essay, seeding: str = "chunk") -> dict:
    ident = {"format": FORMAT, "task": dataclasses.asdict(task), "length": int(length), "n": int(n),
             "seed": int(seed), "prompt": fmt.identity()}
    if seeding != "chunk":  # the default's keys stay those written before there were two seedings
        ident["seeding"] = seeding
    if task.essay:
        ident["essay"] = essay_haystack(essay)[1]
    niah_words = task.family == "niah" and "words" in (task.args["type_needle_k"], task.args["type_needle_v"])
    if niah_words or task.family == "common_words_extraction":
        ident["words"] = words_identity()
    return ident


def _checksum(samples: list[dict]) -> str:
    return hashlib.sha256(json.dumps(samples, sort_keys=True).encode()).hexdigest()


def _check(samples, length: int) -> str | None:
    for s in samples:
        if not isinstance(s, dict) or not {"ids", "tokens", "outputs", "target_ids"} <= set(s):
            return "a sample lacks its fields"
        if s["tokens"] != len(s["ids"]) + s.get("tokens_to_generate", 0) or s["tokens"] > length:
            return f"sample {s.get('index')} has {s['tokens']} tokens for length {length}"
    return None


def read_cached(path: Path, key: str, n: int, length: int) -> list[dict]:
    """The samples of a cache file, or a one-line UserError saying what is wrong with it."""
    def bad(what: str) -> UserError:
        return UserError(f"cached RULER samples {path} are damaged ({what}); delete that file and run again to "
                         "regenerate them")

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not readable JSON: {type(e).__name__}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
        raise bad("written for other settings or by another version")
    samples = data.get("samples")
    if not isinstance(samples, list) or len(samples) != n:
        raise bad(f"{len(samples) if isinstance(samples, list) else 'no'} samples, expected {n}")
    if data.get("sha256") != _checksum(samples):
        raise bad("checksum mismatch")
    what = _check(samples, length)
    if what:
        raise bad(what)
    return samples


def cache_path(cache_dir, task: str, length: int, n: int, seed: int, key: str) -> Path:
    return Path(cache_dir) / "ruler" / f"{task}-{int(length)}-n{int(n)}-s{int(seed)}-{key}.json"


def ruler_samples(task: str, length: int, tokenizer, n: int, seed: int = DEFAULT_SEED, chat="off", *,
                  cache_dir=None, essay=None, say=None, seeding: str = "chunk") -> list[dict]:
    """``n`` RULER samples of ``task`` fitted to ``length`` tokens of ``tokenizer`` (module doc).

    ``tokenizer``: a Hugging Face tokenizer, an extrapolab codec or prepared ``TokenData``, or a
    :class:`.prompt.PromptFormat`. ``chat``: "off" (RULER's base template), "on", "auto" (the
    tokenizer's chat template where it has one) or a (head, tail) pair of strings. ``seeding``:
    "chunk" (sample i is RULER's draw with seed ``seed + i``, its ``--chunk_amount n``) or "stream"
    (RULER's default: the i-th draw of one stream seeded ``seed``; module doc). ``cache_dir``: the cache folder (default
    ``data.cache_dir``, ``.extrapolab-cache``; False: no cache). ``essay``: a file or folder for the
    essay haystack (default: the python3-doc substitute)."""
    t = get_task(task)
    if int(length) < 1 or int(n) < 1:
        raise UserError(f"RULER needs a length >= 1 and n >= 1 samples; got length {length}, n {n}")
    if seeding not in SEEDINGS:
        raise UserError(f"ruler.seeding must be chunk (sample i seeded seed + i, RULER's --chunk_amount n) or stream "
                        f"(RULER's default: one stream seeded seed); got {seeding!r}")
    fmt = tokenizer if isinstance(tokenizer, PromptFormat) else PromptFormat(tokenizer, chat)
    ident = _identity(t, fmt, length, n, seed, essay, seeding)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = None
    if cache_dir is not False:
        if cache_dir is None:
            from ...config import DataConfig

            cache_dir = DataConfig.cache_dir
        path = cache_path(cache_dir, t.name, length, n, seed, key)
        if path.exists():
            return read_cached(path, key, int(n), int(length))
    if seeding == "chunk":
        samples = [_generator(t, fmt, int(seed) + i, int(length), essay).sample(i) for i in range(int(n))]
    else:  # one generator: one seeded stream, one search, n draws
        g = _generator(t, fmt, int(seed), int(length), essay)
        fitted = g.fit()
        samples = [g.draw(i, fitted) for i in range(int(n))]
    if path is not None:
        atomic_write_json(path, {"format": FORMAT, "key": key, "identity": ident, "samples": samples,
                                 "sha256": _checksum(samples)})
        if say:
            say(f"generated {n} {t.name} samples at {length} tokens -> {path}")
    return samples

"""RULER's synthetic long-context tasks, offline (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?", COLM 2024, arXiv 2404.06654; the rules of
NVIDIA/RULER at c3f5e3b). docs/protocols.md ("RULER") says what is RULER-exact and what is not.

Two functions are the API:

* :func:`ruler_samples` ``(task, length, tokenizer, n, seed=42, chat="off")`` -> ``n`` samples of
  one of the 11 offline tasks (:data:`TASKS`: 8 NIAH configurations, ``vt``, ``cwe``, ``fwe``),
  fitted to ``length`` tokens of ``tokenizer`` with ``tokens_to_generate`` counted inside,
  cached on disk; by default sample i is byte for byte what RULER's scripts write for chunk i under
  ``prepare.py --chunk_amount n`` (seed ``seed + i``), not the set of RULER's default single stream
  (``--chunk_amount 1``, which draws every sample from one stream seeded ``seed``); ``seeding="stream"``
  gives that set, byte for byte too (both checked against RULER's scripts, tests/test_ruler_generators.py);
* :func:`score_samples` ``(model, samples, tokenizer, chat=...)`` -> one record per sample: RULER's
  metric on KV-cached greedy output (``score``) and the teacher-forced log-probability and exact
  match of the answer after the answer prefix (``tf_*``).

:func:`run_ruler` is the ``extrapolab ruler`` study (tables per task, length and needle depth).
"""
from .report import summarize
from .run import RulerSpec, run_ruler
from .samples import ruler_samples
from .score import postprocess, score_samples, string_match_all, string_match_part
from .spec import TASKS

__all__ = ["RulerSpec", "TASKS", "postprocess", "ruler_samples", "run_ruler", "score_samples", "string_match_all",
           "string_match_part", "summarize"]

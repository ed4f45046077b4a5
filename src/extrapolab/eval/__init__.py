"""Test long: evaluation protocols E1-E7 (docs/protocols.md).

E1 :func:`nonoverlapping`, E2 :func:`sliding` (ALiBi §2.1, appendix B); E3 :func:`last_token`
(Sandwich §3.4); E4 :func:`positionwise` (thesis §3.5.5); E5 :func:`cached_window_ppl`,
:func:`recomputed_window_ppl`, :func:`generate` (Sandwich appendix B); E6 :func:`verdict` (Qin
def. 0.1); E7 :mod:`.stats` (Sandwich Table 3); :func:`evaluate` runs a chosen set, optionally with
blockwise causal attention (:mod:`.bca`, xPos §3.3).
"""
from .cached import cached_window_ppl, compare_cached, generate, recomputed_window_ppl
from .evaluate import PROTOCOLS, eval_lengths, evaluate, evaluate_config
from .perplexity import last_token, last_token_ends, nonoverlapping, sliding, sliding_windows
from .positionwise import positionwise, positionwise_with_reference, smooth
from .stats import format_table, mark, paired_interval, paired_ttest, summarize, summary, t_interval
from .verdict import verdict

__all__ = [
    "PROTOCOLS", "cached_window_ppl", "compare_cached", "eval_lengths", "evaluate", "evaluate_config", "format_table",
    "generate", "last_token", "last_token_ends", "mark", "nonoverlapping", "paired_interval", "paired_ttest",
    "positionwise", "positionwise_with_reference", "recomputed_window_ppl", "sliding",
    "sliding_windows", "smooth", "summarize", "summary", "t_interval", "verdict",
]

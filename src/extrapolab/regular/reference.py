"""Published numbers the regular-language table is read next to, as cited reference data.

* Chi 2024 thesis Table 6.1 (Max / Avg accuracy % over 3 seeds, test lengths 41..500 resp. 51..100;
  its RNN column is compared with our ``rnn`` and ``lstm``) and Table 6.2 (Parity, P(sigma=1) sweep).
* Ruoss et al. 2023 ("Randomized Positional Encodings Boost Length Generalization of Transformers",
  ACL 2023, arXiv 2305.16843), Table 1, the four tasks it shares with thesis Table 6.1 (its regular
  level R: Even Pairs, Modular Arithmetic (Simple), Parity Check, Cycle Navigation). Setting, from the
  paper: encoder Transformers trained on lengths 1..40 and tested on 41..500 (as Delétang et al. 2023 and
  our Deletang tasks), randomized positions sampled from L = 2048; each cell is the accuracy averaged over
  all test lengths and MAXIMIZED over 10 random seeds and 3 learning rates, so it is comparable to a
  table's Max column (ours: the best of ``--seeds`` seeds at one learning rate), not to Avg. "standard"
  = the encoding at positions 0..T-1, "randomized" = the paper's method. "relative" is Transformer-XL's
  relative encoding (Dai et al. 2019), the thesis' transformer; our ``transformer`` column uses T5 buckets.
"""
from __future__ import annotations

#: thesis Table 6.1, (Max, Avg) in %; its RNN column is compared with our "rnn" and "lstm"
THESIS_TABLE_6_1 = {
    "even_pairs": {"rnn": (100.0, 100.0), "transformer": (99.7, 73.2), "regulargpt-C2": (100.0, 89.3), "regulargpt-C3": (100.0, 96.6)},
    "modular_arithmetic": {"rnn": (100.0, 100.0), "transformer": (21.9, 20.3), "regulargpt-C2": (96.4, 82.6), "regulargpt-C3": (21.2, 20.5)},
    "parity": {"rnn": (100.0, 98.9), "transformer": (52.3, 50.1), "regulargpt-C2": (100.0, 100.0), "regulargpt-C3": (100.0, 88.7)},
    "cycle_navigation": {"rnn": (100.0, 100.0), "transformer": (21.7, 20.6), "regulargpt-C2": (100.0, 100.0), "regulargpt-C3": (100.0, 78.6)},
    "d2": {"rnn": (100.0, 100.0), "transformer": (100.0, 80.1), "regulargpt-C2": (100.0, 100.0), "regulargpt-C3": (99.8, 96.5)},
    "d3": {"rnn": (100.0, 100.0), "transformer": (100.0, 77.8), "regulargpt-C2": (100.0, 99.7), "regulargpt-C3": (98.6, 93.0)},
    "d4": {"rnn": (100.0, 100.0), "transformer": (100.0, 82.6), "regulargpt-C2": (100.0, 98.7), "regulargpt-C3": (97.7, 91.6)},
    "d12": {"rnn": (100.0, 100.0), "transformer": (100.0, 80.3), "regulargpt-C2": (100.0, 99.8), "regulargpt-C3": (94.1, 90.4)},
    "tomita3": {"rnn": (100.0, 100.0), "transformer": (100.0, 94.4), "regulargpt-C2": (100.0, 99.7), "regulargpt-C3": (100.0, 99.9)},
    "tomita4": {"rnn": (100.0, 100.0), "transformer": (100.0, 70.0), "regulargpt-C2": (100.0, 99.8), "regulargpt-C3": (100.0, 99.3)},
    "tomita5": {"rnn": (100.0, 100.0), "transformer": (74.5, 74.5), "regulargpt-C2": (100.0, 99.8), "regulargpt-C3": (98.2, 84.1)},
    "tomita6": {"rnn": (100.0, 100.0), "transformer": (50.0, 50.0), "regulargpt-C2": (100.0, 98.5), "regulargpt-C3": (100.0, 65.7)},
}
#: thesis Table 6.2 (Parity, P(sigma=1) sweep), same length 40 / extrapolation 41..500, in %
THESIS_TABLE_6_2 = {
    "same": {"regulargpt-C2": [100, 100, 100, 100, 100], "rnn": [100, 100, 100, 100, 100],
             "transformer": [98.4, 99.8, 99.6, 97.8, 77.2]},
    "extrapolation": {"regulargpt-C2": [100, 100, 100, 100, 100], "rnn": [100, 100, 100, 100, 100],
                      "transformer": [50.1, 49.7, 50.3, 49.9, 50.0]},
}

#: Ruoss et al. 2023 Table 1, regular tasks, accuracy %: {task: {encoding: (standard, randomized)}}
#: ("none" has no randomized version). Left empty on purpose: the table could not be read where this
#: file was written (no copy of the paper's table was reachable offline), and numbers recalled from
#: memory are not published. Fill it from arXiv 2305.16843 Table 1 and the comparison table shows
#: them next to ours (table_md.ruoss_markdown); until then it names the cell to read instead.
RUOSS_TABLE_1: dict[str, dict[str, tuple[float, float | None]]] = {}
RUOSS_TASK_NAMES = {"even_pairs": "Even Pairs", "modular_arithmetic": "Modular Arithmetic (Simple)",
                    "parity": "Parity Check", "cycle_navigation": "Cycle Navigation"}
#: our column -> (Ruoss et al.'s encoding, "randomized" | "standard"): the cell of theirs it is read next to
RUOSS_COLUMNS = {"transformer-rope-random": ("rope", "randomized"),
                 "transformer-alibi-random": ("alibi", "randomized"),
                 "transformer": ("relative", "standard")}


def ruoss_cell(task: str, column: str) -> float | None:
    """Ruoss et al.'s Table 1 value for our ``column`` on ``task`` (None: no counterpart, or not transcribed)."""
    enc = RUOSS_COLUMNS.get(column)
    row = RUOSS_TABLE_1.get(task, {}).get(enc[0]) if enc else None
    return None if row is None else row[0 if enc[1] == "standard" else 1]

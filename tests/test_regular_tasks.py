"""Regular-language tasks against independent brute-force references, far beyond training."""
import itertools
import re

import numpy as np
import pytest
from scipy.stats import chisquare

from extrapolab.io import UserError
from extrapolab.regular.tasks import BHATTACHARYA, DELETANG, make_task

LENGTHS = [1, 2, 3, 7, 40, 41, 100, 257, 500]


# ---- references written from the task definitions (thesis §6.4.1, Deletang, Tomita) -------------
def ref_parity(s: str) -> int:
    return s.count("b") % 2


def ref_even_pairs(s: str) -> int:
    pairs = sum(s[i:i + 2] in ("ab", "ba") for i in range(len(s) - 1))
    return pairs % 2


def ref_cycle(s: str) -> int:
    pos = 0
    for ch in s:
        pos = (pos + {"0": 0, "+": 1, "-": -1}[ch]) % 5
    return pos


def ref_modular(s: str) -> int:
    return eval(s) % 5  # Python: * before +/-, left to right; % 5 is non-negative


def ref_tomita3(s: str) -> bool:
    runs = [(m.group()[0], len(m.group())) for m in re.finditer(r"0+|1+", s)]  # maximal runs
    return not any(a[0] == "1" and a[1] % 2 and b[0] == "0" and b[1] % 2 for a, b in zip(runs, runs[1:]))


def ref_dyck(s: str, n: int) -> bool:
    """Recursive descent for D_n = ("(" D_{n-1} ")")*, D_0 = empty (independent of the depth DFA)."""
    def parse(i: int, depth: int):  # end of the longest D_depth prefix from i, or None
        while i < len(s) and s[i] == "(":
            if depth == 0:
                return i
            j = parse(i + 1, depth - 1)
            if j is None or j >= len(s) or s[j] != ")":
                return None
            i = j + 1
        return i

    return parse(0, n) == len(s)


REFS = {
    "tomita3": ref_tomita3,
    "tomita4": lambda s: "000" not in s,
    "tomita5": lambda s: s.count("0") % 2 == 0 and s.count("1") % 2 == 0,
    "tomita6": lambda s: (s.count("0") - s.count("1")) % 3 == 0,
    "d2": lambda s: ref_dyck(s, 2), "d3": lambda s: ref_dyck(s, 3),
    "d4": lambda s: ref_dyck(s, 4), "d12": lambda s: ref_dyck(s, 12),
}
DEL_REFS = {"parity": ref_parity, "even_pairs": ref_even_pairs, "cycle_navigation": ref_cycle,
            "modular_arithmetic": ref_modular}


def test_thesis_and_deepmind_examples():
    cyc, mod, ep, par = (make_task(n) for n in ("cycle_navigation", "modular_arithmetic", "even_pairs", "parity"))
    enc = {c: i for i, c in enumerate(mod.symbols)}
    assert cyc.label(np.array([[0, 1, 0, 2, 1, 1]]))[0] == 2  # thesis: 010211 -> 2
    for expr, want in [("1+2-4", 4), ("1+2*3", 2), ("1-1-1", 4), ("0*1+4*3-2", 0)]:
        assert mod.label(np.array([[enc[c] for c in expr]]))[0] == want
    assert ep.label(np.array([[0, 0, 1, 1, 0]]))[0] == 0  # "aabba": one ab + one ba -> even
    assert par.label(np.array([[0, 0, 1, 1, 0]]))[0] == 0  # two b's -> even


@pytest.mark.parametrize("name", DELETANG)
def test_deletang_labels_match_reference(name):
    task, ref = make_task(name), DEL_REFS[name]
    rng = np.random.default_rng(0)
    for T in task.lengths(1, 500):
        if T not in LENGTHS and T != 499:
            continue
        x, y = task.sample(rng, 64, T)
        assert x.shape == (64, T) and x.min() >= 0 and x.max() < task.vocab_size
        assert [ref(task.decode(row)) for row in x] == y.tolist()
    if name == "even_pairs":  # equivalent formulation (thesis): first == last
        x, y = task.sample(rng, 256, 33)
        assert np.array_equal(y, (x[:, 0] != x[:, -1]).astype(int))


@pytest.mark.parametrize("name", BHATTACHARYA)
def test_dfa_equals_reference_on_every_short_string(name):
    task, ref = make_task(name), REFS[name]
    for T in range(0, 13):
        strings = np.array(list(itertools.product([0, 1], repeat=T)), dtype=np.int64).reshape(2 ** T, T)
        want = [ref(task.decode(s)) for s in strings]
        assert task.dfa.accepts(strings).tolist() == want
        assert task.dfa.num_accepted(T) == sum(want)


@pytest.mark.parametrize("name", BHATTACHARYA)
def test_membership_samples_balanced_and_correct_far_beyond_training(name):
    task, ref = make_task(name), REFS[name]
    rng = np.random.default_rng(1)
    for T in task.lengths(1, 20) + task.lengths(50, 52) + task.lengths(100, 101) + task.lengths(300, 301):
        x, y = task.sample(rng, 64, T)
        assert [int(ref(task.decode(row))) for row in x] == y.tolist()
    x, y = task.sample(rng, 2000, task.lengths(60, 70)[0])
    assert 0.45 < y.mean() < 0.55


def test_negatives_are_near_the_language():
    """Half of the D_2 negatives are one edit from a member: many keep #( == #)."""
    task = make_task("d2")
    x, y = task.sample(np.random.default_rng(2), 4000, 40)
    neg = x[y == 0]
    balanced = (neg == 0).sum(1) == (neg == 1).sum(1)
    assert 0.15 < balanced.mean() < 0.9


def test_positives_are_uniform_over_the_language():
    task = make_task("tomita4")
    pos = task.dfa.sample_accepted(np.random.default_rng(3), 30000, 8)
    assert task.dfa.accepts(pos).all()
    keys, counts = np.unique(pos @ (1 << np.arange(8)), return_counts=True)
    assert len(keys) == task.dfa.num_accepted(8) == 149
    assert chisquare(counts).pvalue > 1e-3


def test_valid_lengths_and_errors():
    assert make_task("d4").lengths(51, 60) == [52, 54, 56, 58, 60]
    assert make_task("tomita5").lengths(1, 6) == [2, 4, 6]
    assert make_task("tomita6").lengths(1, 3) == [2, 3]
    assert make_task("modular_arithmetic").lengths(40, 45) == [41, 43, 45]
    assert len(make_task("parity").lengths(41, 500)) == 460
    rng = np.random.default_rng(0)
    for name, T in [("d2", 51), ("modular_arithmetic", 40), ("tomita5", 3)]:
        with pytest.raises(UserError, match="valid length"):
            make_task(name).sample(rng, 2, T)
    with pytest.raises(UserError, match="did you mean 'parity'"):
        make_task("parit")
    with pytest.raises(UserError):
        make_task("parity", p=1.5)


def test_sampling_is_deterministic_and_p_is_honoured():
    for name in ("parity", "tomita3", "d12"):
        t = make_task(name)
        a = t.sample(np.random.default_rng(5), 16, 50)
        b = t.sample(np.random.default_rng(5), 16, 50)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    x, _ = make_task("parity", p=0.1).sample(np.random.default_rng(0), 500, 100)
    assert abs(x.mean() - 0.1) < 0.01


def test_modular_arithmetic_chance_level_and_deepmind_layout():
    """Labels are uniform over the 5 residues (chance = 20%) at training and test lengths;
    numbers sit at even positions and operators at odd ones, as in DeepMind's generator; the
    training lengths are the odd lengths 1..39 (DeepMind maps an even request T to T-1)."""
    task = make_task("modular_arithmetic")
    rng = np.random.default_rng(7)
    for T in (39, 41, 499):
        x, y = task.sample(rng, 5000, T)
        freq = np.bincount(y, minlength=5) / len(y)
        assert np.all(np.abs(freq - 0.2) < 0.025), (T, freq)
        assert x[:, 0::2].max() <= 4 and x[:, 1::2].min() >= 5
    assert task.lengths(1, 40) == list(range(1, 40, 2))
    assert sorted({T - (T % 2 == 0) for T in range(41, 501)}) == task.lengths(41, 500)


@pytest.mark.parametrize("name", [*DELETANG, "tomita4", "d2"])
def test_prefix_labels_are_the_labels_of_every_prefix(name):
    """prefix_labels[:, i] = reference label of the first i+1 symbols; IGNORE at invalid lengths."""
    from extrapolab.regular.tasks import IGNORE

    task = make_task(name)
    ref = DEL_REFS.get(name) or (lambda s: int(REFS[name](s)))
    x, _ = task.sample(np.random.default_rng(3), 16, task.lengths(20, 30)[0])
    lab = task.prefix_labels(x)
    assert lab.shape == x.shape
    for i in range(x.shape[1]):
        if task.length_ok(i + 1):
            assert lab[:, i].tolist() == [int(ref(task.decode(row[:i + 1]))) for row in x], i
        else:
            assert (lab[:, i] == IGNORE).all(), i
    if name == "modular_arithmetic":
        assert (lab[:, 1::2] == IGNORE).all() and (lab[:, 0::2] >= 0).all()

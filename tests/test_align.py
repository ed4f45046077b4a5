"""T1 temperature alignment (thesis ch. 5: Algorithm 1, Props. 5.1/5.2, §5.10.2-3)."""
import json
import math
from pathlib import Path
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from extrapolab import positional
import extrapolab.align as A
from extrapolab.model import AttnOptions
from extrapolab.io import UserError
from extrapolab.model.gpt import GPT, ModelConfig

NEG = -math.inf


class FakeTarget:
    """Reports fixed tau=1 logit rows per (length, layer), like a model whose softmaxes see them."""

    def __init__(self, rows: dict):
        self.rows, self.num_layers, self.model = rows, 2, torch.nn.Linear(1, 1)

    @contextmanager
    def scope(self, tau=1.0, sink=None):
        self.sink = sink
        yield self

    def forward(self, ids):
        for layer, r in self.rows[ids.shape[1]]:
            self.sink.add(layer, torch.tensor(r, dtype=torch.float32))


def _stats_by_hand(rows, tau):
    """Mean P_max and entropy over every row, valid (finite) entries only, plain Python."""
    pm, ent, n = 0.0, 0.0, 0
    for _, block in rows:
        for row in block:
            z = [math.exp(v / tau) for v in row if v != NEG]
            p = [x / sum(z) for x in z]
            pm += max(p)
            ent -= sum(x * math.log(x) for x in p)
            n += 1
    return pm / n, ent / n


HAND = {
    4: [(0, [[2.0, 0, 0, 0]]), (1, [[0.0, NEG, NEG, NEG], [1.0, 0.0, NEG, NEG]])],
    8: [(0, [[2.0] + [0.0] * 7]), (1, [[0.0] + [NEG] * 7, [1.0, 0.0] + [NEG] * 6])],
}


def test_grid_search_picks_matching_tau_on_hand_built_logits():
    tr = A.collect_logit_stats(FakeTarget(HAND), np.zeros((1, 4)), [1.0])
    ex = A.collect_logit_stats(FakeTarget(HAND), np.zeros((1, 8)), A.GRID)
    # layer-0 row by hand: e^2 / (e^2 + 3); the one-key causal row has P_max 1 and H 0
    hand_pm = (math.e ** 2 / (math.e ** 2 + 3) + 1 + 1 / (1 + math.exp(-1))) / 3
    assert tr["pmax"][0] == pytest.approx(hand_pm, rel=1e-6)
    for mode, i in (("pmax", 0), ("entropy", 1)):
        target = _stats_by_hand(HAND[4], 1.0)[i]
        values = [_stats_by_hand(HAND[8], t)[i] for t in A.GRID]
        assert ex[mode] == pytest.approx(values, rel=1e-5)
        best = min(A.GRID, key=lambda t: abs(_stats_by_hand(HAND[8], t)[i] - target))
        assert 0.5 < best < 1.0  # a non-trivial choice
        assert A.pick_tau(tr[mode][0], A.GRID, ex[mode]) == best


def test_propagate_false_equals_retemperatured_rows():
    ex = A.collect_logit_stats(FakeTarget(HAND), np.zeros((1, 8)), A.GRID, propagate=False)
    assert ex["pmax"] == pytest.approx([_stats_by_hand(HAND[8], t)[0] for t in A.GRID], rel=1e-5)


def _gauss(L, s):  # the average logit vector of Assumption 5.1: N(0, s^2) quantiles
    return s * norm.ppf((np.arange(L) + 0.5) / L)


def _softmax(l, t):
    z = np.exp((l - l.max()) / t)
    return z / z.sum()


@pytest.mark.parametrize("Ltr,Lex,s_tr,s_ex,lmax", [(512, 4096, 0.5, 0.6, 4.0), (1024, 8192, 0.7, 0.8, 5.0),
                                                    (512, 2048, 1.0, 1.0, 5.0)])
def test_props_match_direct_numerical_solution_on_gaussian_logits(Ltr, Lex, s_tr, s_ex, lmax):
    ltr, lex = _gauss(Ltr, s_tr), _gauss(Lex, s_ex)
    ent = lambda l, t: float(-(_softmax(l, t) * np.log(_softmax(l, t))).sum())  # noqa: E731
    direct = brentq(lambda t: ent(lex, t) - ent(ltr, 1.0), 0.05, 5.0)
    assert A.prop52_tau(ltr.std(), lex.std(), Ltr, Lex) == pytest.approx(direct, rel=0.05)
    ltr[-1] = lex[-1] = lmax  # Assumption 5.2: the same largest logit at both lengths
    p_tr = float(_softmax(ltr, 1.0).max())
    direct = brentq(lambda t: _softmax(lex, t).max() - p_tr, 0.05, 5.0)
    tau = A.prop51_tau(p_tr, ltr[:-1].std(), lex[:-1].std(), Ltr, Lex)
    assert tau == pytest.approx(direct, rel=0.03)


def test_prop51_is_the_larger_root_and_prop52_aligns_the_entropy_formula():
    p, s_tr, s_ex, Ltr, Lex = 0.3, 3.0, 2.2, 512, 15000  # tau ~ 0.75 as in Table 5.9
    tau = A.prop51_tau(p, s_tr, s_ex, Ltr, Lex)
    A_, B, C = math.log(Lex) + math.log(p), math.log(Ltr) + math.log(p) + s_tr ** 2 / 2, s_ex ** 2 / 2
    assert tau == pytest.approx(B / (A_ + C / tau ** 2), rel=1e-12)  # Prop. 5.1 fixed point
    assert tau > C / (A_ * tau)  # the other root (product of roots = C/A)
    t2 = A.prop52_tau(s_tr, s_ex, Ltr, Lex)
    assert math.log(Lex) - s_ex ** 2 / (2 * t2 ** 2) == pytest.approx(math.log(Ltr) - s_tr ** 2 / 2)
    for L, paper in ((1024, 0.9), (2048, 0.82), (4096, 0.75), (8192, 0.69), (15000, 0.65)):  # Table 5.8
        assert round(A.length_rule(512, L), 2) == paper
    assert round(A.length_rule(768, 1000), 2) == 0.96  # Table 5.11, L_tr = 768
    assert math.isnan(A.prop51_tau(0.093, 1.5, 1.5, 512, 4096))  # no real root: unattainable


def test_layer0_average_logit_vector_stats():
    s = A.SoftmaxStats(1, [1.0], layer0=True)
    row = torch.tensor(_gauss(64, 1.3) + 2.0, dtype=torch.float32)
    s.add(0, row.expand(6, 64))  # encoder-like: identical full rows
    l0 = s.summary()["layer0"]
    assert l0["sigma"] == pytest.approx(float(np.std(_gauss(64, 1.3))), rel=1e-5)
    assert l0["length"] == pytest.approx(64) and l0["rows"] == 6
    c = A.SoftmaxStats(1, [1.0], layer0=True)  # causal rows of lengths 2..200, each Gaussian
    rows = torch.full((199, 200), NEG)
    for i, n in enumerate(range(2, 201)):
        rows[i, :n] = torch.tensor(_gauss(n, 0.8)[np.random.default_rng(i).permutation(n)])
    c.add(0, rows, grid=200)
    l0 = c.summary()["layer0"]
    assert l0["sigma"] == pytest.approx(0.8, rel=0.03)
    assert l0["length"] == pytest.approx(math.exp(np.mean(np.log(np.arange(2, 201)))), rel=1e-6)


def _tiny(scheme, layers=2):
    m = GPT(ModelConfig(vocab_size=40, layers=layers, heads=2, dim=16, scheme=scheme, train_length=64)).eval()
    with torch.no_grad():
        for p in m.scheme.parameters():
            p.add_(torch.rand_like(p))  # non-trivial learned positional parameters
    return m


@pytest.mark.parametrize("scheme", positional.names())
def test_hook_identity_at_1_and_softmax_l_over_tau(scheme):
    m = _tiny(scheme)
    ids = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        base = m(ids)
        with A.temperature_scope(m, 1.0):
            assert torch.equal(m(ids), base)
        for tau in (0.6, [1.0, 0.5]):
            seen = {}

            class Keep(A.SoftmaxStats):
                def add(self, layer, lg, grid=None):
                    seen.setdefault(layer, []).append(lg)

            if m.scheme.replaces_softmax:  # Algorithm 1's statistics are of softmax rows: refused in one line
                with pytest.raises(UserError, match="reads softmax rows"):
                    with A.GPTTarget(m, block_size=10).scope(tau, Keep(2, [1.0])):
                        pass
                continue
            with A.GPTTarget(m, block_size=10).scope(tau, Keep(2, [1.0])):
                probs = m(ids, return_probs=True)["probs"]
            taus = tau if isinstance(tau, list) else [tau, tau]
            for layer in range(2):
                lg = torch.cat([torch.nn.functional.pad(b, (0, 24 - b.shape[-1]), value=NEG) for b in seen[layer]], 2)
                torch.testing.assert_close(probs[layer], torch.softmax(lg / taus[layer], -1), atol=2e-6, rtol=1e-5)
        assert torch.equal(m(ids), base)  # the scope left the model as it was


def test_align_writes_temperature_json_and_figure(tmp_path):
    torch.manual_seed(1)
    m = _tiny("t5", layers=2)
    tokens = np.random.default_rng(0).integers(0, 40, 400)
    res = A.align(m, tokens, train_length=16, lengths=[16, 32, 64], n_segments=2)
    assert res["tau"]["pmax"]["16"] == 1.0 and res["tau"]["entropy"]["16"] == 1.0  # L_ex = L_tr
    assert res["tau"]["length"]["64"] == pytest.approx(2 / 3)
    for rule in ("pmax", "entropy", "length", "prop51", "prop52"):
        assert set(res["tau"][rule]) == {"16", "32", "64"}
    path = A.save_temperature(tmp_path, res)
    assert json.loads(path.read_text())["tau"]["pmax"] == res["tau"]["pmax"]
    assert A.load_temperature(tmp_path, 64, "pmax") == res["tau"]["pmax"]["64"]
    assert A.load_temperature(tmp_path, 8, "entropy") == 1.0
    lo, hi = res["tau"]["pmax"]["32"], res["tau"]["pmax"]["64"]
    assert A.load_temperature(tmp_path, 45, "max") == pytest.approx(lo + (hi - lo) * math.log(45 / 32) / math.log(2))
    assert A.load_temperature(tmp_path, 1000, "length") == pytest.approx(math.log(16) / math.log(1000))
    with pytest.raises(UserError, match="--lengths 128"):
        A.load_temperature(tmp_path, 128, "pmax")
    with pytest.raises(UserError, match="unknown alignment rule"):
        A.load_temperature(tmp_path, 64, "bogus")
    with pytest.raises(UserError, match="no temperature.json"):
        A.load_temperature(tmp_path / "nope", 64, "pmax")
    table = A.align_table(res)
    assert "w/ P_max" in table and "Prop. 5.1" in table and "avg H" in table
    for p in A.plot_temperature_curves(res, tmp_path / "temperature"):
        assert Path(p).stat().st_size > 1000
    with pytest.raises(UserError, match="only 400 tokens"):
        A.align(m, tokens, 16, [512])


def test_nested_scopes_inner_wins_and_outer_is_restored():
    m = _tiny("alibi")
    ids = torch.randint(0, 40, (1, 20))
    with torch.no_grad():
        want = {t: m(ids, opts=AttnOptions(temperature=t)) for t in (0.5, 2.0)}
        with A.temperature_scope(m, 0.5):
            with A.temperature_scope(m, 2.0):
                assert torch.equal(m(ids), want[2.0])
            assert torch.equal(m(ids), want[0.5])
        assert "forward" not in m.blocks[0].__dict__
    with pytest.raises(UserError, match="one per layer"):
        with A.temperature_scope(m, [0.5]):
            pass

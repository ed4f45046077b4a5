"""`regular table` columns after 2023: randomized positions (RoPE, ALiBi) and FIRE, `--models modern`, a
column whose scheme is not registered skipped in one line, `--plan` for them, and the table next to
Ruoss et al. 2023 Table 1 (their cells marked as theirs)."""
import pytest
from typer.testing import CliRunner

from extrapolab.cli.regular import app
from extrapolab.io import UserError
from extrapolab.positional import REGISTRY
from extrapolab.regular import reference as R
from extrapolab.regular import table as T
from extrapolab.regular.columns import MODERN_COLUMNS, available, run_config
from extrapolab.regular.table_md import ruoss_markdown

TINY = dict(steps=2, eval_every=1, val_samples=4, test_samples=4, test_min=41, test_max=45, train_max=6,
            val_lengths=[8], batch_size=4)
PER = {c: {"model_options": {"dim": 16, "heads": 2, "layers": 1}} for c in MODERN_COLUMNS}


def test_modern_columns_are_the_transformer_with_their_scheme_and_the_quick_budget():
    assert MODERN_COLUMNS == ("transformer-rope-random", "transformer-alibi-random", "transformer-fire")
    fire = run_config("parity", "transformer-fire", 0, "quick").resolved()
    assert fire.model == "transformer" and fire.model_options == {"scheme": "fire", "layers": 4}
    assert (fire.steps, fire.lr, fire.positions, fire.test_stride, fire.test_samples) == (2000, 3e-4, "contiguous", 5, 64)
    assert run_config("d2", "transformer-fire", 0, "thesis").model_options["dim"] == 256
    assert T._models("modern,rnn", None) == [*MODERN_COLUMNS, "rnn"]


def test_a_column_whose_scheme_is_not_registered_is_skipped_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delitem(REGISTRY, "fire", raising=False)  # before the FIRE scheme exists
    keep, skipped = available(["rnn", "transformer-fire"])
    assert keep == ["rnn"] and skipped == ["skipping column transformer-fire: scheme 'fire' is not registered in "
                                           "this extrapolab (`extrapolab schemes` lists the ones that are)"]
    monkeypatch.setitem(T.MODEL_SPECS, "rnn", {"model": "rnn", "model_options": {"hidden": 8}})
    t = T.regular_table(tmp_path, "parity", "rnn,transformer-fire", seeds=1, progress=False, **TINY)
    assert list(t["tasks"]["parity"]) == ["rnn", "_plots"] and t["skipped"] == skipped
    assert "skipping column transformer-fire" in (tmp_path / "table.md").read_text()
    with pytest.raises(UserError, match="scheme 'fire' is not registered .*; nothing left to run"):
        T.regular_table(tmp_path, "parity", "transformer-fire", seeds=1, progress=False, **TINY)
    r = CliRunner().invoke(app, ["table", "--out", str(tmp_path), "--models", "transformer-fire", "--plan"])
    assert r.exit_code == 2 and "nothing left to run" in r.output and len(r.output.strip().splitlines()) == 1


def test_the_fire_column_runs_once_a_scheme_named_fire_is_registered(tmp_path, monkeypatch):
    """The wiring: a registered "fire" (ALiBi standing in until the FIRE scheme lands) trains in the column."""
    if "fire" not in REGISTRY:
        monkeypatch.setitem(REGISTRY, "fire", REGISTRY["alibi"])
    t = T.regular_table(tmp_path, "parity", "transformer-fire", seeds=1, progress=False,
                        per_model=PER, **TINY)
    assert t["skipped"] == [] and t["tasks"]["parity"]["transformer-fire"]["seeds"] == 1
    assert (tmp_path / "runs" / "parity" / "transformer-fire" / "seed0" / "result.json").is_file()


def test_plan_estimates_the_new_columns_alone(tmp_path, monkeypatch):
    monkeypatch.delitem(REGISTRY, "fire", raising=False)
    r = CliRunner().invoke(app, ["table", "--out", str(tmp_path), "--models", "modern", "--tasks", "parity",
                                 "--seeds", "2", "--plan", "--probe-steps", "0"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("skipping column transformer-fire") and "0/4 runs finished" in lines[1]


def _table(**cells):
    return {"tasks": {t: {m: {"max": v, "avg": v} for m, v in per.items()} for t, per in cells.items()}}


def test_next_to_ruoss_table_1_names_their_cells_until_transcribed(monkeypatch):
    """Ruoss et al.'s numbers are not in the repository (not read from the paper here): each † cell
    names the Table 1 cell to read; once RUOSS_TABLE_1 holds numbers they are filled and marked."""
    table = _table(parity={"transformer-rope-random": 55.0, "regulargpt-C2": 100.0},
                   cycle_navigation={"transformer-rope-random": 60.0}, d2={"transformer-rope-random": 99.0})
    lines = ruoss_markdown(table, ["regulargpt-C2", "transformer-rope-random"])
    head = next(ln for ln in lines if ln.startswith("| task |"))
    assert head == ("| task | regulargpt-C2 (ours) | regulargpt-C2 thesis | transformer-rope-random (ours) | "
                    "Ruoss rope randomized † |")
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")[1:]]
            for ln in lines if ln.startswith("| parity") or ln.startswith("| cycle")}
    assert rows["parity (Parity Check)"] == ["100.0", "100.0", "55.0", "Table 1, rope randomized"]
    assert rows["cycle_navigation (Cycle Navigation)"][:3] == ["—", "100.0", "60.0"]  # no C2 run; thesis Max
    assert not any(ln.startswith("| d2") for ln in lines)  # not one of Ruoss et al.'s tasks
    assert any("not filled in" in ln for ln in lines)
    assert ruoss_markdown(_table(d2={"rnn": 1.0}), ["rnn"]) == []
    # with numbers in the reference data (a stand-in here, not the paper's) the cells and best columns fill in
    fake = {t: {"none": (10.0, None), "rope": (20.0, 30.0), "relative": (40.0, 25.0)} for t in R.RUOSS_TASK_NAMES}
    monkeypatch.setattr(R, "RUOSS_TABLE_1", fake)
    import extrapolab.regular.table_md as md

    monkeypatch.setattr(md, "RUOSS_TABLE_1", fake)
    lines = ruoss_markdown(table, ["transformer-rope-random"])
    row = next(ln for ln in lines if ln.startswith("| parity"))
    assert [c.strip() for c in row.strip("|").split("|")[1:]] == ["55.0", "30.0", "40.0", "30.0"]
    assert not any("not filled in" in ln for ln in lines)


def test_ruoss_reference_data_is_empty_or_covers_the_shared_tasks():
    assert set(R.RUOSS_TASK_NAMES) == {"even_pairs", "modular_arithmetic", "parity", "cycle_navigation"}
    assert not R.RUOSS_TABLE_1 or set(R.RUOSS_TABLE_1) == set(R.RUOSS_TASK_NAMES)
    assert R.ruoss_cell("d2", "transformer") is None and R.ruoss_cell("parity", "rnn") is None
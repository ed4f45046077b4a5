"""train.tensorboard=true: event files that read back (TensorBoard's own EventAccumulator) as the
run's metrics.jsonl rows, one event per step after a resume, and a one-line error without the package."""
from __future__ import annotations

import sys

import pytest

from extrapolab.io import UserError
from extrapolab.train import train
from extrapolab.train.records import read_rows
from extrapolab.train.tb import TB_DIR, tags

from test_train import markov_data, tiny_cfg

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _events(run) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / TB_DIR), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _from_rows(rows) -> dict[str, list[tuple[int, float]]]:
    want: dict = {}
    for r in rows:
        for tag, v in tags(r).items():
            want.setdefault(tag, []).append((int(r["step"]), v))
    return want


def _same(events, want):
    assert set(events) == set(want)
    for tag in want:
        assert [s for s, _ in events[tag]] == [s for s, _ in want[tag]], tag  # each step once, in order
        assert [v for _, v in events[tag]] == pytest.approx([v for _, v in want[tag]], rel=1e-6), tag  # float32


@pytest.fixture(scope="module")
def data():
    return markov_data()


def test_event_files_equal_the_records_and_resume_does_not_duplicate(tmp_path, data):
    cfg = tiny_cfg("train.tensorboard=true")
    run = tmp_path / "tb"
    train(cfg, run, data=data, progress=False, stop_after=10)  # killed at step 10, last checkpoint at 8
    assert max(s for s, _ in _events(run)["train/loss"]) == 10
    train(cfg, run, data=data, progress=False)  # resumes from 8: steps 9, 10 are logged again
    rows = read_rows(run)
    events = _events(run)
    _same(events, _from_rows(rows))
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "valid/loss", "valid/ppl"} <= set(events)
    assert [s for s, _ in events["valid/loss"]] == [5, 10, 12]
    assert all(v > 0 for _, v in events["train/grad_norm"])
    # started over: the old events go with the old records
    train(cfg, run, data=data, progress=False, resume=False)
    _same(_events(run), _from_rows(read_rows(run)))


def test_off_by_default_and_a_missing_package_is_one_line(tmp_path, data, monkeypatch):
    train(tiny_cfg("train.steps=2"), tmp_path / "plain", data=data, progress=False)
    assert not (tmp_path / "plain" / TB_DIR).exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(UserError) as err:
        train(tiny_cfg("train.tensorboard=true"), tmp_path / "missing", data=data, progress=False)
    assert "pip install -e '.[tb]'" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "missing").exists()  # refused before anything was written

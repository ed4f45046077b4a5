"""Concurrency: one results database, one run folder, one prepared-data cache entry.

Database (report/db.py: SQLite WAL, one transaction per run): three processes (spawn) record many
fake runs each into the same file at the same time (each waits half-way until all have recorded,
so their transactions interleave), all three also re-recording one shared run, while a fourth keeps
reading: no row is lost, none duplicated, every run is 'done' with its own values, and nobody sees
a lock error.
Run folders (io.run_lock, fcntl.flock): a second process cannot take a run another process holds;
the lock dies with its holder (SIGKILL), leaving nothing that blocks; a sweep skips a run another
process is on, leaves its row alone, and a later sweep does it without redoing finished runs.
Prepared data (data/build.py): two processes preparing one dataset at once build it once (the
second waits, then reuses it), and a live builder's temp folder is never cleaned away; the temp
folder of a prepare killed mid-build is removed by the next prepare (of any dataset).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from extrapolab import config as C
from extrapolab.data import prepare
from extrapolab.data.build import clean_stale_tmp
from extrapolab.io import LockBusy, is_locked, run_lock, run_lock_path
from extrapolab.report.db import ResultsDB
from extrapolab.sweep.sweep import run_sweep

WRITERS, RUNS = 3, 40
LENGTHS = (8, 16, 32)


def _wait_for_peers(db: ResultsDB) -> None:
    q = "SELECT COUNT(DISTINCT scheme) FROM runs WHERE status='done' AND run_id != 'shared'"
    end = time.monotonic() + 60
    while db.conn.execute(q).fetchone()[0] < WRITERS and time.monotonic() < end:
        time.sleep(0.005)


def _writer(path: str, tag: str, start, errors) -> None:
    try:
        db = ResultsDB(path, timeout=60)
        start.wait(60)  # a barrier: nobody writes until every process is up
        for i in range(RUNS):
            if i == RUNS // 2:  # go on only once every writer has recorded: the runs interleave for sure
                _wait_for_peers(db)
            for rid in (f"{tag}-{i:03d}", "shared"):
                db.mark(rid, dataset="d", scheme=tag, label=tag, seed=i, status="training", run_dir=f"/runs/{rid}")
                scalars = [("nonoverlapping", L, "ppl", float(1000 * i + L)) for L in LENGTHS]
                db.record(rid, {"writer": tag, "i": i}, scalars, [("positionwise", 32, "nll", [float(i)] * 4)])
            db.set_meta(**{f"last_{tag}": i})
        db.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"{tag}: {type(e).__name__}: {e}")


def _reader(path: str, start, stop, errors) -> None:
    try:
        db = ResultsDB(path, timeout=60)
        start.wait(60)  # a barrier: nobody writes until every process is up
        while not stop.is_set():
            db.runs(None)
            db.scalars("nonoverlapping")
        db.close()
    except BaseException as e:  # noqa: BLE001
        errors.put(f"reader: {type(e).__name__}: {e}")


def test_concurrent_writers_lose_no_rows(tmp_path):
    path = str(tmp_path / "results.sqlite")
    ResultsDB(path).close()  # schema + WAL mode once, before the race
    ctx = mp.get_context("spawn")
    start, stop, errors = ctx.Barrier(WRITERS + 1), ctx.Event(), ctx.Queue()
    tags = [f"w{j}" for j in range(WRITERS)]
    writers = [ctx.Process(target=_writer, args=(path, t, start, errors)) for t in tags]
    reader = ctx.Process(target=_reader, args=(path, start, stop, errors))
    for p in (*writers, reader):
        p.start()
    for p in writers:
        p.join(120)
    stop.set()
    reader.join(60)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found and all(p.exitcode == 0 for p in (*writers, reader)), found

    con = sqlite3.connect(path)
    n_runs = WRITERS * RUNS + 1
    assert con.execute("SELECT COUNT(*), SUM(status='done') FROM runs").fetchone() == (n_runs, n_runs)
    assert con.execute("SELECT COUNT(*) FROM results").fetchone()[0] == n_runs * len(LENGTHS)
    assert con.execute("SELECT COUNT(*) FROM series").fetchone()[0] == n_runs
    for t in tags:  # every writer's own rows carry its own values
        got = con.execute("SELECT run_id, length, value FROM results WHERE run_id LIKE ? ORDER BY run_id, length",
                          (f"{t}-%",)).fetchall()
        assert got == [(f"{t}-{i:03d}", L, float(1000 * i + L)) for i in range(RUNS) for L in LENGTHS]
    # the shared run was re-recorded 3·RUNS times: one copy left, results and summary from one transaction
    i = json.loads(con.execute("SELECT summary FROM runs WHERE run_id='shared'").fetchone()[0])["i"]
    shared = con.execute("SELECT length, value FROM results WHERE run_id='shared' ORDER BY length").fetchall()
    assert shared == [(L, float(1000 * i + L)) for L in LENGTHS]
    spans = [con.execute("SELECT MIN(updated), MAX(updated) FROM runs WHERE scheme=? AND run_id != 'shared'",
                         (t,)).fetchone() for t in tags]
    assert max(a for a, _ in spans) < min(b for _, b in spans)  # the writers really ran at the same time
    meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
    assert all(meta[f"last_{t}"] == str(RUNS - 1) for t in tags)


# ---- run folders ---------------------------------------------------------------------------------
HOLD = ("import sys, time\nfrom extrapolab.io import run_lock\nwith run_lock(sys.argv[1], owner='holder'):\n"
        "    print('held', flush=True)\n    time.sleep(600)\n")


def _hold(run: Path) -> subprocess.Popen:
    """Another process that takes ``run``'s lock and keeps it until killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_run_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    run, other = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    holder = _hold(run)
    try:
        with pytest.raises(LockBusy) as e:
            with run_lock(run):
                pass
        assert f"pid {holder.pid}: holder" in str(e.value) and e.value.holder == f"pid {holder.pid}: holder"
        assert is_locked(run_lock_path(run)) == f"pid {holder.pid}: holder"
        with run_lock(other):  # another run folder is free
            with run_lock(other):  # and re-entrant within a process
                assert is_locked(run_lock_path(other)) is None
        assert not run_lock_path(other).exists()  # removed on release
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run_lock_path(run).exists()  # a SIGKILL leaves the file behind, but no lock
    assert is_locked(run_lock_path(run)) is None
    t0 = time.monotonic()
    with run_lock(run, owner="me"):
        assert time.monotonic() - t0 < 1.0  # taken at once, no waiting for a stale lock
        assert run_lock_path(run).read_text().strip().endswith(": me")
    assert not run.exists() and not run_lock_path(run).exists()  # the lock never makes the run folder


def _updated(db: Path) -> dict[str, tuple]:
    con = sqlite3.connect(db)
    try:
        return {r: (s, u) for r, s, u in con.execute("SELECT run_id, status, updated FROM runs")}
    finally:
        con.close()


def test_sweep_skips_a_run_another_process_is_on(tmp_path):
    out = tmp_path / "sweep"
    over = [f"data.cache_dir={tmp_path / 'cache'}", "train.threads=1", "sweep.seeds=[0]",
            "sweep.schemes=[none,alibi]"]
    busy, free = "stdlib--none--s0", "stdlib--alibi--s0"
    db = ResultsDB(out / "results.sqlite")
    db.mark(busy, dataset="stdlib", scheme="none", label="none", seed=0, status="training", run_dir="elsewhere")
    db.close()
    before = _updated(out / "results.sqlite")[busy]
    holder = _hold(out / "runs" / busy)  # e.g. `extrapolab train` or a second sweep on the same folder
    try:
        run_sweep("demo-smoke", out=out, overrides=over, progress=False)
        rows = _updated(out / "results.sqlite")
        assert rows[busy] == before and rows[free][0] == "done"  # its row left alone, the other run done
        assert not (out / "runs" / busy).exists() and (out / "report.html").is_file()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_sweep("demo-smoke", out=out, overrides=over, progress=False)  # the holder died: now it runs
    again = _updated(out / "results.sqlite")
    assert again[busy][0] == "done" and again[free] == rows[free]  # the finished run was not redone


# ---- prepared data -------------------------------------------------------------------------------
PREPARE = """
import pathlib, sys, time
from extrapolab import config as C
from extrapolab.data import build
cache, corpus, gate = sys.argv[1:4]
real = build._write_split
def gated(*a, **k):  # hold the build (lock taken, temp folder made) until the gate file exists
    print("building", flush=True)
    while not pathlib.Path(gate).exists():
        time.sleep(0.01)
    return real(*a, **k)
build._write_split = gated
cfg = C.resolve(None, [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={cache}"])
print("path", build.prepare(cfg.data, progress=True).path, flush=True)
"""


def prepare_process(cache: Path, corpus: Path, gate: Path) -> subprocess.Popen:
    """``prepare`` in another process that stops mid-build until ``gate`` exists."""
    return subprocess.Popen([sys.executable, "-c", PREPARE, str(cache), str(corpus), str(gate)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def small_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for j in range(20):
        (folder / f"m{j:02d}.py").write_text("".join(f"def h{i}_{j}(x):\n    return x - {i}\n" for i in range(30)))
    return folder


def _wait_for(cond, timeout=120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_concurrent_prepare_builds_once(tmp_path):
    corpus, cache, gate = small_corpus(tmp_path / "corpus"), tmp_path / "cache", tmp_path / "go"
    data = cache / "data"
    first = prepare_process(cache, corpus, gate)
    procs, said = [first], []
    try:
        assert first.stdout.readline().strip() == "building"  # holds the entry's lock, temp folder made
        tmps = list(data.glob(".tmp-*"))
        assert len(tmps) == 1
        assert clean_stale_tmp(data) == [] and tmps[0].is_dir()  # a live builder's temp folder stays
        second = prepare_process(cache, corpus, tmp_path / "never")  # if it built, it would hang
        procs.append(second)
        reader = threading.Thread(target=lambda: said.extend(second.stderr), daemon=True)
        reader.start()
        _wait_for(lambda: any("waiting for another process" in line for line in said))
        gate.touch()
        out1, err1 = first.communicate(timeout=120)
        out2 = second.stdout.read()
        second.wait(120)
        reader.join(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err2 = "".join(said)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert f"(pid {first.pid}: extrapolab prepare path:" in err2  # it named the builder it waited for
    path1 = out1.strip().splitlines()[-1]
    assert out2.strip().splitlines() == [path1]  # reused the same folder, never said "building"
    assert "prepared path:" in err1 and "prepared path:" not in err2  # built once
    assert [p.name for p in data.iterdir() if p.name.startswith(".")] == []  # no temp folder, no lock file


def test_killed_prepare_leaves_nothing_behind(tmp_path):
    corpus, cache = small_corpus(tmp_path / "corpus"), tmp_path / "cache"
    data = cache / "data"
    killed = prepare_process(cache, corpus, tmp_path / "never")
    try:
        assert killed.stdout.readline().strip() == "building"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    (left,) = data.glob(".tmp-*")  # the killed build's temp folder, and its (released) lock file
    assert left.is_dir() and len(list(data.glob(".*.lock"))) == 1
    other = data / ".tmp-path-old-bytes-0123456789abcdef-k1ll3d_x"  # another entry's, killed earlier
    other.mkdir()
    (other / "train.bin").write_bytes(b"\0" * 100)
    cfg = C.resolve(None, [f"data.corpus=path:{corpus}", "data.tokenizer=bytes", f"data.cache_dir={cache}"])
    got = prepare(cfg.data, progress=False)
    assert got.num_tokens("train") > 0 and got.path.parent == data
    assert [p.name for p in data.iterdir()] == [got.path.name]  # both temp folders and the lock file gone


_ORPHAN_SCRIPT = r"""
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from extrapolab.executor.local import exit_with_parent

def job(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=exit_with_parent, initargs=(os.getpid(),)) as pool:
        pool.submit(job, sys.argv[1]).result()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_sweep_worker_ends_when_the_sweep_process_is_killed(tmp_path):
    """A sweep killed with SIGKILL (no chance to stop its pool) leaves no worker training on alone."""
    script, pid_file = tmp_path / "s.py", tmp_path / "worker.pid"
    script.write_text(_ORPHAN_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        t = time.time()
        while not pid_file.exists() or not pid_file.read_text():
            assert time.time() - t < 60 and parent.poll() is None, "worker never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert _alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        t = time.time()
        while _alive(worker) and time.time() - t < 10:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its sweep"
    finally:
        parent.kill()

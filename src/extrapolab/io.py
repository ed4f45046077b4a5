"""Atomic file writes (temp file in the same folder + fsync + rename), inter-process locks
(``fcntl.flock``, released by the kernel when the holder dies) and one-line user errors."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: locks are no-ops
    fcntl = None


class UserError(Exception):
    """An error caused by input: the CLI prints its one-line message and exits non-zero."""


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path next to ``path``; on success fsync it and rename over ``path``.

    On any exception the temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        fsync_path(path.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks (checkpoint manifests, GGUF files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder after a rename in it); errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_with(path: str | Path, writer: Callable[[Path], None]) -> None:
    """``writer(tmp_path)`` writes the file (e.g. safetensors.save_file, torch.save)."""
    with atomic_path(path) as tmp:
        writer(tmp)


# ---- inter-process locks -------------------------------------------------------------------------
class LockBusy(UserError):
    """Another live process holds the lock; ``holder`` is what it wrote in the lock file."""

    def __init__(self, msg: str, holder: str = "") -> None:
        super().__init__(msg)
        self.holder = holder


_HELD: dict[str, list] = {}  # lock path -> [fd, depth, pid]: re-entrant within one process


def _lock_key(path: Path) -> str:
    return str(path.parent.resolve() / path.name)


def _try_flock(path: Path) -> int | None:
    """Lock ``path`` (created if missing) without waiting: the fd, or None if another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:  # the previous holder unlinks the file on release: we may have locked a dead inode
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def lock_holder(path: str | Path) -> str:
    """What the holder of lock ``path`` wrote into it ("pid 123: extrapolab train ..."), or ''."""
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""


@contextmanager
def file_lock(path: str | Path, *, wait: float | None = 0.0, owner: str = "",
              on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block.

    ``wait``: seconds to wait for another holder (0: don't wait, None: wait forever), polling, so
    Ctrl-C works; then :class:`LockBusy`. ``on_wait(holder)`` is called once when it has to wait.
    The kernel drops the lock when its process dies (SIGKILL included), so a stale lock file never
    blocks anybody. Re-entrant within one process. The file is removed on release (holders check
    that they locked the file still at ``path``, so removing it is race-free).
    """
    path = Path(path)
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    key = _lock_key(path)
    held = _HELD.get(key)
    if held is not None and held[2] == os.getpid():  # this process holds it already
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
        return
    fd = _try_flock(path)
    if fd is None and wait != 0:
        if on_wait is not None:
            on_wait(lock_holder(path))
        end = None if wait is None else time.monotonic() + wait
        delay = 0.01
        while fd is None and (end is None or time.monotonic() < end):
            time.sleep(delay)
            delay = min(0.25, delay * 1.5)
            fd = _try_flock(path)
    if fd is None:
        holder = lock_holder(path)
        raise LockBusy(f"{path} is locked by another process ({holder or 'pid unknown'})", holder)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}{': ' + owner if owner else ''}\n".encode())
        _HELD[key] = [fd, 1, os.getpid()]
        yield
    finally:
        _HELD.pop(key, None)
        try:
            os.unlink(path)  # while still holding it: see _try_flock
        except OSError:
            pass
        os.close(fd)  # releases the lock


def is_locked(path: str | Path) -> str | None:
    """The holder's note if another live process holds lock ``path`` now, else None (a snapshot)."""
    path = Path(path)
    if fcntl is None or not path.exists():
        return None
    held = _HELD.get(_lock_key(path))
    if held is not None and held[2] == os.getpid():
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return lock_holder(path) or "pid unknown"
    finally:
        os.close(fd)  # also releases the probe's lock
    return None


def run_lock_path(run_dir: str | Path) -> Path:
    """A run folder's lock file: next to the folder (``.NAME.lock``), so taking it creates no run folder."""
    run_dir = Path(run_dir).resolve()
    return run_dir.parent / f".{run_dir.name}.lock"


@contextmanager
def run_lock(run_dir: str | Path, owner: str = "", wait: float = 0.0) -> Iterator[None]:
    """Exclusive use of a run folder (training, then evaluating/recording it) by this process.

    Raises a one-line :class:`LockBusy` naming the holder and the fix when another process has it
    (after ``wait`` seconds: a run retried on a cluster waits for its killed attempt's process to go).
    """
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(run_lock_path(run_dir), wait=wait,
                                          owner=owner or f"run {Path(run_dir).name}"))
        except LockBusy as e:
            raise LockBusy(f"run folder {run_dir} is in use by another process ({e.holder or 'pid unknown'}); "
                           "wait for it to finish or stop it, then re-run the same command to resume, "
                           "or train into another --run-dir", e.holder) from None
        yield

"""Peak memory of a block of code: the one sampler of the trainer, the analyses and the bench.

``with PeakMemory(device) as m: ...`` then ``m.mib`` (peak increase over the entry level) and
``m.abs_mib`` (peak absolute level), both of this block only:

* CUDA: ``torch.cuda.synchronize`` + ``reset_peak_memory_stats`` on entry, ``max_memory_allocated``
  after a second ``synchronize`` on exit (tensor memory held by the caching allocator).
* CPU (Linux): the kernel's own high-water mark of the resident set. On entry the peak is reset
  (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) after ``malloc_trim`` has returned free heap to
  the OS; on exit ``VmHWM`` of ``/proc/self/status`` is read. No sampler thread runs, so nothing
  costs CPU time inside a timed call and no short peak is missed. Where the reset is refused
  (older kernel, non-Linux), a daemon thread samples ``/proc/self/statm`` every ``interval`` s
  while sleeping in between; timings stay wall-clock around the call only, and ``method`` says
  which was used. Blocks may nest: an inner reset first folds the current peak into every open
  block.

Only torch and the standard library are imported, so every stage can use it.
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
import time

import torch

_OPEN: list["PeakMemory"] = []  # open CPU blocks, innermost last (peak resets are process-wide)
_LOCK = threading.Lock()


def rss_bytes() -> int:
    """This process's resident set size now (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def hwm_bytes() -> int | None:
    """The kernel's peak resident set size of this process since start or the last reset."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


def reset_hwm() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return hwm_bytes() is not None
    except OSError:
        return False


def trim() -> None:
    """Return free heap pages to the OS so the entry level is the memory actually in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of a ``with`` block; ``mib``/``abs_mib`` after exit, ``method`` names the source."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.mib = self.abs_mib = float("nan")
        self.method = "cuda.max_memory_allocated (peak stats reset)" if self.device.type == "cuda" else ""

    @property
    def peak_mb(self) -> float:  # name used by the analysis records
        return self.mib

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        trim()
        self._thread = None
        with _LOCK:
            before = hwm_bytes()
            for outer in _OPEN:  # fold the peak so far into every open block before resetting it
                if outer._kernel:
                    outer._peak = max(outer._peak, before or 0)
            self._base = rss_bytes()
            self._peak = self._base
            self._kernel = reset_hwm()
            if self._kernel:
                self.method = "peak RSS (kernel high-water mark, reset on entry)"
            else:
                self.method = f"peak RSS (sampled every {self.interval * 1e3:g} ms by a sleeping thread)"
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
            _OPEN.append(self)
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.mib, self.abs_mib = max(0, peak - self._base) / 2**20, peak / 2**20
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        with _LOCK:
            self._peak = max(self._peak, rss_bytes(), (hwm_bytes() or 0) if self._kernel else 0)
            if self in _OPEN:
                _OPEN.remove(self)
        self.mib, self.abs_mib = max(0, self._peak - self._base) / 2**20, self._peak / 2**20

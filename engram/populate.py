"""Populate a mapping's pages ahead of use, in a background thread that does not hold the GIL.

A page of a shared segment costs a fault the first time a process touches it: in the daemon the page is
allocated and zeroed (tmpfs), which made puts into a cold pool about half as fast on the project machine
(benchmarks/RESULTS.md, put_get), so the daemon populates its pool at start. (A worker's mapping takes a cheaper
fault per page too; populating a whole pool per worker process cost more than it saved on 2 cores, so workers
do not.) madvise(MADV_POPULATE_READ / _WRITE) (Linux 5.14) does those faults in the
kernel without changing a byte, so it is safe while the mapping is in use. It is called through ctypes, which
releases the GIL for the call (Python's own mmap.madvise does not), so serving is not stalled meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time

import numpy as np

log = logging.getLogger("engram.populate")

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
STEP = 64 * 2**20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


class Populator:
    """Populates [0, size) of an mmap in a daemon thread; `stop()` before unmapping it (waits for one step)."""

    def __init__(self, mm: mmap.mmap, *, write: bool, what: str) -> None:
        view = np.frombuffer(mm, dtype=np.uint8)  # the mapping's address, read-only or not
        self._base, self._size = int(view.ctypes.data), len(mm)
        del view  # no export left on the mmap, so it can be closed later
        self._advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
        self._what = what
        self._stop = False
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engram-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        for off in range(0, self._size, STEP):
            if self._stop:
                return
            if _libc.madvise(self._base + off, min(STEP, self._size - off), self._advice) != 0:
                log.debug("%s is populated as it is used (madvise: errno %d)", self._what, ctypes.get_errno())
                return
        self.done.set()
        log.debug("%s populated: %d MiB in %.1f s", self._what, self._size >> 20, time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop = True
        self._thread.join()

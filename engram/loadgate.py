"""Background puts give way to loads in the same process.

A load (a hit) is on its request's critical path: the first token waits for it. A background save of a finished
prompt is not. In one worker process the two compete for the same PCIe link, GPU, host cores and GIL: on an H100
a 32K-token load took 33-40% longer while a background put ran, and as long as alone when the put gave way
(benchmarks/RESULTS.md vllm_save; the put then ends about the load's time later). A LoadGate
counts the loads in flight (`loading()` around each); a client given one (`EngramClient.give_way_to`) waits for
none to be in flight before a put starts and, on the daemon's host, before each run of blocks it encodes and
copies into the pool (engram/writer.py), at most `max_wait_s` each time: a stream of loads slows saves but
never stops them, and a reservation never waits long enough to expire.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

MAX_WAIT_S = 0.1  # about one 32K-token raw load on an H100; a nvfp4 one takes 40 ms


class LoadGate:
    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._loads = 0
        self.waits = 0  # times a put found a load in flight
        self.waited_s = 0.0  # how long puts waited in all

    @property
    def loads(self) -> int:
        return self._loads

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Around a load (its device work included): puts giving way wait until it is over."""
        with self._cond:
            self._loads += 1
        try:
            yield
        finally:
            with self._cond:
                self._loads -= 1
                if not self._loads:
                    self._cond.notify_all()

    def give_way(self) -> float:
        """Block while loads are in flight, at most max_wait_s; the seconds waited (0.0 when none was)."""
        with self._cond:
            if not self._loads:
                return 0.0
            t0 = time.monotonic()
            self._cond.wait_for(lambda: not self._loads, timeout=self.max_wait_s)
            waited = time.monotonic() - t0
            self.waits += 1
            self.waited_s += waited
        return waited

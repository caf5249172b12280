"""When the daemon's cyclic garbage collector runs, so that its pauses do not grow with the index.

Why: every stored block is a few objects the collector tracks (its BlockMeta, its list of locations, its pool
slot and run), and a full collection walks every tracked object with the event loop stopped. CPython runs one
each time the objects that survived the young generations grow by a quarter of the old ones, so a daemon whose
blocks turn over runs them again and again, each as long as the index is large: 400 ms pauses at 100k blocks
under a put load (benchmarks/RESULTS.md, gc_pause). Start-up's objects are frozen once (`gc.freeze()` in
`serve`); this freezes, every `freeze_s`, what has survived since (after a young collection, so young cyclic
garbage is collected, not frozen), and a full collection then walks only what the last period made.

What it costs: frozen objects are still freed by reference counting when the last reference goes (blocks are
not in reference cycles: the test measures that), but cyclic garbage that was alive when it was frozen is out
of the collector's sight. So every `full_s` the heap is unfrozen and collected once, a pause as long as the
default's, an hour apart instead of seconds, and whatever could have leaked is bounded by one period's worth.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class CollectorSchedule:
    freeze_s: float = 1.0  # how often survivors are frozen
    full_s: float = 3600.0  # how often the heap is unfrozen and collected whole
    freezes: int = 0
    full_collections: int = 0
    freed_by_full: int = 0  # cyclic garbage the full collections found (frozen while it was alive)
    longest_full_s: float = 0.0
    _last_full: float = field(default_factory=time.monotonic)
    _next: float = field(default_factory=time.monotonic)  # when step_if_due steps next

    def step_if_due(self, now: float | None = None) -> None:
        """`step` once freeze_s has passed since the last one: for a loop that does not yield to `run` (the trace
        replayer's, whose awaits never suspend)."""
        now = time.monotonic() if now is None else now
        if now >= self._next:
            self.step(now)
            self._next = now + self.freeze_s

    def step(self, now: float | None = None) -> None:
        """One period: collect the young generations, freeze what survived; past full_s, a full collection."""
        now = time.monotonic() if now is None else now
        gc.collect(1)
        gc.freeze()
        self.freezes += 1
        if now - self._last_full >= self.full_s:
            self._last_full = now
            t0 = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            gc.freeze()
            took = time.perf_counter() - t0
            self.full_collections += 1
            self.freed_by_full += freed
            self.longest_full_s = max(self.longest_full_s, took)
            log.info("full garbage collection: %d unreachable objects freed in %.0f ms", freed, took * 1e3,
                     extra={"fields": {"freed": freed, "ms": round(took * 1e3, 1)}})

    async def run(self) -> None:
        """`step` every freeze_s, until cancelled."""
        while True:
            await asyncio.sleep(self.freeze_s)
            try:
                self.step()
            except Exception:
                log.exception("garbage collection schedule failed")

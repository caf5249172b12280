"""The slot allocator: runs of fixed-size pages carved out of one preallocated buffer.

The pooled tiers (the shared DRAM pool, the HBM pool) allocate once at start and never again; each block
takes a run of consecutive pages. Free runs are kept three ways, so every operation is O(log n) in the
number of free runs:
- by size, in a sorted list of (pages, start): `alloc` takes the best fit (the smallest run that is long
  enough, lowest start among equals), which keeps large runs whole for large blocks;
- by start and by end, in two dicts: `free` merges a run with the free runs on either side (coalescing),
  so freeing everything always gives back one run of the whole buffer.

Every page has a generation, stamped from one monotonic clock whenever the page is allocated and again when
it is freed. A reader that was told "bytes at pages [a, b) with generation g" (a zero-copy descriptor)
checks after copying that every page in [a, b) still carries g: any reuse of any of those pages in between
(which stamps a newer value before the new owner writes) is detected, seqlock-style. The generation array
may be a view into shared memory (engram/tiers/shm.py) so another process can check it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList


@dataclass(frozen=True)
class Run:
    """Pages [start, start + pages), allocated at `generation`."""

    start: int
    pages: int
    generation: int

    @property
    def end(self) -> int:
        return self.start + self.pages


class SlotAllocator:
    def __init__(self, n_pages: int, generations: np.ndarray | None = None) -> None:
        if n_pages <= 0:
            raise ValueError(f"an allocator needs at least one page, got {n_pages}")
        if generations is None:
            generations = np.zeros(n_pages, dtype=np.uint64)
        if generations.shape != (n_pages,) or generations.dtype != np.uint64:
            raise ValueError(f"generations must be a ({n_pages},) uint64 array")
        self.n_pages = n_pages
        self.generations = generations
        self._clock = int(generations.max(initial=0))  # a reused table keeps counting upward
        self._by_size: SortedList = SortedList()
        self._by_start: dict[int, int] = {}  # free run start -> pages
        self._by_end: dict[int, int] = {}  # free run end -> start
        self._allocated: dict[int, Run] = {}  # by start
        self._free_pages = 0
        self._add_free(0, n_pages)

    @property
    def free_pages(self) -> int:
        return self._free_pages

    @property
    def used_pages(self) -> int:
        return self.n_pages - self._free_pages

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def alloc(self, pages: int) -> Run | None:
        """A run of `pages` pages, or None when no free run is long enough (the caller evicts and retries)."""
        if pages <= 0:
            raise ValueError(f"allocate at least one page, got {pages}")
        i = self._by_size.bisect_left((pages, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._remove_free(start, size)
        if size > pages:
            self._add_free(start + pages, size - pages)
        run = Run(start, pages, self._stamp(start, pages))
        self._allocated[start] = run
        return run

    def alloc_many(self, pages: Sequence[int]) -> list[Run | None]:
        """A run for each count in `pages`, as `alloc` gives them (None where none is long enough), for a batch
        booked at once (engram/transfer.py): carved one after another out of the shortest free run that holds
        them all, with one change to the free lists instead of one per run; one by one when no free run does."""
        if any(p <= 0 for p in pages):
            raise ValueError(f"allocate at least one page per run, got {min(pages)}")
        total = sum(pages)
        i = self._by_size.bisect_left((total, -1))
        if not pages or i == len(self._by_size):
            return [self.alloc(p) for p in pages]
        size, start = self._by_size[i]
        self._remove_free(start, size)
        if size > total:
            self._add_free(start + total, size - total)
        first, clock = start, self._clock
        runs: list[Run | None] = []
        for p in pages:
            clock += 1
            run = Run(start, p, clock)
            self._allocated[start] = run
            runs.append(run)
            start += p
        self.generations[first : first + total] = np.repeat(
            np.arange(self._clock + 1, clock + 1, dtype=np.uint64), pages)
        self._clock = clock
        return runs

    def free(self, run: Run) -> None:
        if self._allocated.get(run.start) != run:
            raise AssertionError(f"free of pages {run.start}+{run.pages}, which are not allocated as that run")
        del self._allocated[run.start]
        self._stamp(run.start, run.pages)  # a descriptor of the freed run is stale from now on
        start, pages = run.start, run.pages
        before = self._by_end.get(start)
        if before is not None:
            size = self._by_start[before]
            self._remove_free(before, size)
            start, pages = before, pages + size
        after = self._by_start.get(start + pages)
        if after is not None:
            self._remove_free(start + pages, after)
            pages += after
        self._add_free(start, pages)

    def is_current(self, start: int, pages: int, generation: int) -> bool:
        """Whether pages [start, start + pages) still belong to the allocation stamped `generation`."""
        return bool(np.all(self.generations[start : start + pages] == generation))

    def _stamp(self, start: int, pages: int) -> int:
        self._clock += 1
        self.generations[start : start + pages] = self._clock
        return self._clock

    def _add_free(self, start: int, pages: int) -> None:
        self._by_size.add((pages, start))
        self._by_start[start] = pages
        self._by_end[start + pages] = start
        self._free_pages += pages

    def _remove_free(self, start: int, pages: int) -> None:
        self._by_size.remove((pages, start))
        del self._by_start[start]
        del self._by_end[start + pages]
        self._free_pages -= pages

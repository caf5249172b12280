"""The slot allocator under random alloc/free sequences (hypothesis): runs never overlap and never leave the
buffer, freeing gives the space back (coalesced into one run when everything is free), and a page's
generation strictly increases every time it is reused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.tiers.slots import Run, SlotAllocator

# Each op: ("alloc", pages) or ("free", index into the live runs).
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 24)),
                         st.tuples(st.just("free"), st.integers(0, 10_000))), max_size=200)


@settings(max_examples=300, deadline=None)
@given(n_pages=st.integers(1, 64), ops=ops)
def test_random_sequences_keep_every_invariant(n_pages: int, ops: list[tuple[str, int]]) -> None:
    alloc = SlotAllocator(n_pages)
    live: list[Run] = []
    owner = np.full(n_pages, -1)  # which live run holds each page, by an id we assign
    last_gen = np.zeros(n_pages, dtype=np.uint64)  # generation seen at each page's last allocation
    next_id = 0
    for op, arg in ops:
        if op == "alloc":
            run = alloc.alloc(arg)
            if run is None:
                # Refused only when no free run is long enough.
                assert alloc.largest_free < arg
                continue
            assert run.start >= 0 and run.end <= n_pages and run.pages == arg
            assert np.all(owner[run.start : run.end] == -1), "a new run overlaps a live one"
            assert np.all(alloc.generations[run.start : run.end] > last_gen[run.start : run.end]), \
                "a reused page did not get a newer generation"
            owner[run.start : run.end] = next_id
            last_gen[run.start : run.end] = run.generation
            next_id += 1
            live.append(run)
            assert alloc.is_current(run.start, run.pages, run.generation)
        elif live:
            run = live.pop(arg % len(live))
            alloc.free(run)
            owner[run.start : run.end] = -1
            assert not alloc.is_current(run.start, run.pages, run.generation), "a freed run still looks current"
        assert alloc.used_pages == sum(r.pages for r in live) == int(np.sum(owner >= 0))
        assert alloc.free_pages + alloc.used_pages == n_pages
    for run in live:
        alloc.free(run)
    assert alloc.free_pages == n_pages
    assert alloc.largest_free == n_pages, "freeing everything did not coalesce into one run"
    assert alloc.alloc(n_pages) is not None


def test_best_fit_keeps_large_runs_whole() -> None:
    alloc = SlotAllocator(10)
    a, b, c = alloc.alloc(2), alloc.alloc(5), alloc.alloc(3)
    assert a and b and c
    alloc.free(a)  # free runs: 2 pages at 0
    alloc.free(c)  # and 3 pages at 7
    run = alloc.alloc(2)
    assert run is not None and run.start == 0  # the 2-page hole, not the front of the 3-page one
    assert alloc.alloc(4) is None  # no run of 4: refused, nothing changes
    assert alloc.free_pages == 3


def test_double_free_and_bad_sizes_are_refused() -> None:
    alloc = SlotAllocator(4)
    run = alloc.alloc(2)
    assert run is not None
    alloc.free(run)
    with pytest.raises(AssertionError, match="not allocated"):
        alloc.free(run)
    with pytest.raises(ValueError, match="at least one page"):
        alloc.alloc(0)


def test_a_shared_generation_table_keeps_counting_upward() -> None:
    table = np.zeros(8, dtype=np.uint64)
    first = SlotAllocator(8, table)
    run = first.alloc(8)
    assert run is not None
    # A second allocator over the same table (a daemon restarted over a kept segment) never reissues a
    # generation a stale descriptor could still carry.
    second = SlotAllocator(8, table)
    again = second.alloc(8)
    assert again is not None and again.generation > run.generation

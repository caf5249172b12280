"""The slot allocator under random alloc/free sequences (hypothesis; batches of runs booked at once among them):
runs never overlap and never leave the buffer, freeing gives the space back (coalesced into one run when everything is free), and a page's
generation strictly increases every time it is reused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.tiers.slots import Run, SlotAllocator

# Each op: ("alloc", pages), ("many", [pages, ...]) (alloc_many) or ("free", index into the live runs).
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 24)),
                         st.tuples(st.just("many"), st.lists(st.integers(1, 8), max_size=6)),
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
        if op in ("alloc", "many"):
            sizes = [arg] if op == "alloc" else arg
            largest = alloc.largest_free
            runs = [alloc.alloc(arg)] if op == "alloc" else alloc.alloc_many(arg)
            assert len(runs) == len(sizes)
            for pages, run in zip(sizes, runs, strict=True):
                if run is None:
                    # Refused only when no free run is long enough (one by one: after the batch's earlier runs).
                    assert op == "many" or largest < pages
                    assert alloc.largest_free < pages
                    continue
                assert run.start >= 0 and run.end <= n_pages and run.pages == pages
                assert np.all(owner[run.start : run.end] == -1), "a new run overlaps a live one"
                assert np.all(alloc.generations[run.start : run.end] > last_gen[run.start : run.end]), \
                    "a reused page did not get a newer generation"
                owner[run.start : run.end] = next_id
                last_gen[run.start : run.end] = run.generation
                next_id += 1
                live.append(run)
            for run in runs:
                assert run is None or alloc.is_current(run.start, run.pages, run.generation)
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


def test_a_batch_is_carved_in_order_from_the_shortest_free_run_that_holds_it_and_each_run_frees_alone() -> None:
    """alloc_many (a promotion's group booked at once): consecutive runs, each its own generation, out of the
    shortest free run that holds them all; freed one by one they coalesce as any runs do."""
    alloc = SlotAllocator(20)
    a, b, c = alloc.alloc(3), alloc.alloc(4), alloc.alloc(13)
    assert a and b and c
    alloc.free(a)  # free runs: 3 pages at 0
    alloc.free(c)  # and 13 at 7
    runs = alloc.alloc_many([2, 1, 3])
    assert [(r.start, r.pages) for r in runs if r] == [(7, 2), (9, 1), (10, 3)]  # 6 pages: not the 3-page hole
    assert len({r.generation for r in runs if r}) == 3
    assert all(r and alloc.is_current(r.start, r.pages, r.generation) for r in runs)
    assert alloc.free_pages == 10 and alloc.largest_free == 7
    for r in runs:
        assert r is not None
        alloc.free(r)
    alloc.free(b)
    assert alloc.largest_free == 20


def test_a_batch_no_free_run_holds_is_allocated_run_by_run() -> None:
    """No free run holds the whole batch: each run as `alloc` would place it, None for those that fit nowhere."""
    alloc = SlotAllocator(10)
    a, b, c = alloc.alloc(3), alloc.alloc(4), alloc.alloc(3)
    assert a and b and c
    alloc.free(a)
    alloc.free(c)  # two free runs of 3
    runs = alloc.alloc_many([3, 2, 2])
    assert runs[0] is not None and runs[0].pages == 3
    assert runs[1] is not None and runs[1].pages == 2
    assert runs[2] is None  # one page left
    assert alloc.free_pages == 1
    with pytest.raises(ValueError, match="at least one page"):
        alloc.alloc_many([2, 0])
    assert alloc.free_pages == 1 and alloc.alloc_many([]) == []


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

"""benchmarks/classic_policies.py: LIRS, ARC and S3-FIFO as block simulators. Each admits every block it is asked
for, never holds more than its capacity, never beats the offline optimum, and shows the behaviour it is known
for where LRU does not (a loop kept in part; a reused block kept through a scan)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.trace.formats import Request, prefix_ids

# benchmarks/ is scripts, not a package on the tests' path (pytest runs with --import-mode=importlib): by file.
_bench = Path(__file__).parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _bench / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


classic = _load("classic_policies")
bounds = _load("trace_bounds")
POLICIES = classic.POLICIES


def _requests(chains: list[list[int]]) -> list[Request]:
    return prefix_ids([Request(i, tuple(c), 0, 0) for i, c in enumerate(chains)])[0]


def _lru_hits(trace: list[Request], capacity: int) -> int:
    return bounds.simulate(trace, capacity, bounds.ORDERS["lru"])[0]


chains = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6), min_size=1, max_size=30)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(raw=chains, capacity=st.integers(1, 12))
def test_holds_what_it_was_just_asked_for_within_capacity_and_never_beats_the_optimum(name, raw, capacity) -> None:
    trace = _requests(raw)
    policy = POLICIES[name](capacity)
    accessed = 0

    class Checked:
        """The policy, checked after every access."""

        def __contains__(self, block: object) -> bool:
            return block in policy

        def __len__(self) -> int:
            return len(policy)

        def access(self, block: int) -> None:
            nonlocal accessed
            policy.access(block)
            accessed += 1
            assert block in policy
            assert len(policy) <= capacity

    hits = classic.replay(trace, Checked())
    assert accessed == sum(len(r.hash_ids) for r in trace)
    assert hits <= bounds.simulate(trace, capacity, bounds.ORDERS["belady"])[0]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_with_room_for_every_block_each_equals_lru(name) -> None:
    trace = _requests([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 6], [5, 7]])
    distinct = len({h for r in trace for h in r.hash_ids})
    hits = classic.replay(trace, POLICIES[name](distinct))
    assert hits == _lru_hits(trace, distinct) == 2 + 3 + 1  # [1, 2], [1, 2, 3], [5]


def test_lirs_keeps_part_of_a_loop_that_lru_cycles_through() -> None:
    # 12 one-block requests in a loop, 20 times, through 10 blocks: LRU always evicts the block needed next
    trace = _requests([[b] for _ in range(20) for b in range(100, 112)])
    assert _lru_hits(trace, 10) == 0
    hits = classic.replay(trace, classic.Lirs(10))
    # LIRS holds 9 LIR blocks of the loop for good (1 HIR slot turns over): 9 hits a round after the first
    assert hits >= 9 * 18


def test_lirs_moves_its_protected_set_to_a_new_loop() -> None:
    # 3 rounds of one loop, then 20 of another: blocks of the new loop reused within the protected set's span
    # (they are more recent than its oldest block) take its place, so the new loop hits as the old one did
    old = [[b] for _ in range(3) for b in range(100, 112)]
    new = [[b] for _ in range(20) for b in range(200, 212)]
    first = classic.replay(_requests(old), classic.Lirs(10))
    assert first == 9 * 2
    assert classic.replay(_requests(old + new), classic.Lirs(10)) >= first + 9 * 17


@pytest.mark.parametrize("name", ["arc", "s3fifo"])
def test_a_block_used_twice_survives_a_scan_of_blocks_used_once(name) -> None:
    hot = [[1]] * 2
    scan = [[b] for b in range(1000, 1100)]
    trace = _requests(hot + scan + [[1]])
    assert _lru_hits(trace, 10) == 1  # its second use; the scan pushes it out before the last
    assert classic.replay(trace, POLICIES[name](10)) == 2

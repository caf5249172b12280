"""benchmarks/trace_bounds.py's simulators against the replayer's own LRU and offline optimum (the bounds it
prints rest on them), and its oracle orders between the two."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engram.trace import agent_trace, replay_all
from engram.trace.formats import Request, prefix_ids
from engram.trace.synth import conversation_trace

# benchmarks/ is scripts, not a package on the tests' path (pytest runs with --import-mode=importlib): by file.
_spec = importlib.util.spec_from_file_location("trace_bounds", Path(__file__).parents[1] / "benchmarks" / "trace_bounds.py")
assert _spec is not None and _spec.loader is not None
bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bounds)
ORDERS, reuse_by_feature, simulate = bounds.ORDERS, bounds.reuse_by_feature, bounds.simulate


@pytest.mark.parametrize("make", [lambda: conversation_trace(300, seed=2), lambda: agent_trace(sessions=30, seed=4)],
                         ids=["conversations", "agents"])
def test_lru_and_optimum_equal_the_replayers(make) -> None:
    trace = make()
    dense = prefix_ids(trace)[0]
    for cap in (64, 300):
        res = {r.policy: r.hit_blocks for r in replay_all(trace, [cap], policies=("lru", "belady"))}
        assert simulate(dense, cap, ORDERS["lru"])[0] == res["lru"]
        assert simulate(dense, cap, ORDERS["belady"])[0] == res["belady"]
        flag = simulate(dense, cap, ORDERS["flag"])[0]
        assert res["lru"] <= flag <= res["belady"]


def test_reuse_by_feature_counts_each_added_block_once() -> None:
    trace = [Request(0, (0, 1, 2), 0, 0), Request(1, (0, 1, 3, 4), 0, 0), Request(2, (5, 6), 0, 0),
             Request(3, (0, 1, 3, 7), 0, 0)]
    got = reuse_by_feature(trace)
    # request 0 adds 0, 1 (first turn; both used again) and 2 (its last block, never again); request 1 matched
    # two blocks and adds 3 (used again by request 3) and 4 (last); request 2: 5 (first turn), 6 (last);
    # request 3: 7 (last)
    assert got == {"first turn": (3, 2), "last block": (4, 0), "continuing": (1, 1)}

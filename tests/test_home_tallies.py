"""ChainIndex's home tallies (engram/index.py: `_Space.homes`, `pinned_homes_by`), what a tenant's Stats counts a
namespace other tenants share by, against a walk over every block, through random moves: copies added in any tier
order (a put, a flush, a demotion, a promotion), dropped (an eviction, a damaged copy, the home's own), blocks
removed and indexed again with other copies, pins of the operator, of tenants and of no recorded owner taken and
lifted, and session references. A tally that drifts makes a tenant's Stats wrong, or negative. No store, no tiers:
the index alone, with BlockMeta built from real chain keys (tests/test_index.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engram.index import TIER_RANK, BlockMeta, ChainIndex, _lifters
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.layout import DType

FP = b"model-fp-0000000"
TIERS = tuple(TIER_RANK)  # hbm, dram, nvme
NAMESPACES = ("a", "b")
OWNERS = ("", "t1", "t2")  # a tenant pin's owner ("": of no recorded owner, as a restart gives back)


def block(i: int) -> BlockMeta:
    """A chain's first block of its own (every block a leaf: any may leave the index)."""
    ns = NAMESPACES[i % len(NAMESPACES)]
    tokens = np.arange(i, i + 16, dtype=np.int32)
    parent = root_key(ns, FP)
    return BlockMeta(key=block_key(parent, tokens), parent=parent, namespace=ns, model_fingerprint=FP,
                     tokens=tokens_to_bytes(tokens), num_tokens=16 + i, dtype=DType.BF16, shape=(1, 2, 16, 1, 1),
                     nbytes=100 * (i + 1), checksum=0, locations=[], full=True)


def walked_homes(index: ChainIndex, metas: list[BlockMeta], ns: str) -> tuple[dict[str, tuple[int, int, int, int]],
                                                                             dict[str, dict[str, int]]]:
    """Per home tier, of the namespace's indexed blocks: (blocks, bytes, tokens, pinned blocks); and per pin owner
    the blocks pinned there, counted as `_lifters` counts them."""
    tallies: dict[str, list[int]] = {}
    by: dict[str, dict[str, int]] = {}
    for m in metas:
        if m.namespace != ns or index.get(m.key) is not m or not m.locations:
            continue
        home = max(m.locations, key=TIER_RANK.__getitem__)
        row = tallies.setdefault(home, [0, 0, 0, 0])
        row[0] += 1
        row[1] += m.nbytes
        row[2] += m.num_tokens
        row[3] += 1 if m.pins else 0
        for owner in _lifters(m):
            counts = by.setdefault(owner, {})
            counts[home] = counts.get(home, 0) + 1
    return {n: tuple(r) for n, r in tallies.items() if r[0]}, by  # type: ignore[misc]


MOVES = st.lists(st.tuples(st.sampled_from(("add_copy", "add_copy", "drop_copy", "drop_copy", "pin", "unpin",
                                            "remove", "index", "ref")),
                           st.integers(0, 5), st.sampled_from(TIERS), st.sampled_from(("op", *OWNERS))),
                 max_size=80)


@settings(max_examples=300, deadline=None)
@given(MOVES)
def test_home_tallies_equal_a_walk_through_random_copy_pin_and_index_moves(moves: list[tuple[str, int, str, str]]
                                                                          ) -> None:
    index = ChainIndex()
    metas = [block(i) for i in range(6)]
    for m in metas[:3]:
        index.add_copy(m, "dram")
        index.add(m)
    for step, (op, i, tier, who) in enumerate(moves):
        m = metas[i]
        indexed = index.get(m.key) is m
        if op == "add_copy" and tier not in m.locations:
            index.add_copy(m, tier)
        elif op == "drop_copy":
            index.drop_copy(m, tier)
        elif op == "pin":
            if who == "op":
                index.set_pins(m, m.pins + 1, m.operator_pins + 1)
            else:
                index.set_pins(m, m.pins + 1, owner=who)
        elif op == "unpin" and m.pins:
            if who == "op" and m.operator_pins:
                index.set_pins(m, m.pins - 1, m.operator_pins - 1)
            elif who != "op" and m.owner_pins(who) > 0:
                index.set_pins(m, m.pins - 1, owner=who)
        elif op == "remove" and indexed:
            index.remove(m.key)
        elif op == "index" and not indexed and m.locations:
            index.add(m)
        elif op == "ref" and indexed:
            owner = "" if who == "op" else who
            mine = m.refs if not owner else (m.owner_refs or {}).get(owner, 0)
            index.add_refs(m, -1 if mine and step % 2 else 1, owner=owner)
        assert all(m.locations == sorted(m.locations, key=TIER_RANK.__getitem__) for m in metas), step
        for ns in NAMESPACES:
            walked, pinned_by = walked_homes(index, metas, ns)
            kept = {n: (t.blocks, t.nbytes, t.tokens, t.pinned) for n, t in index.home_tallies([ns]).items()
                    if (t.blocks, t.nbytes, t.tokens, t.pinned) != (0, 0, 0, 0)}
            assert kept == walked, f"step {step} ({op} {i} {tier} {who}): homes of {ns}"
            for owner in OWNERS:
                want: dict[str, int] = {}
                for who_counted in {owner, ""}:
                    for n, c in pinned_by.get(who_counted, {}).items():
                        want[n] = want.get(n, 0) + c
                assert index.pinned_tiers([ns], owner, homes=True) == want, f"step {step}: pinned homes of {owner!r}"

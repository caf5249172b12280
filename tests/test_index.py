"""ChainIndex on its own (engram/index.py): the longest-prefix match over chained keys, partial tails and
blocks that diverge part-way, per-namespace tables, physical bytes, and the parent/child bookkeeping that
eviction relies on. Blocks are BlockMeta built from real chain keys; no store, no tiers."""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import numpy as np
import pytest

from engram.index import BlockMeta, ChainIndex
from engram.keys import block_key, chain_keys, root_key, tokens_to_bytes
from engram.layout import DType

BT = 16
FP = b"model-fp-0000000"
OTHER_FP = b"model-fp-1111111"


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32_000, n, dtype=np.int32)


def meta(namespace: str, parent: bytes, tokens: np.ndarray, *, fp: bytes = FP, nbytes: int = 100,
         key: bytes | None = None) -> BlockMeta:
    return BlockMeta(key=key or block_key(parent, tokens), parent=parent, namespace=namespace, model_fingerprint=fp,
                     tokens=tokens_to_bytes(tokens), num_tokens=len(tokens), dtype=DType.BF16,
                     shape=(1, 2, len(tokens), 1, 1), nbytes=nbytes, checksum=0, locations=["dram"],
                     full=len(tokens) == BT)


def chain(namespace: str, tokens: np.ndarray, *, fp: bytes = FP, salt: bytes = b"", nbytes: int = 100
          ) -> list[BlockMeta]:
    """The blocks a put of `tokens` stores, in chain order (the last one partial if the length says so)."""
    parent = root_key(namespace, fp, salt)
    out = []
    for key, start, end in chain_keys(namespace, fp, tokens, BT, salt):
        out.append(meta(namespace, parent, tokens[start:end], fp=fp, nbytes=nbytes, key=key))
        parent = key
    return out


def recording(reads: list[object]) -> type[dict[Any, Any]]:
    """A dict class that notes every key read through it (to prove a table was never consulted)."""

    class Recording(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            reads.append(key)
            return super().get(key, default)

        def __getitem__(self, key: Any) -> Any:
            reads.append(key)
            return super().__getitem__(key)

    return Recording


def index_of(*metas: BlockMeta) -> ChainIndex:
    index = ChainIndex()
    for m in metas:
        index.add(m)
    return index


# ---- full blocks -------------------------------------------------------------------------------------------


def test_block_meta_takes_every_field_in_order_with_its_default() -> None:
    """BlockMeta's __init__ is written out (compiled, the generated one set each field the slow way): it must take
    every field, in the fields' order, with the same defaults (a field added without it would stay unset, or an
    old default would go on being used); the time it was made is the default creation time."""
    params = list(inspect.signature(BlockMeta.__init__).parameters.values())[1:]
    fields = dataclasses.fields(BlockMeta)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name  # None: made by the factory
        else:
            assert p.default is inspect.Parameter.empty, f.name
    m = meta("ns", root_key("ns", FP), toks(BT))
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert getattr(m, f.name) == f.default, f.name
    assert abs(m.created - time.time()) < 60
    again = dataclasses.replace(m, pins=2)
    assert (again.pins, again.created, again.key) == (2, m.created, m.key)


def test_full_blocks_match_in_chain_order() -> None:
    t = toks(3 * BT)
    blocks = chain("ns", t)
    index = index_of(*blocks)
    match = index.match("ns", FP, t, BT)
    assert match.blocks == tuple(blocks)
    assert match.matched_tokens == 3 * BT
    # A longer query matches the stored prefix and stops where the store does.
    longer = np.concatenate([t, toks(BT, seed=9)])
    assert index.match("ns", FP, longer, BT).matched_tokens == 3 * BT


def test_the_walk_stops_at_the_first_missing_block() -> None:
    # Consecutive blocks only: a block whose parent is gone is unreachable, even though it is indexed.
    t = toks(3 * BT)
    b0, b1, b2 = chain("ns", t)
    index = index_of(b0, b1, b2)
    index.remove(b1.key)
    match = index.match("ns", FP, t, BT)
    assert match.blocks == (b0,)
    assert match.matched_tokens == BT


def test_a_key_match_with_other_stored_tokens_is_not_a_hit() -> None:
    # A key is a hint: a block stored under the query's key (a collision) but holding other tokens is refused.
    t = toks(2 * BT)
    b0, b1 = chain("ns", t)
    impostor = meta("ns", b0.key, toks(BT, seed=5), key=b1.key)
    index = index_of(b0, impostor)
    match = index.match("ns", FP, t, BT)
    assert match.blocks == (b0,)
    assert match.matched_tokens == BT


def test_another_model_never_matches() -> None:
    t = toks(2 * BT)
    index = index_of(*chain("ns", t))
    assert index.match("ns", OTHER_FP, t, BT).matched_tokens == 0
    index.add(chain("ns", t, fp=OTHER_FP)[0])
    assert index.match("ns", OTHER_FP, t, BT).matched_tokens == BT


def test_a_salted_chain_matches_only_with_its_salt() -> None:
    t = toks(2 * BT)
    index = index_of(*chain("ns", t, salt=b"secret"))
    assert index.match("ns", FP, t, BT).matched_tokens == 0
    assert index.match("ns", FP, t, BT, salt=b"wrong").matched_tokens == 0
    assert index.match("ns", FP, t, BT, salt=b"secret").matched_tokens == 2 * BT


# ---- partial tails and divergence --------------------------------------------------------------------------


def test_a_stored_partial_tail_serves_a_longer_query() -> None:
    # Stored: 2 full blocks and a partial of 5; the query carries 12 tokens past them, the first 5 equal.
    t = toks(2 * BT + 12)
    stored = chain("ns", t[: 2 * BT + 5])
    assert not stored[-1].full
    index = index_of(*stored)
    match = index.match("ns", FP, t, BT)
    assert match.blocks == tuple(stored)
    assert match.matched_tokens == 2 * BT + 5


def test_a_query_with_a_partial_tail_uses_the_first_tokens_of_a_stored_full_block() -> None:
    # The query's own last block is partial (its key cannot be computed from a stored full block's): the
    # stored full block that extends the prefix serves its first 7 tokens, and callers slice.
    t = toks(3 * BT)
    stored = chain("ns", t)
    index = index_of(*stored)
    match = index.match("ns", FP, t[: 2 * BT + 7], BT)
    assert match.blocks == tuple(stored)
    assert match.matched_tokens == 2 * BT + 7


def test_a_stored_partial_longer_than_the_query_tail_serves_the_tail() -> None:
    t = toks(BT + 10)
    stored = chain("ns", t)
    index = index_of(*stored)
    match = index.match("ns", FP, t[: BT + 4], BT)
    assert match.blocks == tuple(stored)
    assert match.matched_tokens == BT + 4


def test_divergence_inside_a_block_counts_the_shared_tokens() -> None:
    t = toks(3 * BT)
    stored = chain("ns", t)
    query = t.copy()
    query[BT + 6] += 1  # differs from block 1 at its 7th token
    match = index_of(*stored).match("ns", FP, query, BT)
    assert match.blocks == tuple(stored[:2])
    assert match.matched_tokens == BT + 6


def test_a_block_diverging_at_its_first_token_is_not_listed() -> None:
    t = toks(2 * BT)
    stored = chain("ns", t)
    query = t.copy()
    query[BT] += 1
    match = index_of(*stored).match("ns", FP, query, BT)
    assert match.blocks == (stored[0],)
    assert match.matched_tokens == BT


def test_the_child_sharing_the_longest_prefix_wins() -> None:
    # Three blocks extend the same parent and share 3, 11 and 7 tokens with the query's next block.
    t = toks(2 * BT)
    b0 = chain("ns", t)[0]
    children = []
    for shared in (3, 11, 7):
        other = t[BT: 2 * BT].copy()
        other[shared:] = toks(BT - shared, seed=shared) + 40_000  # token ids the query never has
        children.append(meta("ns", b0.key, other))
    index = index_of(b0, *children)
    match = index.match("ns", FP, t, BT)
    assert match.blocks == (b0, children[1])
    assert match.matched_tokens == BT + 11


def test_a_query_ending_on_a_block_boundary_lists_no_child_past_it() -> None:
    t = toks(3 * BT)
    stored = chain("ns", t)
    index = index_of(*stored)
    match = index.match("ns", FP, t[: 2 * BT], BT)
    assert match.blocks == tuple(stored[:2])  # block 2 extends the prefix but serves none of the query
    assert match.matched_tokens == 2 * BT
    assert index.match("ns", FP, t[:0], BT).matched_tokens == 0


# ---- namespaces --------------------------------------------------------------------------------------------


def test_the_same_tokens_in_two_namespaces_are_two_chains() -> None:
    t = toks(2 * BT)
    a, b = chain("alice", t), chain("bob", t)
    assert {m.key for m in a}.isdisjoint(m.key for m in b)
    index = index_of(*a)
    assert index.match("bob", FP, t, BT).matched_tokens == 0
    index.add(b[0])
    assert index.match("bob", FP, t, BT).blocks == (b[0],)
    assert index.match("alice", FP, t, BT).blocks == tuple(a)


def test_a_block_of_another_namespace_under_a_colliding_key_is_never_matched() -> None:
    # Alice's entry carries the very key (and parent) Bob's query computes: the match still only sees Bob's.
    t = toks(2 * BT)
    bob = chain("bob", t)
    forged = [meta("alice", m.parent, t[i * BT:(i + 1) * BT], key=m.key) for i, m in enumerate(bob)]
    index = index_of(*forged, chain("bob", toks(BT, seed=3))[0])  # Bob has some other block
    reads: list[object] = []
    index._entries = recording(reads)(index._entries)  # the flat table: never part of a tenant's match
    assert index.match("bob", FP, t, BT).matched_tokens == 0
    assert reads == []
    assert index.get_in("bob", bob[0].key) is None
    assert index.get_in("alice", bob[0].key) is forged[0]
    assert index.get(bob[0].key) is forged[0]  # the flat table is the store's bookkeeping only


def test_a_match_in_one_namespace_reads_no_entry_of_another() -> None:
    t = toks(2 * BT + 5)
    index = index_of(*chain("alice", t), *chain("bob", toks(BT, seed=2)))
    reads: list[object] = []
    Recording = recording(reads)
    space = index._spaces["alice"]
    space.entries, space.children = Recording(space.entries), Recording(space.children)
    assert index.match("bob", FP, t, BT).matched_tokens == 0
    assert index.match("carol", FP, t, BT).matched_tokens == 0  # a namespace with no table at all
    assert reads == []
    assert index.match("alice", FP, t, BT).matched_tokens == len(t)  # control: her own match reads them
    assert reads


def test_namespaces_and_blocks_in_list_only_their_own() -> None:
    a, b = chain("alice", toks(2 * BT)), chain("bob", toks(BT + 3, seed=1))
    index = index_of(*a, *b)
    assert index.namespaces() == ["alice", "bob"]
    assert sorted(m.key for m in index.blocks_in("bob")) == sorted(m.key for m in b)
    assert index.blocks_in("carol") == []
    assert len(index) == 4
    assert all(m.key in index for m in a + b)


# ---- bytes and bookkeeping ---------------------------------------------------------------------------------


def test_physical_bytes_count_each_block_once_per_namespace() -> None:
    a = chain("alice", toks(3 * BT), nbytes=100)
    b = chain("bob", toks(BT), nbytes=7)
    index = index_of(*a, *b)
    assert index.physical_bytes("alice") == 300
    assert index.physical_bytes("bob") == 7
    assert index.physical_bytes("carol") == 0
    index.remove(a[2].key)
    assert index.physical_bytes("alice") == 200
    index.remove(b[0].key)
    assert index.physical_bytes("bob") == 0
    assert index.namespaces() == ["alice"]  # an emptied namespace leaves no table behind


def test_adding_a_key_twice_is_refused() -> None:
    b0 = chain("ns", toks(BT))[0]
    index = index_of(b0)
    with pytest.raises(AssertionError, match="already indexed"):
        index.add(meta("ns", b0.parent, toks(BT), key=b0.key))
    assert index.physical_bytes("ns") == b0.nbytes


def test_children_are_counted_and_remove_reports_a_parent_that_became_a_leaf() -> None:
    t = toks(2 * BT)
    b0, b1 = chain("ns", t)
    sibling = meta("ns", b0.key, toks(5, seed=4))  # a partial tail beside b1
    index = index_of(b0, b1, sibling)
    assert b0.children == 2
    assert sorted(m.key for m in index.children_of(b0.key)) == sorted([b1.key, sibling.key])
    assert index.remove(b1.key) == (b1, None)  # b0 still has a child
    assert index.remove(sibling.key) == (sibling, b0)  # now b0 is a leaf: eviction may take it
    assert b0.children == 0
    assert index.children_of(b0.key) == []
    assert index.remove(b0.key) == (b0, None)  # a first block's parent is the root, never indexed
    assert index.remove(b0.key) == (None, None)


def test_partial_children_lists_only_partial_blocks_of_that_namespace() -> None:
    t = toks(2 * BT)
    b0, b1 = chain("ns", t)
    tails = [meta("ns", b0.key, toks(n, seed=n)) for n in (3, 9)]
    index = index_of(b0, b1, *tails)
    assert sorted(m.key for m in index.partial_children("ns", b0.key)) == sorted(m.key for m in tails)
    assert index.partial_children("other", b0.key) == []
    assert index.partial_children("ns", b1.key) == []
    index.remove(tails[0].key)
    assert index.partial_children("ns", b0.key) == [tails[1]]


def test_listeners_see_every_add_and_remove() -> None:
    index = ChainIndex()
    seen: list[tuple[str, bytes]] = []
    index.listeners.append(lambda event, m: seen.append((event, m.key)))
    b0, b1 = chain("ns", toks(2 * BT))
    index.add(b0)
    index.add(b1)
    index.remove(b1.key)
    index.remove(b"absent")
    assert seen == [("add", b0.key), ("add", b1.key), ("remove", b1.key)]


# ---- fan-out -----------------------------------------------------------------------------------------------


def _fan(children: int) -> tuple[ChainIndex, BlockMeta, np.ndarray, list[BlockMeta]]:
    """A first block with `children` blocks extending it, all opening with the same 6 template tokens
    (a chat turn's header after a shared system prompt) and then going their own ways."""
    t = toks(BT)
    b0 = chain("ns", t)[0]
    rng = np.random.default_rng(7)
    kids = []
    for i in range(children):
        body = rng.integers(0, 32_000, BT, dtype=np.int32)
        body[:6] = np.arange(100, 106)
        body[6] = 50_000 + i  # where they part
        kids.append(meta("ns", b0.key, body))
    return index_of(b0, *kids), b0, t, kids


@pytest.mark.parametrize("stored_tail", [False, True])
def test_a_match_does_the_same_work_behind_10_or_10000_children(stored_tail: bool) -> None:
    work = {}
    for n in (10, 10_000):
        index, b0, t, kids = _fan(n)
        target = kids[3]
        query = np.concatenate([t, target.token_array()[:11], [40_001, 40_002]]).astype(np.int32)  # diverges at 11
        if stored_tail:  # the query's next block is cut short: its own tail is partial
            query = query[: BT + 9]
        before = index.probes
        match = index.match("ns", FP, query, BT)
        work[n] = index.probes - before
        assert match.blocks == (b0, target)
        assert match.matched_tokens == BT + (9 if stored_tail else 11)
    assert work[10_000] == work[10]
    assert work[10] <= 2 + BT  # one key probe, then at most one trie step per token of the block


def test_the_trie_finds_what_comparing_every_child_finds() -> None:
    # Children over a tiny vocabulary (so they share prefixes of every length), full and partial, some
    # identical up to a partial's end; every query's answer is checked against the brute-force best.
    rng = np.random.default_rng(11)
    b0 = chain("ns", toks(BT))[0]
    index = index_of(b0)
    kids: dict[bytes, BlockMeta] = {}
    for _ in range(300):
        body = rng.integers(0, 3, int(rng.choice([BT, BT, rng.integers(1, BT)])), dtype=np.int32)
        m = meta("ns", b0.key, body)
        if m.key not in kids:
            kids[m.key] = m
            index.add(m)

    def check() -> None:
        for _ in range(200):
            tail = rng.integers(0, 3, int(rng.integers(1, BT + 1)), dtype=np.int32)
            query = np.concatenate([toks(BT), tail]).astype(np.int32)
            best = max((_shared(k.token_array(), tail) for k in kids.values()), default=0)
            match = index.match("ns", FP, query, BT)
            assert match.matched_tokens == BT + best
            if best:
                assert _shared(match.blocks[-1].token_array(), tail) == best
            else:
                assert match.blocks == (b0,)

    check()
    for key in list(kids)[:-3]:  # remove all but three: the trie shrinks and stays right
        index.remove(key)
        del kids[key]
    check()
    assert b0.children == len(kids) == 3


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_pinned_bytes_count_each_pinned_block_and_what_it_extends_once_through_any_removal() -> None:
    """The namespace's pinned bytes (a tenant's pin share counts them, engram/store/pins.py): a pin on a block
    keeps the chain it extends, counted once however many pins and pinned descendants. A lost block is unindexed
    before its descendants (recovery.drop_lost), pins and all: nothing it counted stays counted, and a block put
    again under the same key counts the pinned children it finds."""
    index = ChainIndex()
    blocks = chain("a", toks(5 * BT))  # 100 bytes each
    for m in blocks:
        index.add(m)
    assert index.pin_growth([blocks[3]]) == 400 and index.pin_growth([blocks[3], blocks[1]]) == 400
    index.set_pins(blocks[3], 1)
    index.set_pins(blocks[1], 2)
    assert index.pinned_bytes("a") == 400 and index.pin_growth([blocks[4]]) == 100
    index.set_pins(blocks[3], 0)
    assert index.pinned_bytes("a") == 200  # blocks[1] is still pinned, and keeps blocks[0]
    index.set_pins(blocks[3], 1)
    index.remove(blocks[2].key)  # lost: unindexed while a pinned block extends it
    assert index.pinned_bytes("a") == 300  # blocks[0], [1] (pinned) and [3] (pinned)
    index.set_pins(blocks[1], 0)
    assert index.pinned_bytes("a") == 100  # blocks[3]: what blocks[2] kept above it went with it
    index.set_pins(blocks[3], 0)  # its parent is gone: nothing above it changes
    assert index.pinned_bytes("a") == 0
    index.set_pins(blocks[3], 1)
    index.add(blocks[2])  # put again: it finds its pinned child, and keeps the chain above it
    assert index.pinned_bytes("a") == 400 and blocks[2].pin_held_children == 1
    index.set_pins(blocks[3], 0)
    assert index.pinned_bytes("a") == 0
    index.set_pins(blocks[4], 1)
    index.remove(blocks[4].key)  # an evict that overrode its pin
    assert index.pinned_bytes("a") == 0
    assert [m.pin_held_children for m in blocks[:4]] == [0, 0, 0, 0]


def test_a_blocks_home_is_its_slowest_copy_and_moves_only_with_that_copy() -> None:
    """`home_tallies` counts each block once, in the slowest tier holding a copy, whatever the order copies come in
    (`add_copy` keeps locations in tier order): a copy added above the home (a read's) changes nothing there, one
    added below moves it down, and dropping the home's copy (a damaged NVMe file, a sound DRAM copy left) moves it
    up; a tenant's pinned homes follow (`pinned_tiers(homes=True)`)."""
    a, b = chain("ns", toks(2 * BT, seed=3))
    index = index_of(a, b)  # both in DRAM alone

    def homes() -> dict[str, tuple[int, int]]:
        pinned = index.pinned_tiers(["ns"], "t", homes=True)
        return {n: (t.blocks, pinned.get(n, 0)) for n, t in index.home_tallies(["ns"]).items() if t.blocks}

    assert homes() == {"dram": (2, 0)}
    index.set_pins(b, 1, owner="t")
    assert homes() == {"dram": (2, 1)}
    index.add_copy(b, "nvme")  # written down (a flush)
    assert b.locations == ["dram", "nvme"] and homes() == {"dram": (1, 0), "nvme": (1, 1)}
    index.add_copy(b, "hbm")  # read up: above its home
    assert b.locations == ["hbm", "dram", "nvme"] and homes() == {"dram": (1, 0), "nvme": (1, 1)}
    index.drop_copy(b, "dram")
    assert homes() == {"dram": (1, 0), "nvme": (1, 1)}
    index.drop_copy(b, "nvme")  # its home's copy dropped: the HBM copy is all that is left
    assert b.locations == ["hbm"] and homes() == {"dram": (1, 0), "hbm": (1, 1)}
    index.set_pins(b, 0, owner="t")
    index.remove(b.key)
    assert homes() == {"dram": (1, 0)}

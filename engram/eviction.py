"""Eviction order for one tier: least recently used first, and on the tier whose eviction deletes a
block (the last one, or any tier with nowhere to demote to) least recently used *leaf* first.

Deleting only blocks with no children in the index (leaves) makes a chain lose its tail before its head,
so every stored block stays reachable from the root (prefix closure): plain LRU would delete the oldest
block, and the oldest block of a chain is its root, whose loss orphans every descendant. Demoting a block
to a lower tier keeps it reachable, so demotion may take any block.

Blocks that a live session references (its prefix: engram/sessions.py) go after every unreferenced block
of the tier: a session about to resume keeps its prefix, while blocks nobody holds (a finished agent's
history) go first. Blocks that several live sessions hold (a shared system prompt, a repository they all
read, a fork point) go after those only one session holds: a shared root serves every session below it, a
private tail only its own. They are still victims when nothing else is left, so sessions cannot wedge a tier.

Structure: a binary heap of (held class, tick, key) with lazy deletion; the class is `held_class`: 0 nobody
holds the block, 1 one session, 2 several. Every access gives a block a new tick and
pushes a fresh entry (so does a change of referenced class); entries whose tick or class no longer match
the block's, or whose block gained a child,
moved tier or left the index, are discarded when they surface. Entries of pinned, leased or moving
blocks are held aside while a victim is sought and pushed back with their own tick, so they keep their
true place in the order (an LRU list could only re-append them as the newest). In leaf-only mode inner
blocks are dropped from the heap and pushed again, with their own tick, when their last child goes;
`rebuild` restores every entry when a tier leaves leaf-only mode. Costs: touch O(log n), victim O(log n) amortised; the heap is
rebuilt when stale entries outnumber live blocks 4:1, so memory stays O(blocks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from engram.index import BlockMeta

_ticks = itertools.count(1)  # one clock for every tier, so a block keeps its recency when it moves


def tick(meta: BlockMeta) -> None:
    meta.tick = next(_ticks)


def held_class(meta: BlockMeta) -> int:
    """0: no live session holds the block, 1: one does, 2: several (evicted in that order)."""
    return min(meta.refs, 2)


def _entry(meta: BlockMeta) -> tuple[int, int, bytes]:
    return (held_class(meta), meta.tick, meta.key)


class LeafLRU:
    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._heap: list[tuple[int, int, bytes]] = []
        self._live = 0

    def touch(self, meta: BlockMeta) -> None:
        """Record a use, or a change of referenced class; call for a block's every tier (one clock, so
        recency is the same everywhere)."""
        heapq.heappush(self._heap, _entry(meta))

    def add(self, meta: BlockMeta) -> None:
        """A copy of the block arrived in this tier."""
        heapq.heappush(self._heap, _entry(meta))

    def victim(self, lookup: Callable[[bytes], BlockMeta | None], live_blocks: int, *, leaf_only: bool,
               max_held: int | None = None) -> BlockMeta | None:
        """The least recently used evictable block (leaf, with leaf_only) of this tier, or None if every
        candidate is pinned, leased or moving. Unreferenced blocks first, then those one session holds,
        then those several hold. `max_held`: give up (None) after passing that many pinned, leased or moving
        blocks, for callers that would rather skip than search (a promotion into a tier that the reader's own
        leased chain fills would otherwise pass every one of them, for every block it promotes)."""
        held: list[tuple[int, int, bytes]] = []
        found = None
        while self._heap and (max_held is None or len(held) < max_held):
            item = heapq.heappop(self._heap)
            meta = lookup(item[2])
            if meta is None or _entry(meta) != item or self.tier_name not in meta.locations:
                continue  # stale entry
            if leaf_only and meta.children:
                continue  # an inner block: `add` pushes it again when its last child goes
            if meta.evictable:
                found = meta
                break
            held.append(item)  # pinned, being read or moving: keep its place
        for item in held:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 4 * max(live_blocks, 16):
            self._compact(lookup)
        return found

    def rebuild(self, metas: Iterable[BlockMeta]) -> None:
        self._heap = [_entry(m) for m in metas if self.tier_name in m.locations]
        heapq.heapify(self._heap)

    def _compact(self, lookup: Callable[[bytes], BlockMeta | None]) -> None:
        keep = []
        for item in self._heap:
            meta = lookup(item[2])
            if meta is not None and _entry(meta) == item and self.tier_name in meta.locations:
                keep.append(item)
        heapq.heapify(keep)
        self._heap = keep

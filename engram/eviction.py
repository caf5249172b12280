"""Eviction order for one tier: least recently used *leaf* first.

Only a block with no children in the index (a leaf) may be evicted, so a chain always loses its tail
before its head and every stored block stays reachable from the root (prefix closure). Plain LRU over
all blocks would evict the oldest block, and the oldest block of a chain is its root, whose loss orphans
every descendant.

Structure: a binary heap of (tick, key) with lazy deletion. Every access gives a block a new tick and
pushes a fresh entry; entries whose tick no longer matches the block's, or whose block gained a child,
moved tier or left the index, are discarded when they surface. When a block's last child goes, the
block is pushed again with its *own* last tick, so it takes its true place in the order (an LRU list
could only append it as the newest). Costs: touch O(log n), victim O(log n) amortised; the heap is
rebuilt when stale entries outnumber live blocks 4:1, so memory stays O(blocks).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from engram.index import BlockMeta

_ticks = itertools.count(1)  # one clock for every tier, so a block keeps its recency when it moves


class LeafLRU:
    def __init__(self, tier_name: str) -> None:
        self.tier_name = tier_name
        self._heap: list[tuple[int, bytes]] = []
        self._live = 0

    def touch(self, meta: BlockMeta) -> None:
        meta.tick = next(_ticks)
        if meta.children == 0:
            heapq.heappush(self._heap, (meta.tick, meta.key))

    def became_leaf(self, meta: BlockMeta) -> None:
        heapq.heappush(self._heap, (meta.tick, meta.key))

    def victim(self, lookup: Callable[[bytes], BlockMeta | None], live_blocks: int) -> BlockMeta | None:
        """The least recently used evictable leaf of this tier, or None if every leaf is pinned or leased."""
        held: list[tuple[int, bytes]] = []
        found = None
        while self._heap:
            tick, key = heapq.heappop(self._heap)
            meta = lookup(key)
            if meta is None or meta.tick != tick or meta.children or meta.tier != self.tier_name:
                continue  # stale entry
            if meta.evictable:
                found = meta
                break
            held.append((tick, key))  # pinned or being read: keep its place for later
        for item in held:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 4 * max(live_blocks, 16):
            self._compact(lookup)
        return found

    def _compact(self, lookup: Callable[[bytes], BlockMeta | None]) -> None:
        keep = []
        for tick, key in self._heap:
            meta = lookup(key)
            if meta is not None and meta.tick == tick and not meta.children and meta.tier == self.tier_name:
                keep.append((tick, key))
        heapq.heapify(keep)
        self._heap = keep

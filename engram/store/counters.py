"""What the store counts, and the per-tier figures assembled from it in one place (`tier_stats`), which
Stats, the Prometheus collector and the log reporter all read."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engram.api import TierStats
from engram.index import Tally

if TYPE_CHECKING:
    from engram.store.placement import Placement
    from engram.tiers.base import Tier


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0  # reads served by a lower tier because this one had no copy
    evictions: int = 0
    demotions: int = 0  # blocks copied down out of this tier
    promotions: int = 0  # blocks copied up into this tier on a hit
    demoted_bytes: int = 0
    promoted_bytes: int = 0
    served_bytes: int = 0  # bytes of the blocks served from this tier (its hits)
    written_bytes: int = 0  # bytes of copies written into this tier: puts, demotions into it, promotions
    io_errors: int = 0
    corrupt_blocks: int = 0
    enospc: int = 0


@dataclass
class TierHealth:
    state: str = "ok"  # "ok" or "degraded"
    reason: str = ""
    retry_at: float = 0.0
    failed_at: float = 0.0  # time.monotonic() of the failure that degraded it last
    cause: str = ""  # that failure


@dataclass
class NamespaceCounters:
    """One namespace's part of the store's activity counters: what a tenant's Stats shows of them, since the
    daemon-wide counts move with every other tenant's calls (bytes served / bytes per token: its prompt lengths)."""

    blocks_put: int = 0
    blocks_deduplicated: int = 0
    blocks_served: int = 0
    bytes_served: int = 0

    def add(self, other: NamespaceCounters) -> NamespaceCounters:
        return NamespaceCounters(self.blocks_put + other.blocks_put,
                                 self.blocks_deduplicated + other.blocks_deduplicated,
                                 self.blocks_served + other.blocks_served, self.bytes_served + other.bytes_served)


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    blocks_put: int = 0
    blocks_deduplicated: int = 0
    blocks_served: int = 0  # by every path: bytes Gets, zero-copy descriptors, Resume, peer fetches
    bytes_served: int = 0
    corrupt_blocks: int = 0
    blocks_evicted_on_request: int = 0  # by `remove` (engram evict), not by tier pressure
    blocks_not_durable: int = 0  # write-through puts acknowledged without a durable copy (on_nvme_failure = degrade)
    blocks_flushed: int = 0  # copied to the durable tier by the background flusher (engram/store/flusher.py)
    blocks_prefetched: int = 0  # copied up into the top tier before their session was due back (`prefetch`)
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    # blocks put, deduplicated and served per namespace a tenant's Stats reads (NamespacePolicy.counted: those the
    # tenancy config names, so the dict is bounded; with tenancy off, none: nothing reads them, and namespaces are
    # the callers' to make up, one entry each for good)
    namespaces: dict[str, NamespaceCounters] = field(default_factory=dict)
    counted: Callable[[str], bool] = field(default=lambda namespace: True)
    _uncounted: NamespaceCounters = field(default_factory=NamespaceCounters)  # bumped, never read

    def of(self, namespace: str) -> NamespaceCounters:
        """`namespace`'s counters, to bump beside the daemon-wide ones."""
        c = self.namespaces.get(namespace)
        if c is None:
            if not self.counted(namespace):
                return self._uncounted
            c = self.namespaces[namespace] = NamespaceCounters()
        return c

    def of_namespaces(self, namespaces: Iterable[str]) -> NamespaceCounters:
        """The sum of some namespaces' counters (a tenant's Stats)."""
        total = NamespaceCounters()
        for ns in set(namespaces):
            if ns in self.namespaces:
                total = total.add(self.namespaces[ns])
        return total


@dataclass(frozen=True)
class ModelUsage:
    fingerprint: bytes
    name: str
    codec: str
    blocks: int
    bytes: int  # as stored
    tokens: int
    raw_bytes: int  # as raw elements of the layout's dtype


@dataclass(frozen=True)
class NamespaceUsage:
    blocks: int
    physical_bytes: int  # each stored block once
    logical_bytes: int  # each block once per session referencing it (once if none does): what dedupe saves
    referenced_blocks: int


def tier_stats(placement: Placement, copies: Mapping[str, Tally]) -> tuple[TierStats, ...]:
    """Usage, counters and health of every tier, fastest first; tokens and pinned blocks from `copies`, the
    index's tallies of the copies each tier holds."""
    out = []
    for tier in placement.tiers:
        usage = tier.usage()
        tc = placement.counters.tiers[tier.name]
        state, reason = tier_state(placement, tier)
        held = copies.get(tier.name)
        out.append(TierStats(
            name=usage.name, capacity_bytes=usage.capacity_bytes, used_bytes=usage.used_bytes, blocks=usage.blocks,
            hits=tc.hits, misses=tc.misses, evictions=tc.evictions, pinned_blocks=0 if held is None else held.pinned,
            state=state, state_reason=reason, demotions=tc.demotions, promotions=tc.promotions,
            io_errors=tc.io_errors, corrupt_blocks=tc.corrupt_blocks, enospc=tc.enospc,
            tokens=0 if held is None else held.tokens, demoted_bytes=tc.demoted_bytes,
            promoted_bytes=tc.promoted_bytes,
        ))
    return tuple(out)


def own_tier_stats(placement: Placement, copies: Mapping[str, Tally], pinned: Mapping[str, int]
                   ) -> tuple[TierStats, ...]:
    """Every tier as a tenant sees it: its capacity and health, and of `copies` (the index's tallies of its
    namespaces' copies per tier) blocks, stored bytes and tokens, and `pinned`'s blocks (those held by pins it may
    lift: in a namespace tenants share, the tallies' counted every tenant's pins, and an admin's). The tier's own
    used bytes, blocks and counters move with every other tenant's puts and hits (their growth / bytes per token:
    another's prompt length): the admin's only."""
    out = []
    for tier in placement.tiers:
        state, reason = tier_state(placement, tier)
        held = copies.get(tier.name) or Tally()
        out.append(TierStats(name=tier.name, capacity_bytes=tier.usage().capacity_bytes, used_bytes=held.nbytes,
                             blocks=held.blocks, tokens=held.tokens, pinned_blocks=pinned.get(tier.name, 0),
                             state=state, state_reason=reason))
    return tuple(out)


def tier_state(placement: Placement, tier: Tier) -> tuple[str, str]:
    """A tier's state and why, for Stats: its placement health, and what the tier says is wrong beside it (an
    NVMe tier whose index journal is dropped takes writes, and shows "ok" by its health alone)."""
    health = placement.health[tier.name]
    trouble = getattr(tier, "trouble", None)
    if not trouble:
        return health.state, health.reason
    return "degraded", f"{health.reason}; {trouble}" if health.reason else trouble

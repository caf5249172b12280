"""The block store: blocks, their tiers, pins, leases and the moves between tiers.

- core.py: BlockStore, the facade and its verbs (lookup, match, find, put, read, reading, served, pin, ...).
- placement.py: copies in tiers: making room, demotion, promotion, the two-phase copy protocol, tier health.
- recovery.py: rebuilding the index from NVMe at start-up, and `check`.
- counters.py: what the store counts, and the per-tier figures every reader of them shares.
- pins.py: a tenant's share of pinned bytes (server.max_pinned_fraction_per_tenant).
"""

from engram.store.core import BlockStore, PutOutcome, WritePolicy
from engram.store.counters import ModelUsage, NamespaceUsage, StoreCounters, TierCounters, TierHealth
from engram.store.recovery import StoreReport

__all__ = ["BlockStore", "ModelUsage", "NamespaceUsage", "PutOutcome", "StoreCounters", "StoreReport",
           "TierCounters", "TierHealth", "WritePolicy"]

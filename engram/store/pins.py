"""A tenant's share of pinned bytes (server.max_pinned_fraction_per_tenant).

A pin keeps blocks from eviction. A tenant without a quota (the default) pinned its blocks until DRAM and NVMe
were full, and every other tenant's put was RESOURCE_EXHAUSTED until it unpinned (an audit, session 44): moving
a pinned block down a tier rather than fail another tenant's put (placement.make_room) does not help once the
last tier is pinned too. So with tenancy on, what one tenant's namespaces hold pinned is bounded.

What counts (ChainIndex.pinned_bytes): each pinned block and every block it extends, once however many pins
hold it. Only leaves leave the last tier, so pinning a chain's last block keeps the whole chain; counting the
pinned blocks alone let a tenant keep a chain 64 times its share. A namespace two tenants share counts in both
tenants' totals (either may unpin there).

Why a fraction of the largest tier, not of all tiers together: a pinned block may hold a copy in every tier at
once (write-back keeps the DRAM copy once its NVMe copy is written), so one tenant's pins can fill any tier no
larger than them. Another tenant's put lands while some tier keeps room beyond them: pins in the tiers above it
move down, and there the unpinned blocks are evicted. Below 1, the largest tier always keeps (1 - fraction) of
itself for the others; of the total, half would fill both tiers of a DRAM and an NVMe of one size. The guarantee
is against any one tenant: k tenants pinning together need a fraction below 1/k (or quotas).

Admins act on the whole daemon and have no share (as with max_concurrent_rpcs_per_tenant); with tenancy off
every caller is the one party of the daemon, with no other tenant to keep room for: no share either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engram.errors import ResourceExhausted
from engram.index import ChainIndex
from engram.tiers.base import Tier


@dataclass(frozen=True)
class PinShare:
    """The pinned bytes one tenant's namespaces may hold together."""

    namespaces: tuple[str, ...]
    limit: int
    fraction: float  # server.max_pinned_fraction_per_tenant, for the message
    largest: str  # the largest tier's name, and its capacity: what the fraction is of
    largest_bytes: int

    @classmethod
    def of(cls, namespaces: Sequence[str], fraction: float, tiers: Sequence[Tier]) -> PinShare:
        largest = max(tiers, key=lambda t: t.capacity_bytes)
        return cls(tuple(namespaces), int(largest.capacity_bytes * fraction), fraction, largest.name,
                   largest.capacity_bytes)

    def check(self, index: ChainIndex, growth: int, what: str) -> None:
        """RESOURCE_EXHAUSTED when pinning what adds `growth` bytes to the tenant's pinned bytes passes the share;
        it names the tenant's own namespaces and figures only."""
        if growth <= 0:
            return
        held = sum(index.pinned_bytes(ns) for ns in self.namespaces)
        if held + growth > self.limit:
            raise ResourceExhausted(
                f"{what} would pin {growth} more bytes (the blocks, and the unpinned blocks they extend, which a pin "
                f"keeps too), but this tenant's namespaces ({', '.join(self.namespaces)}) hold {held} bytes pinned, "
                f"of its share of {self.limit} (server.max_pinned_fraction_per_tenant = {self.fraction:g} of the "
                f"largest tier, {self.largest}'s {self.largest_bytes} bytes); unpin blocks, or put without pin")

"""A tenant's share of pinned bytes (server.max_pinned_fraction_per_tenant).

A pin keeps blocks from eviction. A tenant without a quota (the default) pinned its blocks until DRAM and NVMe
were full, and every other tenant's put was RESOURCE_EXHAUSTED until it unpinned (an audit, session 44): moving
a pinned block down a tier rather than fail another tenant's put (placement.make_room) does not help once the
last tier is pinned too. So with tenancy on, what one tenant's namespaces hold pinned is bounded.

What counts (ChainIndex.pinned_bytes): each pinned block and every block it extends, once however many pins
hold it. Only leaves leave the last tier, so pinning a chain's last block keeps the whole chain; counting the
pinned blocks alone let a tenant keep a chain 64 times its share. A tenant's pins are its own (BlockMeta.pin_owners),
counted per owner (ChainIndex.pinned_bytes(ns, owner)): in a namespace two tenants share, each tenant's pins count
in its share alone, and only it (or an admin) lifts them. They counted in both tenants' totals, and either lifted
the other's (an audit, session 48): one tenant pinning its share there left the other none.

Why a fraction of the largest tier, not of all tiers together: a pinned block may hold a copy in every tier at
once (write-back keeps the DRAM copy once its NVMe copy is written), so one tenant's pins can fill any tier no
larger than them. Another tenant's put lands while some tier keeps room beyond them: pins in the tiers above it
move down, and there the unpinned blocks are evicted. Below 1, the largest tier always keeps (1 - fraction) of
itself for the others; of the total, half would fill both tiers of a DRAM and an NVMe of one size. The guarantee
is against any one tenant: k tenants pinning together need a fraction below 1/k (or quotas).

Admins act on the whole daemon and have no share (as with max_concurrent_rpcs_per_tenant); with tenancy off
every caller is the one party of the daemon, with no other tenant to keep room for: no share either. Their pins
are the operator's (BlockMeta.operator_pins) and no tenant's share counts them: an admin pinning a shared system
prompt in a tenant's namespace took that tenant's share, and the tenant could then pin nothing of its own. A
block both pin counts once, in the tenant's share (its own pin holds it). A tenant's unpin lifts a tenant's pin
only; an admin's lifts the operator's first, then a tenant's.

Across a restart (`restore`): the NVMe tier's journal records each block's pins and whose they are
(engram/tiers/journal.py says why there), and the blocks that come back are pinned again; blocks held in memory
alone do not come back, nor their pins. The operator's pins come back whole. A tenant's come back its own, as
they were (only it or an admin lifts them, and they count in its share alone), within its share as it is now, in
the order they were first recorded, and those that would pass it are dropped (logged, naming the tenant and its
namespaces): the share may have shrunk since (a lower fraction, a smaller tier), and it is the promise to the
other tenants that their puts find room, which pins restored past it would break from the first put on; the
tenant pins again, and is refused as it would be now. (Restored owner-less, a session 49 review found, any tenant
sharing the namespace lifted them, and they counted in every sharing tenant's share.) Pins of no recorded owner
(owner "", BlockMeta.owner_pins) come back so, within the share of every tenant of the namespace, which each
counts them in: a journal an earlier build wrote records counts only, and a tenant no longer given the namespace
(or no longer configured) has no share there to count its pins, which then come back of no recorded owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from engram.errors import ResourceExhausted
from engram.index import BlockMeta, ChainIndex
from engram.tiers.base import Tier
from engram.tiers.journal import Pins

log = logging.getLogger("engram.store")

SharesOf = Callable[[str], Sequence["PinShare"]]  # a namespace -> the shares of the tenants it belongs to


@dataclass(frozen=True)
class PinShare:
    """The pinned bytes one tenant's namespaces may hold together."""

    namespaces: tuple[str, ...]
    limit: int
    fraction: float  # server.max_pinned_fraction_per_tenant, for the message
    largest: str  # the largest tier's name, and its capacity: what the fraction is of
    largest_bytes: int
    tenant: str = ""  # whose pins it counts (BlockMeta.pin_owners); "": those of no recorded owner alone

    @classmethod
    def of(cls, namespaces: Sequence[str], fraction: float, tiers: Sequence[Tier], tenant: str = "") -> PinShare:
        largest = max(tiers, key=lambda t: t.capacity_bytes)
        return cls(tuple(namespaces), int(largest.capacity_bytes * fraction), fraction, largest.name,
                   largest.capacity_bytes, tenant)

    def growth(self, index: ChainIndex, metas: Sequence[BlockMeta | None]) -> int:
        """What pinning `metas` adds to the tenant's pinned bytes (ChainIndex.pin_growth, its own pins')."""
        return index.pin_growth(metas, self.tenant)

    def check(self, index: ChainIndex, growth: int, what: str) -> None:
        """RESOURCE_EXHAUSTED when pinning what adds `growth` bytes to the tenant's pinned bytes passes the share;
        it names the tenant's own namespaces and figures only. What counts: what its own pins keep, and what pins
        of no recorded owner keep (`restore`) in its namespaces; another tenant's pins in a namespace they share
        count in that tenant's share alone."""
        if growth <= 0:
            return
        held = sum(index.pinned_bytes(ns, self.tenant) + (index.pinned_bytes(ns, "") if self.tenant else 0)
                   for ns in self.namespaces)
        if held + growth > self.limit:
            raise ResourceExhausted(
                f"{what} would pin {growth} more bytes (the blocks, and the unpinned blocks they extend, which a pin "
                f"keeps too), but this tenant's namespaces ({', '.join(self.namespaces)}) hold {held} bytes pinned, "
                f"of its share of {self.limit} (server.max_pinned_fraction_per_tenant = {self.fraction:g} of the "
                f"largest tier, {self.largest}'s {self.largest_bytes} bytes); unpin blocks, or put without pin")


def shares_of(tenants: Sequence[tuple[str, Sequence[str]]], fraction: float, tiers: Sequence[Tier]) -> SharesOf:
    """Each namespace's tenants' shares, `tenants` giving each tenant's name and namespaces (a restart's
    `restore`)."""
    by_namespace: dict[str, list[PinShare]] = {}
    for name, namespaces in tenants:
        share = PinShare.of(namespaces, fraction, tiers, name)
        for ns in share.namespaces:
            by_namespace.setdefault(ns, []).append(share)
    return lambda namespace: by_namespace.get(namespace, ())


def restore(index: ChainIndex, recorded: Mapping[bytes, Pins], shares: SharesOf | None,
            note: Callable[[bytes, int, int, dict[str, int] | None], None]) -> None:
    """Pin the blocks that came back as `recorded` (key -> its pins, engram/tiers/journal.py): the operator's whole,
    each owner's its own again within its share, those of no recorded owner within the shares of every tenant of the
    namespace (`shares` None: no shares, tenancy off); `note` (the durable tier's) records what was not restored as
    cleared, so a block of the key put again later is not pinned by an old entry."""
    dropped: dict[PinShare, list[int]] = {}  # the share that refused -> [blocks, bytes] not pinned again
    for key, pins in recorded.items():
        meta = index.get(key)
        if meta is None:  # not back (held in memory alone, or its file lost)
            note(key, 0, 0, None)
            continue
        index.set_pins(meta, meta.pins + pins.operator, meta.operator_pins + pins.operator)
        sharing = None if shares is None else {s.tenant: s for s in shares(meta.namespace)}
        ownerless = pins.tenant - sum(n for _, n in pins.owners)
        for owner, n in pins.owners:
            if sharing is not None and owner not in sharing:  # no share of the namespace counts its pins now
                ownerless += n
            elif sharing is None or _within(index, meta, [sharing[owner]], dropped):
                index.set_pins(meta, meta.pins + n, owner=owner)
        if ownerless and (sharing is None or _within(index, meta, list(sharing.values()), dropped)):
            index.set_pins(meta, meta.pins + ownerless)
        # (set_pins noted the pins that changed; this records those dropped as cleared)
        note(key, meta.pins - meta.operator_pins, meta.operator_pins, meta.pin_owners)
    for share, (blocks, nbytes) in dropped.items():
        log.warning("restart: %d pinned blocks (%d bytes) were not pinned again: they would pass the share of "
                    "tenant %s (namespaces %s) of %d bytes (server.max_pinned_fraction_per_tenant = %g of the "
                    "largest tier, %s's %d bytes); they are stored unpinned", blocks, nbytes, share.tenant,
                    ", ".join(share.namespaces), share.limit, share.fraction, share.largest, share.largest_bytes)


def _within(index: ChainIndex, meta: BlockMeta, shares: Sequence[PinShare], dropped: dict[PinShare, list[int]]) -> bool:
    """Whether pinning `meta` again keeps within every one of `shares`; the first it would pass counts it dropped."""
    for share in shares:
        growth = share.growth(index, [meta])
        try:
            share.check(index, growth, "restoring pins")
        except ResourceExhausted:
            row = dropped.setdefault(share, [0, 0])
            row[0] += 1
            row[1] += growth
            return False
    return True

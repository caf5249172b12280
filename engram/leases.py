"""Read leases of zero-copy Gets: while a worker copies blocks out of the shared DRAM pool in place, the
blocks must keep their slots. A lease holds the store's read lease on each block (so it is neither evicted
nor demoted) until the worker releases it (ReleaseLeases) or `lease_s` passes, whichever comes first: a
worker that dies never pins memory for long. After expiry the slots may be reused; a worker that copies
late is caught by the generation check (engram/tiers/slots.py), never served another block's bytes.

Lease ids are random 63-bit numbers, and a lease can only be released in the namespace that took it, and by the
tenant that took it (an admin, and every caller with tenancy off, ends any of the namespace's): an id of another
namespace, or of another tenant in a namespace tenants share, is reported exactly like an unknown one (a tenant
ended another's leases there by id: a review, session 51).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from engram.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from engram.index import BlockMeta
from engram.store import BlockStore


@dataclass
class Lease:
    id: int
    namespace: str
    owner: str  # the tenant whose call took it; "": an admin's, or tenancy off
    metas: list[BlockMeta]
    expires: float  # time.monotonic()
    timer: asyncio.TimerHandle | None = None


class LeaseTable:
    def __init__(self, store: BlockStore, lease_s: float, max_blocks_per_namespace: int = 0) -> None:
        if lease_s <= 0:
            raise InvalidArgument(f"lease_s must be positive, got {lease_s}")
        self.store = store
        self.lease_s = lease_s
        self._leases: dict[int, Lease] = {}
        self.expired = 0  # leases that ended by expiry rather than release
        # Blocks a namespace's live leases name, per owner (0: no bound): a client asking for leases faster than
        # they end grew the table without bound (2,000 held 1,024-block prefixes: +37 MiB, an audit).
        self.max_blocks_per_namespace = max_blocks_per_namespace
        # per (namespace, owner): in a namespace tenants share, one tenant's leases counted against every tenant's
        # bound refused another's loads, and the refusal told it how many blocks the others' reads held (a review,
        # session 52)
        self._blocks: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, namespace: str, metas: Sequence[BlockMeta], owner: str = "") -> Lease:
        self._count(namespace, owner, len(metas))
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        self.store.acquire(metas)
        lease = Lease(lease_id, namespace, owner, list(metas), time.monotonic() + self.lease_s)
        lease.timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, lease_id)
        self._leases[lease_id] = lease
        return lease

    def grow(self, lease: Lease, metas: Sequence[BlockMeta]) -> None:
        """Lease more blocks under a live lease, bounded as a grant is, and restart its term (`renew`): an answer
        built a slice at a time (engram/server/prefixheader.py) leases each slice's blocks in the step that
        describes them."""
        self._check_live(lease)
        self._count(lease.namespace, lease.owner, len(metas))
        self.store.acquire(metas)
        lease.metas.extend(metas)
        self.renew(lease)

    def _check_live(self, lease: Lease) -> None:
        """Unavailable where `lease` ended (expired) while its answer was built a slice at a time: an answer under
        it would name a lease already gone, and a shortened one released its blocks a second time (dropping
        another lease's hold on them; a review, session 49)."""
        if self._leases.get(lease.id) is not lease:
            raise Unavailable("a lease ended while its answer was built (it expired: the daemon is overloaded); "
                              "ask again")

    def shorten(self, lease: Lease, keep: int) -> None:
        """Release all but a live lease's first `keep` blocks (an answer cut short after they were leased)."""
        self._check_live(lease)
        gone = lease.metas[keep:]
        if gone:
            del lease.metas[keep:]
            self._blocks[lease.namespace, lease.owner] -= len(gone)
            self.store.release(gone)

    def renew(self, lease: Lease) -> None:
        """Restart a live lease's term from now."""
        self._check_live(lease)
        if lease.timer is not None:
            lease.timer.cancel()
        lease.expires = time.monotonic() + self.lease_s
        lease.timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, lease.id)

    def _count(self, namespace: str, owner: str, more: int) -> None:
        """Count `more` blocks leased in the namespace by `owner`, within server.max_leased_blocks_per_namespace
        (a bound per tenant of the namespace; the admins, and every caller with tenancy off, are one owner)."""
        held = self._blocks.get((namespace, owner), 0)
        if self.max_blocks_per_namespace and held + more > self.max_blocks_per_namespace:
            raise ResourceExhausted(f"your live leases in this namespace name {held} blocks and this one {more} "
                                    "more, past server.max_leased_blocks_per_namespace; release leases (a client's "
                                    "next load ends its last) or let them expire")
        self._blocks[namespace, owner] = held + more

    def _reaches(self, lease_id: int, namespace: str, owner: str) -> Lease | None:
        """The live lease a call of `owner` ("": an admin, tenancy off: any owner's) in `namespace` may end."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.namespace != namespace or (owner and lease.owner != owner):
            return None
        return lease

    def release(self, namespace: str, lease_ids: Sequence[int], others: Collection[int] = (), owner: str = "") -> int:
        """End leases of this namespace that `owner` took ("": an admin, tenancy off: anyone's); every id must name
        a live one (NotFound names the first that does not, and then nothing is released), or be one of `others`
        (ids the caller ends itself: a ReleaseLeases' reservations), skipped here. Returns how many leases it
        ended."""
        found = []
        for i, lease_id in enumerate(lease_ids):
            if lease_id in others:
                continue
            lease = self._reaches(lease_id, namespace, owner)
            if lease is None:
                raise NotFound(f"lease {i} ({lease_id}) is not held in this namespace: it expired (after "
                               f"{self.lease_s:g}s), was released already, or was never granted")
            found.append(lease)
        ended = dict.fromkeys(lease.id for lease in found)  # an id named twice ends once
        for lease_id in ended:
            self._end(lease_id)
        return len(ended)

    def release_known(self, namespace: str, lease_ids: Sequence[int], owner: str = "") -> int:
        """End those of these leases that are still held in this namespace by `owner` (as `release`), ignoring the
        rest (expired, or not this namespace's or owner's: reported like absent ones, never released): a worker
        hands back the leases of its previous request with its next one, and one that expired meanwhile is no
        error."""
        ended = 0
        for lease_id in dict.fromkeys(lease_ids):
            if self._reaches(lease_id, namespace, owner) is not None:
                self._end(lease_id)
                ended += 1
        return ended

    def drop(self, lease: Lease) -> None:
        """End a lease the daemon granted but could not deliver (the Get failed)."""
        if lease.id in self._leases:
            self._end(lease.id)

    def _expire(self, lease_id: int) -> None:
        if lease_id in self._leases:
            self.expired += 1
            self._end(lease_id)

    def _end(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease.timer is not None:
            lease.timer.cancel()
        counted = (lease.namespace, lease.owner)
        left = self._blocks[counted] - len(lease.metas)
        if left:
            self._blocks[counted] = left
        else:
            del self._blocks[counted]
        self.store.release(lease.metas)

    def close(self) -> None:
        for lease_id in list(self._leases):
            self._end(lease_id)

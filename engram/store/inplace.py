"""Puts written in place: a worker on the daemon's host writes encoded blocks straight into slots of the shared
DRAM pool, so a put's bytes never cross the socket (ReservePut, then CommitPut).

Reserve: the chain's keys are computed as for any put; blocks already stored are skipped (on the index's word,
as a bytes put skips its Lookup's cached prefix: `_skippable`); for the rest a
slot is allocated in the pool (room made by the ordinary eviction) and held by the tier, but nothing is
indexed, so no reader can see a block whose bytes are still being written, and an unindexed slot is never an
eviction victim. The chain's parent counts the coming children, so it cannot be deleted under the put.
Commit: each slot's bytes are checked against what was reserved (a v1 block's header: codec, dtype, shape;
its body checksum, and the whole payload's, are computed here, by the daemon, from the bytes as they lie in
the pool) and the blocks are published in chain order; under write-through each only once its NVMe copy is
written (another put of the block meanwhile waits on it, as on a Put's), so nothing is acknowledged against a
block that might yet be dropped. Commits of one reservation go one at a time, and its expiry waits for them.
A reservation not committed within its time is closed, and its slots freed one term later (a late writer's
bytes land in slots no block holds). One whose caller says it will not commit it (ReleaseLeases naming its id:
a client whose caller left before the ReservePut's answer came) is freed at once (`give_up`).
Bounds: reserved slots are not blocks, so no eviction frees them, and one never committed is held for up to two
terms. What all reservations hold unpublished (being made, open or lapsed) is at most a fraction of the pool,
and what one tenant's hold (every namespace of its) a smaller one; without them, a caller that reserved and never
committed held the whole pool, and every other put failed for two terms. A refusal names the caller's own
reservations, and others' only by when they are let go: nothing of another tenant's ids, namespaces or bytes.

What it does not do: protect a slot from a worker that writes outside its reservation. A same-host worker
that may write the pool is trusted with it, as one that may read it is (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engram.block import BlockHeader, copy_off_loop
from engram.borrowed import in_thread
from engram.codec import blockformat, stored, streamformat
from engram.codec.base import Axis, codec_by_name
from engram.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from engram.index import BlockMeta
from engram.keys import block_key, tokens_to_bytes
from engram.layout import ModelSpec
from engram.sealing import Sealer, SealTask
from engram.store import durable
from engram.tiers.pool import PoolTier, Slot

if TYPE_CHECKING:
    from engram.store.core import BlockStore, PutOutcome
    from engram.store.pins import PinShare


@dataclass
class Reserved:
    meta: BlockMeta  # not indexed until commit; checksum filled in at commit
    slot: Slot | None  # None: the block was stored already
    header: BlockHeader


@dataclass
class Reservation:
    id: int
    namespace: str
    owner: str  # the tenant whose share of the pool it counts against; "": none (an admin, or tenancy off)
    fingerprint: bytes
    blocks: list[Reserved]
    parent: BlockMeta | None  # the deepest stored block of the chain: holding a coming child, so not deleted
    pool: PoolTier
    expires: float
    pin: bool = False
    pin_share: PinShare | None = None  # the caller's share of pinned bytes (engram/store/pins.py); None: unbounded
    committed: int = 0  # blocks committed so far (a prefix of `blocks`)
    refused: str = ""  # why the reservation stopped before the chain's end (the blocks after it were not reserved)
    timer: asyncio.TimerHandle | None = None
    done: bool = field(default=False)
    committing: bool = False  # a commit is sealing or publishing: another one waits its turn (refused)
    held: int = 0  # payload bytes of its slots not yet published nor freed (and of one being placed)

    def frees_by(self, reserve_s: float) -> float:
        """When its slots are let go at the latest (monotonic): a term after it expires, unless committed."""
        return self.expires + reserve_s


class InPlacePuts:
    def __init__(self, store: BlockStore, pool: PoolTier, reserve_s: float, *, sealers: int | None = None,
                 max_fraction: float = 0.75, max_fraction_per_tenant: float = 0.5) -> None:
        self.store = store
        self.pool = pool
        self.reserve_s = reserve_s
        self.max_fraction = max_fraction  # server.max_reserved_pool_fraction
        self.max_fraction_per_tenant = max_fraction_per_tenant  # server.max_reserved_pool_fraction_per_tenant
        self.max_held = int(pool.capacity_bytes * max_fraction)
        self.max_held_per_tenant = int(pool.capacity_bytes * max_fraction_per_tenant)
        self._making: dict[int, Reservation] = {}  # being reserved (ReservePut has not answered yet)
        self._open: dict[int, Reservation] = {}
        self._lapsed: dict[int, Reservation] = {}  # expired, slots still held for a term: a late writer's landing
        self._held = 0  # payload bytes every reservation's unpublished slots hold (Reservation.held, summed)
        self._held_by: dict[str, int] = {}  # the same per owner
        self._dropping: set[asyncio.Task[None]] = set()  # reservations being freed by a task (_drop_later)
        store.placement.unevictable[pool.name] = self._unevictable
        assert pool.segment is not None
        self.sealer = Sealer(str(pool.segment.path), pool.segment.layout.data_offset,
                             memoryview(pool.buffer.numpy()), sealers)  # type: ignore[arg-type]
        self.sealer.start()

    def __len__(self) -> int:
        return len(self._open)

    async def reserve(self, namespace: str, fingerprint: bytes, parent: bytes, headers: Sequence[BlockHeader],
                      *, pin: bool, owner: str = "", pin_share: PinShare | None = None) -> Reservation:
        """Reserve slots for the chain's blocks not stored yet, up to the bounds (one reservation's half of the pool,
        the caller's and everyone's share of it, the namespace's quota, with pin the caller's `pin_share`); `owner`
        is the tenant whose share the slots count against ("": the total's only)."""
        store = self.store
        spec = store.spec(fingerprint)
        layout = spec.layout
        codec = spec.stored_codec
        pmeta = None
        if parent != store.root(namespace, fingerprint):
            pmeta = store.index.get_in(namespace, parent)
            if pmeta is None or pmeta.model_fingerprint != fingerprint or not pmeta.full:
                raise FailedPrecondition("the parent block is not stored (or is a partial block); Lookup again "
                                         "and put the chain from its first missing block")
        res = Reservation(secrets.randbits(63) or 1, namespace, owner, fingerprint, [], pmeta, self.pool,
                          time.monotonic() + self.reserve_s, pin, pin_share if pin else None)
        # What pinning the chain down to the block at hand would add to the caller's pinned bytes: the stored
        # blocks it extends that no pin keeps yet, then each block of the chain not kept (a chain: no walk per block)
        pin_growth = res.pin_share.growth(store.index, [pmeta]) if res.pin_share is not None else 0
        if pmeta is not None:
            pmeta.children += 1
        rank = store.tier_rank(self.pool.name)
        self._making[res.id] = res
        try:
            for i, h in enumerate(headers):
                h.validate(layout, index=i, model_codec=spec.codec)
                if h.codec != codec:
                    raise InvalidArgument(f"block {i}: this model stores {codec} blocks; encode them so "
                                          f"(in-place puts are written as stored), not {h.codec}")
                if stored.is_streams(codec) and h.payload_nbytes != _v2_plan(spec, h).nbytes:
                    raise InvalidArgument(f"block {i}: {h.payload_nbytes} bytes is not the block as stored "
                                          f"({_v2_plan(spec, h).nbytes}); in-place puts write every stream in its codec")
                if i < len(headers) - 1 and h.num_tokens < layout.block_tokens:
                    raise InvalidArgument(f"block {i} is partial, but only a chain's last block may be")
                key = block_key(parent, h.tokens)
                meta = BlockMeta(key=key, parent=parent, namespace=namespace, model_fingerprint=fingerprint,
                                 tokens=tokens_to_bytes(h.tokens), num_tokens=h.num_tokens, dtype=h.dtype,
                                 shape=tuple(h.shape), nbytes=h.payload_nbytes, checksum=0, locations=[],
                                 full=h.num_tokens == layout.block_tokens, pins=1 if pin else 0,
                                 operator_pins=1 if pin and pin_share is None else 0,
                                 pin_owners={pin_share.tenant: 1} if pin and pin_share is not None else None)
                slot = None
                if res.blocks and not self._fits(res, h.payload_nbytes):
                    break
                existing = await self._skippable(store.index.get_in(namespace, key))
                if res.pin_share is not None:
                    kept = existing is not None and existing.counted_for(res.pin_share.tenant)
                    pin_growth = 0 if kept else pin_growth + (h.payload_nbytes if existing is None else existing.nbytes)
                    try:
                        res.pin_share.check(store.index, pin_growth, f"block {i}")
                    except ResourceExhausted as exc:
                        if not res.blocks:
                            raise
                        res.refused = str(exc)  # the blocks before it are reserved: commit those
                        break
                if existing is not None:  # stored already: hold it instead (the chain's deepest stored block)
                    existing.children += 1
                    self._release_parent(res)
                    res.parent, res.done = existing, False
                else:
                    if over := self._over_bound(res, h.payload_nbytes):
                        if not res.blocks:
                            raise ResourceExhausted(over)
                        res.refused = over  # the blocks before it are reserved: commit those
                        break
                    try:
                        store._charge_quota(namespace, h.payload_nbytes, i)
                    except ResourceExhausted as exc:
                        if not res.blocks:
                            raise
                        res.refused = str(exc)  # the blocks before it are reserved: commit those
                        break
                    need = self.pool.space_for(meta.record())
                    # Held from before the room is made: a ReservePut running beside this one (make_room may wait)
                    # sees it, so the bounds hold however many run at once.
                    self._hold(res, h.payload_nbytes)
                    try:
                        await store.placement.make_room(rank, need, wait=not res.blocks)
                        slot = self.pool.place(key + res.id.to_bytes(8, "little"), need, h.payload_nbytes)
                    except ResourceExhausted as exc:
                        store._quota_pending[namespace] -= h.payload_nbytes
                        self._hold(res, -h.payload_nbytes)
                        if not res.blocks:
                            raise
                        # The pool is full of this reservation's own unpublished slots: commit them first. (A
                        # tenant is not told the tier's use, every tenant's bytes: errors.TierFull.)
                        res.refused = exc.told(admin=not res.owner)
                        break
                    except BaseException:
                        store._quota_pending[namespace] -= h.payload_nbytes
                        self._hold(res, -h.payload_nbytes)
                        raise
                res.blocks.append(Reserved(meta, slot, h))
                parent = key
        except BaseException:
            await self._drop(res)
            raise
        finally:
            del self._making[res.id]
        self._open[res.id] = res
        res.timer = asyncio.get_running_loop().call_later(self.reserve_s, self._expire, res.id)
        return res

    async def _skippable(self, existing: BlockMeta | None) -> BlockMeta | None:
        """`existing` as the reservation may skip it (the caller writes nothing for it), or None when it is not
        stored (any more). Skipped on the index's word, as a bytes put skips the cached prefix its Lookup found:
        a worker saves a whole prompt in place, its cached prefix with it, so checking each stored block here
        would hash (memory) or read back (NVMe) the whole cached prefix on every save, on the daemon's loop. A
        damaged copy is found and dropped by the next read of it, and the next put stores it. One exception: under
        write-through the commit makes a skipped block that has no NVMe copy durable from its memory copy, and
        acknowledges it durable: that copy is checked first (`_sound`)."""
        from engram.store.core import WritePolicy

        store = self.store
        if (existing is None or store.write_policy != WritePolicy.WRITE_THROUGH
                or durable.is_durable(store.placement, existing)):
            return existing
        return await self._sound(existing, "reservation")

    async def _sound(self, existing: BlockMeta | None, at: str) -> BlockMeta | None:
        """`existing` as a put in place may drop its caller's bytes for it, or None when it is not stored (any
        more): a copy of it must verify (`BlockStore.verify_stored`; one xxh3 over a memory copy). At the commit,
        for a block another put stored meanwhile (the caller's slot is freed), and at a write-through reservation
        for a block it would make durable from memory (`_skippable`). One that fails is dropped as a read drops
        it (counted, logged), the block with it when none is left, and the caller's bytes are stored: the
        reservation gives it a slot, the commit keeps its slot."""
        if existing is None:
            return None
        try:
            await self.store.verify_stored(existing, during=f"an in-place put's {at}")
        except DataLoss:
            return None  # dropped, with the blocks that extend it
        return self.store.index.get_in(existing.namespace, existing.key)

    def _fits(self, res: Reservation, nbytes: int) -> bool:
        """Whether one more slot may go into this reservation: at most half the pool is held unpublished by
        one reservation, so a chain longer than the pool goes in rounds (reserve, write, commit) and the
        pool can demote published blocks to make room for the next round."""
        if res.held and res.held + nbytes > self.pool.capacity_bytes // 2:
            res.refused = "the reservation holds half of the shared pool: commit it, then reserve the rest"
            return False
        return True

    def _hold(self, res: Reservation, nbytes: int) -> None:
        """Count (negative: let go of) unpublished slot bytes against the reservation, its owner and the pool."""
        res.held += nbytes
        self._held += nbytes
        if held := self._held_by.get(res.owner, 0) + nbytes:
            self._held_by[res.owner] = held
        else:
            del self._held_by[res.owner]

    def _over_bound(self, res: Reservation, nbytes: int) -> str:
        """Why one more slot of `nbytes` may not be reserved for res's owner ("" when it may): its tenant's
        reservations hold their share of the pool, or everyone's do theirs. One reservation's bound (`_fits`)
        alone let a caller open reservations until the pool was full of slots no one would commit, and every other
        put failed for a reservation's time and a term more (an audit, session 43). A tenant holding nothing may
        reserve one block past its share (a pool too small for a share of one), and the first of all one past the
        total."""
        mine = self._held_by.get(res.owner, 0)
        cap = self.pool.capacity_bytes
        if res.owner and mine and mine + nbytes > self.max_held_per_tenant:
            return (f"tenant {res.owner!r}'s in-place reservations not yet committed hold {mine} bytes of the shared "
                    f"pool, as much as one tenant may (server.max_reserved_pool_fraction_per_tenant = "
                    f"{self.max_fraction_per_tenant:g} of {cap} bytes); {self._describe(res.owner)}; commit them, "
                    "or let them expire, then reserve the rest (or put as bytes)")
        if self._held and self._held + nbytes > self.max_held:
            # Not the total's bytes: less the caller's own, they are the others', whose growth told another tenant's
            # prompt length (its last block is partial), as Stats' used bytes did (an audit, session 44).
            return ("in-place reservations not yet committed hold as much of the shared pool as all together may "
                    f"(server.max_reserved_pool_fraction = {self.max_fraction:g} of {cap} bytes; the rest is kept "
                    "for other puts)" + (f"; {self._describe(res.owner)}" if mine else "")
                    + (f"; {self._others(res.owner)}" if self._held > mine else "")
                    + "; reserve again once some are committed or let go, or put as bytes")
        return ""

    def _holding(self, owner: str | None) -> list[Reservation]:
        """The reservations holding unpublished slots (being made, open or lapsed): of `owner`, or (None) anyone's."""
        return [r for table in (self._making, self._open, self._lapsed) for r in table.values()
                if r.held and (owner is None or r.owner == owner)]

    def _describe(self, owner: str) -> str:
        """The owner's reservations holding slots, told to that owner only: id, namespace, bytes, when each
        expires or has its slots let go. With tenancy off (and for admins) every caller is owner ""."""
        now = time.monotonic()
        held = sorted(self._holding(owner), key=lambda r: r.expires)
        parts = [f"reservation {r.id} (namespace {r.namespace!r}, {r.held} bytes) "
                 + (f"expired, its slots let go in {max(0.0, r.frees_by(self.reserve_s) - now):.0f}s"
                    if r.id in self._lapsed else f"expires in {max(0.0, r.expires - now):.0f}s")
                 for r in held[:4]]
        more = f" and {len(held) - 4} more" if len(held) > 4 else ""
        return f"{'yours' if owner else 'held'}: {', '.join(parts)}{more}"

    def _others(self, owner: str) -> str:
        """Other owners' reservations, told only by when they are let go at the latest: nothing of another
        tenant's ids, namespaces or bytes (their bytes told its prompt lengths)."""
        now = time.monotonic()
        by = max((r.frees_by(self.reserve_s) for r in self._holding(None) if r.owner != owner), default=now)
        return f"other callers' are let go when committed or within {max(0.0, by - now):.0f}s at the latest"

    def _unevictable(self) -> str:
        """That reservations hold part of the pool, for a full tier's error ("" when none do), and by when they
        are let go: not how many bytes (whichever caller's put found no room reads it; another tenant's bytes
        tell its prompt lengths)."""
        if not self._held:
            return ""
        now = time.monotonic()
        by = max((r.frees_by(self.reserve_s) for r in self._holding(None)), default=now)
        return ("part of it is slots of in-place reservations (ReservePut) not yet committed, which no eviction "
                f"frees; they are let go when committed, or within {max(0.0, by - now):.0f}s at the latest")

    def get(self, namespace: str, reservation_id: int, owner: str = "") -> Reservation:
        """The open reservation a call of `owner` ("": an admin, tenancy off: anyone's) in `namespace` may commit;
        another tenant's is reported exactly as one never made."""
        res = self._open.get(reservation_id)
        if res is None or res.namespace != namespace or (owner and res.owner != owner):
            raise NotFound(f"reservation {reservation_id} is not open in this namespace: it was committed, expired "
                           f"(after {self.reserve_s:g}s), or never made")
        return res

    async def commit(self, res: Reservation, count: int = 0) -> list[PutOutcome]:
        """Check, seal and publish the next `count` reserved blocks (0: all that remain) in chain order; the
        slots of blocks stored meanwhile by someone else are dropped (deduplicated). The reservation closes
        with its last block; a failure drops what remains of it. Commits of one reservation go one at a time."""
        if res.committing:
            raise FailedPrecondition(f"reservation {res.id} is being committed by another CommitPut; commit its "
                                     "runs one after the other, in chain order")
        res.committing = True
        self.store.begin_put(res.namespace, res.fingerprint)  # out of _open while its last blocks are published
        try:
            return await self._commit(res, count)
        finally:
            self.store.end_put(res.namespace, res.fingerprint)
            res.committing = False

    def models_in_use(self) -> set[tuple[str, bytes]]:
        """(namespace, model) of every reservation being made, open, or lapsed with its slots held: its commit looks
        the model up again, so the model may not be forgotten (engram/server/modelroom.py)."""
        return {(res.namespace, res.fingerprint) for table in (self._making, self._open, self._lapsed)
                for res in table.values()}

    async def _commit(self, res: Reservation, count: int) -> list[PutOutcome]:
        end = len(res.blocks) if count <= 0 else min(len(res.blocks), res.committed + count)
        batch = res.blocks[res.committed : end]
        last = end == len(res.blocks)
        if last:
            del self._open[res.id]
        if res.timer is not None:  # no expiry while its slots are sealed and published (re-armed after)
            res.timer.cancel()
            res.timer = None
        store = self.store
        try:
            await self._seal(batch)
        except BaseException:
            await self._abandon(res, last)
            raise
        out: list[PutOutcome] = []
        try:
            for i, r in enumerate(batch):
                out.append(await self._publish(res, r, res.committed + i))
        except BaseException:  # NotDurable, or cancelled: what was published stays; the rest is dropped
            await self._abandon(res, last)
            raise
        res.committed = end
        self._release_parent(res)
        if not last:  # the next blocks extend the last one committed: hold it, as the chain's deepest stored block
            tail = store.index.get_in(res.namespace, batch[-1].meta.key)
            if tail is not None:
                tail.children += 1
                res.parent, res.done = tail, False
            res.expires = time.monotonic() + self.reserve_s  # the rest gets a full term from here
            res.timer = asyncio.get_running_loop().call_later(self.reserve_s, self._expire, res.id)
        await store.after_put([r.meta for r in batch if r.meta.locations],
                              {o.key for o in out if not o.durable})
        return out

    async def _publish(self, res: Reservation, r: Reserved, index: int) -> PutOutcome:
        """One sealed block: skipped if it was stored when reserved (pinned, made durable again under
        write-through, but not deduplicated: nothing of it was written, as the bytes path skips a cached block);
        deduplicated against a copy stored meanwhile (made durable again under write-through, as any put's); or
        renamed to its key, given its durable copy under write-through, and only then indexed, so that no other
        put is acknowledged against a block that might yet be dropped."""
        from engram.store.core import PutOutcome, WritePolicy

        store, meta = self.store, r.meta
        while True:
            while (waiting := store._pending.get(meta.key)) is not None:  # another put is storing it: dedupe after
                done = asyncio.Event()
                waiting.append(done)
                await done.wait()
            existing = store.index.get_in(res.namespace, meta.key)
            if existing is not None and r.slot is not None and await self._sound(existing, "commit") is not existing:
                continue  # stored meanwhile, and dropped as damaged (or gone while verified): looked up again
            if existing is None:
                break
            try:
                return await self._deduplicate(res, r, existing, index)
            except DataLoss:  # no copy of it verified: it was dropped
                if r.slot is None:
                    raise FailedPrecondition(
                        f"block {index} was stored when it was reserved, and no copy of it verified since: it was "
                        "dropped as damaged, with the blocks that extend it; put the chain again from its first "
                        "missing block (Lookup)") from None
                # the caller's bytes, in its slot and sealed, are stored anew (as a Put stream stores its own)
        if r.slot is None:  # stored at reserve time and gone since: not acknowledged
            raise FailedPrecondition(f"block {index} was stored when it was reserved and has been evicted since; "
                                     "Lookup again and put the chain from its first missing block")
        placement = store.placement
        if res.pin_share is not None:  # pins taken since it was reserved; nothing awaited from here to the index
            res.pin_share.check(store.index, res.pin_share.growth(store.index, [meta]), f"block {index}")
        self.pool.rename(self._slot_key(res, meta), meta.key)
        r.slot = None
        self._hold(res, -meta.nbytes)
        store._quota_pending[res.namespace] -= meta.nbytes  # the block's bytes now count as its own
        placement.model.arrive(meta)
        store.index.add_copy(meta, self.pool.name)
        ok = True
        if store.write_policy == WritePolicy.WRITE_THROUGH:
            waiters: list[asyncio.Event] = []
            store._pending[meta.key] = waiters
            try:
                ok = await durable.make_durable(store, meta, await self._copy_of(meta.key), index=index)
                if res.pin_share is not None:  # (but for write-through's durable copy)
                    res.pin_share.check(store.index, res.pin_share.growth(store.index, [meta]), f"block {index}")
            except BaseException:
                for name in list(meta.locations):
                    await placement.drop_copy(meta, name)
                raise
            finally:
                del store._pending[meta.key]
                for w in waiters:
                    w.set()
        store.index.add(meta)
        placement.compete(meta)  # the pool's copy, and the durable copy placed before it was indexed
        store.counters.blocks_put += 1
        store.counters.of(meta.namespace).blocks_put += 1
        return PutOutcome(meta.key, stored=True, durable=ok)

    async def _deduplicate(self, res: Reservation, r: Reserved, existing: BlockMeta, index: int) -> PutOutcome:
        """A reserved block stored already (skipped at reserve: counted skipped, as the bytes path skips a cached
        block; or stored meanwhile by another put: deduplicated, its slot freed): pinned with the reservation's
        pin, made durable again under write-through. The durable copy is
        made from the caller's sealed bytes when they are the block's own (the same checksum), else from its own
        copy that verifies; DataLoss when none did: the block was dropped (the slot, if any, kept for the caller's
        bytes to be stored)."""
        from engram.store.core import PutOutcome, WritePolicy

        store = self.store
        if res.pin:
            if res.pin_share is not None:
                res.pin_share.check(store.index, res.pin_share.growth(store.index, [existing]), f"block {index}")
            store.add_pin(existing, share=res.pin_share)
        ok = True
        if store.write_policy == WritePolicy.WRITE_THROUGH:
            own = self.pool.view(self._slot_key(res, r.meta)) if r.slot is not None else None
            # A block stored meanwhile was verified at the commit (`_sound`; in memory: just put), and its bytes
            # replace the caller's: its durable copy is checked too. A skipped block is not (`_skippable`).
            verified = None if r.slot is None else store.placement.tiers[0].name
            ok = await durable.make_durable_again(store, existing, own, r.meta.checksum, index=index,
                                                  verified=verified)
        skipped = r.slot is None  # stored when reserved, so never written: skipped, as the bytes path skips it
        if not skipped:  # its bytes were written and dropped: deduplicated
            await self._free_slot(res, r)
            store.counters.blocks_deduplicated += 1
            store.counters.of(r.meta.namespace).blocks_deduplicated += 1
        return PutOutcome(r.meta.key, stored=False, durable=ok, skipped=skipped)

    async def _seal(self, batch: Sequence[Reserved]) -> None:
        """Verify each slot holds what was reserved, fill in a v1 block's body and header checksums, and take
        the payload's checksum: all from the bytes as they lie in the pool (engram/sealing.py)."""
        todo = [r for r in batch if r.slot is not None]
        tasks = [self._seal_task(r) for r in todo]
        # A worker's own encoding must decode (valid scales), or every later Get of it fails: read in place,
        # beside the hashing (the helpers write only headers; the check reads only bodies). Both end before
        # either's error is raised: a slot is freed only once no helper writes into it.
        sums, checked = await asyncio.gather(self.sealer.seal(tasks), self._check_scales(
            [(i, r) for i, r in enumerate(todo) if not stored.is_raw(r.header.codec)]), return_exceptions=True)
        if isinstance(sums, BaseException):
            raise sums
        for i, (r, got) in enumerate(zip(todo, sums, strict=True)):  # not what was reserved: said first
            if isinstance(got, str):
                raise InvalidArgument(f"block {i}: {got}: not the {r.header.codec} block of shape "
                                      f"{tuple(r.header.shape)} that was reserved")
            r.meta.checksum = got
        if isinstance(checked, BaseException):
            raise checked

    async def _check_scales(self, blocks: list[tuple[int, Reserved]]) -> None:
        """The scale checks in a thread per core (numpy's comparisons let go of the GIL): a 32K-token nvfp4 put
        holds 128 MiB of scales, 30 ms in one thread on the H200's host."""
        n = min(len(blocks), os.cpu_count() or 1)
        # in_thread: a cancelled commit waits for the checks before its failure frees the slots they read
        for failed in await asyncio.gather(*(in_thread(self._check_some, blocks[j::n]) for j in range(n)),
                                           return_exceptions=True):
            if isinstance(failed, BaseException):
                raise failed

    def _check_some(self, blocks: list[tuple[int, Reserved]]) -> None:
        for i, r in blocks:
            assert r.slot is not None
            if stored.is_streams(r.header.codec):  # a v2 block: each quantized stream's scales
                blob = self.pool.region(r.slot).numpy().data
                streamformat.check_scales(blob, _v2_plan(self.store.spec(r.meta.model_fingerprint), r.header),
                                          f"block {i}")
                continue
            body = self.pool.region(r.slot).numpy().data[blockformat.HEADER_LEN :]
            codec_by_name(r.header.codec).check(body, tuple(r.header.shape), Axis.CHANNEL, Axis.TOKEN,  # type: ignore[arg-type]
                                                f"block {i}", r.header.dtype.torch_dtype)

    def _seal_task(self, r: Reserved) -> SealTask:
        assert r.slot is not None
        h = r.header
        if stored.is_streams(h.codec):
            head = streamformat.unsealed_header(_v2_plan(self.store.spec(r.meta.model_fingerprint), h))
            return SealTask(r.slot.offset, r.meta.nbytes, None, head.hex())
        return SealTask(r.slot.offset, r.meta.nbytes, None if stored.is_raw(h.codec) else _v1_fields(h, r.meta.nbytes))

    def _slot_key(self, res: Reservation, meta: BlockMeta) -> bytes:
        return meta.key + res.id.to_bytes(8, "little")

    async def _copy_of(self, key: bytes) -> bytes | memoryview:
        """A committed block's bytes copied out of its slot, for its durable copy (write-through): a large one in a
        worker thread that lets go of the GIL (copy_off_loop), where the pool's read (a copy into bytes) held the
        event loop for the whole copy. The thread has ended when this returns, cancelled or not: the commit's
        failure frees the slot only after."""
        in_place = self.pool.view(key)
        return await self.pool.read(key) if in_place is None else await copy_off_loop(in_place)

    async def _free_slot(self, res: Reservation, r: Reserved) -> None:
        await self.pool.delete(self._slot_key(res, r.meta))
        self.store._quota_pending[res.namespace] -= r.meta.nbytes
        r.slot = None
        self._hold(res, -r.meta.nbytes)

    async def _abandon(self, res: Reservation, last: bool) -> None:
        """A commit failed: the reservation closes, and its slots not yet published are freed: at once when it was
        the last run's, else one term later, as an expired reservation's (its worker may be writing a later run
        into them still: it learns of the failure only from this commit's answer; a review, session 51, saw run 2's
        slots freed under the client's write)."""
        self._open.pop(res.id, None)
        if res.timer is not None:
            res.timer.cancel()
            res.timer = None
        if last:
            await self._drop(res)
            return
        self._lapsed[res.id] = res
        res.timer = asyncio.get_running_loop().call_later(self.reserve_s, self._free_lapsed, res.id)

    async def _drop(self, res: Reservation) -> None:
        for r in res.blocks:
            if r.slot is not None:
                await self._free_slot(res, r)
        self._release_parent(res)
        self.store.placement.notify_freed()

    def _release_parent(self, res: Reservation) -> None:
        p = res.parent
        if p is None or res.done:
            return
        res.done = True
        p.children -= 1
        if p.children == 0:
            for name in p.locations:
                self.store.placement.victims[name].leaf_again(p)

    def release_unanswered(self, res: Reservation) -> None:
        """Free at once a reservation whose ReservePut answer was not delivered (the call ended cancelled, or past
        its deadline): no worker learnt its id or slots, so none writes them late, and none commits it (ids are 63
        random bits)."""
        if self._open.get(res.id) is res and not res.committed:
            self.give_up(res.namespace, res.id)

    def holds(self, namespace: str, reservation_id: int, owner: str = "") -> bool:
        """Whether `give_up` would end this reservation: open in this namespace, made by `owner` ("": an admin,
        tenancy off: anyone's), no commit of it running."""
        res = self._open.get(reservation_id)
        return (res is not None and res.namespace == namespace and not (owner and res.owner != owner)
                and not res.committing)

    def give_up(self, namespace: str, reservation_id: int, owner: str = "") -> bool:
        """End an open reservation its caller will not commit (ReleaseLeases naming its id, the lease_id of its
        slots: a client whose caller left before the ReservePut's answer came, engram/client.py), freeing at once
        its slots not yet published; those committed stay stored. The caller vouches that none of its writes into
        them is in flight (a worker that may still write lets it expire instead: its slots are freed a term after).
        False when there is none to end (committed, expired, another namespace's or tenant's, or being committed)."""
        if not self.holds(namespace, reservation_id, owner):
            return False
        res = self._open.pop(reservation_id)
        if res.timer is not None:
            res.timer.cancel()
            res.timer = None
        self._drop_later(res)
        return True

    def _expire(self, reservation_id: int) -> None:
        """A reservation not committed in time closes (a commit is refused), but its slots are freed one term
        later: its worker may still be writing them (paused, or slow), and a block stored in a freed slot would
        be overwritten by that late write, and served so by the paths that do not verify checksums."""
        res = self._open.pop(reservation_id, None)
        if res is not None:
            self._lapsed[reservation_id] = res
            res.timer = asyncio.get_running_loop().call_later(self.reserve_s, self._free_lapsed, reservation_id)

    def _free_lapsed(self, reservation_id: int) -> None:
        res = self._lapsed.pop(reservation_id, None)
        if res is not None:
            self._drop_later(res)

    def _drop_later(self, res: Reservation) -> None:
        """`_drop` where none may await (a timer, a handler being cancelled): a task, kept until done (a task only
        the loop refers to may be collected mid-way); `close` waits for it."""
        task = asyncio.get_running_loop().create_task(self._drop(res))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def close(self) -> None:
        await self.sealer.close()
        for table in (self._open, self._lapsed):
            for rid in list(table):
                res = table.pop(rid)
                if res.timer is not None:
                    res.timer.cancel()
                await self._drop(res)
        if self._dropping:
            await asyncio.gather(*self._dropping, return_exceptions=True)


def _v2_plan(spec: ModelSpec, header: BlockHeader) -> streamformat.StreamsFormat:
    """The v2 block a stream layout's header announces, every stream in its codec (as stored)."""
    return streamformat.plan(spec.streams, spec.layout.persisted_layers, header.num_tokens)


def _v1_fields(header: BlockHeader, nbytes: int) -> tuple[int, ...]:
    """The v1 header fields a block in place must carry, checksums left out (engram/sealing.py checks them)."""
    codec = codec_by_name(header.codec)
    return (int.from_bytes(blockformat.MAGIC, "little"), blockformat.VERSION, int(codec.codec_id), 0, 1,
            int(header.dtype), 5, 0, *header.shape, nbytes - blockformat.HEADER_LEN)

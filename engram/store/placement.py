"""Where copies of blocks live: making room in a tier, writing a copy, demotion, promotion, the two-phase
copy protocol for moves others perform (engram/transfer.py), and each tier's health.

The rules kept here:
- A copy counts (joins the block's `locations`) only once its write completed; a block that is moving is
  never a victim, and neither is a pinned or leased one.
- A copy is dropped alone only while a copy in a lower tier remains. A block's lowest copy is demoted when a
  tier below can take it (write-back); from the last tier (or with none below available) the block leaves
  the store with every copy, and then only leaves go (engram/eviction.py), so every stored block stays
  reachable from its root. Never is the durable copy dropped while a volatile one stays: that block would
  look stored, be built on by later puts, and vanish at a crash with them.
- A tier whose filesystem is full (ENOSPC) is degraded: the tier above becomes the last, and the tier is
  tried again after `retry_s`; an I/O error fails that block, not the tier.
- A demotion writes a copy down only if it verifies against the block's checksum; a damaged one is dropped
  as a read drops it (the store's `damaged`), never made into a lower tier's copy (an NVMe file).
Backpressure is structural: a write that needs room waits for the demotions that make it (and, when every
candidate is moving or leased, for one of those to end, up to `wait_for_room_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from engram.block import COPY_OFF_LOOP_BYTES, Payload, checksum, checksum_off_loop, copied
from engram.borrowed import in_thread
from engram.errors import (
    DataLoss,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    StorageFull,
    TierFull,
    Unavailable,
)
from engram.eviction import ReturnModel, TierVictims
from engram.index import BlockMeta, ChainIndex
from engram.logbudget import LogBudget
from engram.store.counters import StoreCounters, TierHealth
from engram.tiers.base import ImmediateTier, Tier

log = logging.getLogger(__name__)

TIER_FAULTS = (ResourceExhausted, Unavailable, DataLoss, OSError)
SKIP_HELD = 64  # make_room(wait=False): leased, pinned or moving blocks passed before giving up
HOT_TIERS = frozenset({"hbm", "dram"})  # memory: a block here loads in milliseconds; below it, from NVMe or a peer


def immediate(tier: Tier) -> ImmediateTier | None:
    """The tier as an ImmediateTier if its class writes and deletes without waiting; else None. Asked of the class,
    not the instance: a wrapper that forwards attributes (a test's gated tier) keeps its own awaited write."""
    cls = type(tier)
    if callable(getattr(cls, "write_now", None)) and callable(getattr(cls, "delete_now", None)):
        return typing.cast(ImmediateTier, tier)
    return None


def _copied_and_checked(view: memoryview, want: int) -> tuple[memoryview, bool]:
    """A copy of a slot's bytes, and whether they match the checksum `want` (one worker thread's work, letting go
    of the GIL for both)."""
    payload = copied(view)
    return payload, checksum(payload) == want


@dataclass
class Placement:
    """The tiers of one store, fastest first, with their eviction candidates, health and the moves between them."""

    tiers: list[Tier]
    index: ChainIndex
    counters: StoreCounters
    # A copy a demotion found damaged (it failed its checksum) or missing from its tier, and why: the store drops
    # it as a read would, counted (BlockStore.drop_damaged_copy; with it the block, when no copy is left), instead
    # of writing it down.
    damaged: Callable[[BlockMeta, str, DataLoss], Awaitable[None]]
    retry_s: float = 5.0
    wait_for_room_s: float = 10.0

    def __post_init__(self) -> None:
        self.rank = {t.name: i for i, t in enumerate(self.tiers)}
        self.immediate = [immediate(t) for t in self.tiers]  # per tier: its write and delete without a coroutine
        self.model = ReturnModel(lambda: self.index, lambda: len(self.index))
        self.victims = {t.name: TierVictims(t.name, self.index.get_entry, self.model) for t in self.tiers}
        self.health = {t.name: TierHealth() for t in self.tiers}
        self.busy = 0  # moves in progress plus leases held: what may free a victim soon
        self.freed = asyncio.Condition()  # notified when a move ends or a lease is released
        self.went_cold: list[Callable[[BlockMeta], None]] = []  # called when a block's last hot copy is dropped
        # Per tier: what else holds room there that no eviction frees (a shared pool's in-place reservations not
        # yet committed, engram/store/inplace.py), as a sentence ("" when nothing does): a full tier says so
        # rather than blame pinned blocks alone.
        self.unevictable: dict[str, Callable[[], str]] = {}
        self.full_log = LogBudget()  # a tier found full, with its figures, a burst of refused puts counted

    def tier(self, name: str) -> Tier:
        return self.tiers[self.rank[name]]

    def available(self, i: int) -> bool:
        h = self.health[self.tiers[i].name]
        return h.state == "ok" or time.monotonic() >= h.retry_at

    def lower(self, i: int) -> int | None:
        """The next tier below i that is not degraded, if any."""
        for j in range(i + 1, len(self.tiers)):
            if self.available(j):
                return j
        return None

    def use(self, meta: BlockMeta) -> None:
        """A request used a stored block (a lookup found it, a put found it stored): eviction learns from it."""
        self.model.use(meta)

    def use_all(self, metas: Sequence[BlockMeta]) -> None:
        """`use` of every block a lookup found."""
        self.model.use_all(metas)

    def reordered(self) -> None:
        """Blocks may have become evictable or changed held class: searches start afresh."""
        for v in self.victims.values():
            v.forget_queue()

    def notify_freed(self) -> None:
        """A lease ended or a move landed: a waiting make_room may find a victim now."""
        self.reordered()

        async def notify() -> None:
            async with self.freed:
                self.freed.notify_all()

        if self.freed._waiters:  # type: ignore[attr-defined]
            asyncio.get_running_loop().create_task(notify())

    # ---- copies --------------------------------------------------------------------------------

    async def place(self, meta: BlockMeta, i: int, payload: Payload, *, wait: bool = True) -> None:
        """Make room in tier i and write a copy there; the copy counts once the write completed."""
        tier = self.tiers[i]
        rec = meta.record()
        need = tier.space_for(rec)
        moved = self.index.get(meta.key) is meta  # a copy of an indexed block (not a put's first copy)
        if not tier.reserve(need):  # room already: no make_room coroutine (make_room's first step is this)
            await self.make_room(i, need, wait=wait)
            if moved and self.index.get(meta.key) is not meta:
                # Dropped while room was made (a read found its last copy damaged), and perhaps put again, its copy
                # here under the key now: a move that outlives its block writes nothing (the tier refused the key,
                # and the read that promoted the block, served already, failed INTERNAL)
                tier.unreserve(need)
                return
        now = self.immediate[i]
        try:
            if now is not None and len(payload) < COPY_OFF_LOOP_BYTES:  # a large copy: in a thread (`write`)
                now.write_now(rec, payload, need)
            else:
                await tier.write(rec, payload, need)
        except BaseException as exc:
            self.tier_failed(i, exc)
            if moved and isinstance(exc, Exception) and self.index.get(meta.key) is not meta:
                return  # its block left while a thread copied it (a put of the key may have landed here meanwhile)
            raise
        self.tier_ok(i)
        self.counters.tiers[tier.name].written_bytes += len(payload)
        if moved and self.index.get(meta.key) is not meta:  # deleted while copied (a failed read dropped it):
            await self._discard(i, meta.key)  # the copy would be held by no block, never evicted
            return
        self.index.add_copy(meta, tier.name)
        if len(meta.locations) > 1:  # (one copy: in order already; a put's first copy, no bound method made)
            meta.locations.sort(key=self.rank.__getitem__)
        self.victims[tier.name].add(meta)

    def _full(self, tier: Tier, lower: int | None) -> TierFull:
        """Why no room can be made in a full tier. A pool counts whole pages (a block smaller than a page takes
        one: 64-byte blocks filled a 256 MiB pool of 4 KiB pages at 4 MiB of payload); with no tier below only
        leaves are evicted, so a chain's inner blocks are no candidates (a put of a chain longer than the tier
        holds ends here though nothing is pinned). The tier's use is every tenant's: an admin and the log get it,
        a tenant the rest (errors.TierFull)."""
        used = getattr(tier, "allocated_bytes", tier.used_bytes)
        page = getattr(tier, "page_bytes", 0)
        where = f" in pages of {page} bytes" if page > 1 else ""
        held = self.unevictable[tier.name]() if tier.name in self.unevictable else ""
        why = "pinned, being read or moving" + ("" if lower is not None else
                                                 ", or the parent of a block held here (with no tier below with room, "
                                                 "only the last block of a chain is evicted)")
        rest = (f"{held}; every block in the rest is {why}" if held else
                f"every block in it is {why}; unpin blocks, raise its capacity or add a tier below")
        full = TierFull(f"the {tier.name} tier is full ({used} of {tier.capacity_bytes} bytes{where}): {rest}",
                        f"the {tier.name} tier is full{f' ({where.lstrip()})' if where else ''}: {rest}")
        if (untold := self.full_log.take()) is not None:
            log.info("no room could be made: %s%s", full, f" ({untold} more not logged)" if untold else "")
        return full

    def compete(self, meta: BlockMeta) -> None:
        """A block just published in the index: each of its copies is an eviction candidate of its tier again.
        Copies placed before it was indexed were candidates already, but a victim search meanwhile (a put's
        durable copy awaited) dropped them as unindexed, and nothing else would add them back."""
        for name in meta.locations:
            self.victims[name].add(meta)

    async def make_room(self, i: int, need: int, *, wait: bool = True) -> None:
        """Reserve `need` bytes in tier i, evicting (demoting) as needed. With wait, and when every
        candidate is moving or leased, wait for one to come free; promotions pass wait=False because
        their reader holds leases itself, and waiting on each other's leases would deadlock."""
        tier = self.tiers[i]
        if need > tier.capacity_bytes:
            raise ResourceExhausted(
                f"a block of {need} bytes exceeds the {tier.name} tier's capacity of {tier.capacity_bytes} "
                f"bytes; raise tiers.{tier.name}.capacity or use smaller blocks"
            )
        victims = self.victims[tier.name]
        demote = True
        deadline = time.monotonic() + self.wait_for_room_s
        while not tier.reserve(need):
            lower = self.lower(i) if demote else None
            # A caller that will not wait (a promotion, a transfer's copy) gives up after passing SKIP_HELD
            # blocks it may not evict: it skips the copy rather than scan the tier's leased blocks every time.
            victim = victims.victim(leaf_only=lower is None, max_held=None if wait else SKIP_HELD)
            if victim is None and lower is not None and wait:
                # A put that must land moves a pinned block down (keeping its pin) rather than fail; a promotion
                # (wait=False) is served from below instead: it does not push pinned blocks out.
                victim = victims.pinned_to_demote()
            if victim is None and wait and self.busy and time.monotonic() < deadline:
                # Every candidate is moving or being read: one of those ends soon and frees a victim. Not
                # asyncio.wait_for: on Python 3.11 it drops a cancel that lands as the wait ends (CPython
                # gh-86296), and a put whose caller had gone waited on for room, to its deadline, for nobody.
                async with self.freed:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                            await self.freed.wait()
                continue
            if victim is None:
                raise self._full(tier, lower)
            if self.rank[victim.locations[-1]] > i:
                await self.drop_copy(victim, tier.name)  # a lower tier holds it too
            elif lower is not None:
                try:
                    if not await self._demote(victim, i, lower, wait=wait):
                        continue  # read meanwhile: it keeps this copy, another victim makes the room; or damaged, or
                        # dropped as damaged while copied (it left the index): gone, the room made
                except ResourceExhausted:
                    if wait:
                        demote = False  # the tier below is full of what it may not evict: delete leaves here
                        victims.add(victim)
                        continue
                    # A caller that will not wait (a promotion) skips its copy rather than delete cached blocks
                    # for it: the tier below is full of blocks it holds itself, most likely.
                    victims.add(victim)
                    raise
                except TIER_FAULTS:
                    # The lower tier cannot take it: delete leaves here instead. The victim keeps its place,
                    # and the inner blocks the leaf-only search drops come back once room is made.
                    demote = False
                    victims.add(victim)
                    continue
            # Its lowest copy, with no tier below to take it: the block (a leaf) leaves the store, every copy of
            # it. Dropping this copy alone left the copies above it: from NVMe, an acknowledged block held only
            # in DRAM, which a crash loses, and under which later puts were acknowledged (orphans at the next
            # start). The victim is evictable (no lease, pin or move) on every tier: those are the block's.
            elif not self.delete_block_now(victim):
                await self.delete_block(victim)
            self.counters.tiers[tier.name].evictions += 1
        if not demote:
            victims.rebuild(self.index)

    async def _demote(self, meta: BlockMeta, i: int, j: int, *, wait: bool = True) -> bool:
        """Copy a victim down to tier j, then drop its copy in tier i; False when it did not move: a reader
        leased the block while it was copied (a read may be serving that copy's bytes in place, a view of its
        pool slot, so the copy stays, and is the first to go once the read ends: it has a copy below), the
        copy failed its checksum (a bit flipped in the pool): that is never written down, where it became a
        file under the block's checksum that fails every read, but dropped as damaged (`damaged`), which makes
        the room as well; or the block left the index while it was copied (a read dropped its last copy as
        damaged, which made the room): `place` wrote nothing below, and no demotion is counted."""
        meta.moving = True
        self.busy += 1
        try:
            payload, problem = await self._copy_out(i, meta)  # the flusher's check (BlockStore._read_verified)
            if problem is None:
                await self.place(meta, j, payload, wait=wait)  # a promotion's room below waits on no lease either
        finally:
            meta.moving = False
            self.busy -= 1
            self.notify_freed()
        if problem is not None:
            await self.damaged(meta, self.tiers[i].name, problem)
            return False
        if self.tiers[j].name not in meta.locations:  # `place` wrote nothing: the block left the index meanwhile
            await self.drop_copy(meta, self.tiers[i].name)  # (gone with it already, as it left: then nothing to do)
            return False
        tc = self.counters.tiers[self.tiers[i].name]
        tc.demotions += 1
        tc.demoted_bytes += len(payload)
        if meta.leases:
            self.victims[self.tiers[i].name].add(meta)
            return False
        await self.drop_copy(meta, self.tiers[i].name)
        return True

    async def _copy_out(self, i: int, meta: BlockMeta) -> tuple[Payload, DataLoss | None]:
        """A moving block's copy in tier i, and what is wrong with it: None when it matches the block's checksum,
        else the DataLoss its drop is counted as (it failed its checksum, or the tier does not hold the copy the
        index lists: lost, as `BlockStore._read_verified` finds it, where the tier's NotFound went through
        make_room to the put that needed the room). A large one in a host pool is copied out of its slot and
        hashed in one worker thread (on the loop, a copy into fresh pages and an xxh3 made most of the steps over
        2 ms of a raw 16 MiB put beside demotions: benchmarks/RESULTS.md, put_get, session 51), awaited to its end
        even by a cancelled demotion, whose block stays moving (its slot kept) until then; any other is read, and
        hashed off the loop when large."""
        tier = self.tiers[i]
        view = getattr(tier, "view", None)  # a pool's slot in place (None for one in HBM)
        payload: Payload
        try:
            in_place = view(meta.key) if view is not None and meta.nbytes >= COPY_OFF_LOOP_BYTES else None
            if in_place is not None:
                payload, sound = await in_thread(_copied_and_checked, in_place, meta.checksum)
            else:
                payload = await tier.read(meta.key)
                sound = await checksum_off_loop(payload) == meta.checksum
        except NotFound as exc:
            return b"", DataLoss(f"{exc}, though the index listed a copy there")
        return payload, None if sound else DataLoss(f"block {meta.key.hex()} failed its checksum in tier {tier.name}")

    async def promote(self, meta: BlockMeta, payload: Payload) -> None:
        """Copy a block read from a lower tier into the top tier, if room can be made without waiting."""
        meta.moving = True
        self.busy += 1
        try:
            await self.place(meta, 0, payload, wait=False)
            if self.tiers[0].name in meta.locations:  # (not when the block left meanwhile)
                tc = self.counters.tiers[self.tiers[0].name]
                tc.promotions += 1
                tc.promoted_bytes += len(payload)
        except ResourceExhausted:
            pass  # no room up there right now: the block is served from where it is
        finally:
            meta.moving = False
            self.busy -= 1
            self.notify_freed()

    async def _discard(self, i: int, key: bytes) -> None:
        """Delete a copy tier i holds that no block lists."""
        now = self.immediate[i]
        try:
            if now is not None:
                now.delete_now(key)
            else:
                await self.tiers[i].delete(key)
        except OSError:
            self.counters.tiers[self.tiers[i].name].io_errors += 1

    async def drop_copy(self, meta: BlockMeta, name: str, *, last: Callable[[], object] | None = None) -> None:
        """Delete the block's copy in tier `name`, if it holds one. A tier keeps copies by key: a block that lost
        that copy meanwhile (a move outliving the block, dropped as damaged and put again under its key) would
        delete the copy of the block the index holds now, which was acknowledged stored. `last`: called when it
        was the block's last copy, just before the tier's delete begins (no await between: a put of the key comes
        after that delete has begun, which a tier's write of the key waits for): the caller unindexes the block."""
        if not self._leave(meta, name):
            return
        if last is not None and not meta.locations:
            last()
        await self._discard(self.rank[name], meta.key)

    def _leave(self, meta: BlockMeta, name: str) -> bool:
        """The block's copy in tier `name` no longer counts (before the tier deletes it); False if it held none."""
        if not self.index.drop_copy(meta, name):
            return False
        if name in HOT_TIERS and HOT_TIERS.isdisjoint(meta.locations):
            for listener in self.went_cold:
                try:
                    listener(meta)
                except Exception:  # a listener's bug must not stop the move halfway (a copy no one frees)
                    log.exception("a went-cold listener failed on block %s", meta.key.hex())
        return True

    async def delete_block(self, meta: BlockMeta) -> None:
        """Out of the index at once, then every copy deleted, even if the caller is cancelled meanwhile (it gets
        the cancel once they are): a copy left behind would be one no index knows, its room lost."""
        if not meta.evictable:
            raise AssertionError("deleting a pinned, leased or moving block")
        self.unindex(meta)
        cancelled: asyncio.CancelledError | None = None
        for name in list(meta.locations):
            try:
                await self.drop_copy(meta, name)  # (a tier's delete, once begun, completes on its own: nvme.py)
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled

    def delete_block_now(self, meta: BlockMeta) -> bool:
        """`delete_block` without a coroutine when every copy is in an ImmediateTier (an eviction from memory);
        False, having done nothing, when one is not."""
        rank, immediate = self.rank, self.immediate
        for name in meta.locations:
            if immediate[rank[name]] is None:
                return False
        if not meta.evictable:
            raise AssertionError("deleting a pinned, leased or moving block")
        self.unindex(meta)
        for name in list(meta.locations):
            self._leave(meta, name)
            now = immediate[rank[name]]
            assert now is not None
            now.delete_now(meta.key)  # a memory tier's delete raises no OSError
        return True

    def unindex(self, meta: BlockMeta) -> None:
        if self.index.get(meta.key) is not meta:
            return
        _, new_leaf = self.index.remove(meta.key)
        self.model.forget(meta)
        if new_leaf is not None:
            for name in new_leaf.locations:
                self.victims[name].leaf_again(new_leaf)

    # ---- the two-phase protocol for moves performed elsewhere (engram/transfer.py) ----------------

    async def begin_copy(self, meta: BlockMeta, tier_name: str) -> int:
        """Phase one: mark the block moving and make room in the tier; returns the bytes reserved there.
        Never waits for room."""
        i = self.rank[tier_name]
        meta.moving = True
        self.busy += 1
        try:
            need = self.tiers[i].space_for(meta.record())
            await self.make_room(i, need, wait=False)
        except BaseException:
            self.end_copy(meta, tier_name, ok=False)
            raise
        return need

    def begin_copy_now(self, meta: BlockMeta, tier_name: str) -> int | None:
        """begin_copy when the tier has room already, with no await (a batch books hundreds of blocks, and
        the copy engine idles while it does); None when room must be made first: call begin_copy."""
        tier = self.tier(tier_name)
        need = tier.space_for(meta.record())
        if not tier.reserve(need):
            return None
        meta.moving = True
        self.busy += 1
        return need

    def begin_copies_now(self, metas: Sequence[BlockMeta], tier_name: str) -> list[int | None]:
        """begin_copy_now of a batch in one pass, the room reserved at once where the tier can (a pool's
        `reserve_payloads`): a batched promotion booked every block on its own, and the copy engine waited for that
        Python (benchmarks/RESULTS.md, gpu_transfer). Per block the bytes reserved, or None where room must be
        made first (that block is not moving: call begin_copy for it). The caller passes each block once."""
        tier = self.tier(tier_name)
        reserve_payloads = getattr(tier, "reserve_payloads", None)  # a pool's: no record built per block either
        if reserve_payloads is not None:
            out: list[int | None] = reserve_payloads([m.nbytes for m in metas])
        else:
            out = [need if tier.reserve(need) else None for need in (tier.space_for(m.record()) for m in metas)]
        for meta, need in zip(metas, out, strict=True):
            if need is not None:
                meta.moving = True
                self.busy += 1
        return out

    def end_copy(self, meta: BlockMeta, tier_name: str, *, ok: bool) -> None:
        """Phase two: the new copy joins the block's locations only if its bytes landed (ok)."""
        self.end_copies([meta], tier_name, [ok])

    def end_copies(self, metas: Sequence[BlockMeta], tier_name: str, oks: Sequence[bool]) -> None:
        """end_copy of a batch, with one wake-up of the room makers waiting (instead of one per block)."""
        i = self.rank[tier_name]
        now, victims, rank = self.immediate[i], self.victims[tier_name], self.rank
        try:
            for meta, ok in zip(metas, oks, strict=True):
                if ok and self.index.get(meta.key) is not meta:  # deleted while copied: the copy belongs to nothing
                    if now is not None:
                        now.delete_now(meta.key)
                    ok = False
                if ok:
                    upward = i < min(map(rank.__getitem__, meta.locations), default=0)
                    self.index.add_copy(meta, tier_name)
                    meta.locations.sort(key=rank.__getitem__)
                    victims.add(meta)
                    if upward:
                        self.counters.tiers[tier_name].promotions += 1
                meta.moving = False
                self.busy -= 1
        finally:
            self.notify_freed()

    async def drop_spare_copy(self, meta: BlockMeta, tier_name: str) -> None:
        """Drop one copy of a block that another tier also holds (a caller's own demotion policy)."""
        if tier_name not in meta.locations or len(meta.locations) < 2 or meta.moving or meta.leases:
            raise FailedPrecondition(f"block {meta.key.hex()}: its {tier_name} copy is not a spare copy that "
                                     "may be dropped (the only copy, being read, or moving)")
        await self.drop_copy(meta, tier_name)

    # ---- health ---------------------------------------------------------------------------------

    def tier_failed(self, i: int, exc: BaseException, *, degrade: bool = False) -> None:
        """Count a tier's failure; a full disk (or, with `degrade`, any failure) degrades it until a retry works."""
        name = self.tiers[i].name
        if isinstance(exc, StorageFull):
            self.counters.tiers[name].enospc += 1
        elif isinstance(exc, Unavailable | OSError):
            self.counters.tiers[name].io_errors += 1
        if degrade or isinstance(exc, StorageFull):
            h = self.health[name]
            h.state, h.cause = "degraded", str(exc)
            h.reason = f"{exc}; tried again at most every tiers.retry_s ({self.retry_s:g} s)"
            h.failed_at = time.monotonic()
            h.retry_at = h.failed_at + self.retry_s

    def unavailable_why(self, i: int) -> str:
        """Why tier i takes no write now (not `available`), for a refusal: the failure that marked it and when it
        is tried again, not a claim that it still stands (a disk full then may have room by now)."""
        name = self.tiers[i].name
        h = self.health[name]
        now = time.monotonic()
        return (f"the {name} tier is marked unavailable after a failure {now - h.failed_at:.1f} s ago ({h.cause}), "
                f"and is tried again at most every tiers.retry_s ({self.retry_s:g} s), next in "
                f"{max(0.0, h.retry_at - now):.1f} s")

    def failed_since(self, i: int, since: float) -> bool:
        """Whether tier i was degraded by a failure at or after `since` (time.monotonic())."""
        h = self.health[self.tiers[i].name]
        return h.state != "ok" and h.failed_at >= since

    def tier_ok(self, i: int) -> None:
        h = self.health[self.tiers[i].name]
        if h.state != "ok":
            h.state, h.reason = "ok", ""
            for upper in self.tiers[:i]:  # they evicted leaf-only meanwhile and dropped inner entries
                self.victims[upper.name].rebuild(self.index)

    def holding(self, name: str) -> Sequence[BlockMeta]:
        """Indexed blocks with a copy in tier `name`."""
        return [m for m in self.index if name in m.locations]

"""The background flusher: what bounds write-back's loss window, and what catches up on blocks a degraded
NVMe tier could not take.

Why: under write-back a put lands in DRAM (or HBM) only, and reached NVMe only when DRAM pressure demoted it,
so a crash (or a clean SIGTERM: the shared DRAM segment is unlinked) lost every block not demoted yet, with
no bound. The flusher copies each block held only in volatile tiers to the durable tier (NVMe) once it is
`window_s` old, keeping the DRAM copy (it stays a hit; evicting it later just drops it). So a crash loses at
most the blocks put in the last `window_s` seconds plus what the disk had not caught up with, and never more
than `window_bytes`: a put waits while that many bytes are held only in volatile tiers (backpressure on the
disk's speed). `flush_all` copies every such block at shutdown, within a deadline.

It also takes the blocks write-through acknowledged as not durable (tiers.on_nvme_failure = degrade): they
are due at once, and go to NVMe as soon as the tier takes writes again. And blocks whose NVMe copy was found
damaged while memory holds a sound one (BlockStore.drop_damaged_copy): pending again, from the moment it was
found.

Every copy it writes is read from the block's fastest volatile copy that verifies (xxh3): a damaged copy is
dropped as a read drops it, never made durable (a file under the block's checksum that fails every read).

Order: oldest first (a dict in insertion order), so parents go before their children (a child is put after
its parent); recovery drops blocks whose parent is not on disk. Complexity: O(1) per put and per flush; a
full prune (O(pending)) only when a put would wait and when Stats asks.

What it does not do: bound the window while the NVMe tier is degraded (nothing can be flushed; puts are not
held up, Stats shows the pending bytes and the tier's state), or flush blocks in the middle of being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engram.errors import ResourceExhausted
from engram.index import BlockMeta
from engram.store.durable import durable_tier
from engram.store.placement import TIER_FAULTS

if TYPE_CHECKING:
    from engram.store.core import BlockStore

log = logging.getLogger("engram.store")


@dataclass(frozen=True)
class Pending:
    """Blocks held only in volatile tiers: what a crash now would lose."""

    blocks: int
    bytes: int
    oldest_s: float


@dataclass(frozen=True)
class FlushResult:
    flushed: int
    flushed_bytes: int
    left: int  # blocks still held only in volatile tiers (the deadline passed, or the disk failed)
    seconds: float


class Flusher:
    def __init__(self, store: BlockStore, *, window_s: float, window_bytes: int) -> None:
        self.store = store
        self.window_s = window_s  # 0: no flush by age (only by the byte bound, eviction, shutdown)
        self.window_bytes = window_bytes  # 0: no byte bound
        # key -> (block, due, since: the wall time it became pending), oldest first
        self._pending: dict[bytes, tuple[BlockMeta, float, float]] = {}
        self._bytes = 0
        self._wake = asyncio.Event()
        self._flushed = asyncio.Condition()  # notified after each flush: puts waiting on the byte bound
        self._task: asyncio.Task[None] | None = None
        self._waiting = 0  # puts held back by the byte bound: the loop flushes whatever is due or not

    # ---- what the store tells it ---------------------------------------------------------------

    def note(self, meta: BlockMeta, *, now: bool = False) -> None:
        """A block was published without a durable copy, or lost it (found damaged); `now`: due at once
        (write-through, degraded)."""
        old = self._pending.get(meta.key)
        if old is not None:
            if old[0] is meta:
                return
            self._drop(meta.key)  # a block deleted and put again: the new copy starts its own window
        due = time.monotonic() + (0.0 if now or not self.window_s else self.window_s)
        if not now and not self.window_s:
            due = float("inf")  # no age bound: flushed only by the byte bound, eviction or shutdown
        self._pending[meta.key] = (meta, due, time.time())
        self._bytes += meta.nbytes
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        if now or (self.window_bytes and self._bytes > self.window_bytes):
            self._wake.set()

    async def admit(self, nbytes: int) -> None:
        """Wait while the bytes held only in volatile tiers would pass the window (the byte bound); gives up
        with ResourceExhausted when the flusher makes no progress for `wait_for_room_s`."""
        if not self.window_bytes or self._bytes + nbytes <= self.window_bytes:
            return
        self._prune()
        placement = self.store.placement
        d = durable_tier(placement)
        while self._bytes and self._bytes + nbytes > self.window_bytes:
            if d is None or not placement.available(d):
                return  # nothing can be flushed: the window is not held while the tier is degraded
            self._wake.set()
            async with self._flushed:
                self._waiting += 1
                try:  # not asyncio.wait_for, which drops a cancel landing as the wait ends (as Placement.make_room)
                    async with asyncio.timeout(placement.wait_for_room_s):
                        await self._flushed.wait()
                except TimeoutError:
                    raise ResourceExhausted(
                        f"{self._bytes} bytes are held only in DRAM, past tiers.write_back_window_bytes "
                        f"({self.window_bytes}), and the NVMe tier took none of them for "
                        f"{placement.wait_for_room_s:g}s; retry, or raise tiers.write_back_window_bytes") from None
                finally:
                    self._waiting -= 1
            self._prune()

    # ---- figures -------------------------------------------------------------------------------

    def pending(self) -> Pending:
        self._prune()
        if not self._pending:
            return Pending(0, 0, 0.0)
        # Not the block's age (one put long ago may be pending again), nor the queue's head: a block the disk
        # failed goes to the back of it.
        since = min(entry[2] for entry in self._pending.values())
        return Pending(len(self._pending), self._bytes, max(0.0, time.time() - since))

    # ---- the loop --------------------------------------------------------------------------------

    def _stale(self, meta: BlockMeta, d: int) -> bool:
        """No longer pending: deleted, or a durable copy exists (a demotion wrote it)."""
        return self.store.index.get(meta.key) is not meta or self.store.placement.tiers[d].name in meta.locations

    def _drop(self, key: bytes) -> None:
        meta = self._pending.pop(key)[0]
        self._bytes -= meta.nbytes

    def _prune(self) -> None:
        d = durable_tier(self.store.placement)
        if d is None:
            return
        for key, (meta, *_) in list(self._pending.items()):
            if self._stale(meta, d):
                self._drop(key)

    async def _run(self) -> None:
        placement = self.store.placement
        d = durable_tier(placement)
        assert d is not None
        backoff = 0.05
        while self._pending:
            key, (meta, due, _) = next(iter(self._pending.items()))
            if self._stale(meta, d):
                self._drop(key)
                await self._notify()
                continue
            over = bool(self.window_bytes) and (self._bytes > self.window_bytes or self._waiting > 0)
            wait = due - time.monotonic()
            if wait > 0 and not over:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # (not wait_for: a stop's cancel must not be dropped)
                    async with asyncio.timeout(min(wait, 3600.0)):
                        await self._wake.wait()
                continue
            if not placement.available(d) or meta.moving:
                await asyncio.sleep(0.01 if meta.moving else min(placement.retry_s, 1.0))
                continue
            try:
                flushed = await self._flush(meta, d)
            except Exception:  # a bug, not a disk fault: say so, skip the block, keep the loop alive
                log.exception("flusher: copying block %s to NVMe failed; it stays only in memory", key.hex())
                self._drop(key)
                continue
            if flushed or self._stale(meta, d):  # written; or dropped: no copy of it verified
                self._drop(key)
                backoff = 0.05
                await self._notify()
            else:
                # The disk failed it: back off (the tier's health decides), and let the blocks behind it go first. A
                # key the tier refuses for good (a newer Engram's file set aside under it) stayed at the head and
                # held every later block in memory only, past the loss window (an audit, session 44).
                self._pending[key] = self._pending.pop(key)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _notify(self) -> None:
        async with self._flushed:
            self._flushed.notify_all()

    async def flush_now(self, meta: BlockMeta) -> bool:
        """Copy a block to the durable tier now, outside the loop's order (write-through: a block whose durable
        copy was found damaged): True once it has a durable copy (or is gone); False when it could not be
        written now (the tier is degraded, the write failed, another move holds the block)."""
        d = durable_tier(self.store.placement)
        if d is None or self._stale(meta, d):
            return True
        if meta.moving or not self.store.placement.available(d):
            return False
        return await self._flush(meta, d)

    async def _flush(self, meta: BlockMeta, d: int) -> bool:
        """Copy one block to the durable tier from its fastest volatile copy that verifies, keeping that copy;
        False when the write failed, or no copy verified (the block is dropped then, as a read drops it)."""
        placement = self.store.placement
        meta.moving = True  # not a victim while it is copied
        placement.busy += 1
        try:
            # DataLoss: no copy was sound, the block is gone. Held (moving): a large pool copy is copied off the loop
            payload, _ = await self.store._read_verified(meta, held=True)
            await placement.place(meta, d, typing.cast(bytes, payload))
        except TIER_FAULTS:
            return False
        finally:
            meta.moving = False
            placement.busy -= 1
            placement.notify_freed()
        self.store.counters.blocks_flushed += 1
        return True

    async def flush_all(self, deadline_s: float) -> FlushResult:
        """Copy every block held only in volatile tiers to the durable tier, oldest first, until done,
        `deadline_s` has passed, or the tier fails anew (shutdown: the DRAM pool is about to be unlinked). A
        tier marked degraded by an earlier failure is tried all the same: the disk may have room again within
        tiers.retry_s of the mark, and a stop then copied nothing, every block held only in memory lost."""
        t0 = time.monotonic()
        placement = self.store.placement
        d = durable_tier(placement)
        todo = [] if d is None else sorted(
            (m for m in self.store.index if placement.tiers[d].name not in m.locations and m.locations),
            key=lambda m: m.created)
        flushed = nbytes = 0
        for meta in todo:
            if time.monotonic() - t0 > deadline_s or d is None:
                break
            if self._stale(meta, d):
                continue
            while meta.moving and time.monotonic() - t0 < deadline_s:
                await asyncio.sleep(0.005)
            if meta.moving or self._stale(meta, d):
                continue
            tried = time.monotonic()
            if await self._flush(meta, d):
                flushed += 1
                nbytes += meta.nbytes
            elif placement.failed_since(d, tried):  # full (or failing) now: the rest would fail alike
                break
        left = sum(1 for m in todo if d is not None and not self._stale(m, d))
        self._prune()
        return FlushResult(flushed, nbytes, left, time.monotonic() - t0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

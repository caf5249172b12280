"""DRAM tiers. The default (`shared_dram_tier`) is a pool in one shared-memory segment, pinned when CUDA is
present, that co-located workers map for zero-copy Gets; `DramTier` (tiers.dram.pool = private) keeps
payloads as bytes objects in the daemon's own memory, for hosts without a usable /dev/shm.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engram.block import COPY_OFF_LOOP_BYTES, BlockRecord, Payload, copied
from engram.borrowed import in_thread
from engram.errors import NotFound
from engram.tiers.base import TierUsage
from engram.tiers.budget import ByteBudget
from engram.tiers.pool import PoolTier, auto_page_bytes
from engram.tiers.shm import SharedSegment
from engram.tiers.slots import SlotAllocator


def shared_dram_tier(capacity: int, shm_dir: str | Path = "/dev/shm", page_bytes: int = 0, *,
                     pin: bool = True, prefault: bool = False, group: str = "") -> PoolTier:
    """The DRAM pool: a shared segment of `capacity` bytes carved by the slot allocator, whose generation
    table lives in the segment so a worker can check its descriptors. group: the workers' group the segment
    is opened to (SharedSegment)."""
    page = page_bytes or auto_page_bytes(capacity)
    pages = -(-capacity // page)  # round up: a capacity below a page still holds one block
    seg = SharedSegment(shm_dir, pages * page, page, pin=pin, prefault=prefault, group=group)
    return PoolTier("dram", seg.data, page, SlotAllocator(seg.layout.pages, seg.generations), on_close=seg.close,
                    segment=seg)


class DramTier(ByteBudget):
    """Payloads in a dict: bytes objects as a put hands them over, or a read-only view of a copy made off the loop
    (of a large view the caller reuses: `write`). `name`: the tier's place in a store's chain ("dram"; a test or the
    trace replayer may stand it in for a lower tier, "nvme", without files)."""

    def __init__(self, capacity_bytes: int, name: str = "dram") -> None:
        super().__init__(capacity_bytes, "DRAM")
        self.name = name
        self._blocks: dict[bytes, bytes | memoryview] = {}
        # The payload without an await (BlockStore.read_views' batch reads), or None: the dict's own get.
        self.read_now: Callable[[bytes], bytes | memoryview | None] = self._blocks.get

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def space_for(self, rec: BlockRecord) -> int:
        return rec.nbytes

    async def write(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """`write_now`, but a view of COPY_OFF_LOOP_BYTES or more (the data channel's receive buffer, a pool's slot)
        is copied in a worker thread by block.copied, which lets go of the GIL (bytes() of it on the loop was one
        memcpy holding the loop: 16 MiB 1-4 ms), and which even a cancelled caller waits for (engram/borrowed.py):
        the caller may reuse its buffer once this returns. The reservation stays counted until the copy is kept."""
        if isinstance(payload, bytes) or payload.nbytes < COPY_OFF_LOOP_BYTES:
            self.write_now(rec, payload, reserved)
            return
        try:
            kept = (await in_thread(copied, payload)).toreadonly()
        except BaseException:
            self.unreserve(reserved)
            raise
        self._keep(rec, kept, reserved)

    def write_now(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """`write` without a coroutine (ImmediateTier): a dict entry never waits. A view is copied into bytes here,
        on the caller's thread (the store's placement calls this for payloads below COPY_OFF_LOOP_BYTES)."""
        # kept as it is: a caller's reused buffer (the data channel's) is copied, bytes are not
        self._keep(rec, payload if isinstance(payload, bytes) else bytes(payload), reserved)

    def _keep(self, rec: BlockRecord, payload: bytes | memoryview, reserved: int) -> None:
        self.unreserve(reserved)  # consumed, kept or refused (Tier.write)
        if rec.key in self._blocks:
            raise AssertionError("write of a key already in the tier; the store must dedupe first")
        self._blocks[rec.key] = payload
        self.stored += payload.nbytes if isinstance(payload, memoryview) else len(payload)

    async def read(self, key: bytes) -> bytes | memoryview:
        try:
            return self._blocks[key]
        except KeyError:
            raise NotFound(f"block {key.hex()} is not in the DRAM tier") from None

    async def delete(self, key: bytes) -> int:
        return self.delete_now(key)

    def delete_now(self, key: bytes) -> int:
        payload = self._blocks.pop(key, None)
        if payload is None:
            return 0
        n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        self.stored -= n
        return n

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self._capacity, self.used_bytes, len(self._blocks))

    async def close(self) -> None:
        self._blocks.clear()
        self.stored = 0

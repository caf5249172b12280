"""A pooled tier: block payloads in one preallocated byte buffer, carved into page runs by the slot
allocator (engram/tiers/slots.py). The DRAM tier's buffer is a shared-memory segment (engram/tiers/shm.py);
the HBM tier's is one device tensor (engram/tiers/hbm.py). No allocation happens per block.

The Tier Protocol reserves bytes before a write without naming the block; here a reservation allocates
the run at once (so a fragmented pool says "no room" at reserve time, and the store evicts), and the write
consumes a run reserved for that size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engram.block import COPY_OFF_LOOP_BYTES, BlockRecord, Payload
from engram.borrowed import in_thread
from engram.errors import NotFound
from engram.tiers.base import TierUsage
from engram.tiers.shm import SharedSegment
from engram.tiers.slots import Run, SlotAllocator


@dataclass(frozen=True)
class Slot:
    """Where one block's payload lies in the pool: byte offset, length, and its run's generation."""

    run: Run
    offset: int
    length: int

    @property
    def generation(self) -> int:
        return self.run.generation


def _copy_into(dest: memoryview, payload: Payload) -> None:
    """One memcpy of a payload's bytes into a host pool's slot, on the caller's thread (the event loop's: small)."""
    src = memoryview(payload)
    dest[:] = src if src.format == "B" and src.ndim == 1 else src.cast("B")


def _copy_into_letting_go(dest: memoryview, payload: Payload) -> None:
    """`_copy_into` for a worker thread: numpy's copy lets go of the GIL while it copies (a memoryview's slice
    assignment, one memcpy too, holds it: the event loop waited for the whole copy all the same)."""
    np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(payload, np.uint8))


def auto_page_bytes(capacity: int) -> int:
    """A power of two near capacity / 64Ki, in [16 B, 64 KiB]: at most ~128Ki pages (a 1 MiB generation
    table), and at most 64 KiB lost to rounding per block."""
    page = 16
    while page < 64 * 1024 and page * 2 * 65536 <= capacity:
        page *= 2
    return page


def bytes_tensor(payload: bytes | memoryview) -> torch.Tensor:
    """A uint8 view of immutable bytes, for copy_ sources only (torch warns that it is not writable)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


class PoolTier:
    def __init__(self, name: str, buffer: torch.Tensor, page_bytes: int, allocator: SlotAllocator,
                 on_close: Callable[[], None] | None = None, segment: SharedSegment | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("a pool buffer is a 1-D uint8 tensor")
        if allocator.n_pages * page_bytes > buffer.numel():
            raise ValueError("the allocator's pages overrun the buffer")
        self.name = name
        self.buffer = buffer
        # A host pool's bytes as a memoryview, which write_now copies into with one memcpy on the event loop's
        # thread; torch's copy_ splits a copy over an OpenMP team of torch.get_num_threads() threads and returns
        # when the last of them is done, so beside any other busy process (a worker, a client on a 2-core host)
        # each put's copy waited for the scheduler: a 1 MiB copy 5 ms at the median instead of 0.1 (16 MiB 13
        # against 1.6), stalling every connection (benchmarks/RESULTS.md, put_get, session 49).
        self._host = memoryview(buffer.numpy()) if buffer.device.type == "cpu" else None  # type: ignore[arg-type]
        self.page_bytes = page_bytes
        self.allocator = allocator
        self._on_close = on_close
        # The shared segment a co-located worker maps: the pool's bytes and generation table (DRAM), or
        # only the generation table (HBM, whose bytes a worker opens through CUDA IPC).
        self.segment = segment
        self._ipc: tuple[object, ...] | None = None
        self._slots: dict[bytes, Slot] = {}
        self._reserved: dict[int, list[Run]] = {}  # runs reserved for a coming write, by reserved bytes
        self._reserved_bytes = 0
        self._writing = 0  # reserved bytes of writes copying in a worker thread: consumed, not yet stored
        self._stored = 0

    @property
    def host(self) -> memoryview | None:
        """The whole pool's bytes as one memoryview, for a host pool (None for one in HBM): slicing it costs far
        less than slicing the tensor (a hash of hundreds of blocks' regions, engram/transfer.py)."""
        return self._host

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.n_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Payload bytes held plus bytes reserved (as the other tiers count); `allocated_bytes` adds what
        rounding to pages costs."""
        return self._stored + self._reserved_bytes + self._writing

    @property
    def allocated_bytes(self) -> int:
        return self.allocator.used_pages * self.page_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def space_for(self, rec: BlockRecord) -> int:
        return self.pages_for(rec.nbytes) * self.page_bytes

    def reserve(self, nbytes: int) -> bool:
        run = self.allocator.alloc(self.pages_for(nbytes))
        if run is None:
            return False
        self._reserved.setdefault(nbytes, []).append(run)
        self._reserved_bytes += nbytes
        return True

    def reserve_payloads(self, lengths: Sequence[int]) -> list[int | None]:
        """Room for payloads of these lengths in one pass (a batch of copies booked at once, engram/transfer.py):
        runs carved from one free run where one holds them all (SlotAllocator.alloc_many). Per payload the bytes
        reserved (`space_for` its block: a pool's depends on the length alone), or None where none was."""
        page = self.page_bytes
        sizes = [max(1, -(-n // page)) * page for n in lengths]
        runs = self.allocator.alloc_many([n // page for n in sizes])
        out: list[int | None] = []
        for nbytes, run in zip(sizes, runs, strict=True):
            if run is None:
                out.append(None)
                continue
            self._reserved.setdefault(nbytes, []).append(run)
            self._reserved_bytes += nbytes
            out.append(nbytes)
        return out

    def unreserve(self, nbytes: int) -> None:
        self.allocator.free(self._take_reserved(nbytes))

    def _take_reserved(self, nbytes: int) -> Run:
        runs = self._reserved.get(nbytes)
        if not runs:
            raise AssertionError(f"no reservation of {nbytes} bytes to consume")
        self._reserved_bytes -= nbytes
        return runs.pop()

    async def write(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """`write_now`, but a large payload into a host pool is copied in a worker thread, letting go of the GIL
        (COPY_OFF_LOOP_BYTES: a 16 MiB memcpy held the event loop 1-4 ms), which even a cancelled caller waits for
        (engram/borrowed.py): the payload may be a buffer its caller reuses next (the data channel's receive
        buffer), and the run is freed only once nothing writes into it. The run is counted (`used_bytes`)
        meanwhile, not yet the key's: the block is the tier's once its bytes are."""
        if self._host is None or len(payload) < COPY_OFF_LOOP_BYTES:
            self.write_now(rec, payload, reserved)
            return
        slot = self._slot_for(rec, payload, reserved)
        self._writing += reserved
        try:
            await in_thread(_copy_into_letting_go, self._host[slot.offset : slot.offset + slot.length], payload)
            if rec.key in self._slots:  # another write of the key landed meanwhile
                raise AssertionError("write of a key already in the tier; the store must dedupe first")
        except BaseException:
            self.allocator.free(slot.run)
            raise
        finally:
            self._writing -= reserved
        self._slots[rec.key] = slot
        self._stored += slot.length

    def write_now(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """`write` without a coroutine (ImmediateTier): a copy into the pool's memory on the caller's thread (the
        store's placement calls it for payloads below COPY_OFF_LOOP_BYTES)."""
        slot = self._slot_for(rec, payload, reserved)
        if self._host is not None:
            _copy_into(self._host[slot.offset : slot.offset + slot.length], payload)
        else:
            self.region(slot).copy_(bytes_tensor(payload))
        self._slots[rec.key] = slot
        self._stored += slot.length

    def _slot_for(self, rec: BlockRecord, payload: Payload, reserved: int) -> Slot:
        """The reserved run a write consumes, as the payload's slot (freed again when the write is refused)."""
        run = self._take_reserved(reserved)
        if rec.key in self._slots:
            self.allocator.free(run)
            raise AssertionError("write of a key already in the tier; the store must dedupe first")
        slot = Slot(run, run.start * self.page_bytes, len(payload))
        if slot.length > run.pages * self.page_bytes:
            self.allocator.free(run)
            raise AssertionError(f"a {slot.length}-byte payload does not fit the {reserved} bytes reserved")
        return slot

    def place(self, key: bytes, reserved: int, length: int) -> Slot:
        """Take a reserved run for `key`, for a caller that fills it itself (a batched transfer). The tier
        holds the key from now on; the store publishes the copy only once the caller's copy completed. (A batched
        transfer places under a name of its own and `rename`s to the block's key as it lands: engram/transfer.py.)"""
        run = self._take_reserved(reserved)
        slot = Slot(run, run.start * self.page_bytes, length)
        self._slots[key] = slot
        self._stored += length
        return slot

    def rename(self, key: bytes, new_key: bytes) -> None:
        """The slot of `key` now holds `new_key` (a block written in place under a reservation's own name,
        published under its real one)."""
        if new_key in self._slots:
            raise AssertionError("rename onto a key already in the tier; the store must dedupe first")
        self._slots[new_key] = self._slots.pop(key)

    def cuda_ipc(self) -> tuple[object, ...]:
        """The CUDA IPC export of the pool's one allocation (torch's storage sharing: device, handle, sizes,
        ref counter, event), made once; a worker opens it with UntypedStorage._new_shared_cuda."""
        if self.device.type != "cuda":
            raise AssertionError("only a CUDA pool can be shared by CUDA IPC")
        if self._ipc is None:
            self._ipc = self.buffer.untyped_storage()._share_cuda_()
        return self._ipc

    def region(self, slot: Slot) -> torch.Tensor:
        return self.buffer[slot.offset : slot.offset + slot.length]

    def slot(self, key: bytes) -> Slot:
        try:
            return self._slots[key]
        except KeyError:
            raise NotFound(f"block {key.hex()} is not in the {self.name} tier") from None

    async def read(self, key: bytes) -> bytes:
        region = self.region(self.slot(key))
        if region.device.type != "cpu":
            region = region.cpu()
        return region.numpy().tobytes()

    def view(self, key: bytes) -> memoryview | None:
        """The block's bytes in place (a host pool only; None for one in HBM): valid while the block is held,
        for a sender that writes them to a socket without a copy."""
        region = self.region(self.slot(key))
        return memoryview(region.numpy()) if region.device.type == "cpu" else None  # type: ignore[arg-type]

    async def delete(self, key: bytes) -> int:
        return self.delete_now(key)

    def delete_now(self, key: bytes) -> int:
        slot = self._slots.pop(key, None)
        if slot is None:
            return 0
        self.allocator.free(slot.run)
        self._stored -= slot.length
        return slot.length

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self.capacity_bytes, self.used_bytes, len(self._slots))

    async def close(self) -> None:
        self._slots.clear()
        self._reserved.clear()
        self._stored = self._reserved_bytes = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._host is not None:
            self._host.release()
            self._host = None
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def shared_pool(tiers: Sequence[object]) -> PoolTier | None:
    """The tier whose bytes are a shared segment (the DRAM pool), if the store has one."""
    return next((t for t in tiers if isinstance(t, PoolTier) and t.segment is not None
                 and t.segment.layout.data_bytes), None)


def ipc_pool(tiers: Sequence[object]) -> PoolTier | None:
    """The CUDA pool whose generation table is shared (the HBM pool a worker reaches by CUDA IPC)."""
    return next((t for t in tiers if isinstance(t, PoolTier) and t.device.type == "cuda" and t.segment is not None
                 and not t.segment.layout.data_bytes), None)

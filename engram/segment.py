"""The shared-memory segment format, which the daemon writes (engram/tiers/shm.py) and a co-located worker
reads (`SegmentReader`, used by the client for zero-copy Gets). Kept apart from the tiers so the worker
library imports none of the daemon.

Layout (all offsets are multiples of 4 KiB, so the data area is page-aligned for pinning):

    [header: magic, version, segment id, page_bytes, pages, table offset, data offset, data bytes]
    [generation table: pages x uint64 little-endian]   (engram/tiers/slots.py stamps it)
    [data: pages x page_bytes]

A reader checks the generations of a block's pages before and after it copies them: any reuse of a page
changes its generation, so a late reader gets None, never another block's bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engram.errors import FailedPrecondition

MAGIC = b"ENGRAMSHM\x00"
VERSION = 1
# magic, version, id, page_bytes, pages, table offset, data offset, data bytes (0: a table-only segment,
# the generation table of a pool whose bytes live elsewhere, e.g. the HBM pool shared by CUDA IPC)
HEADER = struct.Struct("<10sH16sQQQQQ")
_ALIGN = 4096


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class SegmentLayout:
    segment_id: bytes  # 16 random bytes: a descriptor names the segment it points into
    page_bytes: int
    pages: int
    table_offset: int
    data_offset: int
    data_bytes: int

    @classmethod
    def for_capacity(cls, capacity: int, page_bytes: int, *, with_data: bool = True) -> SegmentLayout:
        pages = capacity // page_bytes
        table = _align(HEADER.size)
        return cls(uuid.uuid4().bytes, page_bytes, pages, table, table + _align(pages * 8),
                   pages * page_bytes if with_data else 0)

    @property
    def size(self) -> int:
        return self.data_offset + self.data_bytes

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.segment_id, self.page_bytes, self.pages, self.table_offset,
                            self.data_offset, self.data_bytes)

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> SegmentLayout:
        if len(raw) < HEADER.size:
            raise FailedPrecondition(f"{where} is too short to be an Engram segment")
        magic, version, sid, page, pages, table, data, data_bytes = HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise FailedPrecondition(f"{where} is not an Engram segment of version {VERSION}")
        return cls(sid, page, pages, table, data, data_bytes)



class SegmentReader:
    """The worker's side: maps a segment and copies blocks out, detecting stale descriptors. Read-only,
    unless `writable` (a worker that writes puts in place into slots the daemon reserved for it)."""

    def __init__(self, path: str | Path, segment_id: bytes, *, writable: bool = False) -> None:
        self.path = Path(path)
        self.writable = writable
        fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.layout = SegmentLayout.unpack(self._mm[: HEADER.size], str(self.path))
        if self.layout.segment_id != segment_id:
            raise FailedPrecondition(f"{self.path} is another segment than the descriptor names")
        lay = self.layout
        self._gens = np.ndarray((lay.pages,), dtype="<u8", buffer=self._mm, offset=lay.table_offset)

    def current(self, offset: int, length: int, generation: int) -> bool:
        page = self.layout.page_bytes
        first, last = offset // page, (offset + max(length, 1) - 1) // page + 1
        return bool(np.all(self._gens[first:last] == generation))

    def data(self) -> torch.Tensor:
        """The data area as a uint8 tensor over the mapping (no copy): the hit path copies block ranges out of
        it (after registering it with CUDA, at DMA speed). Writing to a read-only mapping faults."""
        lay = self.layout
        if not lay.data_bytes:  # a table-only segment (the HBM pool's generations): no data area
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # a read-only mapping: torch warns, and we only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._mm, dtype=torch.uint8, offset=lay.data_offset, count=lay.data_bytes)

    def header_bytes(self, offset: int, length: int) -> bytes:
        """A few bytes of the data area (a block's format header), copied."""
        start = self.layout.data_offset + offset
        return self._mm[start : start + length]

    def copy(self, offset: int, length: int, generation: int) -> torch.Tensor | None:
        """The bytes at data offset [offset, offset + length) as a new uint8 tensor, or None when the slot
        was reused (before or while copying): the generation is checked before and after the copy.

        One memcpy on the calling thread (a memoryview's), as the daemon's pool copies (engram/tiers/pool.py), not
        torch's copy_: that splits a large copy over torch's OpenMP team and returns when its slowest thread is
        done, which beside busy processes held the client's event loop for the scheduler (benchmarks/RESULTS.md
        put_get, sessions 49 and 50)."""
        if offset + length > self.layout.data_bytes:
            return None
        if not self.current(offset, length, generation):
            return None
        start = self.layout.data_offset + offset
        out = torch.empty(length, dtype=torch.uint8)
        with memoryview(self._mm) as mapped:  # released at once: close() unmaps only a mapping nothing views
            memoryview(out.numpy())[:] = mapped[start : start + length]  # type: ignore[arg-type]
        return out if self.current(offset, length, generation) else None

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._gens = None  # type: ignore[assignment]
            self._mm.close()

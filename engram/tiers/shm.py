"""The shared-memory segment behind the DRAM pool: one file in /dev/shm, mmapped, that a co-located
worker can map read-only to copy blocks without any bytes crossing the socket.

Layout (all offsets are multiples of 4 KiB, so the data area is page-aligned for pinning):

    [header: magic, version, segment id, page_bytes, pages, table offset, data offset]
    [generation table: pages x uint64 little-endian]   (engram/tiers/slots.py stamps it)
    [data: pages x page_bytes]

The daemon holds an exclusive flock on the file for as long as the segment lives; a file nobody holds a
lock on belongs to a daemon that died, and `clean_stale` removes it at start. The segment is unlinked on
close. When CUDA is present the data area is registered with the driver (cudaHostRegister), so host <->
device copies from it run at pinned speed; registering touches every page, which is why the budget is
checked against MemAvailable and the filesystem's free space first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engram.errors import ConfigError, FailedPrecondition

log = logging.getLogger("engram.tiers")

MAGIC = b"ENGRAMSHM\x00"
VERSION = 1
# magic, version, id, page_bytes, pages, table offset, data offset, data bytes (0: a table-only segment,
# the generation table of a pool whose bytes live elsewhere, e.g. the HBM pool shared by CUDA IPC)
_HEADER = struct.Struct("<10sH16sQQQQQ")
_ALIGN = 4096
PREFIX = "engram-seg-"
SUFFIX = ".shm"


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
        table = _align(_HEADER.size)
        return cls(uuid.uuid4().bytes, page_bytes, pages, table, table + _align(pages * 8),
                   pages * page_bytes if with_data else 0)

    @property
    def size(self) -> int:
        return self.data_offset + self.data_bytes

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.segment_id, self.page_bytes, self.pages, self.table_offset,
                            self.data_offset, self.data_bytes)

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> SegmentLayout:
        if len(raw) < _HEADER.size:
            raise FailedPrecondition(f"{where} is too short to be an Engram segment")
        magic, version, sid, page, pages, table, data, data_bytes = _HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise FailedPrecondition(f"{where} is not an Engram segment of version {VERSION}")
        return cls(sid, page, pages, table, data, data_bytes)


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (what the kernel can give without swapping)."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def check_budget(size: int, directory: Path, *, key: str = "tiers.dram.capacity") -> None:
    """Refuse, saying what to change, a segment that the host's memory or the directory cannot hold."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ConfigError(f"{key} needs {size} bytes in {directory}, which has {free} free; lower {key} or "
                          f"give {directory} more room (docker: --shm-size), or set tiers.dram.shm_dir")
    avail = mem_available()
    if size > avail:
        raise ConfigError(f"{key} needs {size} bytes of host memory, but MemAvailable is {avail}; lower {key}")


def clean_stale(directory: Path) -> list[Path]:
    """Remove segments whose daemon died (nobody holds their lock); returns what was removed."""
    removed = []
    for path in sorted(directory.glob(f"{PREFIX}*{SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live daemon's segment
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            log.warning("removed stale shared segment %s (its daemon is gone)", path)
    return removed


class SharedSegment:
    """The daemon's side: creates, locks, maps (and pins) the segment; `data` and `generations` view it."""

    def __init__(self, directory: str | Path, capacity: int, page_bytes: int, *, pin: bool = True,
                 with_data: bool = True) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise ConfigError(f"tiers.dram.shm_dir {directory} is not a directory")
        self.layout = SegmentLayout.for_capacity(capacity, page_bytes, with_data=with_data)
        if self.layout.pages < 1:
            raise ConfigError(f"tiers.dram.capacity ({capacity}) is below one page (tiers.dram.page_bytes = "
                              f"{page_bytes}); raise the capacity or lower page_bytes")
        clean_stale(directory)
        check_budget(self.layout.size, directory)
        self.path = directory / f"{PREFIX}{self.layout.segment_id.hex()}{SUFFIX}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.ftruncate(self._fd, self.layout.size)
        self._mm = mmap.mmap(self._fd, self.layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mm[: _HEADER.size] = self.layout.pack()
        lay = self.layout
        self.generations = np.ndarray((lay.pages,), dtype="<u8", buffer=self._mm, offset=lay.table_offset)
        self.data = (torch.frombuffer(self._mm, dtype=torch.uint8, offset=lay.data_offset, count=lay.data_bytes)
                     if lay.data_bytes else torch.empty(0, dtype=torch.uint8))
        self.pinned = False
        if pin and lay.data_bytes and torch.cuda.is_available():
            self._register()

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        if int(err) != 0:
            raise ConfigError(f"cudaHostRegister of {self.data.numel()} bytes failed ({err}): the pool's directory "
                              "must be a tmpfs (tiers.dram.shm_dir, e.g. /dev/shm), and the memlock limit "
                              "(ulimit -l) must allow it; or set tiers.dram.pin = false")
        self.pinned = True

    def close(self) -> None:
        """Unpin, unmap and unlink. A worker that still maps the file keeps its pages until it unmaps."""
        if self._fd < 0:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        del self.data, self.generations
        with contextlib.suppress(BufferError):  # a view someone still holds: the GC unmaps it later
            self._mm.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)  # drops the lock
        self._fd = -1


class SegmentReader:
    """The worker's side: maps a segment read-only and copies blocks out, detecting stale descriptors."""

    def __init__(self, path: str | Path, segment_id: bytes) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.layout = SegmentLayout.unpack(self._mm[: _HEADER.size], str(self.path))
        if self.layout.segment_id != segment_id:
            raise FailedPrecondition(f"{self.path} is another segment than the descriptor names")
        lay = self.layout
        self._gens = np.ndarray((lay.pages,), dtype="<u8", buffer=self._mm, offset=lay.table_offset)

    def current(self, offset: int, length: int, generation: int) -> bool:
        page = self.layout.page_bytes
        first, last = offset // page, (offset + max(length, 1) - 1) // page + 1
        return bool(np.all(self._gens[first:last] == generation))

    def copy(self, offset: int, length: int, generation: int) -> torch.Tensor | None:
        """The bytes at data offset [offset, offset + length) as a new uint8 tensor, or None when the slot
        was reused (before or while copying): the generation is checked before and after the copy."""
        if offset + length > self.layout.data_bytes:
            return None
        if not self.current(offset, length, generation):
            return None
        start = self.layout.data_offset + offset
        out = torch.empty(length, dtype=torch.uint8)
        with warnings.catch_warnings():  # a read-only mapping: torch warns, and we only read it
            warnings.simplefilter("ignore", UserWarning)
            out.copy_(torch.frombuffer(self._mm, dtype=torch.uint8, offset=start, count=length))
        return out if self.current(offset, length, generation) else None

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._gens = None  # type: ignore[assignment]
            self._mm.close()

"""Sealing blocks written in place: their checksums, computed by the daemon from the bytes in its shared pool.

xxhash holds the GIL, so hashing the gigabytes of a long put in threads gains nothing; the daemon hashes in a
few worker processes instead, each mapping the pool's segment once and taking whole blocks (a block's hash is
sequential; blocks are independent). This module is what those processes import: it loads neither torch nor
the daemon, so they start in well under a second.

For a v1 block (a quantizing codec) a worker also checks the header the client wrote against what was reserved,
then writes the body's checksum and the header's own (engram/codec/blockformat.py's layout) before it takes the
payload's. On a one-core host, or where processes cannot be started, the same function runs in a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import mmap
import multiprocessing
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

# blockformat's v1 header: fields (48 bytes), then the header's checksum (8); the body follows.
_FIELDS = struct.Struct("<4sBBBBBBH5IQQ")
HEADER_LEN = _FIELDS.size + 8


@dataclass(frozen=True)
class SealTask:
    offset: int  # of the block in the segment's data area
    length: int
    v1: tuple[int, ...] | None  # a v1 block: (magic..body_len) as reserved, without the checksums; None: raw


_maps: dict[str, tuple[mmap.mmap, int]] = {}  # in a worker process: segment path -> (mapping, data offset)


def _mapping(path: str, data_offset: int) -> memoryview:
    m = _maps.get(path)
    if m is None:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        m = _maps[path] = (mm, data_offset)
    return memoryview(m[0])[m[1] :]


def seal(path: str, data_offset: int, task: SealTask) -> int | str:
    """The payload's checksum, after sealing a v1 header; or a message saying what is wrong."""
    buf = _mapping(path, data_offset)[task.offset : task.offset + task.length]
    if task.v1 is not None:
        if len(buf) < HEADER_LEN:
            return "too short for a v1 block"
        fields = _FIELDS.unpack_from(buf)
        if tuple(fields[:-1]) != task.v1:
            return "the bytes written are not the block that was reserved (write v1 blocks with zero checksums)"
        struct.pack_into("<Q", buf, _FIELDS.size - 8, xxhash.xxh3_64_intdigest(buf[HEADER_LEN:]))
        struct.pack_into("<Q", buf, _FIELDS.size, xxhash.xxh3_64_intdigest(buf[: _FIELDS.size]))
    return xxhash.xxh3_64_intdigest(buf)


class Sealer:
    """A small pool of hashing processes (started on first use) over one shared segment."""

    def __init__(self, path: str, data_offset: int, workers: int | None = None) -> None:
        self.path = path
        self.data_offset = data_offset
        cores = os.cpu_count() or 1
        self.workers = workers if workers is not None else max(1, min(8, cores // 2))
        self._pool: concurrent.futures.Executor | None = None

    def _executor(self) -> concurrent.futures.Executor | None:
        if self.workers <= 1:
            return None
        if self._pool is None:
            try:
                ctx = multiprocessing.get_context("spawn")  # not fork: the daemon runs gRPC threads
                self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=ctx)
            except (OSError, ValueError):
                self.workers = 1
                return None
        return self._pool

    async def seal(self, tasks: Sequence[SealTask]) -> list[int | str]:
        loop = asyncio.get_running_loop()
        pool = self._executor()
        if pool is None or len(tasks) < 2:
            return await asyncio.to_thread(lambda: [seal(self.path, self.data_offset, t) for t in tasks])
        try:
            futures = [loop.run_in_executor(pool, seal, self.path, self.data_offset, t) for t in tasks]
            return list(await asyncio.gather(*futures))
        except concurrent.futures.process.BrokenProcessPool:
            self._pool = None  # a worker died: hash here this time, start afresh next time
            return await asyncio.to_thread(lambda: [seal(self.path, self.data_offset, t) for t in tasks])

    def close(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

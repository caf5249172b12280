"""The daemon's side of the shared-memory segment behind the DRAM pool: one file in /dev/shm, mmapped, that
a co-located worker can map read-only to copy blocks without any bytes crossing the socket. The format, and
the worker's reader, are engram/segment.py.

The daemon holds an exclusive flock on the file for as long as the segment lives; a file nobody holds a
lock on belongs to a daemon that died, and `clean_stale` removes it at start. The segment is unlinked on
close. When CUDA is present the data area is registered with the driver (cudaHostRegister), so host <->
device copies from it run at pinned speed; registering touches every page, which is why the budget is
checked against MemAvailable and the filesystem's free space first. Without CUDA the pages are populated by a
background thread instead (tiers.dram.prefault), so that puts do not pay for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import torch

from engram.errors import ConfigError, InsufficientResources
from engram.populate import Populator
from engram.private import share_with_group
from engram.segment import HEADER, SegmentLayout

log = logging.getLogger("engram.tiers")

PREFIX = "engram-seg-"
SUFFIX = ".shm"


def mem_available(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """What this process may still allocate, in bytes: the host's MemAvailable, or less where a cgroup (a
    container's --memory) limits it: its limit minus its usage, cgroup v2 (memory.max) or v1 (memory/). The
    usage counts reclaimable page cache, so this errs low."""
    avail = None
    with open(meminfo) as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        raise OSError(f"{meminfo} has no MemAvailable line")
    root = Path(cgroup)
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap, used = (root / limit).read_text().strip(), (root / usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit():  # "max" (v2) or a huge number (v1): no limit below the host's
            return max(0, min(avail, int(cap) - int(used)))
    return avail


def check_budget(size: int, directory: Path, *, key: str = "tiers.dram.capacity") -> None:
    """Refuse, saying what to change, a segment that the host's memory or the directory cannot hold."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise InsufficientResources(f"{key} needs {size} bytes in {directory}, which has {free} free; lower {key} or "
                          f"give {directory} more room (docker: --shm-size), or set tiers.dram.shm_dir")
    avail = mem_available()
    if size > avail:
        raise InsufficientResources(f"{key} needs {size} bytes of host memory, but MemAvailable (or the container's "
                                    f"memory limit) leaves {avail}; lower {key}")


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
                 with_data: bool = True, prefault: bool = False, group: str = "") -> None:
        """group: the workers' group (server.unix_socket_group, where the same-host paths are on) the file is
        opened to, read-write with a data area (the DRAM pool), read-only without (the HBM generation table);
        empty: 0600, the daemon's user only."""
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
        self._fd = self._create_locked()
        if group:
            share_with_group(self._fd, group, writes=with_data)
        os.ftruncate(self._fd, self.layout.size)
        self._mm = mmap.mmap(self._fd, self.layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mm[: HEADER.size] = self.layout.pack()
        lay = self.layout
        self.generations = np.ndarray((lay.pages,), dtype="<u8", buffer=self._mm, offset=lay.table_offset)
        self.data = (torch.frombuffer(self._mm, dtype=torch.uint8, offset=lay.data_offset, count=lay.data_bytes)
                     if lay.data_bytes else torch.empty(0, dtype=torch.uint8))
        self.pinned = False
        if pin and lay.data_bytes and torch.cuda.is_available():
            self._register()  # pinning populates every page: no prefault needed
        self._populator: Populator | None = None
        if prefault and lay.data_bytes and not self.pinned:
            # A fresh tmpfs page is allocated and zeroed at its first write: done here in the background instead
            # of in the puts (engram/populate.py).
            self._populator = Populator(self._mm, write=True, what="the DRAM pool")

    def _create_locked(self) -> int:
        """Create the file and lock it. Between the two, another daemon starting on the same directory may take
        it for a dead daemon's (nobody holds its lock) and unlink it: workers could then never map this pool.
        So once locked, the path must still name this file; if not, it is created again."""
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
            log.warning("shared segment %s was removed as stale while it was created; creating it again", self.path)
        raise InsufficientResources(f"could not create the shared segment {self.path}: another process kept "
                                    "removing it (two daemons cleaning the same tiers.dram.shm_dir?)")

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        if int(err) != 0:
            raise ConfigError(f"cudaHostRegister of {self.data.numel()} bytes failed ({err}): the pool's directory "
                              "must be a tmpfs (tiers.dram.shm_dir, e.g. /dev/shm), and the memlock limit "
                              "(ulimit -l) must allow it; or set tiers.dram.pin = false")
        self.pinned = True

    @property
    def prefaulted(self) -> threading.Event | None:
        """Set once the pool's pages are all allocated (None: no prefault runs)."""
        return self._populator.done if self._populator is not None else None

    def close(self) -> None:
        """Unpin, unmap and unlink. A worker that still maps the file keeps its pages until it unmaps."""
        if self._fd < 0:
            return
        if self._populator is not None:
            self._populator.stop()
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

"""Sealing blocks written in place: their checksums, computed by the daemon from the bytes in its shared pool.

xxhash holds the GIL, so hashing the gigabytes of a long put in threads gains nothing; the daemon hashes in a
few helper processes instead (`python -m engram.sealing PATH DATA_OFFSET`), each mapping the pool's segment
once (prefaulted) and taking whole blocks (a block's hash is sequential; blocks are independent). They are
plain subprocesses speaking one JSON line per task on stdin/stdout, not multiprocessing workers: those would
re-import the daemon's main module (torch, the CLI) in every helper. This module imports neither.

For a v1 block (a quantizing codec) a helper also checks the header the client wrote against what was
reserved, then writes the body's checksum and the header's own (engram/codec/blockformat.py's layout) before it
takes the payload's; likewise for a v2 block (a stream layout's, engram/codec/streamformat.py), whose reserved
header (stream records included) it compares byte for byte. On a small host, or where helpers cannot start, the same function runs in a thread.

A helper that does not answer within ANSWER_S is killed, and one killed or dead is started again by a later commit:
at most RESTARTS times in a row, the row ended only by helpers that answered and are replaced RESTORE_S or more after
the last start (so at most RESTARTS restarts in any RESTORE_S, and none after RESTARTS where no helper ever answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from engram.borrowed import in_thread, to_its_end
from engram.errors import Unavailable

log = logging.getLogger("engram.sealing")

# How long a helper may take to answer one task (a block's hash: milliseconds, a 1 GiB block well under a second)
# before it is taken for hung (stopped, stuck in the kernel): killed, and its block sealed in a thread. Unbounded, a
# hung helper held its commit forever (a cancelled one waits for its exchange to end), and every later commit whose
# tasks it drew, its lock being held.
ANSWER_S = 30.0
# Helpers started again in a row before the daemon gives up on them and seals in threads: a helper killed for hanging,
# or dead, is replaced on the next commit (sealing every later commit in a thread, which holds the GIL, was the cost
# of one hang), but one that cannot work here is not started over and over.
RESTARTS = 3
# The row ends (the count is restored) only when a helper that answered a task is replaced RESTORE_S or more after the
# last start: helpers that worked a while (or were not needed for that long). Helpers that never answer are given up
# for good after RESTARTS; ones that answer and then hang (or die) soon after each start are started again at most
# RESTARTS times in any RESTORE_S, each hang costing a commit ANSWER_S. (One answer restored the count: helpers that
# answered once and then hung were started again every third commit, without end.)
RESTORE_S = 3600.0

# blockformat's v1 header: fields (48 bytes), then the header's checksum (8); the body follows.
_FIELDS = struct.Struct("<4sBBBBBBH5IQQ")
HEADER_LEN = _FIELDS.size + 8
# streamformat's v2 header: 32 fixed bytes (the body checksum at 24), 32 per stream (their count at byte 5), the
# header's checksum (8), zero padding to the body.
_V2_BODY_CHECKSUM_AT = 24


@dataclass(frozen=True)
class SealTask:
    offset: int  # of the block in the segment's data area
    length: int
    v1: tuple[int, ...] | None  # a v1 block: its header fields as reserved, magic as int, checksums left out
    v2: str | None = None  # a v2 block: its header as reserved (hex), both checksums zero, padded to the body


def _map_pool(path: str, data_offset: int) -> memoryview:
    """A helper process's own mapping of the pool's data area (it lives as long as the process)."""
    fd = os.open(path, os.O_RDWR)
    try:
        # MAP_POPULATE: fault the pool in once, here, rather than a page at a time under every put (a fresh
        # 4 GiB put would otherwise cost a million page faults in the hashing processes).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, 0, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return memoryview(mm)[data_offset:]


def seal(data: memoryview, task: SealTask) -> int | str:
    """The payload's checksum, after sealing a v1 header; or a message saying what is wrong. data: the
    pool's data area (a helper's own mapping, or the daemon's)."""
    buf = data[task.offset : task.offset + task.length]
    if task.v2 is not None:
        want = bytes.fromhex(task.v2)
        head_ck_at = 32 + 32 * want[5]
        got = bytearray(buf[: len(want)])
        got[_V2_BODY_CHECKSUM_AT : _V2_BODY_CHECKSUM_AT + 8] = bytes(8)  # whatever checksums the worker wrote
        got[head_ck_at : head_ck_at + 8] = bytes(8)
        if len(buf) < len(want) or bytes(got) != want:
            return "the bytes written are not the block that was reserved (its v2 header differs)"
        struct.pack_into("<Q", buf, _V2_BODY_CHECKSUM_AT, xxhash.xxh3_64_intdigest(buf[len(want):]))
        struct.pack_into("<Q", buf, head_ck_at, xxhash.xxh3_64_intdigest(buf[:head_ck_at]))
    elif task.v1 is not None:
        if len(buf) < HEADER_LEN:
            return "too short for a v1 block"
        fields = _FIELDS.unpack_from(buf)
        if (int.from_bytes(fields[0], "little"), *fields[1:-1]) != tuple(task.v1):
            return "the bytes written are not the block that was reserved (write v1 blocks with zero checksums)"
        struct.pack_into("<Q", buf, _FIELDS.size - 8, xxhash.xxh3_64_intdigest(buf[HEADER_LEN:]))
        struct.pack_into("<Q", buf, _FIELDS.size, xxhash.xxh3_64_intdigest(buf[: _FIELDS.size]))
    return xxhash.xxh3_64_intdigest(buf)


def _serve(path: str, data_offset: int) -> None:
    """A helper's loop: one task a line in ([offset, length, v1 or null, v2 or null]), one result a line out."""
    data = _map_pool(path, data_offset)
    print("ready", flush=True)
    for line in sys.stdin:
        offset, length, v1, v2 = json.loads(line)
        print(json.dumps(seal(data, SealTask(offset, length, v1, v2))), flush=True)


def _seal_all(data: memoryview, tasks: Sequence[SealTask]) -> list[int | str]:
    return [seal(data, t) for t in tasks]


class _Helper:
    def __init__(self, proc: asyncio.subprocess.Process, answer_s: float = ANSWER_S) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()
        self.answer_s = answer_s
        self.answered = False  # it answered a task: it worked here, whatever ends it later

    async def run(self, task: SealTask) -> int | str:
        """The helper's answer to one task. A cancelled caller still waits for it (borrowed.to_its_end): the
        helper writes into the block's slot until it answers, and an answer left unread in its pipe was read
        as the next task's (another block's checksum)."""
        return await to_its_end(asyncio.ensure_future(self._exchange(task)))

    async def _exchange(self, task: SealTask) -> int | str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self.lock:
            if self.proc.returncode is not None:
                raise OSError("a sealing helper died")
            try:
                async with asyncio.timeout(self.answer_s):
                    self.proc.stdin.write((json.dumps([task.offset, task.length, task.v1, task.v2]) + "\n").encode())
                    await self.proc.stdin.drain()
                    line = await self.proc.stdout.readline()
            except TimeoutError:
                # Dead before this returns: a helper's write into the slot after its commit gave up (and freed it,
                # or sealed it again) would land in another block's bytes.
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
                log.warning("a sealing helper (pid %d) did not answer within %g s: killed; its block is sealed in the "
                            "daemon, in a thread", self.proc.pid, self.answer_s)
                raise OSError(f"a sealing helper did not answer within {self.answer_s:g} s: killed") from None
        if not line:
            raise OSError("a sealing helper died")
        result: int | str = json.loads(line)
        self.answered = True
        return result


class Sealer:
    """Helper processes (started by `start`, or on first use) hashing blocks of one shared segment; `data`,
    the daemon's own view of the segment's data area, is what a thread hashes when there are no helpers."""

    def __init__(self, path: str, data_offset: int, data: memoryview, workers: int | None = None) -> None:
        self.path = path
        self.data_offset = data_offset
        self.data = data
        cores = os.cpu_count() or 1
        # Most of the host's cores for the moments a commit hashes; none on a small host (hash in a thread).
        self.workers = workers if workers is not None else (min(16, cores - 2) if cores >= 4 else 1)
        self._helpers: list[_Helper] = []
        self._starting: asyncio.Task[None] | None = None
        self._procs: list[asyncio.subprocess.Process] = []  # every helper started, ready or not
        self._start_by = 0.0  # (loop time) when commits stop waiting for helpers still starting
        self.answer_s = ANSWER_S  # a helper's bound for one answer, and a commit's for the helpers' start
        self._restarts_left = RESTARTS  # (restored when one that answered is replaced RESTORE_S after the last start)
        self._started_at = 0.0  # (loop time) of the last start of helpers, first or again
        self._closed = False

    def start(self) -> None:
        """Start the helpers in the background (each maps and prefaults the pool), ahead of the first put."""
        if self.workers > 1 and self._starting is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._started_at = loop.time()
            self._start_by = self._started_at + self.answer_s
            self._starting = loop.create_task(self._start(self.workers))

    def _replace_dead(self) -> None:
        """Start again, in the background, the helpers that died or were killed (hung), or never said ready, once the
        last start is over: the commit that finds them gone seals without them, the next ones with them. At most
        RESTARTS times in a row (a helper that cannot work here is not started over and over); a helper that
        answered, replaced RESTORE_S or more after the last start, restores the count (one that answered and then
        hung soon after restored it too, and was started again without end)."""
        if self._closed or self._starting is None or not self._starting.done():
            return
        dead = [h for h in self._helpers if h.proc.returncode is not None]
        missing = self.workers - (len(self._helpers) - len(dead))
        if missing <= 0:
            return
        loop = asyncio.get_running_loop()
        if any(h.answered for h in dead) and loop.time() - self._started_at >= RESTORE_S:
            self._restarts_left = RESTARTS
        if self._restarts_left <= 0:
            return
        self._restarts_left -= 1
        self._started_at = loop.time()
        self._helpers = [h for h in self._helpers if h.proc.returncode is None]
        self._procs = [p for p in self._procs if p.returncode is None]
        log.info("starting %d sealing helper(s) again (%d more restarts unless helpers work %g s first)", missing,
                 self._restarts_left, RESTORE_S)
        self._starting = loop.create_task(self._start(missing))

    async def _start(self, n: int) -> None:
        async def one() -> None:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engram.sealing", self.path, str(self.data_offset),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            self._procs.append(proc)  # killed by close(), ready or not
            assert proc.stdout is not None
            if await proc.stdout.readline() == b"ready\n":
                self._helpers.append(_Helper(proc, self.answer_s))  # each takes tasks as soon as it is ready
            else:
                proc.kill()

        # Every start ended before this does (the first failure raised at once while the others went on starting,
        # and a restart counted those as missing)
        for failed in await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True):
            if isinstance(failed, BaseException):
                raise failed

    async def seal(self, tasks: Sequence[SealTask]) -> list[int | str]:
        """Each task's checksum, or what is wrong with its block. Unavailable once `close` began (the daemon is
        stopping: its commit fails and frees its slots): the pool's view is gone, and no helper is started."""
        self._refuse_if_closed()
        if self.workers > 1:
            self.start()
            assert self._starting is not None
            # Each helper maps and prefaults the pool first (seconds for a large one): commits wait for that up to
            # answer_s from the start, then go on with those ready (or a thread); a helper hung before it said
            # ready held every commit forever.
            if not self._starting.done():
                left = self._start_by - asyncio.get_running_loop().time()
                await asyncio.wait((self._starting,), timeout=max(0.0, left))
            if self._starting.done() and not self._starting.cancelled():
                self._starting.exception()  # (an OSError starting them: the thread hashes)
            self._replace_dead()
        self._refuse_if_closed()  # (closed while it waited for the helpers' start)
        helpers = [h for h in self._helpers if h.proc.returncode is None]
        if len(helpers) < 2 or len(tasks) < 2:
            # in a thread that even a cancelled commit waits for: it writes headers into the slots, which the
            # commit's failure frees (engram/borrowed.py)
            return await in_thread(_seal_all, self.data, tasks)
        queue = list(enumerate(tasks))
        out: list[int | str | None] = [None] * len(tasks)

        async def drain(helper: _Helper) -> None:
            while queue:
                i, task = queue.pop()
                out[i] = await helper.run(task)

        # Every helper's exchange ends before this does, cancelled or not (a gather without return_exceptions ended
        # at its first cancelled or failed child, while another helper still sealed a slot)
        for failed in await asyncio.gather(*(drain(h) for h in helpers), return_exceptions=True):
            if isinstance(failed, BaseException) and not isinstance(failed, OSError):
                raise failed
        if any(o is None for o in out):  # a helper died: hash the rest here
            for i, t in enumerate(tasks):
                if out[i] is None:
                    # (killed by close, or closed while the last one was hashed: the pool's view went with it)
                    self._refuse_if_closed()
                    out[i] = await in_thread(seal, self.data, t)
        return out  # type: ignore[return-value]

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise Unavailable("the in-place put's sealer is closed: the daemon is stopping, and seals no block now")

    async def close(self) -> None:
        self._closed = True  # no helper is started again after this, nor a block sealed
        if self._starting is not None:
            self._starting.cancel()  # (a helper that never said ready)
            await asyncio.wait((self._starting,))
            if not self._starting.cancelled():
                self._starting.exception()  # (an OSError starting them: nothing to stop)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await proc.wait()
        self._helpers.clear()
        self._procs.clear()
        self.data = memoryview(b"")  # the pool's view goes with the pool


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))

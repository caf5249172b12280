"""Batched transfers between pooled tiers and paged layouts: many blocks per submission, on a dedicated
CUDA stream, completion signalled by an event, so copies overlap the caller's compute.

- `TransferEngine.copy(src, dst, moves)`: byte ranges between two flat uint8 buffers. Adjacent ranges are
  coalesced; when every range is whole pages of one size and both buffers are on one device, the batch is
  one gather and one scatter over page rows (index_select / index_copy_: two kernel launches for any number
  of blocks); otherwise one cudaMemcpyAsync per coalesced range (host <-> device: PCIe-bound, from pinned
  memory). Without CUDA the same moves run synchronously on the CPU: the semantics CI tests.
- `gather(pool, pairs, pages)`: blocks of a pool into the pages a worker names, a list of (key,
  destination page); `scatter(pages, pairs, pool)` the reverse, into slots reserved for new blocks.
- `promote(store, metas, engine)` (and `copy_blocks`, either direction): DRAM pool -> HBM pool for many blocks, keeping the store's two-phase
  move protocol (begin_copy: moving + room; the copy; end_copy: the HBM copy counts only once the event
  completed), so a block is never served from a copy still in flight. Each copy counts only if it verifies
  against the block's checksum, as every copy the store makes does: a damaged source copy is dropped as a read
  drops it, never made into a copy (in HBM, one a CUDA IPC hit copies device to device without a checksum).

This module does not decide *what* to move (the store's policy does), and does not share memory across
processes (engram/tiers/shm.py and CUDA IPC do).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engram.block import checksum, checksums
from engram.borrowed import to_its_end
from engram.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from engram.index import BlockMeta
from engram.store import BlockStore
from engram.tiers.pool import PoolTier


@dataclass(frozen=True)
class Move:
    """Copy bytes [src, src + length) of the source buffer to [dst, dst + length) of the destination."""

    src: int
    dst: int
    length: int


def coalesce(moves: Sequence[Move]) -> list[Move]:
    """Merge moves that continue each other in both buffers (in the order given)."""
    out: list[Move] = []
    for m in moves:
        if out and out[-1].src + out[-1].length == m.src and out[-1].dst + out[-1].length == m.dst:
            out[-1] = Move(out[-1].src, out[-1].dst, out[-1].length + m.length)
        else:
            out.append(m)
    return out


class Done:
    """Completion of a submitted batch: an event on the transfer stream, or nothing on the CPU."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    async def wait(self) -> None:
        """Wait without blocking the event loop (the daemon's other RPCs go on)."""
        if not self.ready():
            await asyncio.to_thread(self.synchronize)


class TransferEngine:
    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else None
        self.stream = torch.cuda.Stream(dev) if dev is not None and dev.type == "cuda" else None

    def copy(self, src: torch.Tensor, dst: torch.Tensor, moves: Sequence[Move], *, page_bytes: int = 0) -> Done:
        for t in (src, dst):
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise InvalidArgument("transfer buffers are flat uint8 tensors")
        for m in moves:
            if m.length < 0 or m.src < 0 or m.dst < 0 or m.src + m.length > src.numel() or \
                    m.dst + m.length > dst.numel():
                raise InvalidArgument(f"move {m} is outside its buffers ({src.numel()} -> {dst.numel()} bytes)")
        cuda = src.is_cuda or dst.is_cuda
        if not cuda or self.stream is None:
            if cuda:
                raise InvalidArgument("a CUDA transfer needs an engine built for a CUDA device")
            self._run(src, dst, moves, page_bytes)
            return Done(None)
        # The stream waits for work already queued on the current stream (e.g. what wrote src).
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._run(src, dst, moves, page_bytes)
            event = torch.cuda.Event()
            event.record(self.stream)
        for t in (src, dst):
            if t.is_cuda:
                t.record_stream(self.stream)  # the caching allocator must not reuse them before the copy ends
        return Done(event)

    @staticmethod
    def _run(src: torch.Tensor, dst: torch.Tensor, moves: Sequence[Move], page_bytes: int) -> None:
        paged = page_bytes > 0 and src.device == dst.device and len(moves) > 1 and all(
            m.src % page_bytes == 0 and m.dst % page_bytes == 0 and m.length % page_bytes == 0 for m in moves)
        if paged:
            rows_src: list[int] = []
            rows_dst: list[int] = []
            for m in moves:
                n = m.length // page_bytes
                rows_src += range(m.src // page_bytes, m.src // page_bytes + n)
                rows_dst += range(m.dst // page_bytes, m.dst // page_bytes + n)
            idx_src = torch.tensor(rows_src, dtype=torch.int64).to(src.device, non_blocking=True)
            idx_dst = torch.tensor(rows_dst, dtype=torch.int64).to(dst.device, non_blocking=True)
            s = src[: src.numel() // page_bytes * page_bytes].view(-1, page_bytes)
            d = dst[: dst.numel() // page_bytes * page_bytes].view(-1, page_bytes)
            d.index_copy_(0, idx_dst, s.index_select(0, idx_src))
            return
        for m in coalesce(moves):
            dst[m.dst : m.dst + m.length].copy_(src[m.src : m.src + m.length], non_blocking=True)


def _check_pages(pairs: Sequence[tuple[bytes, int]], pages: torch.Tensor) -> None:
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise InvalidArgument(f"pages must be a (n_pages, page_bytes) uint8 tensor, got {tuple(pages.shape)} "
                              f"{pages.dtype}")
    seen: set[int] = set()
    for i, (_, page) in enumerate(pairs):
        if not 0 <= page < pages.shape[0]:
            raise InvalidArgument(f"pair {i}: page {page} is outside the layout's {pages.shape[0]} pages")
        if page in seen:
            raise InvalidArgument(f"pair {i}: page {page} is named twice; each block needs its own page")
        seen.add(page)


def gather(engine: TransferEngine, pool: PoolTier, pairs: Sequence[tuple[bytes, int]], pages: torch.Tensor) -> Done:
    """Copy the blocks named by key into the destination pages; each page starts with its block's bytes
    (what follows them in the page is unspecified). On one device, with pages a multiple of the pool's
    page size, whole pool pages are copied, so the batch is one gather over page rows."""
    _check_pages(pairs, pages)
    page_bytes = pages.shape[1]
    rows = pool.page_bytes if pool.device == pages.device and page_bytes % pool.page_bytes == 0 else 0
    moves = []
    for i, (key, page) in enumerate(pairs):
        slot = pool.slot(key)
        if slot.length > page_bytes:
            raise InvalidArgument(f"pair {i}: a {slot.length}-byte block does not fit a {page_bytes}-byte page")
        length = min(slot.run.pages * pool.page_bytes, page_bytes) if rows else slot.length
        moves.append(Move(slot.offset, page * page_bytes, length))
    return engine.copy(pool.buffer, pages.view(-1), moves, page_bytes=rows)


def scatter(engine: TransferEngine, pages: torch.Tensor, pairs: Sequence[tuple[bytes, int, int]],
            pool: PoolTier, reserved: Sequence[int]) -> Done:
    """Copy (key, source page, length) triples out of the pages into slots reserved in the pool (one
    reservation per triple, as the store's begin_copy made them)."""
    _check_pages([(k, p) for k, p, _ in pairs], pages)
    page_bytes = pages.shape[1]
    moves = []
    for i, ((key, page, length), need) in enumerate(zip(pairs, reserved, strict=True)):
        if length > page_bytes:
            raise InvalidArgument(f"pair {i}: length {length} exceeds the {page_bytes}-byte page")
        moves.append(Move(page * page_bytes, pool.place(key, need, length).offset, length))
    return engine.copy(pages.view(-1), pool.buffer, moves)


SUBMIT_EVERY = 16  # blocks booked and submitted at a time in copy_blocks: the DMA of one runs while the next is booked


async def promote(store: BlockStore, metas: Sequence[BlockMeta], engine: TransferEngine) -> int:
    """DRAM -> HBM for many blocks in one batch: `copy_blocks` from the dram pool to the hbm pool."""
    return await copy_blocks(store, metas, engine, src="dram", dst="hbm")


async def copy_blocks(store: BlockStore, metas: Sequence[BlockMeta], engine: TransferEngine, *, src: str,
                      dst: str) -> int:
    """Copy blocks from one pool tier to another in one batch; returns how many landed. Blocks already
    there, moving, or for which no room can be made without waiting are skipped (served from where they are).
    A copy lands only if it verifies (`_verify`); one whose source copy fails its checksum is not made, and that
    copy is dropped as damaged.

    Booked SUBMIT_EVERY blocks at a time, each group in one store call (`begin_copies_now`: one reservation
    for the group where the pool has room) and submitted before the next is booked; the copies that landed end
    in one `end_copies`. Per-block booking in Python held promotion to 26-40% of a pinned copy_ on an H100."""
    tiers = {t.name: t for t in store.tiers}
    lower, upper = tiers[src], tiers[dst]
    if not isinstance(lower, PoolTier) or not isinstance(upper, PoolTier):
        raise InvalidArgument(f"promote moves between pool tiers; {src} or {dst} is not one")
    started: list[tuple[BlockMeta, Move, bytes]] = []  # each copy: its block, its move, its slot's in-flight name
    done: Done | None = None
    try:
        for at in range(0, len(metas), SUBMIT_EVERY):
            # Each block once, by id (a BlockMeta compares by value, slowly), with no await before it is booked.
            group = list({id(m): m for m in metas[at : at + SUBMIT_EVERY]
                          if not (m.moving or src not in m.locations or dst in m.locations)}.values())
            moves = _book(store, lower, upper, dst, group, store.begin_copies_now(group, dst), started)
            for meta in group:
                if meta.moving or src not in meta.locations or dst in meta.locations:
                    continue  # booked above (or moved or gone meanwhile)
                try:
                    need = await store.begin_copy(meta, dst)  # room made first (no waiting for it)
                except ResourceExhausted:
                    continue  # no room up there right now: served from where it is
                moves += _book(store, lower, upper, dst, [meta], [need], started)
            if moves:
                done = engine.copy(lower.buffer, upper.buffer, moves, page_bytes=0)
        sound = await _verify(lower, upper, started, done)
    except BaseException:
        if done is not None:
            # Cancelled or failed with copies submitted: they must land before their slots are freed (a put
            # reusing a slot would get this copy's bytes over its own) and their sources may go. A few ms at most.
            done.synchronize()
        for _, _, name in started:
            upper.delete_now(name)
        store.end_copies([meta for meta, _, _ in started], dst, [False] * len(started))
        raise
    damaged = [meta for (meta, _, _), ok in zip(started, sound, strict=True) if not ok]
    landed = _publish(store, upper, started, sound)
    store.end_copies([meta for meta, _, _ in started], dst, landed)
    for meta in damaged:  # its source copy read again (a rare path): dropped as damaged if it fails, as a read
        # drops it (a copy that failed from a sound source was damaged on the way: it is only not made)
        if store.block(meta.key) is meta and src in meta.locations and not meta.moving:
            try:  # (no await before the pool's lookup: the block lists its copy there as read)
                problem = (None if checksum(await lower.read(meta.key)) == meta.checksum
                           else DataLoss(f"block {meta.key.hex()} failed its checksum in tier {src}"))
            except NotFound as exc:  # the index lists a copy the pool lacks: lost, as a read finds it
                problem = DataLoss(f"{exc}, though the index listed a copy there")
            if problem is not None:
                await store.damaged_in_a_move(meta, src, problem, f"a batched copy to {dst}")
    return sum(landed)


def _publish(store: BlockStore, upper: PoolTier, started: Sequence[tuple[BlockMeta, Move, bytes]],
             sound: Sequence[bool]) -> list[bool]:
    """Each copy that verified takes its block's key in the upper pool, if the index still holds that block (no
    await from here to end_copies); every other copy's slot is deleted by its in-flight name. Per copy, whether it
    landed."""
    landed = []
    for (meta, _, name), ok in zip(started, sound, strict=True):
        ok = ok and store.block(meta.key) is meta and meta.key not in upper
        if ok:
            upper.rename(name, meta.key)
        else:
            upper.delete_now(name)
        landed.append(ok)
    return landed


def _in_flight(key: bytes) -> bytes:
    """The name a copy's slot holds until it lands: the block's key and a number of this process's (never a key,
    16 bytes, nor an in-place reservation's slot, 24)."""
    return key + b"\xff" + next(_flights).to_bytes(8, "little")


_flights = itertools.count()


def _book(store: BlockStore, lower: PoolTier, upper: PoolTier, dst: str, metas: Sequence[BlockMeta],
          needs: Sequence[int | None], started: list[tuple[BlockMeta, Move, bytes]]) -> list[Move]:
    """Place each block whose room was reserved (a need; None: not booked, left alone) in the upper pool and
    add it to `started`; the moves to submit. A block whose source copy went (while room was made for it), or that
    left the index, gets its room back and ends its move, as does every booked block not placed yet when this
    raises.

    The copy's slot is placed under an in-flight name (`_in_flight`), not the block's key, and takes the key only
    once it lands (`_publish`). A tier keeps one slot a key: the slot of a copy whose block was dropped meanwhile
    (a read found its last copy damaged) held the key, so a put of the block again failed INTERNAL (the pool's
    'write of a key already in the tier'); and the copy's end deleted by key whatever held it."""
    moves: list[Move] = []
    k = 0
    try:
        for k, (meta, need) in enumerate(zip(metas, needs, strict=True)):  # noqa: B007 (k: for the cleanup)
            if need is None:
                continue
            try:
                if store.block(meta.key) is not meta:  # dropped while room was made for it
                    raise NotFound(f"block {meta.key.hex()} left the store")
                slot = lower.slot(meta.key)
                name = _in_flight(meta.key)
                placed = upper.place(name, need, slot.length)
            except BaseException as exc:  # nothing was placed up there
                upper.unreserve(need)
                store.end_copy(meta, dst, ok=False)
                if isinstance(exc, NotFound):
                    continue  # served from where it is now
                raise
            move = Move(slot.offset, placed.offset, slot.length)
            started.append((meta, move, name))
            moves.append(move)
    except BaseException:
        rest = [(m, n) for m, n in zip(metas[k + 1 :], needs[k + 1 :], strict=True) if n is not None]
        for _, need in rest:
            upper.unreserve(need)
        store.end_copies([m for m, _ in rest], dst, [False] * len(rest))
        raise
    return moves


async def _verify(lower: PoolTier, upper: PoolTier, copies: Sequence[tuple[BlockMeta, Move, bytes]],
                  done: Done | None) -> list[bool]:
    """Waits for the copies; then whether each copy's bytes verify against its block's checksum, checked on
    the host side, where a CPU reads them: a source in host memory (a promotion from the DRAM pool) is hashed
    while the copies run (the DMA reads the same bytes: what it finds damaged is damage already there), else
    the copies landed in host memory (HBM -> DRAM) once they have. One job per core, each hashing its share of
    the blocks in one call (`checksums`: xxh3 lets go of the GIL, and no Python runs between two blocks), so the
    event loop goes on and the threads hand the GIL over once per block at most."""
    source_on_host = lower.host is not None
    if done is not None and not source_on_host:
        await done.wait()
    pool = lower if source_on_host else upper
    starts = [m.src if source_on_host else m.dst for _, m, _ in copies]
    host = pool.host
    if host is not None:
        views = [host[start : start + m.length] for start, (_, m, _) in zip(starts, copies, strict=True)]
    else:  # (no pool pair lacks a host pool: two device pools' copies are brought over)
        views = [memoryview(pool.buffer[start : start + m.length].cpu().numpy())  # type: ignore[arg-type]
                 for start, (_, m, _) in zip(starts, copies, strict=True)]
    n = min(len(copies), os.cpu_count() or 1)
    got = [0] * len(copies)
    # The jobs read pool slots that a cancelled copy frees (its bookings up there) or lets go of (its sources, no
    # longer moving): each is waited for to its end, even by a cancelled caller (engram/borrowed.py). to_thread's
    # threads ran on after a cancel, hashing slots another block could take meanwhile.
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(None, checksums, views[j::n]) for j in range(n)]
    parts = await to_its_end(asyncio.gather(*jobs, return_exceptions=True))  # every job ended, not the first
    for j, part in enumerate(parts):
        if isinstance(part, BaseException):
            raise part
        got[j::n] = part
    if done is not None:
        await done.wait()  # one stream: the last submission's event covers every earlier one
    return [g == meta.checksum for g, (meta, _, _) in zip(got, copies, strict=True)]

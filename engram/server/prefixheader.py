"""GetPrefix's answer header, built a slice of blocks at a time in the caller's tenant's turn.

A zero-copy answer names each block's pool slot under one lease. At 65,536 blocks (a million tokens of 16-token
blocks) its refs, descriptors and lease were half a second of Python in one go on the event loop, and another
tenant's 64-token Lookup waited up to 0.9 s beside two such calls (benchmarks/RESULTS.md, index_fanout, session
49). Built `SLICE_BLOCKS` blocks at a time with a turn of the loop between slices (engram/loopturns.py), it says
what one go would have said at its last slice:

- each slice's blocks are leased in the step that describes them (one lease, grown: `LeaseTable.grow`), so no
  block described is evicted or demoted before the caller copies it;
- a block removed between slices (`PrefixWalk.cut`: evicted, if not leased; lost, its last copy found damaged,
  even leased) ends the answer before it: its refs, descriptors and lease are cut there, so the lease holds
  exactly the blocks the answer describes (or, with hold_for_get, names);
- the lease's term restarts once the answer stands: no descriptor's lease_expires_in_s, written earlier,
  overstates it;
- the blocks described are counted as served (hits, bytes served) once the answer stands, those it keeps alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from engram.index import BlockMeta, PrefixWalk
from engram.leases import Lease, LeaseTable
from engram.loopturns import SLICE_BLOCKS, pause
from engram.store import BlockStore
from engram.tiers.pool import PoolTier
from engram.v1 import engram_pb2 as pb


def pool_of(meta: BlockMeta, pools: Sequence[PoolTier]) -> PoolTier | None:
    """The first of `pools` (in order of preference) holding the block."""
    for pool in pools:
        if pool.name in meta.locations:
            return pool
    return None


def cuda_handle(pool: PoolTier) -> pb.CudaIpcHandle:
    """The CUDA IPC export of an HBM pool, as a descriptor carries it (the same for every block of the pool)."""
    dev, handle, size, offset, ref, ref_off, event, sync = pool.cuda_ipc()
    return pb.CudaIpcHandle(device=dev, handle=handle, storage_bytes=size, storage_offset=offset,  # type: ignore[arg-type]
                            ref_counter_handle=ref, ref_counter_offset=ref_off,  # type: ignore[arg-type]
                            event_handle=event or b"", event_sync_required=sync)  # type: ignore[arg-type]


async def not_in_pools(walk: PrefixWalk, pools: Sequence[PoolTier]) -> list[BlockMeta]:
    """The walk's kept blocks that none of `pools` holds (those a shared pool copies up before they are described),
    found a slice at a time."""
    missing: list[BlockMeta] = []
    done = 0
    while done < walk.kept():
        if done:
            await pause()
        end = min(walk.kept(), done + SLICE_BLOCKS)
        missing += [m for m in walk.blocks[done:end] if pool_of(m, pools) is None]
        done = end
    return missing


async def prefix_header(store: BlockStore, leases: LeaseTable, namespace: str, walk: PrefixWalk,
                        refs: list[pb.BlockRef], pools: Sequence[PoolTier], codec: str, *, hold_for_get: bool,
                        promote: tuple[PoolTier, PoolTier] | None, owner: str = ""
                        ) -> tuple[pb.PrefixHeader, list[BlockMeta]]:
    """The answer to a GetPrefix of the walk's kept blocks (`refs`, one a block): its refs; a descriptor a block
    (empty for one in none of `pools`, or moving) when any block is described, those described leased; with
    `hold_for_get` every block leased. Returns it and, given `promote` (the shared DRAM pool and the HBM pool a
    CUDA IPC caller maps), the blocks the first holds and the second lacks, to be copied up for its next hit. `owner`:
    the caller's tenant, whose lease it is (engram/leases.py)."""
    header = pb.PrefixHeader()
    descs = header.descriptors
    lease: Lease | None = None
    leased_at: list[int] = []  # each leased block's place in the walk, in the order of lease.metas
    first_described = -1  # the first block described from a pool: descriptors are sent once one is
    up: list[BlockMeta] = []
    up_at: list[int] = []
    paths = {p.name: str(p.segment.path) for p in pools if p.segment is not None}
    segments = {p.name: p.segment.layout.segment_id for p in pools if p.segment is not None}
    ipc = {p.name: cuda_handle(p) for p in pools if p.device.type == "cuda"}
    # Each pool's blocks described, and their places in the walk: counted as served once the answer stands, those
    # before a cut alone (counted a slice at a time, the blocks a later slice's cut took from the answer stayed
    # counted as served: Stats' and /metrics' hits and bytes served, a review of session 49)
    described: dict[str, list[BlockMeta]] = {p.name: [] for p in pools}
    described_at: dict[str, list[int]] = {p.name: [] for p in pools}
    dtypes: dict[object, int] = {}
    done = 0
    try:
        while done < walk.kept():
            if done:
                await pause()
            end = min(walk.kept(), done + SLICE_BLOCKS)
            header.blocks.extend(refs[done:end])
            part = walk.blocks[done:end]
            where = [pool_of(m, pools) if pools and not m.moving else None for m in part]
            # Used (the lookup's recency bump) before leased: a lease restarts a block's age, and a use after it
            # saw age 0 (no comeback counted), so the eviction order, and a daemon's hits against the replayer's,
            # differed (tests/test_trace.py; a regression of session 49 found by CI). The caller counts the rest.
            store.placement.use_all(part)
            held = [m for m, pool in zip(part, where, strict=True) if pool is not None or hold_for_get]
            if held:  # leased in the step that describes them: none is evicted before the caller copies it
                leased_at += [i for i, pool in enumerate(where, done) if pool is not None or hold_for_get]
                if lease is None:
                    lease = leases.grant(namespace, held, owner)
                else:
                    leases.grow(lease, held)
            if promote is not None:
                dram, hbm = promote
                for i, m in enumerate(part, done):
                    if dram.name in m.locations and hbm.name not in m.locations:
                        up.append(m)
                        up_at.append(i)
            for i, meta, pool in zip(range(done, end), part, where, strict=True) if pools else ():
                if pool is None:
                    descs.add()
                    continue
                assert lease is not None
                if first_described < 0:
                    first_described = len(descs)
                slot = pool.slot(meta.key)
                dtype = dtypes.get(meta.dtype)
                if dtype is None:
                    dtype = dtypes[meta.dtype] = int(meta.dtype)
                d = descs.add(key=meta.key, header=pb.BlockHeader(
                    dtype=dtype, shape=meta.shape, payload_nbytes=meta.nbytes,  # type: ignore[arg-type]
                    checksum=meta.checksum, codec=codec), segment_path=paths[pool.name],
                    segment_id=segments[pool.name], offset=slot.offset, generation=slot.generation,
                    lease_id=lease.id, lease_expires_in_s=leases.lease_s)
                if pool.name in ipc:
                    d.cuda.CopyFrom(ipc[pool.name])
                described[pool.name].append(meta)
                described_at[pool.name].append(i)
            done = end
        # No await since the loop's last check: what stands is the walk's kept blocks. Anything described or
        # leased past a block removed between slices goes.
        kept = walk.kept()
        del header.blocks[kept:]
        if 0 <= first_described < kept:
            del descs[kept:]
        else:
            del descs[:]
        if lease is not None:
            leases.shorten(lease, bisect.bisect_left(leased_at, kept))
            if lease.metas:
                leases.renew(lease)  # its term runs from the answer, as the descriptors say
                header.lease_id = lease.id
                header.lease_expires_in_s = leases.lease_s
            else:
                leases.drop(lease)
        header.matched_tokens = walk.matched_tokens()
        for pool in pools:  # counted like every other hit (the worker copies it in place), as answered
            if answered := described[pool.name][: bisect.bisect_left(described_at[pool.name], kept)]:
                store.served_all(answered, pool.name, namespace)
        return header, up[: bisect.bisect_left(up_at, kept)]
    except BaseException:
        if lease is not None:
            leases.drop(lease)
        raise

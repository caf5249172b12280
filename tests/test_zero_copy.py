"""Same-host zero-copy Get against a real daemon (loopback TCP and a unix socket, the shared DRAM segment in
/dev/shm): descriptors and bytes give identical tensors; a lease keeps a slot from reuse; after expiry or
release the slot is reused and the old descriptor is detected as stale (never another block's bytes);
bad or foreign lease ids get NOT_FOUND and leave the owner's lease intact."""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any

import grpc
import pytest
import torch

from engram.block import checksum
from engram.client import EngramClient, same_host
from engram.errors import NotFound, ResourceExhausted
from engram.segment import SegmentReader
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)


def copied(reader: SegmentReader, offset: int, length: int, generation: int) -> bytes | None:
    """What a worker gets through a descriptor: the bytes, or None for a stale one."""
    out = reader.copy(offset, length, generation)
    return None if out is None else bytes(out.numpy())


async def raw_get(address: str, ns: str, fp: bytes, keys: list[bytes]) -> list[pb.GetResponse]:
    """A zero-copy Get through the bare stub, so a test holds the descriptors (and their leases)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngramStub(ch)
        req = pb.GetRequest(namespace=ns, model_fingerprint=fp, keys=keys, zero_copy=True)
        return [r async for r in stub.Get(req)]


async def wait_until(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_zero_copy_and_bytes_paths_return_identical_tensors(server_factory, codec: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    assert same_host(srv.address)
    spec = tiny_model(codec=codec)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(5 * BLOCK_TOKENS + 3)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks)))).keys)
        fast = await c.get(fp, keys, zero_copy=True)
        slow = await c.get(fp, keys, zero_copy=False)
        auto = await c.get(fp, keys)
        assert len(fast) == len(keys) == 6
        for a, b, d in zip(fast, slow, auto, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a, d)
        # The zero-copy Get really answered with descriptors (no payload bytes on the wire) ...
        resps = await raw_get(srv.address, "t", fp, keys)
        assert [r.HasField("descriptor") for r in resps] == [True] * 6 and not any(r.chunk.data for r in resps)
        # ... and the client released its leases: nothing stays leased.
        await wait_until(lambda: all(srv.store.index.get(k).leases == 1 for k in keys), "the raw Get's leases")
        assert srv.store.counters.blocks_served >= 4 * 6


async def test_an_expired_lease_lets_the_slot_be_reused_and_the_old_descriptor_is_stale(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.capacity": 4 * BLOCK, "server.lease_s": 0.2})
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(SPEC)
        first = tokens(2 * BLOCK_TOKENS, seed=1)
        keys = list((await c.put(fp, first, random_kv(SPEC, len(first), seed=1))).keys)
        [d0, d1] = [r.descriptor for r in await raw_get(srv.address, "t", fp, keys)]
        reader = SegmentReader(d0.segment_path, d0.segment_id)
        original = copied(reader, d0.offset, d0.header.payload_nbytes, d0.generation)
        assert original is not None and checksum(original) == d0.header.checksum
        # The lease expires (nobody released it) ...
        await wait_until(lambda: srv.store.index.get(keys[0]).leases == 0, "lease expiry")
        # ... so new blocks may evict these and take their pages.
        for s in range(2, 5):
            t = tokens(2 * BLOCK_TOKENS, seed=s)
            await c.put(fp, t, random_kv(SPEC, len(t), seed=s))
        assert srv.store.index.get(keys[0]) is None, "the old block was not evicted"
        start = srv.store.tiers[0].segment.layout.data_offset + d0.offset  # type: ignore[attr-defined]
        now = bytes(reader._mm[start : start + d0.header.payload_nbytes])
        assert now != original, "the slot was not reused: the test proves nothing"
        # A read through the old descriptor is refused, not served another block's bytes.
        assert copied(reader, d0.offset, d0.header.payload_nbytes, d0.generation) is None
        assert copied(reader, d1.offset, d1.header.payload_nbytes, d1.generation) is None
        with pytest.raises(NotFound, match="expired"):
            await c.release_leases([d0.lease_id])
        reader.close()


async def test_a_held_lease_keeps_the_slot_and_a_released_one_frees_it(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.capacity": 4 * BLOCK})
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(SPEC)
        first = tokens(2 * BLOCK_TOKENS, seed=1)
        keys = list((await c.put(fp, first, random_kv(SPEC, len(first), seed=1))).keys)
        [d0, _] = [r.descriptor for r in await raw_get(srv.address, "t", fp, keys)]
        reader = SegmentReader(d0.segment_path, d0.segment_id)
        for s in range(2, 5):  # pressure: the leased blocks must survive it
            t = tokens(2 * BLOCK_TOKENS, seed=s)
            await c.put(fp, t, random_kv(SPEC, len(t), seed=s))
        assert srv.store.index.get(keys[0]) is not None
        data = copied(reader, d0.offset, d0.header.payload_nbytes, d0.generation)
        assert data is not None and checksum(data) == d0.header.checksum
        assert await c.release_leases([d0.lease_id]) == 1
        for s in range(5, 8):
            t = tokens(2 * BLOCK_TOKENS, seed=s)
            await c.put(fp, t, random_kv(SPEC, len(t), seed=s))
        assert srv.store.index.get(keys[0]) is None
        assert copied(reader, d0.offset, d0.header.payload_nbytes, d0.generation) is None
        reader.close()


async def test_bad_and_foreign_lease_ids_get_not_found_and_leave_the_lease(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    async with EngramClient(srv.address, namespace="owner") as c, \
            EngramClient(srv.address, namespace="other") as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        toks = tokens(BLOCK_TOKENS)
        keys = list((await c.put(fp, toks, random_kv(SPEC, len(toks)))).keys)
        [d] = [r.descriptor for r in await raw_get(srv.address, "owner", fp, keys)]
        with pytest.raises(NotFound, match="not held in this namespace"):
            await other.release_leases([d.lease_id])
        with pytest.raises(NotFound, match="lease 1"):
            await c.release_leases([d.lease_id, 12345])  # one bad id: nothing is released
        assert srv.store.index.get(keys[0]).leases == 1
        assert await c.release_leases([d.lease_id]) == 1
        assert srv.store.index.get(keys[0]).leases == 0
        # A Get in another namespace gets neither descriptors nor bytes of these blocks.
        with pytest.raises(NotFound):
            await other.get(fp, keys, zero_copy=True)
        # The daemon is still serving.
        [got] = await c.get(fp, keys)
        assert got.shape[2] == BLOCK_TOKENS


async def test_an_unmappable_segment_falls_back_to_bytes(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS)
        kv = random_kv(SPEC, len(toks))
        keys = list((await c.put(fp, toks, kv)).keys)
        seg = srv.store.tiers[0].segment  # type: ignore[attr-defined]
        hidden = seg.path.with_name(seg.path.name + ".hidden")
        os.rename(seg.path, hidden)  # as if the worker ran in another container: the path does not exist
        try:
            got = await c.get(fp, keys, zero_copy=True)
        finally:
            os.rename(hidden, seg.path)
        assert not c._zero_copy_ok  # this client asks for bytes from now on
        assert torch.equal(torch.cat(got, dim=2), kv)
        # The client released its leases (in the background, right after its copies).
        await wait_until(lambda: all(srv.store.index.get(k).leases == 0 for k in keys), "lease release")


async def test_a_load_that_fails_releases_the_lease_the_last_load_left_held(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A finished load's lease is kept to end with the next load's GetPrefix; when that call fails (a prompt over
    the daemon's limit: RESOURCE_EXHAUSTED), the lease is released then, not left to its expiry (lease_s)."""
    srv = await server_factory(**{"server.max_tokens_per_request": 4 * BLOCK_TOKENS})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS)
        keys = (await c.put(fp, toks, random_kv(spec, len(toks)))).keys
        dest = torch.zeros(spec.layout.block_shape(len(toks)), dtype=spec.layout.dtype.torch_dtype)
        assert (await c.load_prefix_into(fp, toks, dest)).mapped_blocks == 2
        assert all(srv.store.index.get(k).leases == 1 for k in keys)  # held for the next load to end
        c._max_tokens = 1 << 62  # as a client that does not cap its requests' tokens (an older one, or another)
        with pytest.raises(ResourceExhausted):
            await c.load_prefix_into(fp, tokens(8 * BLOCK_TOKENS), dest)
        await wait_until(lambda: all(srv.store.index.get(k).leases == 0 for k in keys), "the held lease's release")


async def test_a_zero_copy_get_cancelled_midway_releases_the_leases_it_was_given(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A caller's timeout cancels a zero-copy get after the daemon has leased and described some of its blocks:
    those leases end then (in the background), not at their expiry, which would hold the blocks from eviction.
    The cancel is made to land after the first descriptor by a stand-in stream that passes the real RPC's
    answers through and then raises CancelledError, as the event loop would at the next message's await."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(3 * BLOCK_TOKENS)
        keys = (await c.put(fp, toks, random_kv(spec, len(toks)))).keys
        real_get = c._stub.Get

        async def cancelled_after_first(req: pb.GetRequest) -> Any:
            async for resp in real_get(req):
                yield resp
                raise asyncio.CancelledError

        c._stub.Get = cancelled_after_first
        with pytest.raises(asyncio.CancelledError):
            await c.get(fp, keys, zero_copy=True)
        c._stub.Get = real_get
        await wait_until(lambda: all(srv.store.index.get(k).leases == 0 for k in keys), "the cancelled get's release",
                         timeout=5.0)
        got = await c.get(fp, keys, zero_copy=True)  # the client is still usable
        assert len(got) == 3


async def test_a_load_cancelled_while_its_answer_is_on_the_way_releases_the_answers_lease(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A serving engine's deadline cancels load_prefix_into after the daemon answered GetPrefix (a lease on every
    block of the prefix) and before the client read the answer: the call runs on, and its lease is released
    once the answer comes, not held to its expiry (lease_s, 30 s here) with the blocks it names. The answer is
    delayed by a stand-in stub method that awaits the real call, then 0.2 s."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(3 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        keys = (await c.put(fp, toks, kv)).keys
        real = c._stub.GetPrefix

        async def answered_late(req: pb.GetPrefixRequest, **kw: Any) -> pb.PrefixHeader:
            header = await real(req, **kw)
            await asyncio.sleep(0.2)
            return header

        c._stub.GetPrefix = answered_late
        load = asyncio.create_task(c.load_prefix_into(fp, toks, torch.zeros_like(kv)))
        await wait_until(lambda: len(srv.service.leases) == 1, "the daemon's answer", timeout=5.0)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        c._stub.GetPrefix = real
        await wait_until(lambda: len(srv.service.leases) == 0 and all(srv.store.index.get(k).leases == 0 for k in keys),
                         "the unread answer's lease released", timeout=5.0)


async def test_a_client_that_cannot_map_the_pool_says_so_once_and_goes_on_in_bytes(server_factory, tmp_path,  # type: ignore[no-untyped-def]
                                                                                   caplog) -> None:
    """A same-host worker that cannot map the daemon's pool (another container without its /dev/shm: here the
    segment's name removed, the daemon keeping its mapping; a user outside the segment's group) got every hit and
    in-place put as bytes with not a word (the docs audit, session 48). Its client logs it once for hits and once
    for puts, and serves them as bytes."""
    import logging

    from engram.tiers.pool import shared_pool

    (tmp_path / "shm").mkdir()
    srv = await server_factory(**{"tiers.dram.shm_dir": str(tmp_path / "shm")})
    toks = tokens(3 * BLOCK_TOKENS, seed=61)
    kv = random_kv(SPEC, len(toks), seed=61)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(SPEC)
        await c.put(fp, toks, kv)
    pool = shared_pool(srv.store.tiers)
    assert pool is not None and pool.segment is not None
    pool.segment.path.unlink()
    with caplog.at_level(logging.WARNING, logger="engram.client"):
        async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
            fp = await c.register_model(SPEC)
            for seed in (62, 63):  # in place first: a failed hit stops this client trying the pool for puts too
                more = tokens(2 * BLOCK_TOKENS, seed=seed)
                assert (await c.put(fp, more, random_kv(SPEC, len(more), seed=seed))).stored == 2
            for _ in range(2):
                dest = torch.zeros_like(kv)
                res = await c.load_prefix_into(fp, toks, dest)
                assert (res.mapped_blocks, res.bytes_blocks) == (0, 3) and torch.equal(dest, kv)
            assert torch.equal(torch.cat(await c.get(fp, [b.key for b in (await c.lookup(fp, toks)).blocks]), dim=2), kv)
    kinds = [m.group(1) for r in caplog.records if (m := re.search(r"shared pool .*\): (hits|puts) travel as bytes",
                                                                   r.getMessage()))]
    assert kinds == ["puts", "hits"], caplog.text

"""Puts written in place (ReservePut, the worker writes the pool slots, CommitPut) against a real daemon on this
host: the stored blocks are byte for byte those a Put stores; a chain longer than the pool goes in rounds; the
daemon refuses bytes that are not what was reserved and publishes nothing of them; a reservation never
committed frees its slots; reservation ids are per namespace."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from engram import errors, sealing
from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc
from engram.wire import convert

from helpers import BLOCK_TOKENS, random_kv, rpcs_answered, tiny_model, tokens, until

CODECS = ["raw", "nvfp4", "mxfp4", "fp8_e4m3"]
# On a GPU the worker encodes every block of a run in a few launches and copies them device -> pinned pool.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the H200)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", CODECS)
async def test_an_in_place_put_stores_what_a_put_stores(server_factory, codec: str, device: str) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model(codec=codec)
    toks = tokens(4 * BLOCK_TOKENS + 5)
    kv = random_kv(spec, len(toks)).to(device)
    async with EngramClient(srv.address, namespace="a", in_place_min_bytes=0) as local, \
            EngramClient(srv.address, namespace="b", zero_copy=False) as remote:
        fp = await local.register_model(spec)
        await remote.register_model(spec)
        served = (await local.stats()).blocks_put
        put = await local.put(fp, toks, kv)
        assert (put.stored, put.skipped) == (5, 0) and (await local.stats()).blocks_put == served + 5
        await remote.put(fp, toks, kv.cpu())  # the same KV as Put messages, in another namespace
        their_keys = [b.key for b in (await remote.lookup(fp, toks)).blocks]
        mine = await local.describe_blocks(key_prefixes=[k.hex() for k in put.keys])
        theirs = await remote.describe_blocks(key_prefixes=[k.hex() for k in their_keys])
        # The daemon sealed the in-place blocks from the pool's bytes: the same checksums as the encoded Puts.
        assert [b.checksum for b in mine.blocks] == [b.checksum for b in theirs.blocks]
        assert [b.nbytes for b in mine.blocks] == [b.nbytes for b in theirs.blocks]
        a = torch.cat(await local.get(fp, list(put.keys), zero_copy=False), dim=2)
        assert torch.equal(a, torch.cat(await remote.get(fp, their_keys), dim=2))
        deduplicated = (await local.stats()).blocks_deduplicated
        again = await local.put(fp, toks, kv)  # everything cached: nothing written, nothing deduplicated
        # As on the bytes path, a block skipped as cached is neither stored nor deduplicated, in the PutResult and
        # in Stats: it counted in both skipped and deduplicated (10 of 5 blocks), and the daemon's dedupe counter
        # grew by blocks never sent (an audit, session 45).
        assert (again.stored, again.deduplicated, again.skipped) == (0, 0, 5)
        assert (await local.stats()).blocks_deduplicated == deduplicated


@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_kv_of_another_shape_is_refused_on_every_path(server_factory, codec: str) -> None:  # type: ignore[no-untyped-def]
    """KV with kv_heads and head_dim swapped (or the other factors of their product, or another layer count) is
    InvalidArgument in place as on the bytes path: in place it was stored as the model's KV (its bytes laid out
    by the layout), or failed with a bare torch error after reserving slots (an audit)."""
    srv = await server_factory()
    spec = tiny_model(codec=codec)
    toks = tokens(2 * BLOCK_TOKENS)
    kv = random_kv(spec, len(toks))
    layers, _, t, heads, dim = kv.shape
    wrong = [kv.reshape(layers, 2, t, dim, heads), kv.reshape(layers, 2, t, heads * 2, dim // 2),
             torch.cat([kv, kv[:1]]), kv[..., :-1]]
    for ns, kw in (("in-place", {"in_place_min_bytes": 0}), ("bytes", {"zero_copy": False})):
        async with EngramClient(srv.address, namespace=ns, **kw) as c:
            fp = await c.register_model(spec)
            for bad in wrong:
                with pytest.raises(errors.InvalidArgument, match=r"kv must be \(persisted layers"):
                    await c.put(fp, toks, bad)
            assert (await c.lookup(fp, toks)).matched_tokens == 0  # nothing stored, no reservation left
            put = await c.put(fp, toks, kv)
            assert put.stored == 2 and (put.reserve_ms > 0) == (ns == "in-place")  # each on its own path


async def test_a_chain_longer_than_the_pool_goes_in_rounds(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 4 * block, "tiers.dram.page_bytes": 256,
                                  "tiers.nvme.path": str(tmp_path / "nvme"), "server.metrics_port": -1})
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        toks = tokens(11 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        put = await c.put(fp, toks, kv)
        assert put.stored == 11
        # in place, a round a reservation of at most the 4 blocks the pool holds: 3 rounds or more, none refused
        assert rpcs_answered(srv, "ReservePut") >= 3 and rpcs_answered(srv, "ReservePut", "RESOURCE_EXHAUSTED") == 0
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)
        assert (await c.stats()).tier("nvme").blocks >= 7  # demoted between rounds


async def _reserve(address: str, ns: str, fp: bytes, toks, spec) -> pb.ReservePutResponse:  # type: ignore[no-untyped-def]
    hdr = pb.BlockHeader(tokens=convert.tokens_to_pb(toks), dtype=1, shape=list(spec.layout.block_shape(len(toks))),
                         payload_nbytes=spec.layout.block_nbytes(len(toks)), codec="raw")
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.EngramStub(ch).ReservePut(pb.ReservePutRequest(namespace=ns, model_fingerprint=fp,
                                                                            blocks=[hdr]))


async def test_bytes_that_are_not_what_was_reserved_are_refused_and_nothing_is_published(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    spec = tiny_model(codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(BLOCK_TOKENS)
        used = (await c.stats()).tier("dram").used_bytes
        bt = spec.layout.block_shape(BLOCK_TOKENS)
        from engram.codec.stored import stored_nbytes

        hdr = pb.BlockHeader(tokens=convert.tokens_to_pb(toks), dtype=1, shape=list(bt), codec="nvfp4",
                             payload_nbytes=stored_nbytes("nvfp4", bt, spec.layout.dtype))
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp, blocks=[hdr]))
            # nothing written: the slot holds zeros, not a v1 block
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not the nvfp4 block" in info.value.details()
        assert (await c.lookup(fp, toks)).matched_tokens == 0
        assert (await c.stats()).tier("dram").used_bytes == used  # the slot was freed


async def test_an_uncommitted_reservation_expires_and_ids_are_per_namespace(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Each step waits for the reservation's own timer (its expiry, then its slots' release a term later), so its
    slot is seen held within a full term however loaded the host (fixed sleeps left 0.15 s of it)."""
    lease_s = 1.0
    srv = await server_factory(**{"server.lease_s": lease_s})
    spec = tiny_model()
    loop = asyncio.get_running_loop()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        used = (await c.stats()).tier("dram").used_bytes
        res = await _reserve(srv.address, "t", fp, tokens(BLOCK_TOKENS), spec)
        reservation = srv.service.inplace.get("t", res.reservation_id)
        assert (await c.stats()).tier("dram").used_bytes > used
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:  # another namespace cannot commit it
                await stub.CommitPut(pb.CommitPutRequest(namespace="u", reservation_id=res.reservation_id))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            expiry = reservation.timer.when()
            await asyncio.sleep(max(0.0, expiry - loop.time()) + 0.05)
            with pytest.raises(grpc.aio.AioRpcError) as info:  # expired: closed
                await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in info.value.details()
            assert (await c.stats()).tier("dram").used_bytes > used  # its slot held a term more: a late writer's
            release = reservation.timer.when()
            assert release >= expiry + lease_s
            await asyncio.sleep(max(0.0, release - loop.time()) + 0.05)
            deadline = time.monotonic() + 10
            while (await c.stats()).tier("dram").used_bytes != used:  # then free again (a task the timer starts)
                assert time.monotonic() < deadline, "the lapsed reservation's slot was not let go"
                await asyncio.sleep(0.01)


def _raw_headers(spec, toks) -> list[pb.BlockHeader]:  # type: ignore[no-untyped-def]
    """A ReservePut's headers for `toks` in full raw blocks."""
    return [pb.BlockHeader(tokens=convert.tokens_to_pb(toks[i:i + BLOCK_TOKENS]), dtype=int(spec.layout.dtype),
                           shape=list(spec.layout.block_shape(BLOCK_TOKENS)),
                           payload_nbytes=spec.layout.block_nbytes(BLOCK_TOKENS), codec="raw")
            for i in range(0, len(toks), BLOCK_TOKENS)]


def _write_slots(inplace, slots, kv, only=None) -> None:  # type: ignore[no-untyped-def]
    """What a worker on the daemon's host does between ReservePut and CommitPut: each block's raw bytes into
    its slot of the shared pool (here in process); `only`: those blocks' slots."""
    for i, slot in enumerate(slots):
        if only is None or i in only:
            block = kv[:, :, i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].contiguous().view(-1).view(torch.uint8)
            inplace.pool.buffer[slot.offset:slot.offset + block.numel()].copy_(block)


async def test_a_reservation_does_not_expire_under_a_commit_of_part_of_it(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A CommitPut of the first block of two takes longer to seal than the reservation has left: the expiry
    waits for it (it once freed the slots being sealed and answered the block as deduplicated, stored
    nowhere), and the rest gets a full term after it. The seal is held until the first term is over, its
    expiry's timer due before the seal goes on (it runs first, were it still armed), however long the set-up
    took; the term only has to outlast the set-up (a 0.4 s term and a 0.6 s seal failed once on a loaded CI)."""
    lease_s = 1.5
    srv = await server_factory(**{"server.lease_s": lease_s})
    spec = tiny_model()
    inplace = srv.service.inplace
    toks = tokens(2 * BLOCK_TOKENS, seed=8)
    kv = random_kv(spec, len(toks), seed=8)
    loop = asyncio.get_running_loop()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        headers = _raw_headers(spec, toks)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp, blocks=headers))
            reservation = inplace.get("t", res.reservation_id)
            assert reservation.timer is not None
            first_term_ends = reservation.timer.when()  # the loop's time its expiry is due
            _write_slots(inplace, res.slots, kv)  # the worker writes the blocks (in process: into the pool)
            seal = inplace.sealer.seal
            sealed_from: list[float] = []

            async def seal_after_the_first_term(tasks):  # type: ignore[no-untyped-def]
                await asyncio.sleep(max(0.0, first_term_ends - loop.time()) + 0.05)  # a seal of GiBs on a busy host
                sealed_from.append(loop.time())
                return await seal(tasks)

            inplace.sealer.seal = seal_after_the_first_term
            first = await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id,
                                                             blocks=1))
            inplace.sealer.seal = seal
            assert (first.stored, first.deduplicated) == (1, 0)
            # Still open, due a full term after the seal (not at the first term's end, long past, nor never).
            assert inplace.get("t", res.reservation_id) is reservation and reservation.timer is not None
            assert reservation.timer.when() >= sealed_from[0] + lease_s
            rest = await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert (rest.stored, rest.deduplicated) == (1, 0)
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)


async def test_a_second_commit_while_one_runs_is_refused_and_pins_once(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Two CommitPuts of one reservation at once would seal and publish the same batch twice (a block pinned
    twice, the first one's new expiry orphaned): the second is refused while the first runs."""
    srv = await server_factory()
    spec = tiny_model()
    inplace = srv.service.inplace
    toks = tokens(2 * BLOCK_TOKENS, seed=7)
    kv = random_kv(spec, len(toks), seed=7)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        headers = _raw_headers(spec, toks)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp, blocks=headers,
                                                             pin=True))
            _write_slots(inplace, res.slots, kv)
            seal = inplace.sealer.seal

            async def slow_seal(tasks):  # type: ignore[no-untyped-def]
                await asyncio.sleep(0.3)
                return await seal(tasks)

            inplace.sealer.seal = slow_seal
            request = pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id, blocks=1)
            first = asyncio.ensure_future(stub.CommitPut(request))
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CommitPut(request)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "one after the other" in info.value.details()
            assert (await first).stored == 1
            inplace.sealer.seal = seal
            rest = await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert rest.stored == 1
        assert [m.pins for m in srv.store.find("t", fp, list(res.keys))] == [1, 1]


async def test_a_block_stored_at_reserve_and_deleted_before_the_commit_is_not_acknowledged(server_factory) -> None:  # type: ignore[no-untyped-def]
    """ReservePut skips a block already stored; if that block is gone by the commit (an operator's forced
    Evict), the commit fails instead of counting it deduplicated, and frees the rest of the reservation."""
    srv = await server_factory()
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=9)
    kv = random_kv(spec, len(toks), seed=9)
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=1 << 40) as c:
        fp = await c.register_model(spec)
        [first] = (await c.put(fp, toks[:BLOCK_TOKENS], kv[:, :, :BLOCK_TOKENS])).keys
        headers = _raw_headers(spec, toks)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp, blocks=headers))
            assert list(res.cached) == [True, False]  # the first is stored: no slot
            _write_slots(srv.service.inplace, res.slots, kv, only=[1])
            meta = srv.store.index.get_in("t", first)
            assert meta is not None
            await srv.store.placement.delete_block(meta)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "evicted since" in info.value.details()
        assert (await c.lookup(fp, toks)).matched_tokens == 0
        assert len(srv.service.inplace.pool._slots) == len(srv.store.index) == 0  # nothing left reserved


async def test_a_writer_late_past_its_reservation_lands_in_slots_no_block_holds(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker still writing when its reservation expires (a slow encode, a paused process): its commit is
    refused, and its slots stay held a term after the expiry, so a put meanwhile is stored elsewhere and the late
    write cannot overwrite it (a hit through the shared pool does not verify checksums)."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"server.lease_s": 0.5, "tiers.dram.capacity": 4 * block,
                                  "tiers.dram.page_bytes": 256})
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as a, \
            EngramClient(srv.address, namespace="t", in_place_min_bytes=1 << 40) as b:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        ta, ka = tokens(2 * BLOCK_TOKENS, seed=1), random_kv(spec, 2 * BLOCK_TOKENS, seed=1)
        tb, kb = tokens(2 * BLOCK_TOKENS, seed=2), random_kv(spec, 2 * BLOCK_TOKENS, seed=2)
        write = a._writer.write

        def slow_write(*args, **kw):  # type: ignore[no-untyped-def]
            time.sleep(0.8)  # past the expiry (0.5 s), within the term its slots stay held (1 s)
            return write(*args, **kw)

        a._writer.write = slow_write
        late = asyncio.create_task(a.put(fp, ta, ka))
        await asyncio.sleep(0.6)  # A's reservation has expired; its worker has not written yet
        assert (await b.put(fp, tb, kb)).stored == 2  # the pool's other half
        with pytest.raises(errors.NotFound, match="expired"):
            await late
        n, got = await b.get_prefix(fp, tb)  # the shared pool's path: no checksum
        assert n == len(tb) and torch.equal(got, kb)
        assert (await a.lookup(fp, ta)).matched_tokens == 0


async def test_a_writer_stops_when_its_reservation_has_no_time_left(server_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The client writes a run only while its reservation has time left: a run later than that is not written
    (the daemon frees an expired reservation's slots a term later), the runs before are committed, and the
    put fails saying why."""
    srv = await server_factory()
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=3)
    kv = random_kv(spec, len(toks), seed=3)
    monkeypatch.setattr(EngramClient, "_commit_runs",  # one run per block (runs are >= 64 MiB otherwise)
                        staticmethod(lambda slots, first, n: [(1, slots[:1]), (0, slots[1:])]))
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        reserve = c._stub.ReservePut

        async def short(request, **kw):  # type: ignore[no-untyped-def]
            res = await reserve(request, **kw)
            res.expires_in_s = 0.3  # what the daemon says is left (its own term is 30 s: nothing expires there)
            return res

        c._stub.ReservePut = short
        write = c._writer.write

        def slow_write(*args, **kw):  # type: ignore[no-untyped-def]
            time.sleep(0.4)
            return write(*args, **kw)

        c._writer.write = slow_write
        with pytest.raises(errors.Unavailable, match="ran out before its blocks were written"):
            await c.put(fp, toks, kv)
        assert (await c.lookup(fp, toks)).matched_tokens == BLOCK_TOKENS  # the first run, committed


async def test_a_put_on_a_daemon_without_a_shared_pool_falls_back_to_bytes(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.dram.pool": "private"})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS)
        kv = random_kv(spec, len(toks))
        assert (await c.put(fp, toks, kv)).stored == 2
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)
    with pytest.raises(errors.FailedPrecondition):
        async with EngramClient(srv.address, namespace="t") as c2:
            await c2.register_model(spec)
            stub = c2._stub
            await c2._call(stub.ReservePut, pb.ReservePutRequest(namespace="t", model_fingerprint=fp))


async def test_under_tenancy_the_same_host_paths_are_off_unless_trusted(server_factory) -> None:  # type: ignore[no-untyped-def]
    """The shared pool holds every tenant's blocks: with tenancy on, a worker gets no descriptors into it and
    cannot write it (hits and puts travel as bytes, and still work); auth.same_host_paths = on trusts it."""
    spec = tiny_model()
    auth = {"auth.tenants.alice.token": "alice-token", "auth.tenants.alice.namespaces": "alice",
            "auth.salt_secret": "s"}
    for trusted in (False, True):
        srv = await server_factory(**auth, **({"auth.same_host_paths": "on"} if trusted else {}))
        async with EngramClient(srv.address, namespace="alice", token="alice-token", in_place_min_bytes=0) as c:
            fp = await c.register_model(spec)
            toks = tokens(3 * BLOCK_TOKENS)
            kv = random_kv(spec, len(toks))
            put = await c.put(fp, toks, kv)
            assert put.stored == 3 and (put.write_ms > 0) == trusted  # written in place only when trusted
            dest = torch.zeros_like(kv)
            res = await c.load_prefix_into(fp, toks, dest)
            assert (res.mapped_blocks, res.bytes_blocks) == ((3, 0) if trusted else (0, 3))
            assert torch.equal(dest, kv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_concurrent_in_place_puts_of_one_client_each_store_their_own_kv(server_factory, device: str,  # type: ignore[no-untyped-def]
                                                                             codec: str) -> None:
    """Puts of one client run in threads of their own. On a GPU encoded puts shared the writer's staging buffers
    without ordering between them: one put's encode into a buffer could land before another's copy of it into
    the pool had run, and a block was stored (and sealed, checksum and all) with the other prompt's KV. Eight
    prompts put at once, over and over in fresh namespaces, must each read back as the same KV put one at a
    time over the bytes path."""
    srv = await server_factory(**{"tiers.dram.capacity": "256MiB"})
    spec = tiny_model(codec=codec)
    prompts = [tokens(8 * BLOCK_TOKENS, seed=200 + i) for i in range(8)]
    kvs = [random_kv(spec, len(t), seed=200 + i).to(device) for i, t in enumerate(prompts)]
    async with EngramClient(srv.address, namespace="ref", zero_copy=False) as remote:
        fp = await remote.register_model(spec)
        want = []
        for toks, kv in zip(prompts, kvs, strict=True):
            keys = (await remote.put(fp, toks, kv.cpu())).keys
            want.append(torch.cat(await remote.get(fp, list(keys)), dim=2))
    for round_ in range(5):
        async with EngramClient(srv.address, namespace=f"r{round_}", in_place_min_bytes=0) as local:
            await local.register_model(spec)
            puts = await asyncio.gather(*(local.put(fp, t, kv) for t, kv in zip(prompts, kvs, strict=True)))
            assert all(put.reserve_ms > 0 for put in puts), f"round {round_}: a put fell back to bytes"
            for i, put in enumerate(puts):
                got = torch.cat(await local.get(fp, list(put.keys), zero_copy=False), dim=2)
                assert torch.equal(got, want[i]), f"round {round_}: prompt {i} was stored with other KV"


async def _reserve_chain(stub, ns: str, fp: bytes, toks, spec, token: str = "") -> pb.ReservePutResponse:  # type: ignore[no-untyped-def]
    """A ReservePut of `toks` in full raw blocks, never written nor committed."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    return await stub.ReservePut(pb.ReservePutRequest(namespace=ns, model_fingerprint=fp,
                                                      blocks=_raw_headers(spec, toks)), metadata=md)


async def _refusal(stub, ns: str, fp: bytes, toks, spec, token: str = "") -> str:  # type: ignore[no-untyped-def]
    """The details of a ReservePut refused RESOURCE_EXHAUSTED."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _reserve_chain(stub, ns, fp, toks, spec, token)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return str(info.value.details())


async def _put_and_read_back(c: EngramClient, fp: bytes, spec, seed: int, blocks: int = 2) -> None:  # type: ignore[no-untyped-def]
    toks = tokens(blocks * BLOCK_TOKENS, seed=seed)
    kv = random_kv(spec, len(toks), seed=seed)
    assert (await c.put(fp, toks, kv)).stored == blocks
    n, got = await c.get_prefix(fp, toks)
    assert n == len(toks) and torch.equal(got, kv)


async def test_reservations_no_one_commits_cannot_fill_the_pool_from_other_puts(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A caller opening ReservePuts it never commits held the whole shared pool (each reservation was bounded to
    half of it, not their number), and every other put was refused "every block in it is pinned" for a
    reservation's time and a term more (an audit, session 43). With tenancy off there is no tenant to bound: all
    reservations together hold at most server.max_reserved_pool_fraction (3/4) of the pool; past that a
    ReservePut is RESOURCE_EXHAUSTED naming them, and another namespace's put (in place: it falls back to bytes)
    and the client's own next put are stored."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 16 * block, "tiers.dram.page_bytes": 256,
                                  "server.lease_s": 30})
    async with EngramClient(srv.address, namespace="hog", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)
        held = [await _reserve_chain(stub, "hog", fp, tokens(6 * BLOCK_TOKENS, seed=1), spec)]  # 6 of 16 blocks
        held.append(await _reserve_chain(stub, "hog", fp, tokens(8 * BLOCK_TOKENS, seed=2), spec))
        assert len(held[1].slots) == 6 and "max_reserved_pool_fraction" in held[1].refused  # 12 of 16: 3/4
        for ns, seed in (("hog", 3), ("hog2", 4)):  # a namespace holding nothing too: the total is reached
            said = await _refusal(stub, ns, fp, tokens(BLOCK_TOKENS, seed=seed), spec)
            assert all(f"reservation {r.reservation_id} (namespace 'hog'" in said for r in held), said
    for ns in ("other", "hog"):
        async with EngramClient(srv.address, namespace=ns, in_place_min_bytes=0) as c:
            await c.register_model(spec)
            await _put_and_read_back(c, fp, spec, seed=9)


async def test_a_reserveput_cancelled_while_it_reserves_frees_its_slots_as_the_call_ends(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A ReservePut cancelled while the daemon reserves its slots (many small blocks, the pool with room: the
    reservation runs to its end without awaiting, so the cancel reaches the handler only after) answered into a
    call already gone, and its reservation, named to nobody, held its slots two terms (2 x server.lease_s) before
    the lapse freed them (session 49's cancel audit: DEADLINE_EXCEEDED, the reservation open). Now they are freed as
    the call ends, and the next in-place put goes in place."""
    srv = await server_factory(**{"server.lease_s": 60.0, "server.metrics_port": -1})
    inplace = srv.service.inplace
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        used = (await c.stats()).tier("dram").used_bytes
        req = pb.ReservePutRequest(namespace="t", model_fingerprint=fp,
                                   blocks=_raw_headers(spec, tokens(4096 * BLOCK_TOKENS)))

        def cancel_once_reserving() -> bool:
            """A client in a thread of its own (the daemon's loop is busy reserving): its call, cancelled once the
            daemon has begun to reserve; whether the cancel came before the answer."""
            with grpc.insecure_channel(srv.address) as ch:
                call = pb_grpc.EngramStub(ch).ReservePut.future(req)
                deadline = time.monotonic() + 30
                while not (inplace._making or inplace._open):  # the daemon's state, read from this thread
                    assert time.monotonic() < deadline, "the daemon did not begin to reserve"
                    time.sleep(0.0001)
                return bool(call.cancel())

        assert await asyncio.to_thread(cancel_once_reserving), "the answer came before the cancel"

        async def slots_freed() -> bool:
            return not (inplace._making or inplace._open or inplace._lapsed) and \
                (await c.stats()).tier("dram").used_bytes == used

        await until(slots_freed, "the cancelled reservation's slots freed, well before its lapse", timeout=10)
        answered = rpcs_answered(srv, "ReservePut")
        await _put_and_read_back(c, fp, spec, seed=5)
        assert rpcs_answered(srv, "ReservePut") == answered + 1  # in place


async def test_a_commit_cancelled_while_its_slots_are_sealed_frees_them_only_once_the_sealing_is_done(  # type: ignore[no-untyped-def]
        server_factory, monkeypatch) -> None:
    """A CommitPut seals each slot in place (a v1 block's checksums are written into it, every payload hashed) in
    a thread (one block, or a small host) or in helper processes; a commit that fails frees the reservation's
    slots, which the next put may take. Cancelled while the seal ran, the commit freed them at once, and the
    thread wrote on into slots another block could hold by then. The seal is the module's own, gated (a wrapper
    that waits for the test) so the cancel lands while it runs."""
    srv = await server_factory()
    inplace = srv.service.inplace
    spec = tiny_model()
    toks = tokens(BLOCK_TOKENS, seed=9)
    kv = random_kv(spec, len(toks), seed=9)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            res = await pb_grpc.EngramStub(ch).ReservePut(pb.ReservePutRequest(
                namespace="t", model_fingerprint=fp, blocks=_raw_headers(spec, toks)))
    _write_slots(inplace, res.slots, kv)
    reservation = inplace.get("t", res.reservation_id)
    slot_keys = [inplace._slot_key(reservation, r.meta) for r in reservation.blocks]
    assert slot_keys and all(k in inplace.pool for k in slot_keys)
    real_seal, entered, go = sealing.seal, threading.Event(), threading.Event()

    def gated_seal(data: memoryview, task: sealing.SealTask) -> int | str:
        entered.set()
        go.wait(60)
        return real_seal(data, task)

    monkeypatch.setattr(sealing, "seal", gated_seal)
    commit = asyncio.create_task(inplace.commit(reservation))
    try:
        await asyncio.to_thread(entered.wait, 60)
        commit.cancel()
        for _ in range(20):  # turns of the loop: a cancel that does not wait for the seal has landed long before
            await asyncio.sleep(0)
        assert not commit.done() and all(k in inplace.pool for k in slot_keys), \
            "the commit freed its slots while the seal still wrote into them"
    finally:
        go.set()
    with pytest.raises(asyncio.CancelledError):
        await commit
    assert not any(k in inplace.pool for k in slot_keys)  # freed once the seal was done
    assert all(srv.store.index.get(r.meta.key) is None for r in reservation.blocks)  # and nothing published


async def test_a_sealing_helper_whose_commit_was_cancelled_answers_its_next_task_with_that_tasks_checksum(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """On a host of 4 cores or more, helper processes seal the slots of a commit of several blocks, one JSON line
    a task each way. A commit cancelled while a helper worked left that helper's answer unread in its pipe, and its
    next task (the next commit's block) was answered with it: the block was stored under another block's checksum,
    and every Get of it failed DATA_LOSS. Two helpers are started here whatever the host, and the first one's
    answer is held (its pipe's readline gated, in this process) so that the cancel lands while it is due."""
    srv = await server_factory()
    inplace = srv.service.inplace
    sealer = inplace.sealer
    sealer.workers = 2
    sealer.start()
    assert sealer._starting is not None
    await sealer._starting
    helpers = [h for h in sealer._helpers if h.proc.returncode is None]
    assert len(helpers) == 2
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * BLOCK_TOKENS, seed=11)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            res = await pb_grpc.EngramStub(ch).ReservePut(pb.ReservePutRequest(
                namespace="t", model_fingerprint=fp, blocks=_raw_headers(spec, toks)))
        _write_slots(inplace, res.slots, random_kv(spec, len(toks), seed=11))
        pipe = helpers[0].proc.stdout
        assert pipe is not None
        real_readline, asked, go = pipe.readline, asyncio.Event(), asyncio.Event()

        async def gated_readline() -> bytes:
            asked.set()
            await go.wait()
            return await real_readline()

        pipe.readline = gated_readline  # type: ignore[method-assign]
        commit = asyncio.create_task(inplace.commit(inplace.get("t", res.reservation_id)))
        try:
            await asyncio.wait_for(asked.wait(), 60)
            commit.cancel()
            for _ in range(20):  # turns of the loop: a cancel that does not wait for the helper has landed
                await asyncio.sleep(0)
            assert not commit.done(), "the commit ended while a helper still sealed its slot"
        finally:
            go.set()
        with pytest.raises(asyncio.CancelledError):
            await commit
        del pipe.readline  # the stream's own again
        toks = tokens(2 * BLOCK_TOKENS, seed=12)
        kv = random_kv(spec, len(toks), seed=12)
        put = await c.put(fp, toks, kv)  # in place, sealed by the same two helpers
        assert put.stored == 2
        got = await c.get(fp, put.keys, zero_copy=False)  # as bytes: each payload checked against its checksum
        assert torch.equal(torch.cat(got, dim=2), kv)


async def test_a_commit_whose_sealing_helper_hangs_kills_it_and_seals_its_block_in_the_daemon(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """A helper that stops answering (here a real one, stopped with SIGSTOP, as a process stuck in the kernel or
    frozen by a debugger would be) held the commit of a block it had drawn forever: a commit, cancelled or not,
    waits for each helper's exchange to end, and that helper's lock held every later task it drew. Past
    sealing's answer bound the helper is killed (dead before the commit goes on: it may write into the slot) and
    its block sealed in a thread; the put lands, byte for byte."""
    srv = await server_factory()
    sealer = srv.service.inplace.sealer
    sealer.workers = 2
    sealer.answer_s = 1.0
    sealer.start()
    assert sealer._starting is not None
    await sealer._starting
    helpers = [h for h in sealer._helpers if h.proc.returncode is None]
    assert len(helpers) == 2
    hung = helpers[0].proc
    os.kill(hung.pid, signal.SIGSTOP)
    spec = tiny_model()
    toks = tokens(4 * BLOCK_TOKENS, seed=13)
    kv = random_kv(spec, len(toks), seed=13)
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        try:
            put = await asyncio.wait_for(c.put(fp, toks, kv), 30)
        except TimeoutError:
            pytest.fail("the in-place put never ended: its commit waits on the stopped sealing helper")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung.pid, signal.SIGCONT)  # (a helper the fix did not kill goes on, and close() ends it)
        assert put.stored == 4 and put.reserve_ms > 0  # in place
        assert hung.returncode is not None  # killed, not left stopped with its lock held
        got = await c.get(fp, put.keys, zero_copy=False)  # as bytes: each payload checked against its checksum
        assert torch.equal(torch.cat(got, dim=2), kv)
        again = tokens(4 * BLOCK_TOKENS, seed=14)
        put = await asyncio.wait_for(c.put(fp, again, random_kv(spec, len(again), seed=14)), 30)  # the one left
        assert put.stored == 4


async def test_a_sealing_helper_killed_for_hanging_is_started_again_and_seals_the_later_commits(  # type: ignore[no-untyped-def]
        server_factory, monkeypatch) -> None:
    """A helper killed for hanging (a real one, stopped with SIGSTOP, past sealing's answer bound) was never
    replaced: with one helper left every later commit sealed in a daemon thread, whose xxhash holds the GIL (the
    event loop waits for it), for the daemon's life. The next commit starts one again, in the background; the
    commits after it are sealed by helpers, none in the daemon."""
    srv = await server_factory()
    sealer = srv.service.inplace.sealer
    sealer.workers = 2
    sealer.answer_s = 1.0
    sealer.start()
    assert sealer._starting is not None
    await sealer._starting
    hung = sealer._helpers[0].proc
    os.kill(hung.pid, signal.SIGSTOP)
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        try:
            for seed in (16, 17):  # the first kills the hung helper; the second finds it gone
                toks = tokens(4 * BLOCK_TOKENS, seed=seed)
                assert (await asyncio.wait_for(c.put(fp, toks, random_kv(spec, len(toks), seed=seed)), 30)).stored == 4
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung.pid, signal.SIGCONT)
        assert hung.returncode is not None
        await sealer._starting  # the helper started again
        assert len([h for h in sealer._helpers if h.proc.returncode is None]) == 2
        in_daemon: list[int] = []
        real_seal_all, real_seal = sealing._seal_all, sealing.seal

        def seal_all_here(data, tasks):  # type: ignore[no-untyped-def]
            in_daemon.append(len(tasks))
            return real_seal_all(data, tasks)

        def seal_here(data, task):  # type: ignore[no-untyped-def]
            in_daemon.append(1)
            return real_seal(data, task)

        monkeypatch.setattr(sealing, "_seal_all", seal_all_here)
        monkeypatch.setattr(sealing, "seal", seal_here)
        toks = tokens(4 * BLOCK_TOKENS, seed=18)
        kv = random_kv(spec, len(toks), seed=18)
        put = await asyncio.wait_for(c.put(fp, toks, kv), 30)
        assert put.stored == 4 and put.reserve_ms > 0  # in place
        assert in_daemon == [], "a commit was sealed in the daemon, not by the helpers"
        got = await c.get(fp, put.keys, zero_copy=False)
        assert torch.equal(torch.cat(got, dim=2), kv)


async def test_sealing_helpers_that_keep_dying_are_started_again_a_bounded_number_of_times(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, monkeypatch) -> None:
    """Helpers that die after each start (here real processes that say ready and exit) are started again on the next
    commits at most sealing.RESTARTS times while none answers a task, not once a commit for ever; every commit is
    sealed in the daemon meanwhile, and lands."""
    srv = await server_factory()
    inplace = srv.service.inplace
    old = inplace.sealer  # the daemon's own, started already; a fresh one of two helpers that die
    inplace.sealer = sealer = sealing.Sealer(old.path, old.data_offset, old.data, workers=2)
    await old.close()
    started = tmp_path / "started"
    dying = tmp_path / "python"
    dying.write_text(f"#!/bin/sh\necho . >> {started}\necho ready\nexit 0\n")
    dying.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dying))

    async def started_and_dead() -> None:  # before the next commit looks (each start, two helpers)
        assert sealer._starting is not None
        await asyncio.wait((sealer._starting,))
        for proc in sealer._procs:
            await proc.wait()

    sealer.start()
    await started_and_dead()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        for seed in range(20, 20 + sealing.RESTARTS + 3):
            toks = tokens(2 * BLOCK_TOKENS, seed=seed)
            kv = random_kv(spec, len(toks), seed=seed)
            put = await asyncio.wait_for(c.put(fp, toks, kv), 30)
            assert put.stored == 2 and put.reserve_ms > 0  # in place
            await started_and_dead()
        got = await c.get(fp, put.keys, zero_copy=False)
        assert torch.equal(torch.cat(got, dim=2), kv)
    assert len(started.read_text().split()) == 2 * (1 + sealing.RESTARTS)
    await sealer.close()


async def test_sealing_helpers_that_answer_once_and_then_hang_are_started_again_a_bounded_number_of_times(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, monkeypatch) -> None:
    """Helpers that answer their first task and hang on the next (here real ones, running the helper's own seal
    once, then sleeping) were started again without end: one answer restored sealing.RESTARTS, so every third
    commit found them killed for hanging and restarted them, and every hang cost a commit the answer bound. Now
    only helpers that went sealing.RESTORE_S or more after their start restore the count: these are started again
    RESTARTS times, then the daemon seals in threads; every commit lands."""
    srv = await server_factory()
    inplace = srv.service.inplace
    old = inplace.sealer  # the daemon's own, started already; a fresh one of two helpers that answer once
    inplace.sealer = sealer = sealing.Sealer(old.path, old.data_offset, old.data, workers=2)
    await old.close()
    sealer.answer_s = 1.0
    started = tmp_path / "started"
    once = tmp_path / "answer_once.py"
    once.write_text(
        "import json, sys, time\n"
        "from engram import sealing\n"
        "data = sealing._map_pool(sys.argv[3], int(sys.argv[4]))  # (argv: -m engram.sealing PATH DATA_OFFSET)\n"
        "print('ready', flush=True)\n"
        "offset, length, v1, v2 = json.loads(sys.stdin.readline())\n"
        "print(json.dumps(sealing.seal(data, sealing.SealTask(offset, length, v1, v2))), flush=True)\n"
        "time.sleep(600)  # every later task: no answer\n")
    helper = tmp_path / "python"
    helper.write_text(f"#!/bin/sh\necho . >> {started}\nexec {sys.executable} {once} \"$@\"\n")
    helper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(helper))

    async def started_again() -> None:  # a start under way has ended before the next commit looks
        assert sealer._starting is not None
        await asyncio.wait((sealer._starting,))

    sealer.start()
    await started_again()
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        # each round: a commit the helpers answer, one they hang on (killed), one that starts them again
        for seed in range(30, 30 + 3 * (sealing.RESTARTS + 2)):
            toks = tokens(2 * BLOCK_TOKENS, seed=seed)
            kv = random_kv(spec, len(toks), seed=seed)
            put = await asyncio.wait_for(c.put(fp, toks, kv), 30)
            assert put.stored == 2 and put.reserve_ms > 0  # in place
            await started_again()
        got = await c.get(fp, put.keys, zero_copy=False)  # as bytes: each payload checked against its checksum
        assert torch.equal(torch.cat(got, dim=2), kv)
    assert len(started.read_text().split()) == 2 * (1 + sealing.RESTARTS)
    await sealer.close()


@pytest.mark.parametrize(("workers", "started"), [(2, False), (2, True), (1, False)],
                         ids=["helpers-never-started", "helpers-started", "no-helpers"])
async def test_a_sealer_closed_refuses_to_seal_unavailable_rather_than_fail_or_hash_a_pool_it_let_go(  # type: ignore[no-untyped-def]
        server_factory, workers: int, started: bool) -> None:
    """A commit that reaches the sealer after the daemon's stop closed it (InPlacePuts.close, before the store's)
    failed an AssertionError where its helpers had never started (an internal error), and elsewhere sealed the
    blocks in a thread over the empty view close() leaves of the pool: checksums of no bytes, which the commit would
    have published as the blocks'. Closed, the sealer refuses UNAVAILABLE: the daemon is stopping."""
    srv = await server_factory()
    own = srv.service.inplace.sealer  # on the daemon's real pool
    sealer = sealing.Sealer(own.path, own.data_offset, own.data, workers=workers)
    if started:
        sealer.start()
        assert sealer._starting is not None
        await sealer._starting
        assert len([h for h in sealer._helpers if h.proc.returncode is None]) == workers
    await sealer.close()
    block = tiny_model().layout.block_nbytes(BLOCK_TOKENS)
    with pytest.raises(errors.Unavailable, match="closed"):
        await sealer.seal([sealing.SealTask(0, block, None), sealing.SealTask(block, block, None)])


async def test_a_seal_whose_helpers_died_stops_hashing_in_the_daemon_once_the_sealer_is_closed(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, monkeypatch) -> None:
    """Two helpers (real processes that say ready, read a task and exit) die under a seal of two blocks, which then
    hashes them in the daemon, one thread a block. The daemon's stop closes the sealer while the first is hashed
    (held in the thread): the second was hashed over the empty view close() leaves of the pool, a checksum of no
    bytes returned as the block's. The seal now refuses UNAVAILABLE before each block it hashes so."""
    srv = await server_factory()
    own = srv.service.inplace.sealer  # on the daemon's real pool
    sealer = sealing.Sealer(own.path, own.data_offset, own.data, workers=2)
    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\necho ready\nread task\nexit 0\n")
    dying.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dying))
    sealer.start()
    assert sealer._starting is not None
    await sealer._starting
    real_seal, entered, go = sealing.seal, threading.Event(), threading.Event()

    def first_held(data: memoryview, task: sealing.SealTask) -> int | str:  # the daemon's own hashing, in its thread
        if not entered.is_set():
            entered.set()
            go.wait(30)
        return real_seal(data, task)

    monkeypatch.setattr(sealing, "seal", first_held)
    block = tiny_model().layout.block_nbytes(BLOCK_TOKENS)
    seal = asyncio.create_task(sealer.seal([sealing.SealTask(0, block, None), sealing.SealTask(block, block, None)]))
    try:
        assert await asyncio.to_thread(entered.wait, 30), "the seal never hashed a block in the daemon"
        await sealer.close()
    finally:
        go.set()
    with pytest.raises(errors.Unavailable, match="closed"):
        await seal


async def test_a_commit_does_not_wait_forever_for_sealing_helpers_that_never_start(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, monkeypatch) -> None:
    """Helpers that never say they are ready (a start stuck mapping the pool: here a real process that sleeps in
    the interpreter's place) held every commit forever, each waiting for the helpers' start. Past sealing's answer
    bound from the start a commit seals in a thread; close() ends the helpers."""
    srv = await server_factory()
    sealer = srv.service.inplace.sealer
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(sleeper))
    sealer.workers = 2
    sealer.answer_s = 1.0
    sealer.start()  # (its task runs later: the interpreter stays the sleeper until the put is done)
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS, seed=15)
    kv = random_kv(spec, len(toks), seed=15)
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        try:
            put = await asyncio.wait_for(c.put(fp, toks, kv), 30)
        except TimeoutError:
            pytest.fail("the in-place put never ended: its commit waits for helpers that never start")
        monkeypatch.undo()
        assert put.stored == 3 and put.reserve_ms > 0  # in place
        got = await c.get(fp, put.keys, zero_copy=False)
        assert torch.equal(torch.cat(got, dim=2), kv)
    procs = list(sealer._procs)
    await sealer.close()
    assert procs and all(p.returncode is not None for p in procs)  # the sleepers were ended too


def _tenants(**namespaces: str) -> dict[str, str]:
    """server_factory overrides for tenants (token NAME-token) trusted with the shared pool."""
    auth = {"auth.same_host_paths": "on", "auth.salt_secret": "s"}
    for name, ns in namespaces.items():
        auth |= {f"auth.tenants.{name}.token": f"{name}-token", f"auth.tenants.{name}.namespaces": ns}
    return auth


async def _register(srv, spec, *names: str) -> None:  # type: ignore[no-untyped-def]
    """Each tenant registers the model itself: a tenant sees only the models it registered."""
    for name in names:
        async with EngramClient(srv.address, namespace="", token=f"{name}-token") as c:
            await c.register_model(spec)


async def test_a_tenant_with_two_namespaces_reserves_at_most_its_share_of_the_pool(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A share per namespace let a tenant with two namespaces hold three quarters of the pool in reservations it
    never committed. One tenant's reservations, every namespace of its, stop at
    server.max_reserved_pool_fraction_per_tenant (half); its refusal names its own reservations only, and
    another tenant's put still lands."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 16 * block, "tiers.dram.page_bytes": 256},
                               **_tenants(evil="e1,e2", good="good"))
    async with EngramClient(srv.address, namespace="good", token="good-token", in_place_min_bytes=0) as good:
        fp = await good.register_model(spec)
        await _register(srv, spec, "evil")
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            theirs = await _reserve_chain(stub, "good", fp, tokens(2 * BLOCK_TOKENS, seed=5), spec, "good-token")
            first = await _reserve_chain(stub, "e1", fp, tokens(6 * BLOCK_TOKENS, seed=1), spec, "evil-token")
            second = await _reserve_chain(stub, "e2", fp, tokens(6 * BLOCK_TOKENS, seed=2), spec, "evil-token")
            assert (len(first.slots), len(second.slots)) == (6, 2)  # 8 of 16 blocks: the tenant's half
            assert "tenant 'evil'" in second.refused and "per_tenant" in second.refused, second.refused
            said = await _refusal(stub, "e2", fp, tokens(BLOCK_TOKENS, seed=3), spec, "evil-token")
            assert "max_reserved_pool_fraction_per_tenant" in said, said
            assert f"reservation {first.reservation_id} (namespace 'e1'" in said, said
            assert f"reservation {second.reservation_id} (namespace 'e2'" in said, said
            assert str(theirs.reservation_id) not in said and "good" not in said, said
        await _put_and_read_back(good, fp, spec, seed=9)  # in place: 12 of 16 blocks are reserved, then as bytes


@pytest.mark.parametrize("admin", [False, True])
async def test_a_reservation_stopped_by_a_full_pool_tells_a_tenant_why_but_not_the_pools_use(  # type: ignore[no-untyped-def]
        server_factory, admin: bool) -> None:
    """A pool of eight blocks, five of them Alice's pinned chain. Another caller's ReservePut of four blocks gets
    three slots; no room can be made for the fourth, and the reservation says why in `refused`. That said 'the dram
    tier is full (32768 of 32768 bytes ...)' to a tenant: the bytes every tenant's blocks and reservations hold,
    which move with their puts (a tenant's put refused over gRPC or the data channel is told the same without the
    figures, c91613f). A tenant is told the tier is full and why; an admin keeps the figures."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 8 * block, "tiers.dram.page_bytes": 256,
                                  "server.max_pinned_fraction_per_tenant": 1.0, "auth.admin_tokens": "admin-token"},
                               **_tenants(alice="alice-ns", bob="bob-ns"))
    async with EngramClient(srv.address, namespace="alice-ns", token="alice-token") as alice:
        fp = await alice.register_model(spec)
        theirs = tokens(5 * BLOCK_TOKENS, seed=1)
        assert (await alice.put(fp, theirs, random_kv(spec, len(theirs), seed=1), pin=True)).stored == 5
    caller, ns = ("admin-token", "ops") if admin else ("bob-token", "bob-ns")
    async with EngramClient(srv.address, namespace=ns, token=caller) as c:
        await c.register_model(spec)
    async with grpc.aio.insecure_channel(srv.address) as ch:
        res = await _reserve_chain(pb_grpc.EngramStub(ch), ns, fp, tokens(4 * BLOCK_TOKENS, seed=2), spec, caller)
    assert len(res.slots) == 3 and "the dram tier is full" in res.refused, res.refused
    figures = re.search(rf"\d+ of {8 * block} bytes", res.refused)
    assert bool(figures) == admin, res.refused


async def test_reservations_of_every_tenant_together_stop_at_their_fraction_naming_only_the_callers_own(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """All tenants' reservations together hold at most server.max_reserved_pool_fraction of the pool. A tenant
    refused by that bound is told its own reservations (id, namespace, when they expire) and the others' only
    by when they are let go: another tenant's reservation ids, namespaces, name or bytes would tell it what that
    tenant is putting (bytes: its prompt's length). A tenant holding nothing is refused too, and its put lands as bytes."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 16 * block, "tiers.dram.page_bytes": 256,
                                  "server.max_reserved_pool_fraction": 0.5,  # 8 blocks
                                  "server.max_reserved_pool_fraction_per_tenant": 0.375},  # 6 blocks
                               **_tenants(alice="alice-ns", bob="bob-ns", carol="carol-ns"))
    async with EngramClient(srv.address, namespace="carol-ns", token="carol-token", in_place_min_bytes=0) as carol:
        fp = await carol.register_model(spec)
        await _register(srv, spec, "alice", "bob")
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            a = await _reserve_chain(stub, "alice-ns", fp, tokens(8 * BLOCK_TOKENS, seed=1), spec, "alice-token")
            assert len(a.slots) == 6 and "per_tenant" in a.refused  # alice's own share: 6 of 16 blocks
            b = await _reserve_chain(stub, "bob-ns", fp, tokens(6 * BLOCK_TOKENS, seed=2), spec, "bob-token")
            assert len(b.slots) == 2, b.refused  # the total: 8 of 16 blocks
            said = await _refusal(stub, "bob-ns", fp, tokens(BLOCK_TOKENS, seed=3), spec, "bob-token")
            assert "server.max_reserved_pool_fraction = 0.5" in said, said
            assert f"reservation {b.reservation_id} (namespace 'bob-ns'" in said and "expires in" in said, said
            assert "other callers' are let go when committed or within" in said, said
            assert str(6 * block) not in said and str(8 * block) not in said, said  # no bytes of others
            for secret in (str(a.reservation_id), "alice"):
                assert secret not in said and secret not in b.refused, (secret, said, b.refused)
            said = await _refusal(stub, "carol-ns", fp, tokens(BLOCK_TOKENS, seed=4), spec, "carol-token")
            assert "reservation " not in said and "other callers' are let go" in said, said
            assert str(6 * block) not in said and str(8 * block) not in said and str(2 * block) not in said, said
            assert not any(s in said for s in ("alice", "bob", str(a.reservation_id), str(b.reservation_id))), said
        await _put_and_read_back(carol, fp, spec, seed=9)


async def test_a_put_refused_for_room_while_reservations_hold_the_tier_says_so(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A tier full of pinned blocks and of reservations not yet committed refused a put blaming pinned blocks
    alone ("unpin blocks or raise its capacity"), though most of its room was slots no eviction frees and that
    are let go when committed or expired: the error says so, and by when."""
    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.dram.capacity": 8 * block, "tiers.dram.page_bytes": 256})
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        pinned = tokens(2 * BLOCK_TOKENS, seed=8)
        await c.put(fp, pinned, random_kv(spec, len(pinned)), pin=True)  # 2 of 8 blocks
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            got = [await _reserve_chain(stub, ns, fp, tokens(4 * BLOCK_TOKENS, seed=seed), spec)
                   for ns, seed in (("a", 1), ("b", 2))]
            assert [len(r.slots) for r in got] == [4, 2]  # 6 of 8 blocks: 3/4, the tier full
        toks = tokens(BLOCK_TOKENS, seed=9)
        with pytest.raises(errors.ResourceExhausted) as info:
            await c.put(fp, toks, random_kv(spec, len(toks)))
        said = str(info.value)
        assert "part of it is slots of in-place reservations (ReservePut) not yet committed" in said
        assert str(6 * block) not in said, said  # no bytes: whoever's put it is reads it
        assert "let go when committed, or within" in said and "unpin blocks" not in said, said


async def _write_through_daemon(server_factory, tmp_path):  # type: ignore[no-untyped-def]
    """A daemon whose shared pool sits over NVMe under write-through, the flusher stopped (nothing but the puts
    below writes a block's NVMe copy); the daemon and the model's fingerprint."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    await srv.store.flusher.close()
    return srv, srv.store.registry.register(tiny_model())


async def _damaged_in_memory_only(store, key: bytes) -> None:  # type: ignore[no-untyped-def]
    """The block's NVMe copy lost (dropped) and a byte of its pool copy flipped, as a stray writer would."""
    meta = store.block(key)
    await store.drop_copy(meta, "nvme")
    store.tiers[0].view(key)[-1] ^= 0x40


async def test_an_in_place_put_of_a_block_held_damaged_in_memory_alone_stores_the_callers_bytes(  # type: ignore[no-untyped-def]
        server_factory, tmp_path) -> None:
    """Write-through: a chain put in place, its first block then held in the pool alone (its NVMe copy lost) and
    damaged there. The same KV put in place again stores the caller's bytes, both blocks durable: the reservation
    checks the copy the commit would make durable, drops it as damaged (counted) and reserves a slot for it. The
    put failed DATA_LOSS: ReservePut skipped the block as stored, so the daemon had none of the caller's bytes for
    it when the commit found no copy of it that verified."""
    srv, fp = await _write_through_daemon(server_factory, tmp_path)
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=31)
    kv = random_kv(spec, len(toks), seed=31)
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(spec)
        first = await c.put(fp, toks, kv)
        assert first.stored == 2 and first.reserve_ms > 0  # in place
        await _damaged_in_memory_only(srv.store, first.keys[0])
        again = await c.put(fp, toks, kv)
        assert (again.stored, again.skipped, again.not_durable) == (2, 0, 0) and again.reserve_ms > 0
        assert all(srv.store.block(k).locations == ["dram", "nvme"] for k in first.keys)
        assert (await c.stats()).corrupt_blocks == 1
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)
    assert (await srv.store.check(fix=False)).ok


async def _commit_after_another_put_of_the_block(srv: Any, fp: bytes, toks: np.ndarray, mine: torch.Tensor,
                                                 other: torch.Tensor, damage: Callable[[bytes], Awaitable[None]]
                                                 ) -> tuple[pb.PutResponse, bytes]:
    """Reserve a block and write `mine` into its slot; before the commit a Put stores the same tokens with `other`
    bytes, and `damage(key)` harms that copy; then commit. The commit's answer and the block's key."""
    from engram.block import BlockHeader, checksum

    spec, store = tiny_model(), srv.store
    payload = other.contiguous().view(torch.uint8).numpy().tobytes()
    header = BlockHeader(toks, spec.layout.dtype, spec.layout.block_shape(len(toks)), len(payload), checksum(payload))
    async with grpc.aio.insecure_channel(srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)
        res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp,
                                                         blocks=_raw_headers(spec, toks)))
        _write_slots(srv.service.inplace, res.slots, mine)
        [key] = res.keys
        assert (await store.put("t", fp, store.root("t", fp), header, payload)).stored
        await damage(key)
        done = await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
    return done, key


@pytest.mark.parametrize("theirs", ["same", "other"], ids=["same-bytes", "other-bytes"])
async def test_a_commit_whose_block_was_stored_meanwhile_and_damaged_stores_the_callers_bytes(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, theirs: str) -> None:
    """Write-through: a block is reserved and written in place; before the commit a Put stores the same block
    (the same bytes, or another worker's for the same tokens), which then loses its NVMe copy and is damaged in
    the pool. The commit checks the copy it would drop the caller's bytes for: none verifies, so the block is
    dropped (counted) and the caller's bytes are stored, whether or not they are the block's own. Both answered
    DATA_LOSS: the commit freed the caller's slot and read the damaged copy. (Session 45 then deduplicated the
    same bytes, making the NVMe copy from them and leaving the damaged pool copy indexed; now it is stored.)"""
    srv, fp = await _write_through_daemon(server_factory, tmp_path)
    spec = tiny_model()
    store = srv.store
    mine = random_kv(spec, BLOCK_TOKENS, seed=32)
    other = mine if theirs == "same" else random_kv(spec, BLOCK_TOKENS, seed=33)
    done, key = await _commit_after_another_put_of_the_block(srv, fp, tokens(BLOCK_TOKENS, seed=32), mine, other,
                                                             lambda key: _damaged_in_memory_only(store, key))
    assert (done.stored, done.deduplicated, done.not_durable) == (1, 0, 0)
    meta = store.block(key)
    assert meta is not None and "nvme" in meta.locations
    assert await store.tiers[-1].read(key) == mine.contiguous().view(torch.uint8).numpy().tobytes()
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        await c.register_model(spec)
        [got] = await c.get(fp, [key])
        assert torch.equal(got, mine)
        assert (await c.stats()).corrupt_blocks == 1  # the damaged pool copy: at the commit, or at this read
    assert (await store.check(fix=False)).ok


async def test_a_commit_cancelled_while_its_slot_is_written_to_nvme_frees_the_slot_only_once_the_write_ends(  # type: ignore[no-untyped-def]
        server_factory, tmp_path) -> None:
    """Write-through: a block reserved and written in place is stored meanwhile by a Put (the same bytes), whose
    NVMe copy is then lost. The commit deduplicates against it and makes it durable from the caller's slot, read
    in place by the NVMe tier's write in an I/O thread. Cancelled there, the commit freed the slot at once (the
    group commit gave up on a write still running), and the thread read on from a slot another block could
    hold by then. The write is gated at the tier's fault hook (its first step in the thread)."""
    from engram.block import BlockHeader, checksum

    srv, fp = await _write_through_daemon(server_factory, tmp_path)
    spec, store, inplace = tiny_model(), srv.store, srv.service.inplace
    toks = tokens(BLOCK_TOKENS, seed=37)
    kv = random_kv(spec, len(toks), seed=37)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    async with grpc.aio.insecure_channel(srv.address) as ch:
        res = await pb_grpc.EngramStub(ch).ReservePut(pb.ReservePutRequest(
            namespace="t", model_fingerprint=fp, blocks=_raw_headers(spec, toks)))
    _write_slots(inplace, res.slots, kv)
    [key] = res.keys
    header = BlockHeader(toks, spec.layout.dtype, spec.layout.block_shape(len(toks)), len(payload), checksum(payload))
    assert (await store.put("t", fp, store.root("t", fp), header, payload)).stored
    await store.drop_copy(store.block(key), "nvme")  # in the pool alone: the dedupe makes it durable again
    reservation = inplace.get("t", res.reservation_id)
    [slot_key] = [inplace._slot_key(reservation, r.meta) for r in reservation.blocks]
    nvme, entered, go = store.tiers[-1], threading.Event(), threading.Event()

    def gated(op: str, path: Any) -> None:
        if op == "write":
            entered.set()
            go.wait(60)

    nvme.fault_hook = gated
    commit = asyncio.create_task(inplace.commit(reservation))
    try:
        await asyncio.to_thread(entered.wait, 60)
        commit.cancel()
        for _ in range(20):  # turns of the loop: a cancel that does not wait for the write has landed long before
            await asyncio.sleep(0)
        assert not commit.done() and slot_key in inplace.pool, \
            "the commit freed its slot while the NVMe write still read it"
    finally:
        go.set()
    with pytest.raises(asyncio.CancelledError):
        await commit
    nvme.fault_hook = None
    assert slot_key not in inplace.pool  # freed once the write was done
    assert store.block(key).locations == ["dram"] and not list((tmp_path / "nvme" / "tmp").iterdir())
    assert (await store.check(fix=False)).ok


async def test_a_block_stored_at_reserve_and_dropped_as_damaged_before_the_commit_is_put_again(  # type: ignore[no-untyped-def]
        server_factory, tmp_path) -> None:
    """Write-through: ReservePut skips a block stored (sound) and held in the pool alone; before the commit its
    copy is damaged. The commit, which has none of the caller's bytes for it, finds no copy that verifies: the
    block is dropped (counted) and the commit refused FAILED_PRECONDITION, put the chain again (as for a block
    evicted meanwhile), which stores it. It answered DATA_LOSS, as if the caller's data were lost."""
    srv, fp = await _write_through_daemon(server_factory, tmp_path)
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=34)
    kv = random_kv(spec, len(toks), seed=34)
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(spec)
        put = await c.put(fp, toks[:BLOCK_TOKENS], kv[:, :, :BLOCK_TOKENS])
        assert put.reserve_ms > 0  # in place
        [first] = put.keys
        await srv.store.drop_copy(srv.store.block(first), "nvme")  # in the pool alone, sound
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.EngramStub(ch)
            res = await stub.ReservePut(pb.ReservePutRequest(namespace="t", model_fingerprint=fp,
                                                             blocks=_raw_headers(spec, toks)))
            assert list(res.cached) == [True, False]
            _write_slots(srv.service.inplace, res.slots, kv, only=[1])
            srv.store.tiers[0].view(first)[-1] ^= 0x40
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
            assert "put the chain again" in info.value.details()
        assert srv.store.block(first) is None and (await c.stats()).corrupt_blocks == 1
        assert len(srv.service.inplace.pool._slots) == 0  # nothing left reserved
        again = await c.put(fp, toks, kv)
        assert again.stored == 2 and again.reserve_ms > 0  # put again in place
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)


@pytest.mark.parametrize("where", ["pool", "nvme-corrupt", "nvme-missing"])
async def test_an_in_place_put_skips_a_damaged_block_which_a_read_drops_and_the_next_put_stores(  # type: ignore[no-untyped-def]
        server_factory, tmp_path, where: str) -> None:
    """Write-back: a chain of two blocks put in place; the second's only copy is then damaged, a byte flipped in
    the pool (no NVMe tier) or its NVMe file (the block moved there alone) corrupt or gone. The same tokens put in
    place again are skipped on the index's word (a worker saves its whole prompt: its cached prefix is not hashed
    or read back on every save); the next read that verifies (a Get as bytes) finds the damaged copy and drops it (counted, never served), and
    the put after that stores the caller's bytes, which a Get serves."""
    over = {"tiers.nvme.path": str(tmp_path / "nvme")} if where != "pool" else {}
    srv = await server_factory(**over)
    if srv.store.flusher is not None:
        await srv.store.flusher.close()  # nothing moves the blocks but the test
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=35)
    first, again = random_kv(spec, len(toks), seed=35), random_kv(spec, len(toks), seed=36)
    store = srv.store
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        put = await c.put(fp, toks, first)
        assert put.stored == 2 and put.reserve_ms > 0  # in place
        damaged = put.keys[1]
        if where == "pool":
            store.tiers[0].view(damaged)[-1] ^= 0x40
        else:
            await store.keep_only_in(store.block(damaged), "nvme")
            path = store.tiers[-1].path_of(damaged)
            if where == "nvme-missing":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[-1] ^= 0x40
                path.write_bytes(bytes(data))
        skipped = await c.put(fp, toks, again)
        assert (skipped.stored, skipped.deduplicated, skipped.skipped) == (0, 0, 2) and skipped.reserve_ms > 0
        with pytest.raises(errors.DataLoss):  # a read that verifies (not the hit path's in place): never served
            await c.get(fp, [put.keys[1]], zero_copy=False)
        assert (await c.stats()).corrupt_blocks == 1
        result = await c.put(fp, toks, again)
        assert (result.stored, result.deduplicated, result.skipped) == (1, 0, 1) and result.reserve_ms > 0
        got = await c.get(fp, list(put.keys), zero_copy=False)
        assert torch.equal(got[0], first[:, :, :BLOCK_TOKENS]) and torch.equal(got[1], again[:, :, BLOCK_TOKENS:])
    assert (await store.check(fix=False)).ok


async def test_a_commit_whose_block_was_stored_meanwhile_damaged_under_write_back_stores_the_callers_bytes(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """Write-back: a block is reserved and written in place; before the commit a Put stores the same tokens with
    other bytes, and a stray writer damages that copy in the pool. The commit checks the copy it would drop the
    caller's bytes for: it fails (dropped, counted), and the caller's bytes are stored, which a Get serves. It was
    deduplicated against the damaged copy, the caller's slot freed, and every hit of the block failed."""
    srv = await server_factory()
    spec = tiny_model()
    fp = srv.store.registry.register(spec)
    store = srv.store
    mine = random_kv(spec, BLOCK_TOKENS, seed=37)

    async def damage(key: bytes) -> None:
        store.tiers[0].view(key)[-1] ^= 0x40

    done, key = await _commit_after_another_put_of_the_block(srv, fp, tokens(BLOCK_TOKENS, seed=37), mine,
                                                             random_kv(spec, BLOCK_TOKENS, seed=38), damage)
    assert (done.stored, done.deduplicated) == (1, 0)
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        await c.register_model(spec)
        [got] = await c.get(fp, [key])
        assert torch.equal(got, mine)
        assert (await c.stats()).corrupt_blocks == 1
    assert (await store.check(fix=False)).ok

"""The daemon's large per-block work runs off its event loop (whose other connections waited 2-3 ms per 16 MiB
under load: benchmarks/RESULTS.md put_get, session 50), with what it checks unchanged: a put's checksum, a hit's
check of the stored copy, a raw put's copy into a quantizing model's codec. Watched with a profile hook on the
loop's thread (a daemon in this process; the client hashes blocks of this size in threads too)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
import torch
import xxhash

from engram import block
from engram.block import CHECKSUM_OFF_LOOP_BYTES, checksum, checksum_off_loop
from engram.client import EngramClient
from engram.codec import stored, streamformat
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec
from engram.tiers.pool import PoolTier
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, random_kv, rpcs_answered, tiny_model, tokens

BIG = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
               block_tokens=2048)  # 8 MiB raw: the smallest block hashed off the loop
BIG4 = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                block_tokens=2048)  # 32 MiB raw, 9 MiB in nvfp4: a worker-encoded block checked off the loop
UNLIMITED = [("grpc.max_receive_message_length", -1)]  # a raw gRPC Get's chunks are server.chunk_bytes each


async def put_requests(fp: bytes, header: pb.BlockHeader, payload: bytes | bytearray
                       ) -> AsyncIterator[pb.PutRequest]:
    """A raw Put of one block in namespace "t", in 1 MiB chunks (what a client that is not EngramClient sends)."""
    yield pb.PutRequest(header=pb.PutHeader(namespace="t", model_fingerprint=fp))
    step = 2**20
    for at in range(0, len(payload), step):
        yield pb.PutRequest(chunk=pb.BlockChunk(header=header if at == 0 else None, data=bytes(payload[at:at + step]),
                                                last=at + step >= len(payload)))


@contextmanager
def on_the_loop(*watched: Any) -> Iterator[list[str]]:
    """The names of the watched C functions (xxh3) and Python functions called on this thread meanwhile."""
    codes = {f.__code__ for f in watched if hasattr(f, "__code__")}
    seen: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if (event == "c_call" and arg in watched) or (event == "call" and frame.f_code in codes):
            seen.append(getattr(arg, "__name__", "") if event == "c_call" else frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        yield seen
    finally:
        sys.setprofile(None)


async def test_a_large_put_and_hit_are_hashed_off_the_daemons_loop_and_a_damaged_put_is_still_refused(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    srv = await server_factory()
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    assert BIG.block_nbytes(2048) == CHECKSUM_OFF_LOOP_BYTES
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks, kv = tokens(2048, seed=3), random_kv(spec, 2048, seed=3)
        with on_the_loop(xxhash.xxh3_64_intdigest) as seen:
            (key,) = (await c.put(fp, toks, kv)).keys
            (got,) = await c.get(fp, [key], zero_copy=False)  # served from the pool: its copy checked first
        assert seen == [] and torch.equal(got, kv)
        payload = bytearray(stored.encode(random_kv(spec, 2048, seed=4), stored.RAW))
        good = checksum(payload)
        payload[12345] ^= 0x40  # damaged on the way

        header = pb.BlockHeader(tokens=tokens(2048, seed=4).tolist(), dtype=int(DType.BF16),
                                shape=list(BIG.block_shape(2048)), payload_nbytes=len(payload), checksum=good)
        async with grpc.aio.insecure_channel(srv.address) as ch:
            with on_the_loop(xxhash.xxh3_64_intdigest) as seen, pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.EngramStub(ch).Put(put_requests(fp, header, payload))
        assert seen == []
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in (info.value.details() or "")
        assert len(srv.store.index) == 1  # the damaged block stored nowhere


async def test_a_raw_put_to_an_nvfp4_model_is_copied_and_encoded_off_the_loop_and_stores_the_same_bytes(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """The raw elements are copied out of the put's buffer (stored.decode) in the encoding's thread, not on the
    loop, and the block stored is the codec's encoding of them, sampled as before."""
    srv = await server_factory(**{"codec.quality_sample": 1})
    spec = ModelSpec("big-blocks", "w", BIG, codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks, kv = tokens(2048, seed=5), random_kv(spec, 2048, seed=5)
        with on_the_loop(stored.decode, xxhash.xxh3_64_intdigest) as seen:
            (key,) = (await c.put(fp, toks, kv)).keys
        assert seen == []
    meta = srv.store.index.get(key)
    want = stored.encode(kv, "nvfp4", backend=srv.store.codec_backend)
    assert await srv.store.read(meta) == want and meta.checksum == checksum(want)
    await srv.store.quality.drain()
    assert srv.store.quality.errors.blocks == 1  # the sample kept the elements the thread copied


async def test_a_cancelled_off_loop_checksum_returns_only_once_its_thread_let_go_of_the_buffer() -> None:
    """The data channel reuses its receive buffer once a put ends, cancelled or not: a hash still running in its
    thread would read the next block's bytes, and hold an export of the buffer (a release or resize raises
    BufferError). Cancelled, the call waits for its thread."""
    buf = bytearray(512 * 2**20)  # hashed in tens of ms
    view = memoryview(buf)
    task = asyncio.create_task(checksum_off_loop(view))
    await asyncio.sleep(0.01)  # the thread is hashing
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    view.release()  # BufferError if the thread still held it
    buf.extend(b"x")


async def test_a_decoding_get_cancelled_while_its_thread_decodes_holds_the_block_until_the_thread_is_done(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """The data channel's Get with decode reads a block in place (a view of its pool slot) and decodes it in a
    worker thread; the block is held (leased: never evicted, its slot never given to another block) only while
    the Get runs. Cancelled mid-decode, the Get holds it until the thread has let go of the slot: with
    asyncio.to_thread it ended at once, its hold released, while the thread still read the slot. The decode is
    the store's own, gated by a wrapper that waits for the test, so the cancel lands while it runs."""
    srv = await server_factory()
    spec = tiny_model(codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        kv = random_kv(spec, BLOCK_TOKENS, seed=7)
        (key,) = (await c.put(fp, tokens(BLOCK_TOKENS, seed=7), kv)).keys
    store, meta = srv.store, srv.store.index.get(key)
    assert srv.service is not None and meta is not None and store.placement.tiers[0].view(key) is not None
    real_as_raw, entered, go = store.as_raw, threading.Event(), threading.Event()
    decoded: list[bytes] = []

    def gated_as_raw(payload: bytes | memoryview, m: Any) -> bytes:
        entered.set()
        go.wait(60)
        decoded.append(real_as_raw(payload, m))
        return decoded[-1]

    store.as_raw = gated_as_raw  # type: ignore[method-assign]

    async def get() -> None:
        async for _ in srv.service.serve_bytes("t", fp, [meta], decode=True):  # type: ignore[union-attr]
            pass

    task = asyncio.create_task(get())
    try:
        await asyncio.to_thread(entered.wait, 60)
        assert meta.leases == 1
        task.cancel()
        for _ in range(20):  # turns of the loop: a cancel that does not wait for the thread has landed long before
            await asyncio.sleep(0)
        assert not task.done() and meta.leases == 1, "the Get let go of the block while its thread read the slot"
    finally:
        go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert meta.leases == 0 and decoded == [stored.as_raw(await store.read(meta), "nvfp4", spec.layout.dtype,
                                                          meta.shape, backend=store.codec_backend)]


async def test_a_demotion_and_a_flush_copy_a_large_block_out_of_the_pool_and_hash_it_off_the_loop(  # type: ignore[no-untyped-def]
        server_factory, tmp_path) -> None:
    """A block moving from the DRAM pool to NVMe (a put's demotion making room; the write-back flush) is copied
    out of its slot into bytes and verified against its checksum before it is written down: 8 MiB a block, on the
    loop both were (the pool's `read`, a copy into fresh pages, and a hash: milliseconds under load). Each still
    lands on NVMe as stored, and reads back."""
    srv = await server_factory(**{"tiers.dram.capacity": "20MiB", "tiers.nvme.path": str(tmp_path / "nvme"),
                                  "tiers.nvme.fsync": False, "tiers.write_back_window_s": 0})
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    assert BIG.block_nbytes(2048) == 8 * 2**20  # block.COPY_OFF_LOOP_BYTES: the smallest copied off the loop
    kvs = [random_kv(spec, 2048, seed=10 + i) for i in range(3)]
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        keys = [(await c.put(fp, tokens(2048, seed=10 + i), kvs[i])).keys[0] for i in range(2)]  # the pool's room
        dram = srv.store.counters.tiers["dram"]
        with on_the_loop(block.checksum, PoolTier.read) as seen:
            keys += (await c.put(fp, tokens(2048, seed=12), kvs[2])).keys  # demotes the coldest
        assert seen == [] and dram.demotions == 1
        assert srv.store.flusher is not None
        with on_the_loop(block.checksum, PoolTier.read) as seen:
            flushed = await srv.store.flusher.flush_all(60)  # the two left only in DRAM
        assert seen == [] and flushed.flushed == 2
        assert all(m.locations[-1] == "nvme" for m in map(srv.store.index.get, keys))  # type: ignore[union-attr]
        for key, kv in zip(keys, kvs, strict=True):
            meta = srv.store.index.get(key)
            assert meta is not None
            payload, _ = await srv.store._read_verified(meta, only="nvme")
            assert payload == stored.encode(kv, stored.RAW)
        assert all(torch.equal(g, kv) for g, kv in zip(await c.get(fp, keys), kvs, strict=True))


async def test_a_large_block_a_worker_encoded_is_checked_off_the_loop_and_a_damaged_one_still_refused(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """A put of a block in the model's codec (a worker's own encoding) is checked before it is stored: its v1
    body's checksum and its scales. 9 MiB of nvfp4 here: hashed on the loop before, now in the put's thread."""
    srv = await server_factory()
    spec = ModelSpec("big-fp4", "w", BIG4, codec="nvfp4")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        kv = random_kv(spec, 2048, seed=6)
        blob = stored.encode(kv, "nvfp4", backend=srv.store.codec_backend)
        assert len(blob) >= CHECKSUM_OFF_LOOP_BYTES
        with on_the_loop(stored.check_encoded) as seen:  # (the client in this process encodes, and hashes, on it)
            (key,) = (await c.put_blocks(fp, [(tokens(2048, seed=6), kv)], codec="nvfp4")).keys
        assert seen == []
        meta = srv.store.index.get(key)
        assert meta is not None and await srv.store.read(meta) == blob
        damaged = bytearray(blob)
        damaged[-1] ^= 0x01  # a code in the body: the v1 body checksum fails
        header = pb.BlockHeader(tokens=tokens(2048, seed=8).tolist(), dtype=int(DType.BF16),
                                shape=list(BIG4.block_shape(2048)), payload_nbytes=len(damaged),
                                checksum=checksum(damaged), codec="nvfp4")

        async with grpc.aio.insecure_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.EngramStub(ch).Put(put_requests(fp, header, damaged))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "body checksum" in (info.value.details() or "")
        assert len(srv.store.index) == 1



def lets_go_of_the_gil(fn: Callable[..., Any], *args: Any) -> bool:
    """Whether fn(*args), run in a worker thread, lets go of the GIL before it returns, so that another thread (a
    daemon's event loop) runs meanwhile. With a switch interval of an hour no thread is made to drop the GIL: this
    thread, waiting for it from the moment the worker starts, gets it before fn returns only where fn lets go of
    it (numpy's copy, xxh3), not where fn copies into bytes or a bytearray (one memcpy holding it)."""
    inside = [False]

    def work() -> None:
        inside[0] = True
        try:
            fn(*args)
        finally:
            inside[0] = False

    before = sys.getswitchinterval()
    sys.setswitchinterval(3600)
    try:
        worker = threading.Thread(target=work)
        worker.start()  # returns once this thread has the GIL again: fn let go of it, or ended
        seen = inside[0]
        worker.join()
    finally:
        sys.setswitchinterval(before)
    return seen


def in_its_thread(fn: Callable[..., Any], *watched: Any) -> tuple[Callable[..., Any], list[str]]:
    """fn, wrapped to record the names of the watched Python functions and C methods (by name: "tobytes") called
    on whichever thread runs it (a worker thread: on_the_loop watches the loop's)."""
    codes = {f.__code__ for f in watched if hasattr(f, "__code__")}
    names = {f for f in watched if isinstance(f, str)}
    seen: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") in names:
            seen.append(arg.__name__)
        elif event == "call" and frame.f_code in codes:
            seen.append(frame.f_code.co_name)

    def run(*args: Any) -> Any:
        sys.setprofile(watch)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    return run, seen


def test_a_copy_by_block_copied_lets_another_thread_run_and_a_copy_into_bytes_does_not() -> None:
    """What the daemon's worker threads copy with: block.copied (numpy's copy) lets go of the GIL while it copies,
    so the event loop runs meanwhile; bytes() and a bytearray, one memcpy each too, hold it throughout, and a worker
    thread making them held the loop all the same (benchmarks/RESULTS.md, put_get, session 51)."""
    view = memoryview(bytes(64 * 2**20))
    assert lets_go_of_the_gil(block.copied, view)
    assert not lets_go_of_the_gil(bytes, view) and not lets_go_of_the_gil(bytearray, view)


async def test_a_raw_puts_encoding_thread_copies_the_elements_out_letting_go_of_the_gil(  # type: ignore[no-untyped-def]
        server_factory, monkeypatch) -> None:
    """A raw put to a quantizing model copies its elements out of the put's buffer in the encoding's thread
    (stored.decode of the raw codec): into a bytearray, which held the GIL, so the loop waited for the 16 MiB copy
    beside the thread all the same; now with block.copied. The block stored is the codec's encoding, as before."""
    from engram.store import core

    srv = await server_factory()
    spec = ModelSpec("big-blocks", "w", BIG, codec="nvfp4")
    encoded, seen = in_its_thread(core._encoded, block.copied)
    monkeypatch.setattr(core, "_encoded", encoded)
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        toks, kv = tokens(2048, seed=11), random_kv(spec, 2048, seed=11)
        (key,) = (await c.put(fp, toks, kv)).keys
    assert seen == ["copied"]
    meta = srv.store.index.get(key)
    assert meta is not None and await srv.store.read(meta) == stored.encode(kv, "nvfp4",
                                                                             backend=srv.store.codec_backend)


async def test_a_decoding_gets_thread_sends_the_decoded_elements_without_copying_them_into_bytes(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """A Get with decode_on_server decodes in a worker thread; its last step was `tobytes` of the decoded elements
    (32 MiB for a 9 MiB nvfp4 block), one memcpy holding the GIL, which the loop waited for beside the thread. The
    elements are sent from the decoded tensor itself now (a view of its bytes), over both channels."""
    srv = await server_factory()
    spec = ModelSpec("big-fp4", "w", BIG4, codec="nvfp4")
    assert srv.service is not None
    decoded, seen = in_its_thread(srv.service._decoded, "tobytes")
    srv.service._decoded = decoded  # type: ignore[method-assign]
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        (key,) = (await c.put(fp, tokens(2048, seed=12), random_kv(spec, 2048, seed=12))).keys
        meta = srv.store.index.get(key)
        assert meta is not None
        want = srv.store.decode(await srv.store.read(meta), meta)
        (got,) = await c.get(fp, [key], decode_on_server=True)  # the data channel
        assert torch.equal(got, want)
        async with grpc.aio.insecure_channel(srv.address, options=UNLIMITED) as ch:
            chunks = [r.chunk async for r in pb_grpc.EngramStub(ch).Get(
                pb.GetRequest(namespace="t", model_fingerprint=fp, keys=[key], decode=True))]
        raw = b"".join(ch.data for ch in chunks)
        assert raw == stored.encode(want, stored.RAW) and chunks[0].header.checksum == checksum(raw)
    assert seen == []


async def test_a_stream_layouts_decoding_get_assembles_the_raw_block_without_copies_that_hold_the_gil(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """A Get with decode of a stream layout's block decodes each quantized stream in a worker thread, then copied
    each into bytes (`tobytes`) and joined them into the raw block (`streamformat.assemble`: a bytearray's slice
    assignments, then bytes() and a concatenation of the whole block): memcpys holding the GIL, which the daemon's
    loop waited for beside the thread. The raw block is assembled by numpy's copies now, the same bytes: a v2 block
    of the streams decoded, each raw, over both channels."""
    srv = await server_factory()
    layout = KVLayout((LayerSpec(LayerKind.GLOBAL),) * 2, block_tokens=BLOCK_TOKENS, streams=(
        StreamSpec("latent", (64,)), StreamSpec("exact", (2, 8), DType.FP32, codec="raw")))
    spec = ModelSpec("mla-ish", "w", layout, "nvfp4")
    assert srv.service is not None
    decoded, seen = in_its_thread(srv.service._decoded, "tobytes", streamformat.assemble)
    srv.service._decoded = decoded  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(18)
    data = {s.name: torch.randn(layout.stream_shape(s, BLOCK_TOKENS), generator=gen).to(s.dtype.torch_dtype)
            for s in layout.stream_specs}
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        (key,) = (await c.put(fp, tokens(BLOCK_TOKENS, seed=18), data)).keys
        meta = srv.store.index.get(key)
        assert meta is not None
        held = await srv.store.read(meta)
        streams = stored.decode_block(held, stored.STREAMS, meta.dtype, meta.shape, backend=srv.store.codec_backend)
        want = stored.encode_streams(streams, streamformat.raw_streams(srv.store.spec(fp).streams), BLOCK_TOKENS)
        (got,) = await c.get(fp, [key], decode_on_server=True)  # the data channel
        assert set(got) == set(streams) and all(torch.equal(got[n], streams[n]) for n in streams)
        async with grpc.aio.insecure_channel(srv.address, options=UNLIMITED) as ch:
            chunks = [r.chunk async for r in pb_grpc.EngramStub(ch).Get(
                pb.GetRequest(namespace="t", model_fingerprint=fp, keys=[key], decode=True))]
        raw = b"".join(ch.data for ch in chunks)
        assert raw == want and chunks[0].header.checksum == checksum(raw) and chunks[0].header.codec == stored.STREAMS
    assert seen == []


async def test_a_grpc_get_of_a_large_block_in_the_pool_sends_it_without_a_copy_on_the_loop(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """A gRPC Get read a block in the DRAM pool with the pool's `read`: a copy of the whole block into bytes on the
    loop (8 MiB here, 16 a common block), one step. It frames the block from its slot now, a chunk at a time."""
    srv = await server_factory()
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        kv = random_kv(spec, 2048, seed=13)
        (key,) = (await c.put(fp, tokens(2048, seed=13), kv)).keys
    assert srv.store.placement.tiers[0].view(key) is not None  # in the pool
    async with grpc.aio.insecure_channel(srv.address, options=UNLIMITED) as ch:
        with on_the_loop(PoolTier.read) as seen:
            chunks = [r.chunk async for r in pb_grpc.EngramStub(ch).Get(
                pb.GetRequest(namespace="t", model_fingerprint=fp, keys=[key]))]
    assert seen == []
    assert b"".join(ch.data for ch in chunks) == stored.encode(kv, stored.RAW)


async def test_a_grpc_get_sends_a_large_block_a_mib_a_message_by_default_each_a_short_step_of_the_loop(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """Each message a daemon streams is built and handed to gRPC in one step of its event loop: at the former default
    of 8 MiB a message (server.chunk_bytes) that step took 8-13 ms of the loop's CPU, most of it inside gRPC's send
    (benchmarks/RESULTS.md, put_get, session 53). By default an 8 MiB block goes as eight messages of 1 MiB now,
    its bytes the same."""
    srv = await server_factory()
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        kv = random_kv(spec, 2048, seed=17)
        (key,) = (await c.put(fp, tokens(2048, seed=17), kv)).keys
    async with grpc.aio.insecure_channel(srv.address, options=UNLIMITED) as ch:
        chunks = [r.chunk async for r in pb_grpc.EngramStub(ch).Get(
            pb.GetRequest(namespace="t", model_fingerprint=fp, keys=[key]))]
    assert [len(ch.data) for ch in chunks] == [2**20] * 8 and [ch.last for ch in chunks] == [False] * 7 + [True]
    assert b"".join(ch.data for ch in chunks) == stored.encode(kv, stored.RAW)


async def test_the_private_dram_tier_copies_a_large_put_off_the_loop_and_keeps_its_bytes_past_the_next_put(  # type: ignore[no-untyped-def]
        server_factory) -> None:
    """The private DRAM tier (tiers.dram.pool = private) keeps a copy of a put's payload, which comes as a view of
    the data channel's receive buffer: bytes() of it on the loop, one memcpy holding the loop (8 MiB here, 16 a
    common block). Copied by block.copied in a worker thread now; the block read back is the put's, after the next
    put on the same connection too."""
    from engram.tiers.dram import DramTier

    srv = await server_factory(**{"tiers.dram.pool": "private"})
    assert isinstance(srv.store.placement.tiers[0], DramTier)
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    kvs = [random_kv(spec, 2048, seed=19 + i) for i in range(2)]
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(spec)
        with on_the_loop(DramTier.write_now) as seen:
            keys = [(await c.put(fp, tokens(2048, seed=19 + i), kvs[i])).keys[0] for i in range(2)]
        assert seen == []
        for key, kv in zip(keys, kvs, strict=True):
            meta = srv.store.index.get(key)
            assert meta is not None and meta.locations == ["dram"]
            assert await srv.store.read(meta) == stored.encode(kv, stored.RAW)
        assert all(torch.equal(g, kv) for g, kv in zip(await c.get(fp, keys), kvs, strict=True))


async def test_write_through_copies_a_large_block_out_of_the_pool_for_its_durable_copy_off_the_loop(  # type: ignore[no-untyped-def]
        server_factory, tmp_path) -> None:
    """Under write-through a block's NVMe copy is written from its pool copy where the put's own bytes are not at
    hand: an in-place put's commit (the worker wrote the slot), and a put deduplicated against a stored block whose
    bytes differ from the put's and whose NVMe copy is missing. Both read the pool copy with the pool's `read`, a
    copy into bytes on the loop; now copied out in a worker thread. Each NVMe copy is the stored block's."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.nvme.fsync": False, "server.metrics_port": -1})
    store = srv.store
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    kvs = [random_kv(spec, 2048, seed=14 + i) for i in range(3)]
    async with EngramClient(srv.address, namespace="t", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        with on_the_loop(PoolTier.read) as seen:
            (key,) = (await c.put(fp, tokens(2048, seed=14), kvs[0])).keys  # in place: reserve, write, commit
        assert seen == [] and rpcs_answered(srv, "CommitPut") == 1
        meta = store.index.get(key)
        assert meta is not None and meta.locations == ["dram", "nvme"]
        payload, _ = await store._read_verified(meta, only="nvme")
        assert payload == stored.encode(kvs[0], stored.RAW)
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        await c.register_model(spec)
        (key,) = (await c.put(fp, tokens(2048, seed=15), kvs[1])).keys
        meta = store.index.get(key)
        assert meta is not None
        await store.drop_copy(meta, "nvme")  # lost: the next put of the block writes it again
        with on_the_loop(PoolTier.read) as seen:
            again = await c.put(fp, tokens(2048, seed=15), kvs[2])  # the same tokens, other bytes: deduplicated
        assert seen == [] and list(again.keys) == [key] and meta.locations == ["dram", "nvme"]
        payload, _ = await store._read_verified(meta, only="nvme")
        assert payload == stored.encode(kvs[1], stored.RAW)  # the stored block's bytes, not the put's


async def test_a_read_cancelled_while_its_thread_copies_the_block_out_of_the_pool_holds_it_until_the_copy_ends(  # type: ignore[no-untyped-def]
        server_factory, monkeypatch) -> None:
    """A read that copies a large block out of its pool slot (a gRPC Get's peer fetch, a Resume, write-through)
    does so in a worker thread under a lease of its own: cancelled meanwhile, it ends only once the thread has let
    go of the slot, its lease held till then (released at once, the block could be evicted and its slot given to
    another block under the copy). The copy is block.copied, gated by a wrapper that waits for the test."""
    srv = await server_factory()
    spec = ModelSpec("big-blocks", "w", BIG, codec="raw")
    async with EngramClient(srv.address, namespace="t") as c:
        fp = await c.register_model(spec)
        (key,) = (await c.put(fp, tokens(2048, seed=16), random_kv(spec, 2048, seed=16))).keys
    meta = srv.store.index.get(key)
    assert meta is not None and meta.leases == 0
    entered, go = threading.Event(), threading.Event()
    real = block.copied

    def gated(view: memoryview) -> memoryview:
        entered.set()
        go.wait(60)
        return real(view)

    monkeypatch.setattr(block, "copied", gated)
    task = asyncio.create_task(srv.store.read(meta))
    try:
        assert await asyncio.to_thread(entered.wait, 10), "the read did not copy the block out in a thread"
        assert meta.leases == 1
        task.cancel()
        for _ in range(20):  # turns of the loop: a cancel that does not wait for the thread has landed long before
            await asyncio.sleep(0)
        assert not task.done() and meta.leases == 1, "the read let go of the block while its thread copied the slot"
    finally:
        go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert meta.leases == 0

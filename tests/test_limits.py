"""Hostile or mistaken input is bounded at the edge: every case below reached the daemon's internals before
(INTERNAL, or memory it could not hold) and now gets INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message
that says what to change, while good clients keep being served."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import xxhash

from engram import errors, limits
from engram.block import checksum
from engram.client import EngramClient
from engram.codec import stored
from engram.codec.blockformat import HEADER_LEN
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire.channel import open_channel, stub_for

from helpers import BLOCK_TOKENS, random_kv, register_holding, tiny_model, tokens


async def expect(coro: Any, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, (info.value.code(), info.value.details())
    assert match in (info.value.details() or ""), info.value.details()


def stub(srv: RunningServer, token: str = "") -> tuple[grpc.aio.Channel, Any]:
    channel = open_channel(srv.address)
    return channel, stub_for(channel, token)


def layout_pb(**kw: Any) -> pb.KVLayout:
    base: dict[str, Any] = {"layers": [pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL)], "num_kv_heads": 2, "head_dim": 16,
                            "dtype": pb.DTYPE_BF16, "block_tokens": 16}
    base.update(kw)
    return pb.KVLayout(**base)


async def test_layouts_out_of_bounds_are_invalid_argument(server: RunningServer) -> None:
    channel, s = stub(server)
    big = [pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL)] * (limits.MAX_LAYERS + 1)
    cases = [(layout_pb(block_tokens=2**31), "block_tokens must be a power of two in [16, 65536]"),
             (layout_pb(num_kv_heads=0), "num_kv_heads must be in [1, 1024]"),
             (layout_pb(head_dim=0), "head_dim must be in [1, 4096]"),
             (layout_pb(head_dim=2**31), "head_dim must be in [1, 4096]"),
             (layout_pb(num_kv_heads=2**20), "num_kv_heads must be in [1, 1024]"),
             (layout_pb(layers=big), "number of layers must be in [1, 1024]"),
             (layout_pb(layers=[pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL),
                                pb.LayerSpec(kind=pb.LAYER_KIND_SLIDING, window=2**30)]), "sliding window"),
             # Within each bound, but 1024 layers x 1024 heads x 4096 x 64K tokens is far past a block's bytes.
             (layout_pb(layers=big[:1024], num_kv_heads=1024, head_dim=4096, block_tokens=65536), "max_block_bytes")]
    for layout, match in cases:
        req = pb.RegisterModelRequest(model=pb.ModelSpec(name="m", weights_id="w", layout=layout))
        await expect(s.RegisterModel(req), grpc.StatusCode.INVALID_ARGUMENT, match)
    long_name = pb.ModelSpec(name="n" * 5000, weights_id="w", layout=layout_pb())
    await expect(s.RegisterModel(pb.RegisterModelRequest(model=long_name)), grpc.StatusCode.INVALID_ARGUMENT,
                 "model's name is 5000 bytes")
    await channel.close()
    async with EngramClient(server.address, namespace="ok") as c:  # still serving
        assert await c.register_model(tiny_model())


async def test_the_number_of_models_is_bounded(server_factory: Any) -> None:
    srv = await server_factory(**{"server.max_models": 2})
    async with EngramClient(srv.address) as c:  # each holds a block: it keeps its place (an idle one gives it up)
        await register_holding(c, tiny_model(weights_id="a"))
        await register_holding(c, tiny_model(weights_id="b"))
        await c.register_model(tiny_model(weights_id="a"))  # a known model is no new one
        with pytest.raises(errors.ResourceExhausted, match=r"server\.max_models"):
            await c.register_model(tiny_model(weights_id="c"))


async def test_a_long_namespace_is_refused_and_poisons_no_later_put(server_factory: Any, tmp_path: Path) -> None:
    """A namespace over 65,535 bytes was stored in DRAM, then failed every demotion to NVMe (its length did
    not fit the block file's u16 field), so another client's later put got INTERNAL."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": "64KiB",
                                  "tiers.dram.pool": "private"})
    spec = tiny_model()
    channel, s = stub(srv)
    fp = (await s.RegisterModel(pb.RegisterModelRequest(model=convert.model_to_pb(spec)))).model_fingerprint
    for ns in ("x" * 70_000, "é" * (limits.MAX_NAMESPACE_BYTES // 2 + 1)):
        await expect(s.Lookup(pb.LookupRequest(namespace=ns, model_fingerprint=fp, tokens=[1, 2])),
                     grpc.StatusCode.INVALID_ARGUMENT, "at most 1024 bytes")

        async def put(ns: str = ns) -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=fp))

        await expect(s.Put(put()), grpc.StatusCode.INVALID_ARGUMENT, "at most 1024 bytes")
        await expect(s.OpenSession(pb.OpenSessionRequest(namespace=ns, model_fingerprint=fp,
                                                         mode=pb.REPLAY_MODE_PERSIST)),
                     grpc.StatusCode.INVALID_ARGUMENT, "at most 1024 bytes")
    await channel.close()
    async with EngramClient(srv.address, namespace="n" * limits.MAX_NAMESPACE_BYTES) as c:  # the bound itself is fine
        await c.register_model(spec)
        for seed in range(12):  # 12 x 4 KiB blocks... through a 64 KiB DRAM tier: demotions to NVMe
            toks = tokens(4 * BLOCK_TOKENS, seed=seed)
            await c.put(fp, toks, random_kv(spec, len(toks), seed=seed))
        n, got = await c.get_prefix(fp, tokens(4 * BLOCK_TOKENS, seed=0))
        assert n == 4 * BLOCK_TOKENS and got is not None


async def _header_then_wait(fp: bytes, header: pb.BlockHeader, ns: str, never: asyncio.Event
                            ) -> AsyncIterator[pb.PutRequest]:
    """A Put that announces a block and then sends nothing more: the daemon must answer from the header."""
    yield pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=fp))
    yield pb.PutRequest(chunk=pb.BlockChunk(header=header, data=b"\0" * 1024, last=False))
    await never.wait()


async def test_a_put_that_cannot_fit_the_top_tier_is_refused_before_its_payload(server_factory: Any) -> None:
    srv = await server_factory(**{"tiers.dram.capacity": "1MiB", "tiers.dram.pool": "private"})
    layout = KVLayout((LayerSpec(LayerKind.GLOBAL),) * 8, num_kv_heads=8, head_dim=128, block_tokens=64)
    spec = ModelSpec("wide", "w", layout, codec="raw")  # 1 MiB + per block: never fits
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(spec)
    n = layout.block_nbytes(64)
    header = pb.BlockHeader(tokens=list(range(64)), dtype=pb.DTYPE_BF16, shape=list(layout.block_shape(64)),
                            payload_nbytes=n, checksum=0, codec="raw")
    channel, s = stub(srv)
    never = asyncio.Event()
    # Answered although the stream is still open and 1 KiB of the payload has come: nothing was buffered.
    await expect(asyncio.wait_for(s.Put(_header_then_wait(fp, header, "default", never)), 10),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "cannot fit the dram tier's capacity")
    await channel.close()


async def test_a_chain_longer_than_a_tier_without_one_below_says_why_no_room_is_made(server_factory: Any) -> None:
    """A DRAM pool of 16 pages of 4 KiB and no tier below, and a chain of 20 blocks of 64 bytes: the 17th finds no
    room, since with no tier below only a chain's last block is evicted and each block takes a whole page. The
    refusal said "full (1024 of 65536 bytes): every block in it is pinned, being read or moving" (an audit, with
    a 2M-token chain: nothing was pinned); it counts the pages allocated and names both reasons."""
    srv = await server_factory(**{"tiers.dram.capacity": "64KiB", "tiers.dram.page_bytes": "4KiB"})
    layout = KVLayout((LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=1, block_tokens=16)
    spec = ModelSpec("tiny-blocks", "w", layout, codec="raw")
    assert layout.block_nbytes(16) == 64
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((1, 2, 20 * 16, 1, 1), generator=gen).to(torch.bfloat16)
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(spec)
        with pytest.raises(errors.ResourceExhausted) as info:
            await c.put(fp, np.arange(20 * 16, dtype=np.int32), kv)
    msg = str(info.value)
    assert "65536 of 65536 bytes in pages of 4096 bytes" in msg, msg
    assert "the parent of a block held here" in msg, msg


async def test_a_put_past_the_namespace_quota_is_refused_before_its_payload(server_factory: Any) -> None:
    srv = await server_factory(**{"auth.tenants.t.token": "tok", "auth.tenants.t.quota": "6KiB",
                                  "auth.salt_secret": "s"})
    spec = tiny_model()  # 4 KiB blocks: one fits, the second cannot
    toks = tokens(BLOCK_TOKENS)
    async with EngramClient(srv.address, token="tok", namespace="t") as c:
        fp = await c.register_model(spec)
        await c.put(fp, toks, random_kv(spec, BLOCK_TOKENS))
    kv = random_kv(spec, BLOCK_TOKENS, seed=3)
    payload = stored.encode(kv, stored.RAW)
    header = pb.BlockHeader(tokens=tokens(BLOCK_TOKENS, seed=3).tolist(), dtype=pb.DTYPE_BF16,
                            shape=list(kv.shape), payload_nbytes=len(payload), checksum=checksum(payload))
    channel, s = stub(srv, "tok")
    await expect(asyncio.wait_for(s.Put(_header_then_wait(fp, header, "t", asyncio.Event())), 10),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "quota")
    await channel.close()


async def test_sessions_per_namespace_are_bounded(server_factory: Any) -> None:
    srv = await server_factory(**{"auth.tenants.a.token": "a", "auth.tenants.a.max_sessions": 2,
                                  "auth.tenants.b.token": "b", "auth.salt_secret": "s",
                                  "server.max_sessions_per_namespace": 3})
    async with EngramClient(srv.address, token="a", namespace="a") as a, \
            EngramClient(srv.address, token="b", namespace="b") as b:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        first = await a.open_session(fp, mode="persist")
        await a.open_session(fp, mode="persist")
        with pytest.raises(errors.ResourceExhausted, match="2 live sessions"):
            await a.open_session(fp, mode="persist")
        with pytest.raises(errors.ResourceExhausted):
            await a.fork_session(first.session_id)
        await a.close_session(first.session_id)
        await a.open_session(fp, mode="persist")  # room again
        for _ in range(3):  # b has the daemon's default, 3
            await b.open_session(fp, mode="persist")
        with pytest.raises(errors.ResourceExhausted, match="3 live sessions"):
            await b.open_session(fp, mode="persist")


def window_for(spec: ModelSpec, n: int, seed: int = 0) -> torch.Tensor:
    lay = spec.layout
    sliding = [x for x in lay.layers if x.kind == LayerKind.SLIDING]
    rows = min(n, sliding[0].window - 1)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(sliding), 2, rows, lay.num_kv_heads, lay.head_dim, generator=gen).bfloat16()


async def test_persisted_windows_count_against_the_quota_and_a_daemon_budget(server_factory: Any) -> None:
    spec = tiny_model()
    win = window_for(spec, BLOCK_TOKENS)  # (2, 2, 7, 2, 16) bf16: 1,792 bytes
    nbytes = win.numel() * 2
    # a block, two windows, and the 4-byte tokens of three sessions' appends (sessions' tokens count too)
    srv = await server_factory(**{"auth.tenants.t.token": "tok",
                                  "auth.tenants.t.quota": 4 * 1024 + 2 * nbytes + 3 * 4 * BLOCK_TOKENS,
                                  "auth.tenants.u.token": "u", "auth.salt_secret": "s",
                                  "replay.max_persisted_window_bytes": 4 * nbytes})
    toks = tokens(BLOCK_TOKENS)
    async with EngramClient(srv.address, token="tok", namespace="t") as c:
        fp = await c.register_model(spec)
        await c.put(fp, toks, random_kv(spec, BLOCK_TOKENS))  # 4 KiB of the quota
        sids = [(await c.open_session(fp, mode="persist")).session_id for _ in range(3)]
        for sid in sids[:2]:
            await c.append_session(sid, toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
        with pytest.raises(errors.ResourceExhausted, match="quota"):  # blocks + 2 windows fill it
            await c.append_session(sids[2], toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
        assert (await c.list_sessions())[2].info.tokens == 0  # the refused append changed nothing
        more = tokens(BLOCK_TOKENS, seed=5)
        with pytest.raises(errors.ResourceExhausted, match="quota"):  # and the windows hold quota blocks need
            await c.put(fp, more, random_kv(spec, BLOCK_TOKENS, seed=5))
        with pytest.raises(errors.ResourceExhausted):  # a fork of a persisted window holds it once more
            await c.fork_session(sids[0])
        await c.close_session(sids[0])  # gives its window's bytes back
        await c.append_session(sids[2], toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
    async with EngramClient(srv.address, token="u", namespace="u") as u:  # the daemon-wide budget: 4 windows
        await u.register_model(spec)
        ids = [(await u.open_session(fp, mode="persist")).session_id for _ in range(3)]
        await u.append_session(ids[0], toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
        await u.append_session(ids[1], toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_persisted_window_bytes") as full:
            await u.append_session(ids[2], toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
        assert str(4 * nbytes) not in str(full.value)  # t's windows and u's: not told to u
        assert (await u.stats()).replay.persisted_window_bytes == 2 * nbytes  # its own: Stats is scoped


async def test_sessions_tokens_count_against_the_quota(server_factory: Any) -> None:
    """A session's tokens are daemon memory a tenant keeps outside the index (4 bytes each, up to 2^21 a
    session): they count against the quota as persisted windows do, and closing gives them back (16 sessions of
    2^21 tokens grew the daemon 188 MiB past a 64 MiB quota, an audit)."""
    srv = await server_factory(**{"auth.tenants.t.token": "tok", "auth.tenants.t.quota": 4096,
                                  "auth.salt_secret": "s"})
    async with EngramClient(srv.address, token="tok", namespace="t") as c:
        fp = await c.register_model(tiny_model())
        a = await c.open_session(fp, mode="persist", tokens=tokens(600))  # 2,400 bytes
        with pytest.raises(errors.ResourceExhausted, match="this session's tokens needs 2400 more"):
            await c.open_session(fp, mode="persist", tokens=tokens(600))
        b = await c.open_session(fp, mode="persist", tokens=tokens(400))
        with pytest.raises(errors.ResourceExhausted, match="these tokens needs 120 more"):
            await c.append_session(b.session_id, tokens(30))
        assert (await c.list_sessions())[1].info.tokens == 400  # the refused append changed nothing
        fork = await c.fork_session(a.session_id)  # shares its parent's tokens: nothing more is held
        await c.close_session(a.session_id)
        with pytest.raises(errors.ResourceExhausted, match="quota"):  # the fork holds a's tokens still
            await c.append_session(b.session_id, tokens(30))
        await c.close_session(fork.session_id)
        await c.append_session(b.session_id, tokens(30))
        await c.open_session(fp, mode="persist", tokens=tokens(500))


async def test_approx_k_must_be_finite(server: RunningServer) -> None:
    async with EngramClient(server.address) as c:
        fp = await c.register_model(tiny_model())
    channel, s = stub(server)
    for k in (math.nan, math.inf, -math.inf, -1.0, 1e300):
        for mode in (pb.REPLAY_MODE_APPROX, pb.REPLAY_MODE_PERSIST):
            req = pb.OpenSessionRequest(namespace="n", model_fingerprint=fp, mode=mode, approx_k=k)
            await expect(s.OpenSession(req), grpc.StatusCode.INVALID_ARGUMENT, "approx_k must be a finite number")
    await expect(s.OpenSession(pb.OpenSessionRequest(namespace="n", model_fingerprint=fp, session_id="s" * 300,
                                                     mode=pb.REPLAY_MODE_PERSIST)),
                 grpc.StatusCode.INVALID_ARGUMENT, "session id is 300 bytes")
    await channel.close()


async def test_zero_sized_dims_are_refused(server: RunningServer) -> None:
    async with EngramClient(server.address) as c:
        fp = await c.register_model(tiny_model())
    channel, s = stub(server)
    lay = tiny_model().layout
    for shape in ([0, 2, 16, 2, 16], [2, 2, 0, 2, 16], [2, 2, 16, 0, 16], [2, 0, 16, 2, 16], []):
        header = pb.BlockHeader(tokens=list(range(16)), dtype=pb.DTYPE_BF16, shape=shape, payload_nbytes=0)

        async def put(header: pb.BlockHeader = header) -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace="n", model_fingerprint=fp))
            yield pb.PutRequest(chunk=pb.BlockChunk(header=header, data=b"", last=True))

        await expect(s.Put(put()), grpc.StatusCode.INVALID_ARGUMENT, "does not match the layout")
    sid = (await s.OpenSession(pb.OpenSessionRequest(namespace="n", model_fingerprint=fp,
                                                     mode=pb.REPLAY_MODE_PERSIST))).session_id
    for shape in ([0, 2, 0, 2, 16], [2, 2, 0, 0, 0], []):
        window = pb.SwaWindowData(prefix_len=16, start=16, dtype=pb.DTYPE_BF16, shape=shape, data=b"",
                                  checksum=xxhash.xxh3_64_intdigest(b""))
        req = pb.AppendSessionRequest(session=pb.SessionRef(namespace="n", session_id=sid),
                                      tokens=list(range(16)), window=window)
        await expect(s.AppendSession(req), grpc.StatusCode.INVALID_ARGUMENT, "does not fit")
    await channel.close()
    assert lay.block_shape(16) == (2, 2, 16, 2, 16)


def _nan_scale(blob: bytes) -> bytes:
    """A v1 nvfp4 block whose first group scale is the E4M3 NaN pattern, checksums made right again."""
    body = bytearray(blob[HEADER_LEN:])
    body[4] = 0x7F  # after K's float32 tensor scale: its first group scale
    head = bytearray(blob[:HEADER_LEN])
    struct.pack_into("<Q", head, 40, xxhash.xxh3_64_intdigest(bytes(body)))
    struct.pack_into("<Q", head, 48, xxhash.xxh3_64_intdigest(bytes(head[:48])))
    return bytes(head) + bytes(body)


async def test_worker_encoded_blocks_with_bad_scales_are_refused_at_put(server: RunningServer) -> None:
    spec = tiny_model(codec="nvfp4")
    toks = tokens(2 * BLOCK_TOKENS, seed=4)
    kv = random_kv(spec, len(toks), seed=4)
    async with EngramClient(server.address, namespace="w") as c:
        fp = await c.register_model(spec)
        good = stored.encode(kv[:, :, :BLOCK_TOKENS], "nvfp4")
        bad = _nan_scale(good)
        with pytest.raises(ValueError, match="NaN"):  # what every later Get hit when it was stored
            stored.decode(bad, "nvfp4", DType.BF16, tuple(kv[:, :, :BLOCK_TOKENS].shape))
        channel, s = stub(server)

        async def put(payload: bytes) -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace="w", model_fingerprint=fp))
            yield pb.PutRequest(chunk=pb.BlockChunk(header=pb.BlockHeader(
                tokens=toks[:BLOCK_TOKENS].tolist(), dtype=pb.DTYPE_BF16, shape=list(spec.layout.block_shape(16)),
                payload_nbytes=len(payload), checksum=checksum(payload), codec="nvfp4"), data=payload, last=True))

        await expect(s.Put(put(bad)), grpc.StatusCode.INVALID_ARGUMENT, "would not decode")
        await channel.close()
        assert (await c.lookup(fp, toks)).matched_tokens == 0  # nothing of it was stored
        await c.put(fp, toks, kv, encode=True)  # control: the worker's own good encoding is taken
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and got.shape == kv.shape
        assert bool(torch.isfinite(got.float()).all())
    np.testing.assert_equal(len(bad), len(good))


async def test_blocks_written_in_place_with_bad_scales_are_refused_at_commit(server: RunningServer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On the daemon's host a put writes its encoded blocks straight into the shared pool (ReservePut /
    CommitPut): the daemon checks their scales in place before it publishes them."""
    from engram.writer import PutWriter

    spec = tiny_model(codec="nvfp4")
    toks = tokens(2 * BLOCK_TOKENS, seed=6)
    kv = random_kv(spec, len(toks), seed=6)
    write = PutWriter.write

    def nan_scale(self: PutWriter, kv: torch.Tensor, spec: ModelSpec, slots: Any, stream: Any = None,
                  **kw: Any) -> int:
        n = write(self, kv, spec, slots, stream, **kw)
        s = slots[-1]
        s.segment.data[s.offset + HEADER_LEN + 4] = 0x7F  # K's first group scale: the E4M3 NaN pattern
        return n

    async with EngramClient(server.address, namespace="w", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        monkeypatch.setattr(PutWriter, "write", nan_scale)
        with pytest.raises(errors.InvalidArgument, match="would not decode"):
            await c.put(fp, toks, kv)
        assert (await c.lookup(fp, toks)).matched_tokens == 0  # nothing of the chain was published
        monkeypatch.setattr(PutWriter, "write", write)
        put = await c.put(fp, toks, kv)  # control: the same put, written right
        assert put.stored == 2 and put.reserve_ms > 0  # and it went in place
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and bool(torch.isfinite(got.float()).all())


async def test_a_stopped_daemon_leaves_its_pool_unmapped() -> None:
    """Sealing an in-place put in a thread (a host of fewer than 4 cores) maps the pool in the daemon's
    process, prefaulted; a stopped daemon must let go of it, or every daemon started in one process keeps
    its whole pool resident (the test suite ran this 24 GiB machine out of memory)."""
    import gc

    from engram.config import load_config
    from engram.server import start_server
    from engram.tiers.pool import shared_pool

    srv = await start_server(load_config(env={}, overrides={"server.port": 0, "tiers.dram.capacity": "16MiB"}))
    pool = shared_pool(srv.store.tiers)
    assert pool is not None and pool.segment is not None
    path = str(pool.segment.path)

    def mapped() -> bool:  # this daemon's segment, unlinked at stop, still mapped by this process
        with open("/proc/self/maps") as fh:
            return any(path in line for line in fh)

    spec = tiny_model()
    toks = tokens(4 * BLOCK_TOKENS)
    async with EngramClient(srv.address, namespace="n", in_place_min_bytes=0) as c:
        fp = await c.register_model(spec)
        assert (await c.put(fp, toks, random_kv(spec, len(toks)))).reserve_ms > 0  # in place: sealed here
    assert mapped()  # control: the pool was mapped here while the daemon ran
    await srv.stop(0)
    del pool
    gc.collect()
    assert not mapped()


async def test_a_get_stream_never_read_is_ended_and_lets_go_and_one_read_slowly_is_not(server_factory: Any) -> None:
    """A client that opened a Get stream and never read it held, for as long as it stayed, the daemon's handler
    with the block it was sending, every block's read hold and the tenant's call share. The daemon now ends a
    stream whose client takes no message for server.stream_stall_s: DEADLINE_EXCEEDED (what the client reads
    after the messages already sent), naming the setting; holds and share come back at once. HTTP/2 shows only
    whole messages taken, each once the client has read about a flow-control window ahead of it (0.2-0.3 s at a
    message every 50 ms here): a client reading steadily that fast is served whole, for longer than the stall.
    48 blocks of 1 MiB: more than flow control lets the daemon send before the client reads."""
    srv = await server_factory(**{"server.stream_stall_s": 1.0, "server.metrics_port": -1,
                                  "server.metrics_token": "scrape-tok", "auth.tenants.alice.token": "a-tok",
                                  "auth.salt_secret": "s"})
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, block_tokens=128)
    spec = ModelSpec(name="mib", weights_id="w", layout=layout, codec="raw")
    kv = random_kv(spec, 48 * 128)
    async with EngramClient(srv.address, token="a-tok", namespace="alice", zero_copy=False,
                            data_channel=False) as c:
        fp = await c.register_model(spec)
        keys = list((await c.put(fp, tokens(48 * 128), kv)).keys)
    assert srv.service is not None and srv.service.tenancy is not None and srv.metrics is not None
    calls = srv.service.tenancy._calls
    holds = lambda: sum(srv.store.index.get(k).leases for k in keys)  # noqa: E731
    ended = lambda: srv.metrics.registry.get_sample_value(  # type: ignore[union-attr]  # noqa: E731
        "engram_rpcs_total", {"method": "Get", "code": "DEADLINE_EXCEEDED"}) or 0
    channel, s = stub(srv, "a-tok")
    try:
        deaf = s.Get(pb.GetRequest(namespace="alice", model_fingerprint=fp, keys=keys))
        deadline = time.monotonic() + 20
        while not (ended() == 1 and holds() == 0 and not calls.get("rpc")):
            assert time.monotonic() < deadline, (ended(), holds(), calls)
            await asyncio.sleep(0.02)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in deaf:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "server.stream_stall_s" in (info.value.details() or "")
        slow, got = s.Get(pb.GetRequest(namespace="alice", model_fingerprint=fp, keys=keys)), []
        async for resp in slow:
            got.append(resp.chunk.data)  # a block a message (server.chunk_bytes holds one)
            await asyncio.sleep(0.05)
        assert got == [kv[:, :, i * 128:(i + 1) * 128].contiguous().view(torch.uint8).numpy().tobytes()
                       for i in range(48)]
        assert ended() == 1 and holds() == 0
    finally:
        await channel.close()


async def test_a_get_stream_whose_client_process_dies_ends_cancelled_not_as_an_internal_error(
        server_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The streaming wrapper writes each message itself (under server.stream_stall_s); a client process killed
    while it read made that write raise grpc's InternalError (at some timings: 1 run in 6 here; otherwise grpc
    cancels the handler first), logged with a traceback as "internal error in Get" and counted INTERNAL. A
    client gone is a cancel: counted CANCELLED, holds back, nothing logged as an error."""
    srv = await server_factory(**{"server.metrics_port": -1})
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, block_tokens=128)
    spec = ModelSpec(name="mib", weights_id="w", layout=layout, codec="raw")
    async with EngramClient(srv.address, zero_copy=False, data_channel=False) as c:
        fp = await c.register_model(spec)
        keys = list((await c.put(fp, tokens(48 * 128), random_kv(spec, 48 * 128))).keys)
    assert srv.metrics is not None
    count = lambda code: srv.metrics.registry.get_sample_value(  # type: ignore[union-attr]  # noqa: E731
        "engram_rpcs_total", {"method": "Get", "code": code}) or 0
    holds = lambda: sum(srv.store.index.get(k).leases for k in keys)  # noqa: E731
    script = (
        "import asyncio, sys, grpc\n"
        "from engram.v1 import engram_pb2 as pb, engram_pb2_grpc as pbg\n"
        "async def main():\n"
        f"    ch = grpc.aio.insecure_channel({srv.address!r})\n"
        "    s = pbg.EngramStub(ch)\n"
        f"    call = s.Get(pb.GetRequest(namespace='default', model_fingerprint={fp!r}, keys={keys!r}))\n"
        "    await call.read()\n"
        "    print('reading', flush=True)\n"
        "    while True:\n"
        "        await call.read()\n"
        "        await asyncio.sleep(0.01)\n"
        "asyncio.run(main())\n")
    kills = 8  # a write meets the dead client (rather than the cancel the handler) only at some timings
    for i in range(kills):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"reading\n"
            proc.kill()
            await proc.wait()
            deadline = time.monotonic() + 20
            while not (count("CANCELLED") + count("INTERNAL") == i + 1 and holds() == 0):
                assert time.monotonic() < deadline, (count("CANCELLED"), count("INTERNAL"), holds())
                await asyncio.sleep(0.02)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert (count("CANCELLED"), count("INTERNAL")) == (kills, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_get_stream_that_fails_part_way_unread_gives_back_the_tenants_share_and_ends_in_its_status(
        server_factory: Any) -> None:
    """A Get that meets a corrupt block part-way (DATA_LOSS) while its client reads nothing: the handler ends
    and the tenant's call share (server.max_concurrent_rpcs_per_tenant, 1 here) and the blocks' holds come back
    at once, long before server.stream_stall_s, not when grpc delivers the status; the client that reads at last
    gets the blocks before the corrupt one, then DATA_LOSS."""
    srv = await server_factory(**{"server.stream_stall_s": 600.0, "tiers.dram.pool": "private",
                                  "server.max_concurrent_rpcs_per_tenant": 1,
                                  "auth.tenants.alice.token": "a-tok", "auth.salt_secret": "s"})
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=64, block_tokens=64)
    spec = ModelSpec(name="small", weights_id="w", layout=layout, codec="raw")  # 16 KiB blocks
    kv = random_kv(spec, 8 * 64)
    async with EngramClient(srv.address, token="a-tok", namespace="alice", zero_copy=False,
                            data_channel=False) as c:
        fp = await c.register_model(spec)
        keys = list((await c.put(fp, tokens(8 * 64), kv)).keys)
    dram = srv.store.placement.tier("dram")
    blob = bytearray(dram._blocks[keys[2]])  # type: ignore[attr-defined]
    blob[-1] ^= 0xFF
    dram._blocks[keys[2]] = bytes(blob)  # type: ignore[attr-defined]
    assert srv.service is not None and srv.service.tenancy is not None
    calls = srv.service.tenancy._calls
    holds = lambda: sum(m.leases for k in keys if (m := srv.store.index.get(k)) is not None)  # noqa: E731
    # No BDP probing: the stream's window stays HTTP/2's 64 KiB, so the two blocks before the corrupt one are
    # sent (their writes end) and whatever follows them waits on the client
    channel = grpc.aio.insecure_channel(srv.address, options=[("grpc.http2.bdp_probe", 0)])
    other, s2 = stub(srv, "a-tok")
    try:
        deaf = stub_for(channel, "a-tok").Get(pb.GetRequest(namespace="alice", model_fingerprint=fp, keys=keys))
        deadline = time.monotonic() + 20
        while not (srv.store.counters.corrupt_blocks == 1 and holds() == 0 and not calls.get("rpc")):
            assert time.monotonic() < deadline, (srv.store.counters.corrupt_blocks, holds(), calls)
            await asyncio.sleep(0.02)
        await s2.Lookup(pb.LookupRequest(namespace="alice", model_fingerprint=fp, tokens=[1]))  # the share is free
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for resp in deaf:
                got.append(resp.chunk.data)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value
        assert got == [kv[:, :, i * 64:(i + 1) * 64].contiguous().view(torch.uint8).numpy().tobytes() for i in range(2)]
    finally:
        await channel.close()
        await other.close()


@pytest.mark.parametrize("method", ["/grpc.health.v1.Health/Watch",
                                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"])
async def test_unparsable_health_and_reflection_requests_are_invalid_argument_with_no_traceback_logged(
        server_factory: Any, caplog: pytest.LogCaptureFixture, method: str) -> None:
    """Bytes that are not a message, sent with no token to a streaming service that needs none (Check's case is in
    tests/test_server_errors.py): INVALID_ARGUMENT, and no traceback in the daemon's log (grpcio's handlers answered
    UNKNOWN "Unexpected DecodeError" and logged an ERROR traceback for each, so anyone could fill the log)."""
    srv = await server_factory(**{"auth.tenants.alice.token": "a-tok", "auth.salt_secret": "s"})
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(srv.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if method.endswith("Watch"):
                async for _ in channel.unary_stream(method)(b"\xff\xff\xff"):
                    pass
            else:
                async for _ in channel.stream_stream(method)(iter([b"\xff\xff\xff"])):
                    pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "not a valid message" in (info.value.details() or "")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text

"""Requests of many tiny items, and request fields of any size, against a real daemon at its default limits.

Protobuf parses a 2-byte empty sub-message into tens of bytes, so one request of millions of them made the daemon
gigabytes larger and held its event loop for seconds before any count was checked; and error messages that
repeated a request's key or fingerprint whole grew past gRPC's 16 KiB metadata limit, so the client got
RESOURCE_EXHAUSTED "Stream removed" instead of the real status (an audit). Peak memory is read from the kernel
(VmHWM, reset through clear_refs) in this process, which runs the daemon."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from test_data_channel import expect_error, raw_conn

from engram import errors
from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire import data as wire
from engram.wire.channel import open_channel

from helpers import tiny_model, tokens

NS = "tenant-a"
MB = 2**20
PEAK_GROWTH_MAX = 100 * MB  # before the fix each case below peaked 250 MB and more above where it started


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand: building millions of sub-messages in protobuf would cost this
    process what the test measures in the daemon."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _rss_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/self/status")


class PeakGrowth:
    """How far this process's peak RSS rose above its RSS at the start."""

    def __enter__(self) -> PeakGrowth:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self.start = _rss_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = (_rss_kib("VmHWM") - self.start) * 1024


async def _call(channel: grpc.aio.Channel, method: str, request: bytes, timeout: float = 60) -> grpc.aio.AioRpcError:
    call = channel.unary_unary(f"/engram.v1.Engram/{method}", request_serializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request, timeout=timeout)
    return info.value


async def test_register_model_of_two_million_layers_is_refused_before_they_are_parsed(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    layers = _field(1, b"\x08\x01") * 2_000_000  # KVLayout.layers: LayerSpec(kind=GLOBAL), 8 MB
    request = _field(1, _field(1, b"m") + _field(2, b"w") + _field(3, layers))
    async with EngramClient(srv.address, namespace=NS) as other:
        fp = await other.register_model(tiny_model())
        async with open_channel(srv.address) as channel:
            t0 = time.monotonic()
            with PeakGrowth() as peak:
                refused, hit = await asyncio.gather(_call(channel, "RegisterModel", request),
                                                    other.lookup(fp, tokens(64)))
            elapsed = time.monotonic() - t0
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "bytes exceeds" in (refused.details() or ""), refused.details()
    assert hit.matched_tokens == 0  # the other client's Lookup was answered meanwhile
    assert peak.bytes < PEAK_GROWTH_MAX, f"the daemon's peak grew {peak.bytes / MB:.0f} MB"
    assert elapsed < 20


async def test_a_layout_with_too_many_layers_is_refused_by_count_before_any_is_converted(server_factory) -> None:  # type: ignore[no-untyped-def]
    """1,025 layers, the last of an unknown kind: the count is refused first (converting each layer first let
    a layout of millions reach the daemon's memory before KVLayout counted them)."""
    srv = await server_factory()
    layout = convert.layout_to_pb(tiny_model().layout)
    del layout.layers[:]
    layout.layers.extend([pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL)] * 1024 + [pb.LayerSpec(kind=99)])  # type: ignore[list-item]
    request = pb.RegisterModelRequest(model=pb.ModelSpec(name="m", weights_id="w", layout=layout))
    async with open_channel(srv.address) as channel:
        refused = await _call(channel, "RegisterModel", request.SerializeToString())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "number of layers must be in [1, 1024], got 1025" in (refused.details() or ""), refused.details()


async def test_reserve_put_of_three_million_empty_headers_is_refused_before_they_are_parsed(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    async with EngramClient(srv.address, namespace=NS) as c:
        fp = await c.register_model(tiny_model())
    request = _field(1, NS.encode()) + _field(2, fp) + _field(5, b"") * 3_000_000  # 6 MB
    async with open_channel(srv.address) as channel:
        with PeakGrowth() as peak:
            refused = await _call(channel, "ReservePut", request)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert peak.bytes < PEAK_GROWTH_MAX, f"the daemon's peak grew {peak.bytes / MB:.0f} MB"


async def test_data_channel_put_of_three_million_empty_headers_is_refused_before_they_are_parsed(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    async with EngramClient(srv.address, namespace=NS) as c:
        fp = await c.register_model(tiny_model())
    meta = _field(1, pb.PutHeader(namespace=NS, model_fingerprint=fp).SerializeToString()) + _field(2, b"") * 3_000_000
    conn = await raw_conn(srv)
    try:
        with PeakGrowth() as peak:
            await conn.send_frame(wire.PUT, meta)
            await expect_error(conn, errors.ResourceExhausted, "max_blocks_per_request")
    finally:
        conn.close()
    assert peak.bytes < PEAK_GROWTH_MAX, f"the daemon's peak grew {peak.bytes / MB:.0f} MB"


async def test_a_twenty_kilobyte_fingerprint_or_key_gets_its_status_not_resource_exhausted(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory()
    async with EngramClient(srv.address, namespace=NS) as c:
        fp = await c.register_model(tiny_model())
    huge = b"\xab" * 20_000
    async with open_channel(srv.address) as channel:
        lookup = await _call(channel, "Lookup", pb.LookupRequest(namespace=NS, model_fingerprint=huge,
                                                                 tokens=[1, 2, 3]).SerializeToString())
        get = channel.unary_stream("/engram.v1.Engram/Get", request_serializer=lambda m: m.SerializeToString())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in get(pb.GetRequest(namespace=NS, model_fingerprint=fp, keys=[huge]), timeout=30):
                pass
    assert lookup.code() == grpc.StatusCode.NOT_FOUND, lookup.details()
    assert "(20000 bytes)" in (lookup.details() or "")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()

"""Calls whose request never arrives (engram/server/arrival.py): a client that sends a call's headers and no
message must not hold grpc's server.max_concurrent_rpcs slots from everyone else. A stream-unary call to a
unary method sends exactly that; grpcio's own client does it here, against a real daemon."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb

from helpers import tiny_model, tokens

pytestmark = pytest.mark.asyncio

SILENT = 8  # as many silent calls as the daemon's slots below


async def _never() -> AsyncIterator[bytes]:
    await asyncio.Event().wait()
    yield b""  # pragma: no cover: never reached


def _silent_calls(channel: grpc.aio.Channel, method: str, n: int, token: str = "") -> list[Any]:
    """`n` calls of `method` whose headers are sent and whose request message never is."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    call = channel.stream_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    return [call(_never(), metadata=metadata) for _ in range(n)]


async def _outcome(call: Any) -> grpc.StatusCode | None:
    """The silent call's status if it has ended within a second, else None (still open on the daemon)."""
    try:
        await asyncio.wait_for(asyncio.shield(call), 1)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except TimeoutError:
        return None
    return grpc.StatusCode.OK


async def _stats_served(address: str, token: str = "", namespace: str = "") -> bool:
    try:
        async with EngramClient(address, token=token, namespace=namespace or "default") as c:
            await c.stats()
        return True
    except Exception as exc:
        assert "RESOURCE_EXHAUSTED" in repr(exc) or "Concurrent RPC limit" in str(exc), exc
        return False


async def test_calls_whose_request_never_arrives_end_after_stream_stall_s_and_free_their_slots(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Tenancy off: anyone's silent calls to Engram's unary methods took every slot for as long as the peer
    liked; each now ends DEADLINE_EXCEEDED once server.stream_stall_s passes without its message."""
    srv = await server_factory(**{"server.max_concurrent_rpcs": SILENT, "server.stream_stall_s": 1.0})
    async with grpc.aio.insecure_channel(srv.address) as channel:
        silent = _silent_calls(channel, "/engram.v1.Engram/Stats", SILENT)
        assert await _outcome(silent[0]) is None  # open: the daemon waits for its message, within the stall
        for _ in range(100):
            if await _stats_served(srv.address):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the silent calls kept every slot past server.stream_stall_s")
        for call in silent:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(call, 10)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "did not arrive within 1s (server.stream_stall_s)" in (ended.value.details() or "")


async def test_silent_calls_without_a_token_are_refused_at_their_headers(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Tenancy on: a peer with no token is UNAUTHENTICATED before the daemon waits for anything, so its silent
    calls hold no slot while a tenant's calls are served."""
    srv = await server_factory(**{"server.max_concurrent_rpcs": SILENT, "server.stream_stall_s": 60.0,
                                  "auth.tenants.alice.token": "alice-token", "auth.salt_secret": "s"})
    async with grpc.aio.insecure_channel(srv.address) as channel:
        silent = _silent_calls(channel, "/engram.v1.Engram/Lookup", SILENT)
        for call in silent:
            assert await _outcome(call) == grpc.StatusCode.UNAUTHENTICATED
        assert await _stats_served(srv.address, "alice-token", "alice")


async def test_a_tenants_silent_calls_fill_only_its_own_share(server_factory) -> None:  # type: ignore[no-untyped-def]
    """A tenant's silent calls count against server.max_concurrent_rpcs_per_tenant from their headers on: the
    ones past its share are refused at once, and another tenant's calls find slots while the rest wait."""
    srv = await server_factory(**{"server.max_concurrent_rpcs": 4, "server.max_concurrent_rpcs_per_tenant": 2,
                                  "server.stream_stall_s": 60.0, "auth.salt_secret": "s",
                                  "auth.tenants.alice.token": "alice-token", "auth.tenants.bob.token": "bob-token"})
    async with grpc.aio.insecure_channel(srv.address) as channel:
        silent = _silent_calls(channel, "/engram.v1.Engram/Stats", 4, token="alice-token")
        outcomes = [await _outcome(call) for call in silent]
        assert sorted(outcomes, key=str) == sorted([None, None, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                    grpc.StatusCode.RESOURCE_EXHAUSTED], key=str)
        async with EngramClient(srv.address, token="bob-token", namespace="bob") as bob:
            fp = await bob.register_model(tiny_model())
            assert (await bob.lookup(fp, tokens(64))).matched_tokens == 0
        for call in silent:
            call.cancel()


async def test_silent_health_checks_count_in_the_open_services_share(server_factory) -> None:  # type: ignore[no-untyped-def]
    """Health/Check needs no token: its silent calls count against server.max_concurrent_open_rpcs from their
    headers on (they took every slot of server.max_concurrent_rpcs), and a tenant's calls are served."""
    srv = await server_factory(**{"server.max_concurrent_rpcs": SILENT, "server.max_concurrent_open_rpcs": 2,
                                  "server.stream_stall_s": 60.0})
    async with grpc.aio.insecure_channel(srv.address) as channel:
        silent = _silent_calls(channel, "/grpc.health.v1.Health/Check", SILENT)
        outcomes = [await _outcome(call) for call in silent]
        assert outcomes.count(None) == 2
        assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == SILENT - 2
        assert await _stats_served(srv.address)
        for call in silent:
            call.cancel()


async def test_a_put_stream_that_stops_sending_ends_and_a_call_without_its_message_is_invalid(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client-streaming Put that sent its header and then nothing held its slot (and its tenant's share) for
    ever; it ends DEADLINE_EXCEEDED after server.stream_stall_s. A unary call that half-closes without its
    message is INVALID_ARGUMENT."""
    srv = await server_factory(**{"server.stream_stall_s": 1.0})
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(tiny_model())

    async def header_then_nothing() -> AsyncIterator[bytes]:
        yield pb.PutRequest(header=pb.PutHeader(model_fingerprint=fp, namespace="ns")).SerializeToString()
        await asyncio.Event().wait()

    async def nothing() -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover

    async with grpc.aio.insecure_channel(srv.address) as channel:
        stalled = await _ended(channel, "/engram.v1.Engram/Put", header_then_nothing())
        assert stalled.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "next message of this Put stream" in (stalled.details() or "")
        empty = await _ended(channel, "/engram.v1.Engram/Stats", nothing())
        assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "without its request message" in (empty.details() or "")


async def _ended(channel: grpc.aio.Channel, method: str, requests: AsyncIterator[bytes]) -> grpc.aio.AioRpcError:
    """The error a call of `method` sending `requests` ends with (within 20 s)."""
    call = channel.stream_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await asyncio.wait_for(call(requests), 20)
    return ended.value

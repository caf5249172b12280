"""Bad input gets the right status code and a message; the daemon keeps serving and loses nothing."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from engram import errors
from engram.block import checksum
from engram.client import EngramClient
from engram.codec.stored import RAW, encode
from engram.layout import DType
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens


@pytest.fixture
async def seeded(server: RunningServer, client: EngramClient):  # type: ignore[no-untyped-def]
    """A daemon holding known content, and a raw stub for malformed requests."""
    spec = tiny_model()
    fp = await client.register_model(spec)
    toks = tokens(3 * BLOCK_TOKENS + 4, seed=11)
    kv = random_kv(spec, len(toks), seed=11)
    await client.put(fp, toks, kv)
    channel = grpc.aio.insecure_channel(server.address)
    stub = pb_grpc.EngramStub(channel)
    yield spec, fp, toks, kv, stub, channel
    await channel.close()


async def assert_content_intact(client: EngramClient, fp: bytes, toks: np.ndarray, kv: torch.Tensor) -> None:
    n, got = await client.get_prefix(fp, toks)
    assert n == len(toks) and got is not None and torch.equal(got, kv)
    stats = await client.stats()
    assert stats.tiers[0].blocks == 4


def block_msg(toks: np.ndarray, kv: torch.Tensor, **override: object) -> pb.PutRequest:
    payload = encode(kv, RAW)
    fields: dict[str, object] = {
        "tokens": toks.tolist(), "dtype": int(DType.from_torch(kv.dtype)), "shape": list(kv.shape),
        "payload_nbytes": len(payload), "checksum": checksum(payload),
    }
    data = override.pop("data", payload)
    last = override.pop("last", True)
    fields.update(override)
    return pb.PutRequest(chunk=pb.BlockChunk(header=pb.BlockHeader(**fields), data=data, last=last))  # type: ignore[arg-type]


async def put_raw(stub: pb_grpc.EngramStub, fp: bytes, *msgs: pb.PutRequest, ns: str = "tenant-a") -> pb.PutResponse:
    async def gen():  # type: ignore[no-untyped-def]
        yield pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=fp))
        for m in msgs:
            yield m

    return await stub.Put(gen())


async def expect_status(coro, code: grpc.StatusCode, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert match in (info.value.details() or ""), info.value.details()


async def test_wrong_shape(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    bad = torch.zeros(2, 2, BLOCK_TOKENS, 4, 16, dtype=torch.bfloat16)  # 4 kv heads, layout has 2
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS, 5), bad)),
                        grpc.StatusCode.INVALID_ARGUMENT, "does not match the layout")
    await assert_content_intact(client, fp, toks, kv)


async def test_wrong_dtype(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    bad = random_kv(spec, BLOCK_TOKENS).to(torch.float16)
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS, 5), bad)),
                        grpc.StatusCode.INVALID_ARGUMENT, "dtype FP16 does not match")
    with pytest.raises(errors.InvalidArgument, match="dtype"):
        await client.put(fp, tokens(BLOCK_TOKENS, 5), bad)
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS, 5), random_kv(spec, BLOCK_TOKENS), dtype=9)),
                        grpc.StatusCode.INVALID_ARGUMENT, "dtype must be")
    await assert_content_intact(client, fp, toks, kv)


async def test_checksum_and_size_mismatch(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    good = random_kv(spec, BLOCK_TOKENS)
    flipped = bytearray(encode(good, RAW))
    flipped[7] ^= 0x10
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS, 5), good, data=bytes(flipped))),
                        grpc.StatusCode.INVALID_ARGUMENT, "checksum")
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS, 5), good, payload_nbytes=10)),
                        grpc.StatusCode.INVALID_ARGUMENT, "payload_nbytes")
    await expect_status(put_raw(stub, fp, block_msg(tokens(BLOCK_TOKENS + 1, 5), good)),
                        grpc.StatusCode.INVALID_ARGUMENT, "exceed the layout's block_tokens")
    await assert_content_intact(client, fp, toks, kv)


async def test_unknown_model_fingerprint(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    unknown = bytes(16)
    await expect_status(put_raw(stub, unknown, block_msg(tokens(BLOCK_TOKENS, 5), random_kv(spec, BLOCK_TOKENS))),
                        grpc.StatusCode.NOT_FOUND, "RegisterModel")
    await expect_status(stub.Lookup(pb.LookupRequest(namespace="tenant-a", model_fingerprint=unknown, tokens=[1])),
                        grpc.StatusCode.NOT_FOUND, "unknown model fingerprint")
    # A model with other weights has another fingerprint, and sees none of the first model's blocks.
    fp2 = await client.register_model(tiny_model(weights_id="seed-1"))
    assert fp2 != fp and (await client.lookup(fp2, toks)).matched_tokens == 0
    await assert_content_intact(client, fp, toks, kv)


async def test_truncated_stream_stores_nothing_of_the_broken_block(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    new = tokens(2 * BLOCK_TOKENS, seed=21)
    new_kv = random_kv(spec, len(new), seed=21)
    first = block_msg(new[:BLOCK_TOKENS], new_kv[:, :, :BLOCK_TOKENS])
    second_full = block_msg(new[BLOCK_TOKENS:], new_kv[:, :, BLOCK_TOKENS:])
    half = second_full.chunk.data[: len(second_full.chunk.data) // 2]
    second_cut = pb.PutRequest(chunk=pb.BlockChunk(header=second_full.chunk.header, data=half, last=False))
    await expect_status(put_raw(stub, fp, first, second_cut), grpc.StatusCode.INVALID_ARGUMENT,
                        "ended inside block 1")
    hit = await client.lookup(fp, new)
    assert hit.matched_tokens == BLOCK_TOKENS  # block 0 was complete and is stored; block 1 is not
    empty_put = await put_raw(stub, fp)  # a header and no blocks is a valid, empty Put
    assert list(empty_put.keys) == [] and empty_put.stored == 0
    n, got = await client.get_prefix(fp, toks)
    assert n == len(toks) and got is not None and torch.equal(got, kv)


async def test_stream_protocol_violations(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded

    async def no_header():  # type: ignore[no-untyped-def]
        yield block_msg(tokens(BLOCK_TOKENS), random_kv(spec, BLOCK_TOKENS))

    await expect_status(stub.Put(no_header()), grpc.StatusCode.INVALID_ARGUMENT, "must be a PutHeader")

    async def empty():  # type: ignore[no-untyped-def]
        return
        yield

    await expect_status(stub.Put(empty()), grpc.StatusCode.INVALID_ARGUMENT, "empty Put stream")
    headerless = pb.PutRequest(chunk=pb.BlockChunk(data=b"x", last=True))
    await expect_status(put_raw(stub, fp, headerless), grpc.StatusCode.INVALID_ARGUMENT, "must carry the BlockHeader")
    # A partial block followed by another block: only a chain's last block may be partial.
    short = tokens(5, seed=3)
    await expect_status(
        put_raw(stub, fp, block_msg(short, random_kv(spec, 5)), block_msg(tokens(BLOCK_TOKENS, 4), random_kv(spec, BLOCK_TOKENS))),
        grpc.StatusCode.INVALID_ARGUMENT, "only a chain's last block may be partial")
    # A parent that is not stored.
    async def orphan():  # type: ignore[no-untyped-def]
        yield pb.PutRequest(header=pb.PutHeader(namespace="tenant-a", model_fingerprint=fp, parent_key=b"\x01" * 16))
        yield block_msg(tokens(BLOCK_TOKENS, 8), random_kv(spec, BLOCK_TOKENS))

    await expect_status(stub.Put(orphan()), grpc.StatusCode.FAILED_PRECONDITION, "parent block")
    await assert_content_intact(client, fp, toks, kv)


async def test_oversized_message_is_refused(server_factory, transport) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"server.max_message_bytes": 1 << 20, "server.chunk_bytes": 1 << 19})
    spec = tiny_model()
    async with EngramClient(srv.address, namespace="tenant-a") as client:
        fp = await client.register_model(spec)
        toks = tokens(40)
        kv = random_kv(spec, 40)
        await client.put(fp, toks, kv)
        channel = grpc.aio.insecure_channel(srv.address, options=[("grpc.max_send_message_length", 8 << 20)])
        stub = pb_grpc.EngramStub(channel)
        huge = pb.LookupRequest(namespace="tenant-a", model_fingerprint=fp, tokens=list(range(400_000)))  # ~1.1 MB
        await expect_status(stub.Lookup(huge), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
        await channel.close()
        n, got = await client.get_prefix(fp, toks)
        assert n == 40 and got is not None and torch.equal(got, kv)


async def test_request_limits(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"server.max_tokens_per_request": 100, "server.max_blocks_per_request": 2})
    spec = tiny_model()
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        # As a client that does not cap or split its requests (an older one, or another)
        client._max_tokens = client._max_blocks = 1 << 62
        with pytest.raises(errors.ResourceExhausted, match="limit of 100"):
            await client.lookup(fp, tokens(101))
        with pytest.raises(errors.ResourceExhausted, match="limit of 2"):
            await client.put(fp, tokens(3 * BLOCK_TOKENS), random_kv(spec, 3 * BLOCK_TOKENS), skip_cached=False)
        with pytest.raises(errors.ResourceExhausted, match="limit of 2"):
            await client.get(fp, [b"k" * 16] * 3)


async def test_garbage_bytes_get_invalid_argument(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, channel = seeded
    for method in ("Lookup", "Stats", "RegisterModel", "Pin"):
        raw = channel.unary_unary(f"/engram.v1.Engram/{method}")  # no serializers: bytes go as they are
        await expect_status(raw(b"\xff\xff\xff\xff garbage"), grpc.StatusCode.INVALID_ARGUMENT, "not a valid")
    raw_get = channel.unary_stream("/engram.v1.Engram/Get")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in raw_get(b"\x0a\xff\xff"):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    raw_put = channel.stream_unary("/engram.v1.Engram/Put")

    async def garbage():  # type: ignore[no-untyped-def]
        yield b"\x12\xff\xff\xff\x0f"

    await expect_status(raw_put(garbage()), grpc.StatusCode.INVALID_ARGUMENT, "not a valid")
    await assert_content_intact(client, fp, toks, kv)


async def test_unknown_block(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    with pytest.raises(errors.NotFound, match=f"^block {'00' * 16} is not stored .*key 1 of the 2 this request"):
        hit = await client.lookup(fp, toks)
        await client.get(fp, [hit.blocks[0].key, b"\x00" * 16])
    with pytest.raises(errors.NotFound):
        await client.pin(fp, [b"\x00" * 16])
    await assert_content_intact(client, fp, toks, kv)


async def test_an_unknown_model_reaches_the_client_as_unknown_model_and_an_unknown_block_as_plain_not_found(
        seeded, client) -> None:  # type: ignore[no-untyped-def]
    """Both are NOT_FOUND on the wire; the client tells the model's apart by the daemon's message, because a worker
    recovers from that one alone, by registering the model again (a daemon restarted without a model registry)."""
    spec, fp, toks, kv, stub, _ = seeded
    with pytest.raises(errors.UnknownModel, match="unknown model fingerprint 0101"):
        await client.lookup(b"\x01" * 16, toks)
    with pytest.raises(errors.NotFound) as info:
        await client.get(fp, [b"\x00" * 16])
    assert type(info.value) is errors.NotFound


async def test_bad_layout_is_invalid_argument(seeded, client) -> None:  # type: ignore[no-untyped-def]
    spec, fp, toks, kv, stub, _ = seeded
    bad = pb.ModelSpec(name="m", weights_id="w", layout=pb.KVLayout(
        layers=[pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL)], num_kv_heads=2, head_dim=16, dtype=pb.DTYPE_BF16,
        block_tokens=24))
    await expect_status(stub.RegisterModel(pb.RegisterModelRequest(model=bad)), grpc.StatusCode.INVALID_ARGUMENT,
                        "power of two")
    good_layout = pb.KVLayout(layers=[pb.LayerSpec(kind=pb.LAYER_KIND_GLOBAL)], num_kv_heads=2, head_dim=16,
                              dtype=pb.DTYPE_BF16, block_tokens=16)
    no_weights = pb.ModelSpec(name="m", layout=good_layout)
    await expect_status(stub.RegisterModel(pb.RegisterModelRequest(model=no_weights)),
                        grpc.StatusCode.INVALID_ARGUMENT, "weights_id")
    await assert_content_intact(client, fp, toks, kv)


async def test_health_and_reflection_are_served(server) -> None:  # type: ignore[no-untyped-def]
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service="engram.v1.Engram"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for r in refl.ServerReflectionInfo(ask()):
            names = [s.name for s in r.list_services_response.service]
        assert "engram.v1.Engram" in names and "grpc.health.v1.Health" in names


async def test_open_health_watches_without_a_token_cannot_take_the_tenants_call_slots(server_factory, caplog
                                                                                       ) -> None:  # type: ignore[no-untyped-def]
    """Health and reflection need no token; Watch streams never end. With 8 call slots and 3 for them, 8 Watches
    opened by a caller with no token: 3 are served, the rest refused RESOURCE_EXHAUSTED at once, and a
    tenant's calls still find slots (they took all of server.max_concurrent_rpcs, so every tenant's call was
    RESOURCE_EXHAUSTED). Bytes the health service cannot decode are INVALID_ARGUMENT, not UNKNOWN with a
    traceback in the log."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = await server_factory(**{"server.max_concurrent_rpcs": 8, "server.max_concurrent_open_rpcs": 3,
                                  "auth.tenants.alice.token": "alice-token", "auth.salt_secret": "s"})
    async with grpc.aio.insecure_channel(srv.address) as channel:
        watches = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                   for _ in range(8)]
        served, refused = 0, 0
        for watch in watches:
            try:
                first = await asyncio.wait_for(watch.read(), 10)
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                served += 1
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent_open_rpcs" in exc.details()
                refused += 1
        assert (served, refused) == (3, 5)
        async with EngramClient(srv.address, token="alice-token", namespace="alice") as alice:
            fp = await alice.register_model(tiny_model())
            await alice.stats()
            assert (await alice.lookup(fp, tokens(BLOCK_TOKENS))).matched_tokens == 0
        for watch in watches:
            watch.cancel()
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):  # the cancelled watches end on the daemon's side soon after
            try:
                await health.Check(health_pb2.HealthCheckRequest(service=""))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.05)
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        caplog.clear()
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await check(b"\xff\xff\xff")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the log for a request anyone may send"


async def test_an_open_service_request_of_more_than_a_few_kib_is_refused_and_not_kept(server_factory
                                                                                     ) -> None:  # type: ignore[no-untyped-def]
    """Health and reflection need no token, and took requests as long as server.max_message_bytes (64 MiB):
    grpcio's health servicer keeps a Watch's service name for the stream's life, so 8 Watches naming 32 MiB
    services held 825 MiB of a tenancy-on daemon for as long as the peer liked (an audit, session 48). A request
    past OPEN_REQUEST_MAX_BYTES is refused RESOURCE_EXHAUSTED, for Check, Watch and reflection alike, and the
    servicer keeps no such name; a long but plausible name is still answered."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    srv = await server_factory(**{"auth.tenants.alice.token": "alice-token", "auth.salt_secret": "s"})
    huge = "x" * (64 * 2**10)
    async with grpc.aio.insecure_channel(srv.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=huge))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(watch.read(), 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "services take at most 4096" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health.Check(health_pb2.HealthCheckRequest(service=huge))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        async def ask(symbol: str):  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in reflect(ask(huge)):
                pass
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        found = [r async for r in reflect(ask("engram.v1.Engram"))]
        assert found and found[0].file_descriptor_response.file_descriptor_proto
        plausible = health.Watch(health_pb2.HealthCheckRequest(service="y" * 1000))
        first = await asyncio.wait_for(plausible.read(), 10)
        assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watched = srv.health._watcher_count_by_service  # grpcio's aio servicer: service name -> its Watches
        assert "y" * 1000 in watched and huge not in watched
        plausible.cancel()


async def test_every_method_the_daemon_serves_checks_a_token_or_is_one_of_the_open_methods(server_factory,  # type: ignore[no-untyped-def]
                                                                                           monkeypatch) -> None:
    """The open services (no token, a share of their own) are an exact set of methods (server/openrpcs.py), not
    name prefixes. Every method the daemon registers, whatever registers it, is either refused
    UNAUTHENTICATED without a token, or one of that set and counted in its share (with the one slot of
    server.max_concurrent_open_rpcs held by a Health/Watch, refused RESOURCE_EXHAUSTED); and every method of
    the set is served. A service added later fails here until it is classified."""
    from grpc.aio import _server
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from engram.server.openrpcs import OPEN_METHODS

    registered: dict[str, grpc.RpcMethodHandler] = {}
    add_generic, add_registered = _server.Server.add_generic_rpc_handlers, _server.Server.add_registered_method_handlers

    def generic(self, handlers):  # type: ignore[no-untyped-def]
        for h in handlers:
            table = getattr(h, "_method_handlers", None)  # grpc.method_handlers_generic_handler's table
            assert table is not None, f"a generic handler whose methods this test cannot list: {h!r}"
            registered.update(table)
        return add_generic(self, handlers)

    def by_service(self, service, handlers):  # type: ignore[no-untyped-def]
        registered.update({f"/{service}/{name}": h for name, h in handlers.items()})
        return add_registered(self, service, handlers)

    monkeypatch.setattr(_server.Server, "add_generic_rpc_handlers", generic)
    monkeypatch.setattr(_server.Server, "add_registered_method_handlers", by_service)
    srv = await server_factory(**{"server.max_concurrent_open_rpcs": 1, "auth.tenants.alice.token": "alice-token",
                                  "auth.salt_secret": "s"})
    open_methods = {m for m in registered if m in OPEN_METHODS}
    assert open_methods == OPEN_METHODS
    token_checked = sorted(set(registered) - OPEN_METHODS)
    strays = [m for m in token_checked if not m.startswith("/engram.v1.")]
    assert len(token_checked) > 10 and not strays, f"neither Engram's methods nor open ones: {strays}"
    async with grpc.aio.insecure_channel(srv.address) as channel:
        for method in token_checked:
            assert await _status_without_a_token(channel, method, registered[method]) == \
                grpc.StatusCode.UNAUTHENTICATED, method
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 10)).status == health_pb2.HealthCheckResponse.SERVING
        for method in sorted(OPEN_METHODS):
            assert await _status_without_a_token(channel, method, registered[method]) == \
                grpc.StatusCode.RESOURCE_EXHAUSTED, method
        watch.cancel()


async def _status_without_a_token(channel: grpc.aio.Channel, method: str, handler: grpc.RpcMethodHandler
                                  ) -> grpc.StatusCode:
    """Call `method` with an empty request (a stream of none), as its handler's kind takes it: its status."""
    async def nothing():  # type: ignore[no-untyped-def]
        return
        yield

    kind = f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"
    call = getattr(channel, kind)(method)(nothing() if handler.request_streaming else b"")
    try:
        if handler.response_streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK

"""Room in the model registry, through a real daemon: a registration that holds nothing gives its place up.

A deployment registers a new model per checkpoint. Registrations were never dropped, so after
server.max_models_per_tenant of them a tenant could register no other, ever (its namespace evicted whole, after
restarts), and with tenancy off the same at server.max_models for everyone (an audit, session 45). Now a
registration past a bound first drops registrations that hold nothing (no block, session, reservation or put in
flight), the least recently registered or used first; one that holds anything keeps its place."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc
from engram.wire import convert

from helpers import BLOCK_TOKENS, register_holding, tiny_model, tokens

ALICE, BOB = "alice-token", "bob-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.salt_secret": "test-secret",
        "auth.same_host_paths": "on"}  # so that ReservePut reaches its reservation


def as_(srv: RunningServer, token: str) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace="")  # "": the token's own namespace


async def knows(client: EngramClient, fp: bytes) -> bool:
    """Whether the client's tenant sees the model (a Lookup naming one it has not registered: UnknownModel), asked
    by a client of its token that registered nothing: `client` registers its own models again on that error."""
    async with EngramClient(client.address, token=client._token, namespace=client.namespace) as asker:
        try:
            await asker.lookup(fp, tokens(BLOCK_TOKENS))
        except errors.UnknownModel:
            return False
    return True


def model_files(root: Path) -> dict[str, list[str]]:
    """The registry on disk: each model file's weights id and the tenants it names."""
    files = [json.loads(p.read_text()) for p in (root / "models").glob("*.json")]
    return {f["weights_id"]: f["tenants"] for f in files}


async def test_past_its_share_a_tenant_drops_its_registrations_that_hold_nothing_and_a_restart_agrees(
        server_factory: Any, tmp_path: Path) -> None:
    cfg = {**AUTH, "server.max_models_per_tenant": 2, "tiers.nvme.path": str(tmp_path / "nvme"),
           "tiers.write_policy": "write-through"}
    srv = await server_factory(**cfg)
    async with as_(srv, BOB) as b:
        shared = await register_holding(b, tiny_model(weights_id="shared"))
    async with as_(srv, ALICE) as a:
        fa = await register_holding(a, tiny_model(weights_id="a"))
        assert await a.register_model(tiny_model(weights_id="shared")) == shared  # nothing of hers under it
        fc = await a.register_model(tiny_model(weights_id="c"))  # past her share of 2: "shared" gave its place up
        assert not await knows(a, shared) and await knows(a, fa) and await knows(a, fc)
        assert (await a.lookup(fa, tokens(BLOCK_TOKENS))).matched_tokens == BLOCK_TOKENS  # a holds its block
        await a.evict(whole_namespace=True)  # now "a" holds nothing either; "c", used before it, goes first
        fd = await a.register_model(tiny_model(weights_id="d"))
        assert not await knows(a, fc) and await knows(a, fa) and await knows(a, fd)  # "d" used last
        fe = await a.register_model(tiny_model(weights_id="e"))
        assert not await knows(a, fa) and await knows(a, fd) and await knows(a, fe)
    async with as_(srv, BOB) as b:  # his registration and block are untouched
        assert (await b.lookup(shared, tokens(BLOCK_TOKENS))).matched_tokens == BLOCK_TOKENS
    # A model no tenant registers any more and nothing holds is gone with its file; "shared" stays Bob's.
    assert model_files(tmp_path / "nvme") == {"shared": ["bob"], "d": ["alice"], "e": ["alice"]}
    await srv.stop(0)

    srv = await server_factory(**cfg)  # the same registry on disk
    async with as_(srv, ALICE) as a:
        assert [await knows(a, fp) for fp in (fa, shared, fc, fd, fe)] == [False, False, False, True, True]
        assert await a.register_model(tiny_model(weights_id="e")) == fe  # hers again: free, nothing dropped
        assert await knows(a, fd)
    async with as_(srv, BOB) as b:
        assert (await b.lookup(shared, tokens(BLOCK_TOKENS))).matched_tokens == BLOCK_TOKENS


async def open_put(stub: pb_grpc.EngramStub, fp: bytes, md: tuple[tuple[str, str], ...]
                   ) -> tuple[asyncio.Event, Any]:
    """A Put stream that sent its header and waits (a worker between blocks); it ends when the event is set."""
    done = asyncio.Event()

    async def requests() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(model_fingerprint=fp))
        await done.wait()

    call = stub.Put(requests(), metadata=md)
    await asyncio.sleep(0.3)  # the daemon has read the header
    return done, call


async def test_a_registration_holding_a_block_session_reservation_or_put_in_flight_keeps_its_place(
        server_factory: Any) -> None:
    srv = await server_factory(**{**AUTH, "server.max_models_per_tenant": 2, "server.lease_s": 0.5})
    md = (("authorization", f"Bearer {ALICE}"),)
    spec_b = tiny_model(weights_id="b")
    lay = spec_b.layout
    header = pb.BlockHeader(tokens=convert.tokens_to_pb(tokens(BLOCK_TOKENS)), dtype=int(lay.dtype),
                            shape=list(lay.block_shape(BLOCK_TOKENS)), payload_nbytes=lay.block_nbytes(BLOCK_TOKENS),
                            codec="raw")
    async with as_(srv, ALICE) as a, grpc.aio.insecure_channel(srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)
        fa = await register_holding(a, tiny_model(weights_id="a"))
        fb = await a.register_model(spec_b)

        async def c_refused() -> None:
            with pytest.raises(errors.ResourceExhausted, match="has registered 2 models"):
                await a.register_model(tiny_model(weights_id="c"))
            assert await knows(a, fa) and await knows(a, fb)

        session = await a.open_session(fb, mode="persist")
        await c_refused()
        await a.close_session(session.session_id)

        await stub.ReservePut(pb.ReservePutRequest(model_fingerprint=fb, blocks=[header]), metadata=md)
        await c_refused()
        await asyncio.sleep(1.5)  # never committed: closed after lease_s, its slots let go a term later

        done, call = await open_put(stub, fb, md)
        await c_refused()
        done.set()
        assert not (await call).keys  # the stream ended with no block

        fc = await a.register_model(tiny_model(weights_id="c"))  # "b" holds nothing now: it gives its place up
        assert not await knows(a, fb) and await knows(a, fa) and await knows(a, fc)


async def test_with_tenancy_off_a_full_registry_forgets_a_model_that_holds_nothing(
        server_factory: Any, tmp_path: Path) -> None:
    cfg = {"server.max_models": 2, "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"}
    srv = await server_factory(**cfg)
    async with EngramClient(srv.address, namespace="ns") as c:
        fa = await register_holding(c, tiny_model(weights_id="a"))
        fb = await c.register_model(tiny_model(weights_id="b"))
        fc = await c.register_model(tiny_model(weights_id="c"))  # a full registry: "b" held nothing
        assert not await knows(c, fb) and await knows(c, fa) and await knows(c, fc)
    assert model_files(tmp_path / "nvme") == {"a": [], "c": []}
    await srv.stop(0)

    srv = await server_factory(**cfg)
    async with EngramClient(srv.address, namespace="ns") as c:
        assert [await knows(c, fp) for fp in (fa, fb, fc)] == [True, False, True]
        assert (await c.lookup(fa, tokens(BLOCK_TOKENS))).matched_tokens == BLOCK_TOKENS
        await register_holding(c, tiny_model(weights_id="c"))
        with pytest.raises(errors.ResourceExhausted, match=r"already knows 2 models \(server\.max_models\)"):
            await c.register_model(tiny_model(weights_id="d"))  # each holds a block: refused as before

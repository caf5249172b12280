"""Model visibility per tenant through a real daemon: with tenancy on, a tenant sees only the models it registered.

A call naming a model another tenant registered got OK (or NOT_FOUND of its blocks) where an unknown fingerprint
got "unknown model fingerprint", and registering it passed the tenant's share of the registry when another had
registered it, so any tenant could tell which models the others run (an audit). Each probe is paired with a
control: the same call once the tenant has registered the model answers otherwise, so the comparison could see
a difference."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from engram import errors
from engram.client import EngramClient, SyncEngramClient
from engram.integrations.registration import Registration
from engram.layout import ModelSpec
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc
from engram.wire import convert

from helpers import BLOCK_TOKENS, random_kv, register_holding, tiny_model, tokens

ALICE, BOB, CAROL, DAVE, ADMIN = "alice-token", "bob-token", "carol-token", "dave-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB,
        "auth.tenants.carol.token": CAROL, "auth.tenants.carol.namespaces": "shared",
        "auth.tenants.dave.token": DAVE, "auth.tenants.dave.namespaces": "shared",
        "auth.admin_tokens": ADMIN, "auth.salt_secret": "test-secret",
        "auth.same_host_paths": "on"}  # so that ReservePut reaches the model, not a refusal of in-place puts


def as_(srv: RunningServer, token: str, **kwargs: Any) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace="", **kwargs)  # "": the token's first


def unknown_model() -> bytes:
    """A fingerprint nobody registered."""
    return tiny_model(weights_id="nobody-registered-this").fingerprint


async def answer(call: Callable[[], Awaitable[Any]], fingerprint: bytes) -> tuple[str, str]:
    """What a call answers, as a caller sees it: its status and message (the fingerprint written as <fp>), or OK."""
    try:
        await call()
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, _without(exc.details() or "", fingerprint)
    except errors.EngramError as exc:
        return type(exc).__name__, _without(str(exc), fingerprint)
    return "OK", ""


def _without(message: str, fingerprint: bytes) -> str:
    return message.replace(fingerprint.hex(), "<fp>") if fingerprint else message


class Probes:
    """Every call of a tenant (`token`) that names a model fingerprint: gRPC's and the data channel's."""

    def __init__(self, srv: RunningServer, token: str, spec: ModelSpec, keys: list[bytes]) -> None:
        self.srv, self.token, self.spec, self.keys = srv, token, spec, keys
        self.toks = tokens(2 * BLOCK_TOKENS, seed=3)
        self.kv = random_kv(spec, len(self.toks), seed=3)

    async def answers(self, fp: bytes) -> dict[str, tuple[str, str]]:
        md = (("authorization", f"Bearer {self.token}"),)
        lay = self.spec.layout
        toks_pb = convert.tokens_to_pb(self.toks)
        headers = [pb.BlockHeader(tokens=convert.tokens_to_pb(self.toks[i:i + BLOCK_TOKENS]), dtype=int(lay.dtype),
                                  shape=list(lay.block_shape(BLOCK_TOKENS)),
                                  payload_nbytes=lay.block_nbytes(BLOCK_TOKENS), codec="raw")
                   for i in range(0, len(self.toks), BLOCK_TOKENS)]
        block = [(self.toks[:BLOCK_TOKENS], self.kv[:, :, :BLOCK_TOKENS])]
        async with grpc.aio.insecure_channel(self.srv.address) as ch, \
                as_(self.srv, self.token) as data, as_(self.srv, self.token, data_channel=False) as plain:
            stub = pb_grpc.EngramStub(ch)

            async def get() -> None:
                async for _ in stub.Get(pb.GetRequest(model_fingerprint=fp, keys=self.keys), metadata=md):
                    pass

            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "Lookup": lambda: stub.Lookup(pb.LookupRequest(model_fingerprint=fp, tokens=toks_pb), metadata=md),
                "GetPrefix": lambda: stub.GetPrefix(pb.GetPrefixRequest(model_fingerprint=fp, tokens=toks_pb),
                                                    metadata=md),
                "Get": get,
                "Pin": lambda: stub.Pin(pb.PinRequest(model_fingerprint=fp, keys=self.keys), metadata=md),
                "ReservePut": lambda: stub.ReservePut(pb.ReservePutRequest(model_fingerprint=fp, blocks=headers),
                                                      metadata=md),
                "OpenSession": lambda: stub.OpenSession(pb.OpenSessionRequest(
                    model_fingerprint=fp, mode=pb.REPLAY_MODE_PERSIST, tokens=toks_pb), metadata=md),
                "Put": lambda: plain.put_blocks(fp, block),
                "Get (data channel)": lambda: data.get(fp, self.keys, zero_copy=False),
                "Put (data channel)": lambda: data.put_blocks(fp, block),
            }
            return {name: await answer(call, fp) for name, call in calls.items()}


async def alice_model(srv: RunningServer, weights_id: str = "alice-model") -> tuple[ModelSpec, bytes, list[bytes]]:
    spec = tiny_model(weights_id=weights_id)
    toks = tokens(2 * BLOCK_TOKENS, seed=3)
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(spec)
        keys = list((await a.put(fp, toks, random_kv(spec, len(toks), seed=3))).keys)
    return spec, fp, keys


async def test_a_model_only_another_tenant_registered_answers_every_call_as_an_unknown_fingerprint(
        server_factory: Any) -> None:
    srv = await server_factory(**AUTH)
    spec, fp, keys = await alice_model(srv)
    bob = Probes(srv, BOB, spec, keys)
    unknown = await bob.answers(unknown_model())
    assert all(code in ("NOT_FOUND", "UnknownModel") and msg.startswith(errors.UNKNOWN_MODEL)
               for code, msg in unknown.values()), unknown
    assert await bob.answers(fp) == unknown
    async with as_(srv, ADMIN) as admin:  # the admin sees every model
        assert (await admin.lookup(fp, bob.toks)).matched_tokens == 0
    async with as_(srv, BOB) as b:  # control: registered by him too, it is a model he knows (his namespace's blocks)
        assert await b.register_model(spec) == fp  # one record, one fingerprint, whoever registers it
    registered = await bob.answers(fp)
    assert registered["Lookup"] == ("OK", "") and registered != unknown
    async with as_(srv, ALICE) as a:  # and hers are untouched
        assert (await a.lookup(fp, bob.toks)).matched_tokens == len(bob.toks)


async def test_registering_a_model_another_tenant_registered_counts_against_the_share(server_factory: Any) -> None:
    srv = await server_factory(**{**AUTH, "server.max_models_per_tenant": 2})
    _, fp, _ = await alice_model(srv)
    async with as_(srv, BOB) as b:  # each holds a block: it keeps its place (an idle one gives it up)
        await register_holding(b, tiny_model(weights_id="bob-0"))
        await register_holding(b, tiny_model(weights_id="bob-1"))
        refused = [await answer(lambda s=spec: b.register_model(s), fp)  # type: ignore[misc]
                   for spec in (tiny_model(weights_id="alice-model"), tiny_model(weights_id="never-seen"))]
        assert refused[0] == refused[1] and refused[0][0] == "ResourceExhausted", refused
        assert "max_models_per_tenant" in refused[0][1]
        assert await b.register_model(tiny_model(weights_id="bob-1"))  # his own again: free
    async with as_(srv, ALICE) as a:  # control: hers again is free for her
        assert await a.register_model(tiny_model(weights_id="alice-model")) == fp


async def test_a_full_registry_refuses_a_tenant_alike_whether_or_not_the_model_is_known(server_factory: Any) -> None:
    srv = await server_factory(**{**AUTH, "server.max_models": 3})
    await alice_model(srv, "alice-0")
    async with as_(srv, ALICE) as a:  # each holds a block: it keeps its place (an idle one gives it up)
        await register_holding(a, tiny_model(weights_id="alice-1"))
        await register_holding(a, tiny_model(weights_id="alice-2"))
        assert await a.register_model(tiny_model(weights_id="alice-2"))  # control: hers, known to her, is free
    async with as_(srv, BOB) as b:
        known = await answer(lambda: b.register_model(tiny_model(weights_id="alice-0")), b"")
        new = await answer(lambda: b.register_model(tiny_model(weights_id="bob-0")), b"")
        assert known == new and known[0] == "ResourceExhausted" and "server.max_models" in known[1], (known, new)
        assert "3" not in known[1]  # nor how many models the others registered
    async with as_(srv, ADMIN) as admin:  # the admin's message still counts them
        with pytest.raises(errors.ResourceExhausted, match=r"already knows 3 models"):
            await admin.register_model(tiny_model(weights_id="admin-0"))


async def test_stats_and_describe_blocks_show_a_tenant_only_the_models_it_registered(server_factory: Any) -> None:
    """Carol and Dave share a namespace: Dave sees Carol's blocks there (that is what sharing is), not her model."""
    srv = await server_factory(**AUTH)
    spec = tiny_model(weights_id="carol-model")
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    async with as_(srv, CAROL) as c:
        fp = await c.register_model(spec)
        keys = (await c.put(fp, toks, random_kv(spec, len(toks), seed=5))).keys
        assert [m.model_fingerprint for m in (await c.stats()).models] == [fp]  # control: hers, she sees
    hexes = [k.hex() for k in keys]
    async with as_(srv, DAVE) as d:
        assert (await d.stats()).models == ()
        assert {b.codec for b in (await d.describe_blocks(key_prefixes=hexes)).blocks} == {
            "unknown (model not registered)"}
        await d.register_model(spec)
        assert [m.model_fingerprint for m in (await d.stats()).models] == [fp]
        assert {b.codec for b in (await d.describe_blocks(key_prefixes=hexes)).blocks} == {"raw"}
    async with as_(srv, ADMIN) as admin:
        assert [m.model_fingerprint for m in (await admin.stats()).models] == [fp]


async def test_registrations_outlive_a_restart_and_an_older_model_file_shows_only_its_adder(
        server_factory: Any, tmp_path: Path) -> None:
    """Each model file names the tenants that registered it. A file from before that field names at most the
    tenant that added the model (`added_by`): others register it again, and a worker integration does that by
    itself on the UnknownModel it gets."""
    cfg = {**AUTH, "tiers.nvme.path": str(tmp_path / "n")}
    first = await server_factory(**cfg)
    spec, fp, keys = await alice_model(first)
    await first.stop(0)
    models = tmp_path / "n" / "models"
    assert json.loads((models / f"{fp.hex()}.json").read_text())["tenants"] == ["alice"]
    older = {"bob-older": "bob", "admin-older": ""}  # files as the build before per-tenant visibility wrote them
    for weights_id, adder in older.items():
        old = tiny_model(weights_id=weights_id)
        (models / f"{old.fingerprint.hex()}.json").write_text(
            json.dumps({**old.to_dict(), **({"added_by": adder} if adder else {})}))

    srv = await server_factory(**cfg)
    bob = Probes(srv, BOB, spec, keys)
    assert await bob.answers(fp) == await bob.answers(unknown_model())
    toks = tokens(BLOCK_TOKENS, seed=9)
    async with as_(srv, ALICE) as a:  # hers, registered before the restart
        assert (await a.lookup(fp, tokens(2 * BLOCK_TOKENS, seed=3))).matched_tokens == 2 * BLOCK_TOKENS
        for weights_id in older:
            with pytest.raises(errors.UnknownModel):
                await a.lookup(tiny_model(weights_id=weights_id).fingerprint, toks)
    async with as_(srv, BOB) as b:
        await b.lookup(tiny_model(weights_id="bob-older").fingerprint, toks)  # his, as the older file says
    async with as_(srv, ADMIN) as admin:
        for weights_id in older:
            await admin.lookup(tiny_model(weights_id=weights_id).fingerprint, toks)

    def worker() -> int:  # Alice's worker, started before the upgrade, knows the fingerprint from then
        with SyncEngramClient(srv.address, token=ALICE, namespace="") as client:
            reg = Registration(client, tiny_model(weights_id="admin-older"),
                               tiny_model(weights_id="admin-older").fingerprint)
            return int(reg.call(lambda f: client.lookup(f, toks)).matched_tokens)

    assert await asyncio.to_thread(worker) == 0
    admin_older = tiny_model(weights_id="admin-older").fingerprint.hex()
    assert json.loads((models / f"{admin_older}.json").read_text())["tenants"] == ["alice"]

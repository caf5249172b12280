"""An admin forgets a model (ForgetModel, `engram models forget`), through a real daemon: every block of it, in every
namespace and tier, its registration (every tenant's) and its file go; what uses it refuses, unless force.

An operator had no way to remove a retired checkpoint's model and blocks short of deleting files under a stopped
daemon (an audit, session 45)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner, Result

from engram import errors
from engram.cli.main import app
from engram.client import EngramClient
from engram.control import ControlClient
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens, until

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.admin_tokens": ADMIN,
        "auth.salt_secret": "test-secret"}
TOKS = tokens(3 * BLOCK_TOKENS, seed=1)
RETIRED, CURRENT = tiny_model(weights_id="retired"), tiny_model(weights_id="current")
KV = random_kv(RETIRED, len(TOKS), seed=1)


def as_(srv: RunningServer, token: str) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace="")  # "": the token's own namespace


def block_files(nvme: Path) -> int:
    return len(list((nvme / "blocks").rglob("*.blk")))


def model_files(nvme: Path) -> set[str]:
    return {json.loads(p.read_text())["weights_id"] for p in (nvme / "models").glob("*.json")}


async def test_an_admin_forgets_a_retired_model_with_every_block_and_its_file_and_a_restart_agrees(
        server_factory: Any, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    cfg = {**AUTH, "tiers.nvme.path": str(nvme), "tiers.write_policy": "write-through"}
    srv = await server_factory(**cfg)
    async with as_(srv, ALICE) as a, as_(srv, BOB) as b, ControlClient(srv.address, token=ADMIN) as admin:
        fp = await a.register_model(RETIRED)
        assert await b.register_model(RETIRED) == fp
        current = await a.register_model(CURRENT)
        keys = (await a.put(fp, TOKS, KV)).keys
        await b.put(fp, TOKS, KV)
        await a.put(current, TOKS, KV)
        session = await a.open_session(fp, mode="persist", tokens=TOKS)
        await a.pin(fp, keys[:1])
        assert block_files(nvme) == 9 and model_files(nvme) == {"retired", "current"}

        with pytest.raises(errors.PermissionDenied, match="admin token"):
            await a.forget_model(fp, force=True)
        with pytest.raises(errors.FailedPrecondition, match="live session"):
            await admin.forget_model(fp)
        await a.close_session(session.session_id)
        with pytest.raises(errors.FailedPrecondition, match="pinned"):
            await admin.forget_model(fp)
        assert srv.store.registry.registrants(fp) == {"alice", "bob"} and block_files(nvme) == 9  # nothing changed

        done = await admin.forget_model(fp, force=True)
        assert (done.model_fingerprint, done.evicted, done.unpinned, done.sessions_closed, done.tenants) == (
            fp, 6, 1, 0, ("alice", "bob"))
        assert fp not in srv.store.registry and not srv.store.index.holds_model(fp)
        assert block_files(nvme) == 3 and model_files(nvme) == {"current"}
        assert [m.model_fingerprint for m in (await admin.stats()).models] == [current]
        with pytest.raises(errors.UnknownModel):  # nothing of it left
            await admin.forget_model(fp)
        assert (await a.lookup(current, TOKS)).matched_tokens == len(TOKS)  # the other model untouched
    await srv.stop(0)

    srv = await server_factory(**cfg)  # the same NVMe directory
    assert fp not in srv.store.registry and current in srv.store.registry and len(srv.store.index) == 3


async def test_force_closes_the_models_sessions_but_a_put_in_flight_refuses_it_until_it_ends(
        server_factory: Any) -> None:
    """Tenancy off: every caller is an admin. A Put stream between its header and its end holds the model (it
    publishes blocks after awaits): refused even with force, nothing changed; once it ends, force closes the
    session and every block goes."""
    srv = await server_factory()
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(RETIRED)
        await c.put(fp, TOKS, KV)
        await c.open_session(fp, mode="persist", tokens=TOKS)
        go = asyncio.Event()

        async def requests() -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace="ns", model_fingerprint=fp))
            await go.wait()

        async with grpc.aio.insecure_channel(srv.address) as channel:
            put = channel.stream_unary("/engram.v1.Engram/Put", request_serializer=pb.PutRequest.SerializeToString,
                                       response_deserializer=pb.PutResponse.FromString)(requests())
            async def putting() -> bool:
                return bool(srv.store.models_being_put())

            await until(putting, "the Put's header arrived")
            with pytest.raises(errors.FailedPrecondition, match="being put"):
                await c.forget_model(fp, force=True)
            assert len(srv.sessions.sessions()) == 1 and len(srv.store.index) == 3 and fp in srv.store.registry
            go.set()
            assert list((await put).keys) == []
        done = await c.forget_model(fp, force=True)
        assert (done.evicted, done.sessions_closed, done.tenants) == (3, 1, ())
        assert srv.sessions.sessions() == [] and len(srv.store.index) == 0 and fp not in srv.store.registry


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


async def test_engram_models_forget_takes_a_fingerprint_prefix_and_says_why_it_refuses(server_factory: Any) -> None:
    srv = await server_factory(**AUTH)
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(RETIRED)
        await a.put(fp, TOKS, KV)
        await a.open_session(fp, mode="persist", tokens=TOKS)
    prefix = fp.hex()[:8]

    async def forget(*args: str) -> Result:
        return await asyncio.to_thread(cli, "models", "forget", *args, "-a", srv.address)

    refused = await forget(prefix, "--token", ALICE)
    assert refused.exit_code == 6 and "admin token" in refused.output
    assert (await forget("not-hex", "--token", ADMIN)).exit_code == 4
    assert (await forget("ffff" if not fp.hex().startswith("ffff") else "0000", "--token", ADMIN)).exit_code == 3
    in_use = await forget(prefix, "--token", ADMIN)
    assert in_use.exit_code == 4 and "live session" in in_use.output and fp in srv.store.registry
    done = await forget(prefix, "--force", "--json", "--token", ADMIN)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout) == {"model_fingerprint": fp.hex(), "evicted": 3, "unpinned": 0,
                                       "sessions_closed": 1, "tenants": ["alice"]}
    assert fp not in srv.store.registry

"""Two tenants in one namespace, through a real daemon and a real tenants file: bob and carol share `shared`,
alice has her own, an admin acts on the whole daemon (the isolation audit of session 48 found each case below).

A session belongs to the tenant that opened it: another tenant's call naming it answers exactly as for an absent
session, and its listings leave it out. A model is a tenant's own even where its blocks are shared: another
tenant's inspection shows no fingerprint of it. An operator's (admin's) pin outlives a tenant's forced evict,
as it outlives the tenant's unpin. Each probe is paired with a control that sees the difference."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc
from engram.wire import convert
from engram.wire import data as wire

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

ALICE, BOB, CAROL, ADMIN = "alice-tok-1", "bob-tok-2", "carol-tok-3", "admin-tok-9"
TENANTS = f'''admin_tokens = "{ADMIN}"
[tenants.alice]
token = "{ALICE}"
namespaces = "alice"
[tenants.bob]
token = "{BOB}"
namespaces = "bob,shared"
[tenants.carol]
token = "{CAROL}"
namespaces = "carol,shared"
'''


@pytest.fixture
async def daemon(server_factory: Any, tmp_path: Path) -> RunningServer:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    srv: RunningServer = await server_factory(**{"auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt"})
    return srv


def as_(srv: RunningServer, token: str, namespace: str = "") -> EngramClient:
    return EngramClient(srv.address, token=token, namespace=namespace)


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def answer(call: Callable[[], Awaitable[Any]], session_id: str) -> tuple[str, str]:
    """What a call answers on the wire: its status and message (the session id written as <id>), or OK."""
    try:
        result = call()
        if hasattr(result, "__aiter__"):  # Resume: a stream, read to its end
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, (exc.details() or "").replace(session_id, "<id>")
    return "OK", ""


async def test_another_tenants_session_in_a_shared_namespace_answers_as_an_absent_one(daemon: RunningServer) -> None:
    """Carol's session in `shared`: Bob's Append, Resume, Fork, Suspend, Close, DescribeBlocks and Evict of it
    answer word for word what they answer for an id nobody opened (Bob appended to it, and his Resume reached
    its replay), his ListSessions leaves it out, and it is as Carol left it. Controls: Carol's own calls on it
    pass, and the admin lists it."""
    spec = tiny_model(weights_id="carol-ckpt")
    toks = tokens(4 * BLOCK_TOKENS, seed=5)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b:
        fp = await c.register_model(spec)
        await c.put(fp, toks, random_kv(spec, len(toks), seed=5))
        await c.open_session(fp, mode="persist", session_id="carol-s", tokens=toks)
        await b.register_model(spec)  # a model Bob has too: only the session's owner tells the calls apart
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        st = pb_grpc.EngramStub(channel)

        def calls(sid: str) -> dict[str, Callable[[], Any]]:
            ref = pb.SessionRef(namespace="shared", session_id=sid)
            return {
                "AppendSession": lambda: st.AppendSession(pb.AppendSessionRequest(session=ref, tokens=[1, 2, 3]),
                                                          metadata=md(BOB)),
                "Resume": lambda: st.Resume(pb.ResumeRequest(session=ref, position=0), metadata=md(BOB)),
                "ForkSession": lambda: st.ForkSession(pb.ForkSessionRequest(parent=ref), metadata=md(BOB)),
                "SuspendSession": lambda: st.SuspendSession(ref, metadata=md(BOB)),
                "DescribeBlocks": lambda: st.DescribeBlocks(pb.DescribeBlocksRequest(namespace="shared",
                                                                                     session_id=sid),
                                                            metadata=md(BOB)),
                "Evict": lambda: st.Evict(pb.EvictRequest(namespace="shared", session_id=sid), metadata=md(BOB)),
                "CloseSession": lambda: st.CloseSession(ref, metadata=md(BOB)),
            }

        hers, absent = calls("carol-s"), calls("nobody-s")
        for rpc in hers:
            got, want = await answer(hers[rpc], "carol-s"), await answer(absent[rpc], "nobody-s")
            assert got == want, f"Bob's {rpc} of Carol's session: {got}, of an absent one: {want}"
            assert got[0] == "NOT_FOUND", f"Bob's {rpc} of an absent session: {got}"
        listed = await st.ListSessions(pb.ListSessionsRequest(namespace="shared"), metadata=md(BOB))
        assert [s.info.session_id for s in listed.sessions] == []
    async with as_(daemon, CAROL, "shared") as c:
        mine = await c.list_sessions()
        assert [(s.info.session_id, s.info.tokens) for s in mine] == [("carol-s", len(toks))]  # nothing of Bob's
        info = await c.append_session("carol-s", tokens(BLOCK_TOKENS, seed=6))
        assert info.tokens == len(toks) + BLOCK_TOKENS
    async with as_(daemon, ADMIN, "shared") as admin:
        assert [s.info.session_id for s in await admin.list_sessions(all_namespaces=True)] == ["carol-s"]
        await admin.describe_blocks(session_id="carol-s", namespace="shared")


async def test_a_shared_namespaces_blocks_show_no_fingerprint_of_a_model_the_caller_did_not_register(
        daemon: RunningServer) -> None:
    """Bob describes Carol's blocks in `shared` by key: no codec (as before) and no fingerprint of her model,
    which he never registered (he read it whole). Controls: Carol, the admin, and Bob once he registers the
    model see the fingerprint."""
    spec = tiny_model(weights_id="carol-secret-ckpt")
    toks = tokens(2 * BLOCK_TOKENS, seed=7)
    async with as_(daemon, CAROL, "shared") as c:
        fp = await c.register_model(spec)
        keys = [k.hex() for k in (await c.put(fp, toks, random_kv(spec, len(toks), seed=7))).keys]
        assert {b.model_fingerprint for b in (await c.describe_blocks(key_prefixes=keys)).blocks} == {fp}
    async with as_(daemon, BOB, "shared") as b:
        await b.register_model(tiny_model(weights_id="bobs-own"))
        seen = (await b.describe_blocks(key_prefixes=keys)).blocks
        assert [(d.model_fingerprint, d.codec) for d in seen] == [(b"", "unknown (model not registered)")] * 2
        assert await b.register_model(spec) == fp
        assert {d.model_fingerprint for d in (await b.describe_blocks(key_prefixes=keys)).blocks} == {fp}
    async with as_(daemon, ADMIN) as admin:
        assert {d.model_fingerprint for d in (await admin.describe_blocks(key_prefixes=keys,
                                                                          namespace="shared")).blocks} == {fp}


async def test_a_tenants_forced_evict_keeps_the_blocks_an_operator_pinned(daemon: RunningServer) -> None:
    """In Bob's namespace the admin pins chain A's last block and Bob pins chain B's. Bob's Evict(force) of both
    chains evicts B (lifting his own pin) and keeps A whole, reported as the operator's (it lifted the admin's
    pin and removed A, where Bob's unpin leaves that pin alone). Control: the admin's forced evict removes A."""
    spec = tiny_model()
    a_toks, b_toks = tokens(2 * BLOCK_TOKENS, seed=9), tokens(2 * BLOCK_TOKENS, seed=10)
    async with as_(daemon, BOB, "bob") as b, as_(daemon, ADMIN, "bob") as admin:
        fp = await b.register_model(spec)
        await admin.register_model(spec)
        chain_a = list((await b.put(fp, a_toks, random_kv(spec, len(a_toks), seed=9))).keys)
        chain_b = list((await b.put(fp, b_toks, random_kv(spec, len(b_toks), seed=10))).keys)
        assert await admin.pin(fp, chain_a[-1:], namespace="bob") == 1
        assert await b.pin(fp, chain_b[-1:]) == 1
        assert await b.pin(fp, chain_a[-1:], unpin=True) == 0  # his unpin leaves the operator's pin

        done = await b.evict(key_prefixes=[chain_a[0].hex(), chain_b[0].hex()], force=True)
        assert sorted(done.evicted) == sorted(chain_b) and done.unpinned == 1
        assert sorted(done.operator_pinned) == sorted(chain_a) and not done.skipped
        kept = (await admin.describe_blocks(key_prefixes=[k.hex() for k in chain_a], namespace="bob")).blocks
        assert [d.pins for d in kept] == [0, 1]
        assert (await b.lookup(fp, a_toks)).matched_tokens == len(a_toks)

        done = await admin.evict(key_prefixes=[chain_a[0].hex()], force=True, namespace="bob")
        assert sorted(done.evicted) == sorted(chain_a) and done.unpinned == 1 and not done.operator_pinned
        assert (await b.lookup(fp, a_toks)).matched_tokens == 0


async def test_a_session_id_another_tenant_holds_opens_as_a_free_one(daemon: RunningServer) -> None:
    """Carol holds `s1` in `shared`. Bob's OpenSession of `s1` answers as his OpenSession of an id nobody holds:
    a session of his own (it answered "already exists": Bob read which ids Carol uses, and took the ones she
    would use next). Carol's session is untouched. Controls: Bob's second OpenSession of `s1` is "already exists"
    (ids are unique per owner); the admin lists both, with their owners, and naming `s1` without an owner is
    FAILED_PRECONDITION naming both tenants, with one it reaches that one's session."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await c.put(fp, toks, random_kv(spec, len(toks), seed=5))
        await c.open_session(fp, mode="persist", session_id="s1", tokens=toks)
        taken = await b.open_session(fp, mode="persist", session_id="s1", tokens=toks[:BLOCK_TOKENS])
        free = await b.open_session(fp, mode="persist", session_id="free", tokens=toks[:BLOCK_TOKENS])
        assert (taken.tokens, taken.owner, taken.mode) == (free.tokens, free.owner, free.mode) == (
            BLOCK_TOKENS, "bob", free.mode)
        with pytest.raises(errors.InvalidArgument, match="already exists"):  # his own id, held
            await b.open_session(fp, mode="persist", session_id="s1")
        assert [(s.info.session_id, s.info.tokens) for s in await c.list_sessions()] == [("s1", len(toks))]
        assert sorted((s.info.session_id, s.info.tokens) for s in await b.list_sessions()) == [
            ("free", BLOCK_TOKENS), ("s1", BLOCK_TOKENS)]
        await b.append_session("s1", toks[BLOCK_TOKENS:])  # his own, not hers
        assert [s.info.tokens for s in await c.list_sessions()] == [len(toks)]

        listed = await admin.list_sessions(namespace="shared")
        assert sorted((s.info.session_id, s.info.owner) for s in listed) == [
            ("free", "bob"), ("s1", "bob"), ("s1", "carol")]
        with pytest.raises(errors.FailedPrecondition, match="bob, carol"):
            await admin.describe_blocks(session_id="s1", namespace="shared")
        hers = await admin.describe_blocks(session_id="s1", namespace="shared", session_owner="carol")
        assert hers.session is not None and hers.session.info.owner == "carol"
        assert (await admin.describe_blocks(session_id="free", namespace="shared")).session.info.owner == "bob"
        closed = await admin.close_session("s1", namespace="shared", owner="bob")
        assert closed.owner == "bob"
        assert [s.info.session_id for s in await c.list_sessions()] == ["s1"]
        with pytest.raises(errors.PermissionDenied, match="only an admin"):  # a tenant names no other owner
            await b.close_session("s1", owner="carol")


async def test_a_tenants_stats_count_its_own_sessions_in_a_shared_namespace(daemon: RunningServer) -> None:
    """Carol opens three sessions in `shared`, Bob one: Bob's Stats (replay.sessions, the namespace's sessions)
    and DescribeNamespace count his one (they counted all four: Bob read how many sessions Carol has open).
    Control: the admin's Stats counts all four."""
    spec = tiny_model()
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        for _ in range(3):
            await c.open_session(fp, mode="persist")
        await b.open_session(fp, mode="persist")
        st = await b.stats()
        assert st.replay.sessions == 1
        assert [(n.namespace, n.sessions) for n in st.namespaces] == [("shared", 1)]
        assert (await b.describe_namespace("shared")).sessions == 1
        assert (await c.stats()).replay.sessions == 3
        st = await admin.stats()
        assert st.replay.sessions == 4 and {n.namespace: n.sessions for n in st.namespaces}["shared"] == 4


async def test_a_tenants_stats_and_block_descriptions_count_its_own_references_and_pins_in_a_shared_namespace(
        daemon: RunningServer) -> None:
    """In `shared`, Carol's session holds a 4-block chain and her pin its last block; Bob's two sessions hold its
    first 2 blocks and his pin block 1. Bob's Stats count the blocks his sessions reference (2) and the bytes his
    second session's references add (2 blocks); his DescribeBlocks shows his sessions and pins on each block. Main
    showed him the namespace's: 4 blocks referenced, Carol's session and pin on the blocks (he read what her
    sessions hold and what she pinned). Controls: Carol sees hers alone, the admin everyone's."""
    spec = tiny_model()
    toks = tokens(4 * BLOCK_TOKENS, seed=11)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=11))).keys)
        block = daemon.store.block(keys[0]).nbytes  # type: ignore[union-attr]
        await c.open_session(fp, mode="persist", tokens=toks)
        assert await c.pin(fp, keys[3:]) == 1
        for _ in range(2):
            await b.open_session(fp, mode="persist", tokens=toks[: 2 * BLOCK_TOKENS])
        assert await b.pin(fp, keys[1:2]) == 1
        hexes = [k.hex() for k in keys]

        async def seen(client: EngramClient) -> tuple[int, int, list[tuple[int, int, int]]]:
            ns = {n.namespace: n for n in (await client.stats()).namespaces}["shared"]
            assert ns.physical_bytes == 4 * block
            described = (await client.describe_blocks(key_prefixes=hexes, namespace="shared")).blocks
            assert all(d.refcount == d.children + d.sessions + d.pins for d in described)
            return ns.referenced_blocks, ns.logical_bytes - ns.physical_bytes, [(d.sessions, d.pins, d.refcount)
                                                                               for d in described]

        assert await seen(b) == (2, 2 * block, [(2, 0, 3), (2, 1, 4), (0, 0, 1), (0, 0, 0)])
        assert await seen(c) == (4, 0, [(1, 0, 2), (1, 0, 2), (1, 0, 2), (1, 1, 2)])
        assert await seen(admin) == (4, 4 * block, [(3, 0, 4), (3, 1, 5), (1, 0, 2), (1, 1, 2)])
        shared = await b.describe_namespace("shared")
        assert (shared.referenced_blocks, shared.logical_bytes) == (2, 6 * block)


async def test_a_tenants_stats_count_per_tier_the_pins_it_may_lift_in_a_shared_namespace(
        daemon: RunningServer) -> None:
    """In `shared`, Carol pins blocks 0-2 of a 4-block chain, Bob blocks 2 and 3, and the admin block 1; Bob pins a
    block in his own namespace too. Each tenant's Stats count per tier the blocks it holds pinned there, the pins it
    may lift as its DescribeBlocks counts them (Bob: his 2 in `shared` and 1 in `bob`; Carol: her 3), the admin's
    every pinned block; an unpin moves the pinner's figure alone. Main counted every pinned block of the tenant's
    namespaces: Bob read from his Stats that other tenants (or an admin) pinned 2 more of the shared blocks, and
    when Carol unpinned."""
    spec = tiny_model()
    toks, own = tokens(4 * BLOCK_TOKENS, seed=12), tokens(BLOCK_TOKENS, seed=13)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=12))).keys)
        own_keys = list((await b.put(fp, own, random_kv(spec, len(own), seed=13), namespace="bob")).keys)
        assert await c.pin(fp, keys[:3]) == 3
        assert await b.pin(fp, keys[2:]) == 2
        assert await admin.pin(fp, keys[1:2]) == 1
        assert await b.pin(fp, own_keys, namespace="bob") == 1

        async def pinned(client: EngramClient) -> int:
            return (await client.stats()).tier("dram").pinned_blocks

        async def described(client: EngramClient) -> int:
            blocks = (await client.describe_blocks(key_prefixes=[k.hex() for k in keys], namespace="shared")).blocks
            return sum(1 for d in blocks if d.pins)

        assert (await pinned(b), await pinned(c), await pinned(admin)) == (3, 3, 5)
        assert (await described(b), await described(c), await described(admin)) == (2, 3, 4)
        assert await c.pin(fp, keys[:1], unpin=True) == 1
        assert (await pinned(b), await pinned(c), await pinned(admin)) == (3, 2, 4)
        assert await b.pin(fp, keys[2:3], unpin=True) == 1
        assert (await pinned(b), await pinned(c), await pinned(admin)) == (2, 2, 4)  # Carol's pin keeps block 2


async def test_each_tenants_sessions_count_against_its_own_limit_in_a_shared_namespace(server_factory: Any,
                                                                                      tmp_path: Path) -> None:
    """Bob may hold 2 live sessions a namespace, Carol 3; they share `shared`. Carol's 3 sessions there leave Bob
    his 2, and his third is refused naming his own limit and what he may do, nothing of Carol's. Main bounded the
    namespace's sessions together by the smaller limit: Carol's 2 refused Bob any ("namespace 'shared' has 2 live
    sessions": he read how many she held). Control: Carol's fourth is refused at her 3; the admin's own sessions
    there count against the namespace's limit (the smaller) alone."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS.replace('namespaces = "bob,shared"', 'namespaces = "bob,shared"\nmax_sessions = 2')
                    .replace('namespaces = "carol,shared"', 'namespaces = "carol,shared"\nmax_sessions = 3'))
    srv = await server_factory(**{"auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt"})
    spec = tiny_model()
    async with as_(srv, CAROL, "shared") as c, as_(srv, BOB, "shared") as b, as_(srv, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        for _ in range(3):
            await c.open_session(fp, mode="persist")
        for _ in range(2):
            await b.open_session(fp, mode="persist")
        with pytest.raises(errors.ResourceExhausted) as refused:
            await b.open_session(fp, mode="persist")
        said = str(refused.value)
        assert "you have 2 live sessions in namespace 'shared'" in said and "auth.tenants.bob.max_sessions" in said
        assert "close sessions of yours" in said and "3" not in said and "5" not in said
        with pytest.raises(errors.ResourceExhausted, match="you have 3 live sessions"):
            await c.open_session(fp, mode="persist")
        for _ in range(2):
            await admin.open_session(fp, mode="persist")
        with pytest.raises(errors.ResourceExhausted, match="namespace 'shared' has 2 live sessions"):
            await admin.open_session(fp, mode="persist")


async def test_a_tenant_is_not_shown_the_hits_and_leases_other_tenants_reads_leave_on_shared_blocks(
        daemon: RunningServer) -> None:
    """Carol stores a chain in `shared`; Bob reads it (a Get) and holds a GetPrefix lease on it. Carol's (and
    Bob's) DescribeBlocks there show 0 hits and 0 leases: the figures are every tenant's, not kept per tenant, and
    Carol read Bob's activity on her prefix from them (a review, session 50). Controls: the admin sees them; in
    Alice's own namespace Alice sees her own hits."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=13)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin, as_(daemon, ALICE, "alice") as a:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=13))).keys)
        hexes = [k.hex() for k in keys]
        await b.get(fp, keys)
        channel = grpc.aio.insecure_channel(daemon.address)
        try:
            held = await pb_grpc.EngramStub(channel).GetPrefix(
                pb.GetPrefixRequest(namespace="shared", model_fingerprint=fp, tokens=convert.tokens_to_pb(toks),
                                    hold_for_get=True), metadata=md(BOB))
            assert held.lease_id

            async def seen(client: EngramClient) -> list[tuple[int, int]]:
                return [(d.hits, d.leases) for d in (await client.describe_blocks(key_prefixes=hexes,
                                                                                  namespace="shared")).blocks]

            assert await seen(c) == [(0, 0), (0, 0)]
            assert await seen(b) == [(0, 0), (0, 0)]
            assert all(h >= 1 and n == 1 for h, n in await seen(admin))
        finally:
            await channel.close()
        afp = await a.register_model(spec)
        own = list((await a.put(afp, toks, random_kv(spec, len(toks), seed=13))).keys)
        await a.get(afp, own)
        mine = (await a.describe_blocks(key_prefixes=[k.hex() for k in own], namespace="alice")).blocks
        assert [d.hits for d in mine] == [1, 1]


async def test_a_tenants_stats_counters_leave_out_namespaces_other_tenants_share(daemon: RunningServer) -> None:
    """Carol's Stats count blocks put, deduplicated and served per namespace, not per tenant: in `shared`, Bob's
    Get of her chain moved her blocks_served and bytes_served by his read's bytes (a review, session 50). A
    namespace other tenants share is left out of her counters. Control: Alice's own Get in her own namespace
    counts in hers."""
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS, seed=17)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, as_(daemon, ALICE, "alice") as a:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=17))).keys)
        before = await c.stats()
        await b.get(fp, keys)
        after = await c.stats()
        assert (after.blocks_served, after.bytes_served) == (before.blocks_served, before.bytes_served)
        afp = await a.register_model(spec)
        own = list((await a.put(afp, toks, random_kv(spec, len(toks), seed=17))).keys)
        await a.get(afp, own)
        assert (await a.stats()).blocks_served == 3


# ---- tiers: another tenant's read copies a shared block up (NVMe -> DRAM) ------------------------------------------


async def _carols_chain_on_nvme(srv: RunningServer) -> tuple[bytes, Any, list[bytes]]:
    """Carol's 2-block chain in `shared`, held on NVMe alone (other blocks of hers pushed it down, then went), with
    her session over it and her pin on its last block; Bob and the admin have her model registered."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=21)
    async with as_(srv, CAROL, "shared") as c, as_(srv, BOB, "shared") as b, as_(srv, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=21))).keys)
        for seed in (22, 23):
            more = tokens(4 * BLOCK_TOKENS, seed=seed)
            await c.put(fp, more, random_kv(spec, len(more), seed=seed), namespace="carol")
        await admin.evict(whole_namespace=True, force=True, namespace="carol")
        assert [d.tiers for d in (await admin.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks] == [
            ("nvme",)] * 2
        await c.open_session(fp, mode="persist", session_id="carol-s", tokens=toks)
        assert await c.pin(fp, keys[1:]) == 1
    return fp, toks, keys


@pytest.fixture
async def tiered(server_factory: Any, tmp_path: Path) -> RunningServer:
    """The tenants above on a daemon with a DRAM tier of 8 blocks over an NVMe tier."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    block = tiny_model().layout.block_nbytes(BLOCK_TOKENS)
    srv: RunningServer = await server_factory(**{
        "auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt", "tiers.dram.capacity": 8 * block,
        "tiers.dram.page_bytes": 256, "tiers.nvme.path": str(tmp_path / "nvme")})
    return srv


async def test_a_tenant_is_shown_a_shared_blocks_home_tier_not_the_one_another_tenants_read_copied_it_up_to(
        tiered: RunningServer) -> None:
    """Carol's chain in `shared` lies on NVMe; Bob's Get copies it up into DRAM. Carol's DescribeBlocks (by key and
    by her session) and ListSessions show the same tiers before and after: each block's home, the slowest tier
    holding it (NVMe). They showed DRAM joining, and Carol read that someone had read those blocks (session 50's
    loose ends). Controls: the admin sees the DRAM copy; Alice, in her own namespace, sees her own read's."""
    fp, toks, keys = await _carols_chain_on_nvme(tiered)
    hexes = [k.hex() for k in keys]
    async with as_(tiered, CAROL, "shared") as c, as_(tiered, BOB, "shared") as b, \
            as_(tiered, ADMIN, "shared") as admin:

        async def seen() -> tuple[list[tuple[str, ...]], list[tuple[str, ...]], tuple[str, ...], tuple[str, ...]]:
            by_key = (await c.describe_blocks(key_prefixes=hexes)).blocks
            mine = await c.describe_blocks(session_id="carol-s")
            assert mine.session is not None
            listed = [s.tiers for s in await c.list_sessions()]
            assert len(listed) == 1
            return [d.tiers for d in by_key], [d.tiers for d in mine.blocks], mine.session.tiers, listed[0]

        before = await seen()
        assert before == ([("nvme",)] * 2, [("nvme",)] * 2, ("nvme",), ("nvme",))
        await b.get(fp, keys)
        truth = (await admin.describe_blocks(key_prefixes=hexes)).blocks
        assert [d.tiers for d in truth] == [("dram", "nvme")] * 2  # Bob's read copied them up
        assert await seen() == before
        assert [d.tiers for d in (await b.describe_blocks(key_prefixes=hexes)).blocks] == [("nvme",)] * 2
    async with as_(tiered, ALICE, "alice") as a:
        spec = tiny_model()
        afp = await a.register_model(spec)
        own = list((await a.put(afp, toks, random_kv(spec, len(toks), seed=21))).keys)
        assert [d.tiers for d in (await a.describe_blocks(key_prefixes=[k.hex() for k in own])).blocks] == [
            ("dram",)] * 2  # her own namespace: every copy, as before


async def test_a_tenants_stats_count_a_shared_block_in_its_home_tier_whoever_reads_it(tiered: RunningServer) -> None:
    """Carol's Stats per tier (blocks, bytes, tokens, pinned blocks) of her chain in `shared` on NVMe: Bob's Get, which
    copies it into DRAM, moves none of them (they counted the DRAM copies: Carol read from her DRAM figures that
    someone had read 2 of her blocks, session 50's loose ends). Control: the admin's DRAM tier holds them."""
    fp, toks, keys = await _carols_chain_on_nvme(tiered)
    async with as_(tiered, CAROL, "shared") as c, as_(tiered, BOB, "shared") as b, \
            as_(tiered, ADMIN, "shared") as admin:

        async def tiers(client: EngramClient) -> dict[str, tuple[int, int, int, int]]:
            return {t.name: (t.blocks, t.used_bytes, t.tokens, t.pinned_blocks) for t in (await client.stats()).tiers}

        block = tiered.store.block(keys[0]).nbytes  # type: ignore[union-attr]
        before = await tiers(c)
        assert before == {"dram": (0, 0, 0, 0), "nvme": (2, 2 * block, len(toks), 1)}
        admin_dram = (await tiers(admin))["dram"][0]
        await b.get(fp, keys)
        assert (await tiers(admin))["dram"][0] == admin_dram + 2
        assert await tiers(c) == before
        assert await tiers(b) == {"dram": (0, 0, 0, 0), "nvme": (2, 2 * block, len(toks), 0)}


async def test_a_tenants_lookup_in_a_shared_namespace_names_each_blocks_home_tier(tiered: RunningServer) -> None:
    """Carol's Lookup (a probe: it moves nothing) of her chain in `shared` on NVMe names each block's tier: after
    Bob's Get copied it into DRAM, still NVMe, its home (it named DRAM, the fastest: a free, repeatable reading of who
    read her blocks, session 50's loose ends). Controls: the admin's Lookup names DRAM; Alice's in her own namespace
    names the fastest tier of her own blocks."""
    fp, toks, keys = await _carols_chain_on_nvme(tiered)
    async with as_(tiered, CAROL, "shared") as c, as_(tiered, BOB, "shared") as b, \
            as_(tiered, ADMIN, "shared") as admin:
        assert [r.tier for r in (await c.lookup(fp, toks, probe=True)).blocks] == ["nvme", "nvme"]
        await b.get(fp, keys)
        assert [r.tier for r in (await admin.lookup(fp, toks, probe=True)).blocks] == ["dram", "dram"]
        assert [r.tier for r in (await c.lookup(fp, toks, probe=True)).blocks] == ["nvme", "nvme"]
        assert [r.tier for r in (await c.lookup(fp, toks)).blocks] == ["nvme", "nvme"]
    async with as_(tiered, ALICE, "alice") as a:
        spec = tiny_model()
        afp = await a.register_model(spec)
        await a.put(afp, toks, random_kv(spec, len(toks), seed=21))
        assert [r.tier for r in (await a.lookup(afp, toks, probe=True)).blocks] == ["dram", "dram"]


async def test_a_tenants_resume_in_a_shared_namespace_names_each_blocks_home_tier(
        server_factory: Any, tmp_path: Path, model: Any) -> None:
    """Carol's persisted session in `shared` over her prefix on NVMe: her Resume (its window persisted: it reads no
    block) names each global KV block's tier. After Bob's Get copied them into DRAM, still NVMe, their home (it named
    DRAM: Carol read that someone had read her prefix, session 50's loose ends). Control: the admin's Lookup names
    DRAM."""
    import torch
    from test_sessions_replay import BT, P, block_tensor, tokens_for

    from engram.replay.runtime import model_spec_for

    spec = model_spec_for(model, block_tokens=BT, codec="raw")
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    srv = await server_factory(**{
        "auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt",
        "tiers.dram.capacity": 8 * spec.layout.block_nbytes(BT), "tiers.dram.page_bytes": 256,
        "tiers.nvme.path": str(tmp_path / "nvme")})
    toks = tokens_for(P, seed=31)
    async with as_(srv, CAROL, "shared") as c, as_(srv, BOB, "shared") as b, as_(srv, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        await c.put(fp, toks, block_tensor(model, toks))
        more = tokens_for(8 * BT, seed=32)
        await c.put(fp, more, block_tensor(model, more), namespace="carol")  # pushes her prefix down to NVMe
        await admin.evict(whole_namespace=True, force=True, namespace="carol")
        keys = [r.key for r in (await admin.lookup(fp, toks, probe=True)).blocks]
        assert len(keys) == -(-P // BT) and {r.tier for r in (await admin.lookup(fp, toks, probe=True)).blocks} == {
            "nvme"}
        info = await c.open_session(fp, mode="persist")
        ref = model.prefill(torch.as_tensor(toks, dtype=torch.long), logits=False).swa_window(P)
        window = torch.stack([torch.stack((k, v)) for k, v in ref.kv])
        await c.append_session(info.session_id, toks, window=window, window_start=ref.start)

        async def tiers() -> list[str]:
            r = await c.resume(info.session_id)
            assert r.source == "persisted" and [x.key for x in r.blocks] == keys
            return [x.tier for x in r.blocks]

        assert await tiers() == ["nvme"] * len(keys)
        await b.get(fp, keys)
        assert [r.tier for r in (await admin.lookup(fp, toks, probe=True)).blocks] == ["dram"] * len(keys)
        assert await tiers() == ["nvme"] * len(keys)


async def test_a_tenants_get_prefix_in_a_shared_namespace_names_each_blocks_home_tier(tiered: RunningServer) -> None:
    """Carol's GetPrefix (bytes, no descriptors: it moves no block) of her chain in `shared` on NVMe names each
    block's home tier in its refs after Bob's Get copied the chain into DRAM, as her Lookup does (the same walk's
    answer, `_answered`; untested for GetPrefix when 1f14a5e came). Control: the admin's GetPrefix names DRAM."""
    fp, toks, keys = await _carols_chain_on_nvme(tiered)
    channel = grpc.aio.insecure_channel(tiered.address)
    try:
        stub = pb_grpc.EngramStub(channel)

        async def tiers(token: str) -> list[str]:
            header = await stub.GetPrefix(pb.GetPrefixRequest(
                namespace="shared", model_fingerprint=fp, tokens=convert.tokens_to_pb(toks)), metadata=md(token))
            assert [r.key for r in header.blocks] == keys and not header.lease_id
            return [r.tier for r in header.blocks]

        assert await tiers(CAROL) == ["nvme", "nvme"]
        async with as_(tiered, BOB, "shared") as b:
            await b.get(fp, keys)
        assert await tiers(ADMIN) == ["dram", "dram"]
        assert await tiers(CAROL) == ["nvme", "nvme"]
        assert await tiers(BOB) == ["nvme", "nvme"]
    finally:
        await channel.close()


# ---- evict: a tenant removes what no one else holds ----------------------------------------------------------------


async def test_a_tenants_evict_in_a_shared_namespace_keeps_what_another_tenant_holds_without_saying_why(
        daemon: RunningServer) -> None:
    """In `shared`, Carol's session holds chain S, her pin chain P's last block, her GetPrefix lease chain L; chain F
    nobody holds. Bob's evict of the four (unforced, then forced) removes F and keeps S, P and L whole, reported
    together in `in_use`, nothing in `skipped` or `operator_pinned`. Main removed S under Carol's session (her
    next turn missed), refused the unforced evict for Carol's pin, naming its block, and reported L's lease in
    `skipped`: Bob read her sessions, her pins and her reads apart. Controls: Carol's chains match whole after, and
    the admin's forced evict removes them all."""
    spec = tiny_model()
    chains = {name: tokens(2 * BLOCK_TOKENS, seed=40 + i) for i, name in enumerate("SPLF")}
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = {n: list((await c.put(fp, t, random_kv(spec, len(t), seed=40 + i))).keys)
                for i, (n, t) in enumerate(chains.items())}
        await c.open_session(fp, mode="persist", session_id="carol-s", tokens=chains["S"])
        assert await c.pin(fp, keys["P"][1:]) == 1
        channel = grpc.aio.insecure_channel(daemon.address)
        try:
            held = await pb_grpc.EngramStub(channel).GetPrefix(
                pb.GetPrefixRequest(namespace="shared", model_fingerprint=fp, tokens=convert.tokens_to_pb(chains["L"]),
                                    hold_for_get=True), metadata=md(CAROL))
            assert held.lease_id
            kept = sorted(k for n in "SPL" for k in keys[n])
            for force, named in ((False, "SPLF"), (True, "SPL")):
                done = await b.evict(key_prefixes=[keys[n][0].hex() for n in named], force=force)
                assert sorted(done.evicted) == (sorted(keys["F"]) if not force else [])
                assert sorted(done.in_use) == kept and not done.skipped and not done.operator_pinned
                assert done.unpinned == 0
            for n in "SPL":
                assert (await c.lookup(fp, chains[n])).matched_tokens == 2 * BLOCK_TOKENS
            assert (await c.lookup(fp, chains["F"])).matched_tokens == 0
            await pb_grpc.EngramStub(channel).ReleaseLeases(
                pb.ReleaseLeasesRequest(namespace="shared", lease_ids=[held.lease_id]), metadata=md(CAROL))
        finally:
            await channel.close()
        done = await admin.evict(key_prefixes=[keys[n][0].hex() for n in "SPL"], force=True)
        assert sorted(done.evicted) == kept and done.unpinned == 1 and not done.in_use


async def test_a_tenants_evict_of_its_session_in_a_shared_namespace_reports_the_blocks_another_tenant_holds(
        daemon: RunningServer) -> None:
    """Bob's session in `shared` runs through Carol's 2-block chain, which her session holds, and 2 blocks of his
    own; Carol pins his last block. Bob's evict of his session (unforced) removes nothing of what Carol holds and
    reports all 4 blocks in `in_use` (his last pinned by her, his third under it, her two under her session). Main
    refused it for Carol's pin (naming the block), and, forced, reported that pin in `operator_pinned` and left
    her session's blocks out of the answer. Control: once Carol unpins and closes her session, his evict removes
    all 4."""
    spec = tiny_model()
    hers = tokens(2 * BLOCK_TOKENS, seed=50)
    his = np.concatenate([hers, tokens(2 * BLOCK_TOKENS, seed=51)])
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        await c.put(fp, hers, random_kv(spec, len(hers), seed=50))
        await c.open_session(fp, mode="persist", session_id="carol-s", tokens=hers)
        keys = list((await b.put(fp, his, random_kv(spec, len(his), seed=51))).keys)
        await b.open_session(fp, mode="persist", session_id="bob-s", tokens=his)
        assert await c.pin(fp, keys[3:]) == 1
        for force in (False, True):
            done = await b.evict(session_id="bob-s", force=force)
            assert not done.evicted and sorted(done.in_use) == sorted(keys)
            assert not done.skipped and not done.operator_pinned
        assert await c.pin(fp, keys[3:], unpin=True) == 1
        await c.close_session("carol-s")
        done = await b.evict(session_id="bob-s")
        assert sorted(done.evicted) == sorted(keys) and not done.in_use


async def test_a_tenant_may_not_evict_a_shared_namespace_whole(daemon: RunningServer) -> None:
    """Bob's whole_namespace evict of `shared` is PERMISSION_DENIED, saying it needs an admin and what he may do,
    and Carol's blocks stay (main evicted every block no one pinned or read: Carol's cache, gone). Controls: Bob
    evicts his own namespace whole; the admin evicts `shared` whole."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=60)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=60))).keys)
        own = list((await b.put(fp, toks, random_kv(spec, len(toks), seed=60), namespace="bob")).keys)
        with pytest.raises(errors.PermissionDenied, match=r"shared with other tenants.*admin token.*session_id"):
            await b.evict(whole_namespace=True)
        assert (await c.lookup(fp, toks)).matched_tokens == len(toks)
        assert sorted((await b.evict(whole_namespace=True, namespace="bob")).evicted) == sorted(own)
        assert sorted((await admin.evict(whole_namespace=True)).evicted) == sorted(keys)


# ---- leases and reservations: the tenant that took one ends it ---------------------------------------------------


@pytest.fixture
async def trusted(server_factory: Any, tmp_path: Path) -> RunningServer:
    """The tenants above, trusted with the shared DRAM pool (in-place puts, zero-copy Gets)."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    srv: RunningServer = await server_factory(**{"auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt",
                                                 "auth.same_host_paths": "on"})
    return srv


def _reserve_request(spec: Any, fp: bytes, toks: Any) -> pb.ReservePutRequest:
    """An in-place put's reservation of `toks` in full raw blocks in `shared`."""
    return pb.ReservePutRequest(namespace="shared", model_fingerprint=fp, blocks=[
        pb.BlockHeader(tokens=convert.tokens_to_pb(toks[i:i + BLOCK_TOKENS]), dtype=int(spec.layout.dtype),
                       shape=list(spec.layout.block_shape(BLOCK_TOKENS)),
                       payload_nbytes=spec.layout.block_nbytes(BLOCK_TOKENS), codec="raw")
        for i in range(0, len(toks), BLOCK_TOKENS)])


async def test_a_tenant_cannot_end_another_tenants_lease_or_reservation_in_a_shared_namespace(
        trusted: RunningServer) -> None:
    """Carol holds a GetPrefix lease on her chain in `shared` and an open in-place reservation there. Bob naming
    their ids, in ReleaseLeases, CommitPut, and the release_lease_ids of his GetPrefix and Get, is answered word for
    word as for ids nobody was granted, and ends nothing: the admin still sees her lease on the blocks, and Carol's
    ReleaseLeases ends both (2). Main checked the namespace alone: Bob's ReleaseLeases ended them (1; her worker's
    copy then raced the eviction, and her reservation's slots were freed under her writes). Controls: Bob ends his
    own lease; the admin ends one of Carol's."""
    spec = tiny_model()
    toks, fresh = tokens(2 * BLOCK_TOKENS, seed=70), tokens(2 * BLOCK_TOKENS, seed=71)
    async with as_(trusted, CAROL, "shared") as c, as_(trusted, BOB, "shared") as b:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=70))).keys)
    hexes = [k.hex() for k in keys]
    async with grpc.aio.insecure_channel(trusted.address) as channel:
        st = pb_grpc.EngramStub(channel)

        async def lease(token: str) -> int:
            got = await st.GetPrefix(pb.GetPrefixRequest(namespace="shared", model_fingerprint=fp,
                                                         tokens=convert.tokens_to_pb(toks), hold_for_get=True),
                                     metadata=md(token))
            assert got.lease_id
            return int(got.lease_id)

        hers = await lease(CAROL)
        reservation = (await st.ReservePut(_reserve_request(spec, fp, fresh), metadata=md(CAROL))).reservation_id
        assert reservation
        unknown = [hers ^ (1 << 40), reservation ^ (1 << 40)]  # granted to nobody

        def calls(ids: list[int]) -> dict[str, Callable[[], Any]]:
            return {
                "ReleaseLeases": lambda: st.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="shared", lease_ids=ids),
                                                          metadata=md(BOB)),
                "ReleaseLeases (reservation)": lambda: st.ReleaseLeases(
                    pb.ReleaseLeasesRequest(namespace="shared", lease_ids=ids[1:]), metadata=md(BOB)),
                "CommitPut": lambda: st.CommitPut(pb.CommitPutRequest(namespace="shared", reservation_id=ids[1]),
                                                  metadata=md(BOB)),
            }

        theirs, nobodys = calls([hers, reservation]), calls(unknown)
        for rpc in theirs:
            got = await answer(theirs[rpc], str(hers))
            want = await answer(nobodys[rpc], str(unknown[0]))
            assert (got[0], got[1].replace(str(reservation), "<id>")) == (
                want[0], want[1].replace(str(unknown[1]), "<id>")), rpc
            assert got[0] == "NOT_FOUND", (rpc, got)
        await st.GetPrefix(pb.GetPrefixRequest(namespace="shared", model_fingerprint=fp, tokens=convert.tokens_to_pb(
            toks[:BLOCK_TOKENS]), release_lease_ids=[hers, reservation]), metadata=md(BOB))
        async for _ in st.Get(pb.GetRequest(namespace="shared", model_fingerprint=fp, keys=keys[:1],
                                            release_lease_ids=[hers, reservation]), metadata=md(BOB)):
            pass
        async with as_(trusted, ADMIN, "shared") as admin:
            assert [d.leases for d in (await admin.describe_blocks(key_prefixes=hexes)).blocks] == [1, 1]
        mine = await lease(BOB)
        assert (await st.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="shared", lease_ids=[mine]),
                                       metadata=md(BOB))).released == 1
        assert (await st.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="shared", lease_ids=[hers, reservation]),
                                       metadata=md(CAROL))).released == 2
        again = await lease(CAROL)
        assert (await st.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="shared", lease_ids=[again]),
                                       metadata=md(ADMIN))).released == 1


async def test_a_tenants_unforced_evict_in_a_shared_namespace_is_refused_for_its_own_pin_alone(
        daemon: RunningServer) -> None:
    """In `shared`, Bob pins the last block of a chain Carol pinned too: his unforced evict of it is refused
    FAILED_PRECONDITION, saying the pin is his, and removes nothing; forced, it keeps the chain (Carol's pin) in
    `in_use`, his own pin not lifted."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=80)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b, \
            as_(daemon, ADMIN, "shared") as admin:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=80))).keys)
        assert await c.pin(fp, keys[1:]) == 1 and await b.pin(fp, keys[1:]) == 1
        with pytest.raises(errors.FailedPrecondition, match=r"1 of the 2 blocks .* pinned by you"):
            await b.evict(key_prefixes=[keys[0].hex()])
        done = await b.evict(key_prefixes=[keys[0].hex()], force=True)
        assert not done.evicted and sorted(done.in_use) == sorted(keys) and done.unpinned == 0
        assert [d.pins for d in (await admin.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks] == [0, 2]


async def test_a_tenants_data_channel_get_ends_its_own_lease_not_another_tenants(daemon: RunningServer) -> None:
    """A Get over the data channel ends the leases its release_lease_ids name (release_after_get), as the tenant
    whose connection it is (the HELLO token's): Bob's Get there naming Carol's GetPrefix lease in `shared` leaves it
    held (the admin still sees it on both blocks), Carol's own ends it. The gRPC Get's case is tested above; the
    data channel reads its principal from the connection, not from call metadata, and had no test."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=72)
    async with as_(daemon, CAROL, "shared") as c, as_(daemon, BOB, "shared") as b:
        fp = await c.register_model(spec)
        await b.register_model(spec)
        keys = list((await c.put(fp, toks, random_kv(spec, len(toks), seed=72))).keys)
    port = daemon.service.dataport
    endpoint = wire.Endpoint(unix_path=port.unix_path or "", host="" if port.unix_path else "127.0.0.1",
                             port=port.tcp_port)

    async def data_get(token: str, release: list[int]) -> int:
        """A data-channel Get of the chain's first block as `token`'s tenant, ending `release`: blocks answered."""
        req = pb.GetRequest(namespace="shared", model_fingerprint=fp, keys=keys[:1], release_lease_ids=release)

        async def blocks(conn: wire.Conn) -> int:
            n = 0
            while True:
                kind, meta, body = await conn.read_frame()
                if kind == wire.END:
                    return n
                assert kind == wire.BLOCK, wire.error_of(meta)
                await conn.recv(body)
                n += 1

        channel = wire.DataChannel(endpoint, token)
        try:
            return await channel.exchange(wire.GET, req.SerializeToString(), (), blocks)
        finally:
            await channel.aclose()

    async with grpc.aio.insecure_channel(daemon.address) as ch:
        got = await pb_grpc.EngramStub(ch).GetPrefix(pb.GetPrefixRequest(
            namespace="shared", model_fingerprint=fp, tokens=convert.tokens_to_pb(toks), hold_for_get=True),
            metadata=md(CAROL))
    hers = int(got.lease_id)
    assert hers
    hexes = [k.hex() for k in keys]
    async with as_(daemon, ADMIN, "shared") as admin:
        assert await data_get(BOB, [hers]) == 1
        assert [d.leases for d in (await admin.describe_blocks(key_prefixes=hexes)).blocks] == [1, 1]
        assert await data_get(CAROL, [hers]) == 1
        assert [d.leases for d in (await admin.describe_blocks(key_prefixes=hexes)).blocks] == [0, 0]
    assert len(daemon.service.leases) == 0


async def test_one_tenants_leases_in_a_shared_namespace_neither_refuse_nor_tell_another_tenants_reads(
        server_factory: Any, tmp_path: Path) -> None:
    """server.max_leased_blocks_per_namespace = 2. Bob's GetPrefix leases his two blocks in `shared`; Carol's
    GetPrefix of her own two blocks there leases them too: the bound counts each tenant's leases. It was one count
    for the namespace: her load was refused RESOURCE_EXHAUSTED, its message telling her how many blocks the others'
    live leases named (a review, session 52). Control: in their own namespaces each leases its two."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    srv: RunningServer = await server_factory(**{"auth.tenants_file": str(path), "auth.salt_secret": "s3cret-salt",
                                                 "server.max_leased_blocks_per_namespace": 2})
    spec = tiny_model()
    his, hers = tokens(2 * BLOCK_TOKENS, seed=80), tokens(2 * BLOCK_TOKENS, seed=81)
    fps = {}
    for token, toks, ns in ((BOB, his, "shared"), (CAROL, hers, "shared"), (BOB, his, "bob"),
                            (CAROL, hers, "carol")):
        async with as_(srv, token, ns) as cl:
            fps[token] = await cl.register_model(spec)
            await cl.put(fps[token], toks, random_kv(spec, len(toks), seed=82))
    async with grpc.aio.insecure_channel(srv.address) as channel:
        st = pb_grpc.EngramStub(channel)

        def lease(token: str, toks: Any, ns: str) -> Callable[[], Any]:
            return lambda: st.GetPrefix(pb.GetPrefixRequest(namespace=ns, model_fingerprint=fps[token],
                                                            tokens=convert.tokens_to_pb(toks), hold_for_get=True),
                                        metadata=md(token))

        assert (await lease(BOB, his, "bob")()).lease_id and (await lease(CAROL, hers, "carol")()).lease_id
        assert (await lease(BOB, his, "shared")()).lease_id
        assert await answer(lease(CAROL, hers, "shared"), "-") == ("OK", "")

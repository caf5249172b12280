"""Daemons of a cluster share blocks only where their [auth] grants are the same (cluster.peer_grants = "same",
the default), with a real redis-server (started here on a free port) and real daemons.

A grant is each daemon's own config, and a peer serves any namespace a member names (FetchBlocks carries no
tenant): where daemon B grants Bob namespace alice and daemon A does not, Bob read through B Alice's blocks that A
holds, which A itself refuses him (session 53 only said so in the log). Now A serves FetchBlocks only to a peer
whose call sends A's own grants (the signed record each daemon publishes), and B fetches only from holders whose
published record holds its own: the read is a miss, as for any holder that cannot serve. "any" keeps the
sharing, trusting each peer's grants."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis

from engram import errors
from engram.client import EngramClient
from engram.cluster import block_record_key
from engram.config import ConfigError, load_config
from engram.server import RunningServer, start_server
from engram.tenancy import Tenancy
from engram.trust import ClusterTrust

from helpers import BLOCK_TOKENS, free_port, random_kv, rpcs_served, tiny_model, tokens, until

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

SAME = {"auth.tenants.alice.token": "alice-token", "auth.tenants.alice.namespaces": "alice",
        "auth.tenants.bob.token": "bob-token", "auth.salt_secret": "shared-secret", "auth.admin_tokens": "admin-token",
        "cluster.peer_token": "peer-token", "cluster.secret": "cluster-secret",
        "server.metrics_port": -1, "server.metrics_token": "metrics-token"}
BOB_GETS_ALICE = {"auth.tenants.bob.namespaces": "bob,alice"}  # B's grants: Bob may also act in alice


# ---- the digest alone ----------------------------------------------------------------------------------

def _digest(**overrides: Any) -> str:
    auth = load_config(env={}, overrides={**SAME, **overrides}).auth
    tenancy = Tenancy.from_config(auth, "peer-token")
    assert tenancy is not None
    return ClusterTrust(b"cluster-secret").grants_digest(tenancy.grants())


@pytest.mark.parametrize("differ", [
    {"auth.admin_tokens": "another-admin-token"},
    {"auth.admin_tokens": "admin-token,second-admin-token"},
    {"auth.salt_secret": "another-secret"},
    {"auth.tenants.alice.token": "another-alice-token"},
    BOB_GETS_ALICE,
])
def test_the_grants_digest_differs_with_admin_tokens_the_salt_secret_and_tenants_tokens_and_namespaces(
        differ: dict[str, str]) -> None:
    """What decides access on a daemon is in its digest: an admin token, the salt secret or a tenant's token told
    apart too (the digest covered tenants' names and namespaces alone, session 53); the peer token is cluster
    config, not a grant; and nothing of a secret is in the clear (the digest is keyed with the cluster secret)."""
    assert _digest(**differ) != _digest()
    assert _digest(**{"cluster.peer_token": "another-peer-token"}) == _digest()
    assert _digest() == _digest()
    trust = ClusterTrust(b"cluster-secret")
    assert trust.grants_digest([b"b", b"a"]) == trust.grants_digest([b"a", b"b"])  # the order does not matter
    assert ClusterTrust(b"another-cluster-secret").grants_digest([b"a"]) != trust.grants_digest([b"a"])  # keyed


# ---- daemons over real Redis -----------------------------------------------------------------------------

class Daemons:
    """Daemons joined through the test's redis-server, each with the same [auth] (SAME) but for its overrides."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.running: list[RunningServer] = []

    async def start(self, name: str, **overrides: Any) -> RunningServer:
        srv = await start_server(load_config(env={}, overrides={
            "server.port": 0, "tiers.dram.capacity": "64MiB", "cluster.node_id": name,
            "cluster.redis_url": f"redis://127.0.0.1:{self.redis_port}/0", "cluster.heartbeat_s": 0.2,
            "cluster.ttl_s": 2.0, **SAME, **overrides}))
        self.running.append(srv)
        return srv

    async def stop(self, srv: RunningServer) -> None:
        self.running.remove(srv)
        await srv.stop(0)


@pytest.fixture
async def daemons(redis_port: int) -> AsyncIterator[Daemons]:
    d = Daemons(redis_port)
    yield d
    for srv in list(d.running):
        await d.stop(srv)


def refused(srv: RunningServer) -> float:
    """FetchBlocks calls `srv` answered PERMISSION_DENIED (its /metrics registry)."""
    assert srv.metrics is not None
    return sum(s.value for m in srv.metrics.registry.collect() if m.name == "engram_rpcs" for s in m.samples
               if s.name == "engram_rpcs_total" and s.labels["method"] == "FetchBlocks"
               and s.labels["code"] == "PERMISSION_DENIED")


async def joined(*daemons: RunningServer) -> bool:
    for d in daemons:
        async with EngramClient(d.address, token="admin-token") as c:
            if (await c.stats()).cluster.state != "ok":
                return False
    return True


def published(redis_port: int, node: str, keys: list[bytes]) -> Callable[[], Awaitable[bool]]:
    """Whether `node`'s holder entries of every one of `keys` are in Redis (what a reader's pick of holders reads)."""
    async def check() -> bool:
        r = redis.Redis(port=redis_port)
        try:
            return all(r.hexists(block_record_key(k), node) for k in keys)
        finally:
            r.close()
    return check


async def alices_prefix(a: RunningServer, seed: int) -> tuple[bytes, Any, list[bytes]]:
    """Alice's prefix put through A: (model fingerprint, tokens, keys)."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=seed)
    async with EngramClient(a.address, token="alice-token", namespace="alice") as alice:
        fp = await alice.register_model(spec)
        keys = list((await alice.put(fp, toks, random_kv(spec, len(toks), seed=seed))).keys)
    return fp, toks, keys


async def alices_prefix_on_a_beside(daemons: Daemons, redis_port: int, seed: int, b_id: str = "b",
                                    **b_overrides: Any) -> tuple[RunningServer, RunningServer, bytes, Any, list[bytes]]:
    """Daemons A and B (B with its overrides) joined, and Alice's prefix put through A, its holder entries in Redis:
    (A, B, model fingerprint, tokens, keys)."""
    a = await daemons.start("a")
    b = await daemons.start(b_id, **b_overrides)
    await until(lambda: joined(a, b), "both daemons joined")
    fp, toks, keys = await alices_prefix(a, seed=seed)
    await until(published(redis_port, "a", keys), "A's holder entries of Alice's blocks are in Redis")
    return a, b, fp, toks, keys


@pytest.mark.parametrize(("a_mode", "b_mode"), [("same", "same"), ("same", "any"), ("any", "same"), ("any", "any")])
async def test_bob_granted_alices_namespace_by_b_alone_reads_her_blocks_held_by_a_only_where_both_trust_peers_grants(
        daemons: Daemons, redis_port: int, a_mode: str, b_mode: str) -> None:
    """B grants Bob namespace alice, A does not. Where both daemons share only with peers of their own grants (the
    default), Bob's Get through B of Alice's keys that A holds is NOT_FOUND and his lookup a miss, as for a key
    nobody holds; where B trusts peers' grants but A does not, B asks and A answers PERMISSION_DENIED; where A
    trusts but B does not, B never asks A. Only where both trust ("any") does he read them (as every daemon did
    before: the first three cases failed then, Bob read Alice's blocks)."""
    a = await daemons.start("a", **{"cluster.peer_grants": a_mode})
    b = await daemons.start("b", **{"cluster.peer_grants": b_mode, **BOB_GETS_ALICE})
    await until(lambda: joined(a, b), "both daemons joined")
    fp, toks, keys = await alices_prefix(a, seed=31)
    await until(published(redis_port, "a", keys), "A's holder entries of Alice's blocks are in Redis")
    async with EngramClient(b.address, token="bob-token", namespace="alice") as bob:
        assert await bob.register_model(tiny_model()) == fp
        if a_mode == b_mode == "any":
            assert len(await bob.get(fp, keys)) == len(keys)  # trusting B's grants, A serves him her blocks
            assert (await bob.lookup(fp, toks)).matched_tokens == len(toks)
            assert refused(a) == 0
            return
        if b_mode == "any":  # B asks; A refuses, as often as B asks
            with pytest.raises(errors.NotFound, match="no live peer of the cluster supplied it"):
                await bob.get(fp, keys)
            assert refused(a) >= 1
        else:  # B asks no holder of other grants
            with pytest.raises(errors.NotFound, match="no live peer of the cluster supplied it"):
                await bob.get(fp, keys)
            assert rpcs_served(a, "FetchBlocks") == 0
        assert (await bob.lookup(fp, toks)).matched_tokens == 0
        assert b.store.index.get(keys[0]) is None  # nothing of Alice's copied to B


async def test_daemons_of_the_same_grants_still_share_blocks(daemons: Daemons, redis_port: int) -> None:
    """The default ("same") with the same [auth] on both: Alice's prefix put through A is a hit through B (her
    lookup and her Get by key), fetched from A, and A refused nothing."""
    a, b, fp, toks, keys = await alices_prefix_on_a_beside(daemons, redis_port, 32)
    async with EngramClient(b.address, token="alice-token", namespace="alice") as alice_on_b:
        assert await alice_on_b.register_model(tiny_model()) == fp
        assert (await alice_on_b.lookup(fp, toks)).matched_tokens == len(toks)
        assert len(await alice_on_b.get(fp, keys)) == len(keys)
    assert rpcs_served(a, "FetchBlocks") >= 1 and refused(a) == 0


@pytest.mark.parametrize("b_id", ["node b", "nœud-b"])
async def test_daemons_of_the_same_grants_share_blocks_whatever_characters_their_node_ids_hold(
        daemons: Daemons, redis_port: int, b_id: str) -> None:
    """B's cluster.node_id holds a space or a character beyond ASCII, which a gRPC header cannot carry. With the
    same grants as A and the default ("same"), Alice's prefix put through A is a hit through B, and A refused none
    of B's calls. Before, B sent neither its node id nor its grants record (they travel together), and A refused
    every FetchBlocks of it PERMISSION_DENIED as a daemon of other grants: Alice's lookup through B missed."""
    a, b, fp, toks, keys = await alices_prefix_on_a_beside(daemons, redis_port, 36, b_id)
    async with EngramClient(b.address, token="alice-token", namespace="alice") as alice_on_b:
        assert await alice_on_b.register_model(tiny_model()) == fp
        assert (await alice_on_b.lookup(fp, toks)).matched_tokens == len(toks)
    assert refused(a) == 0


async def test_a_peer_restarted_under_its_id_with_other_grants_is_refused_at_once_not_at_the_next_resync(
        daemons: Daemons, redis_port: int) -> None:
    """A and B of the same grants share (Alice through B reads her blocks from A). B is restarted under its id
    granting Bob namespace alice (and trusting peers' grants, so that it asks): A refuses its first FetchBlocks
    (compared at every call), and Bob through B misses, though A met B with the same grants and would compare
    again only at its next republish (a third of record_ttl_s, 20 minutes). The other way too: Bob's blocks put
    in namespace alice through the new B are not fetched by A for Alice (compared at each pick of a holder)."""
    a, b, fp, toks, keys = await alices_prefix_on_a_beside(daemons, redis_port, 33)
    async with EngramClient(b.address, token="alice-token", namespace="alice") as alice_on_b:
        assert await alice_on_b.register_model(tiny_model()) == fp
        assert len(await alice_on_b.get(fp, keys[:1])) == 1  # shared while the grants are the same
    assert refused(a) == 0
    await daemons.stop(b)
    b = await daemons.start("b", **{"cluster.peer_grants": "any", **BOB_GETS_ALICE})
    await until(lambda: joined(a, b), "B joined again, with its new grants")
    spec = tiny_model()
    bobs = tokens(2 * BLOCK_TOKENS, seed=34)
    async with EngramClient(b.address, token="bob-token", namespace="alice") as bob:
        assert await bob.register_model(spec) == fp
        with pytest.raises(errors.NotFound, match="no live peer of the cluster supplied it"):
            await bob.get(fp, keys)
        assert refused(a) >= 1
        bob_keys = list((await bob.put(fp, bobs, random_kv(spec, len(bobs), seed=34))).keys)
    await until(published(redis_port, "b", bob_keys), "B's holder entries of Bob's blocks are in Redis")
    async with EngramClient(a.address, token="alice-token", namespace="alice") as alice:
        assert (await alice.lookup(fp, bobs)).matched_tokens == 0  # A does not take Bob's blocks for hers
    assert rpcs_served(b, "FetchBlocks") == 0


async def test_daemons_whose_admin_tokens_differ_do_not_share(daemons: Daemons, redis_port: int) -> None:
    """The same tenants, but B has an admin token A does not: an admin of B reads every namespace there, so B is
    a daemon of other grants, and Alice through B misses her blocks held by A (before: shared)."""
    a, b, fp, toks, keys = await alices_prefix_on_a_beside(
        daemons, redis_port, 35, **{"auth.admin_tokens": "admin-token,b-admin-token"})
    async with EngramClient(b.address, token="alice-token", namespace="alice") as alice_on_b:
        assert await alice_on_b.register_model(tiny_model()) == fp
        assert (await alice_on_b.lookup(fp, toks)).matched_tokens == 0
    assert rpcs_served(a, "FetchBlocks") == 0


def test_a_peer_grants_setting_other_than_same_or_any_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.peer_grants must be same .* or any"):
        load_config(env={}, overrides={"cluster.redis_url": "redis://127.0.0.1:1/0", "cluster.secret": "s",
                                       "cluster.peer_grants": "Same"})


async def test_a_peers_fetch_between_the_daemons_grpc_start_and_its_cluster_join_is_unavailable_not_served_unchecked(
        redis_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC serves a few loop turns before the daemon joins its cluster, and the grants check needs the joined
    ClusterIndex: a FetchBlocks with the peer token in that window was served without it (a review, session 54).
    The join is held here (the app's `_join_cluster` waits on an event), and a raw FetchBlocks with the peer token
    and no grants is answered UNAVAILABLE; once joined, the same call is refused PERMISSION_DENIED (no grants)."""
    import asyncio

    import grpc

    from engram.server import app
    from engram.v1 import engram_pb2 as pb
    from engram.wire.channel import open_channel, stub_for

    joining, go = asyncio.Event(), asyncio.Event()
    join = app._join_cluster

    async def held_join(*args: Any) -> None:
        joining.set()
        await go.wait()
        await join(*args)

    monkeypatch.setattr(app, "_join_cluster", held_join)
    port = free_port()
    starting = asyncio.create_task(start_server(load_config(env={}, overrides={
        "server.port": port, "server.data_channel": False, "cluster.node_id": "a",
        "cluster.redis_url": f"redis://127.0.0.1:{redis_port}/0", **SAME})))
    srv = None
    try:
        await asyncio.wait_for(joining.wait(), 30)
        request = pb.FetchBlocksRequest(keys=[b"\0" * 16], namespace="alice", model_fingerprint=b"\0" * 16)
        codes = []
        for _ in range(2):
            channel = open_channel(f"127.0.0.1:{port}")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub_for(channel, "peer-token").FetchBlocks(request):
                    pass
            codes.append(info.value.code())
            await channel.close()
            if not go.is_set():
                go.set()
                srv = await asyncio.wait_for(starting, 30)
        assert codes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED]
    finally:
        go.set()
        if srv is None:
            srv = await starting
        await srv.stop(0)

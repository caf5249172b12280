"""A cluster node restarted under its node id, with a real redis-server and real daemons: node A is an `engram serve`
process killed (SIGKILL: no goodbye to Redis) and started again on its port, DRAM only, so it comes back holding
nothing and knowing no model. Its earlier process's holder entries are skipped and removed by the daemons that meet
them, a Get of a model it no longer knows says so (the worker registers it again), a holder that fails a fetch is
one log line within a budget, and the first fetch after its restart reaches it."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer
from engram.trust import ClusterTrust

from helpers import (
    BLOCK_TOKENS,
    CLUSTER,
    ENGRAM,
    NEUTRAL_CWD,
    cluster_daemon,
    cluster_joined,
    free_port,
    random_kv,
    tiny_model,
    tokens,
    until,
    wait_for,
)

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class NodeProcess:
    """`engram serve` as node `name`, DRAM only, on a port of its own that a restart keeps."""

    def __init__(self, redis_port: int, name: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        host, port = self.address.rsplit(":", 1)
        settings = {"server.host": host, "server.port": port, "tiers.dram.capacity": "64MiB",
                    "tiers.dram.prefault": "false", "tiers.dram.pin": "false", "server.metrics_port": -1,
                    "cluster.redis_url": f"redis://127.0.0.1:{redis_port}/0", "cluster.node_id": name, **CLUSTER}
        self.args = [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([*ENGRAM, "serve", "--log-level", "warning", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True, cwd=NEUTRAL_CWD)
        wait_for(self.address, self.proc, timeout=60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
async def node_a(redis_port: int) -> AsyncIterator[NodeProcess]:
    a = NodeProcess(redis_port, "a")
    a.start()
    yield a
    a.kill()


@pytest.fixture
async def b_and_c(redis_port: int) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    b = await cluster_daemon(redis_port, "b")
    c = await cluster_daemon(redis_port, "c")
    yield b, c
    await c.stop(0)
    await b.stop(0)


def holder_fields(port: int, key: bytes) -> list[str]:
    return subprocess.run(["redis-cli", "-p", str(port), "hkeys", "engram:block:{" + key.hex() + "}"],
                          capture_output=True, text=True, check=True).stdout.split()


async def published(port: int, keys: list[bytes]) -> bool:
    return all(holder_fields(port, k) for k in keys)


async def hits(c: EngramClient, fp: bytes, toks: Any) -> bool:
    return (await c.lookup(fp, toks)).matched_tokens == len(toks)


async def test_a_restarted_nodes_earlier_entries_are_skipped_and_removed_while_another_holder_keeps_the_block(
        redis_port: int, node_a: NodeProcess, b_and_c: tuple[RunningServer, RunningServer]) -> None:
    """A's entries outlived its crash for good: C holding the same blocks renews each block's hash, and A's restart
    republished only what it holds (nothing). Every daemon that fetched a block tried A first, got nothing and went
    on to C. Now each entry carries its process's boot: B skips A's earlier ones and removes them from Redis."""
    b_srv, c_srv = b_and_c
    assert b_srv.service is not None and b_srv.service.cluster is not None
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS, seed=1)
    kv = random_kv(spec, len(toks), seed=1)
    async with EngramClient(node_a.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b, \
            EngramClient(c_srv.address, namespace="ns") as c:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        await c.register_model(spec)
        await cluster_joined(b)
        await cluster_joined(c)
        keys = list((await a.put(fp, toks, kv)).keys)
        await until(lambda: hits(c, fp, toks), "C fetched A's blocks")

        async def both_hold() -> bool:
            return all(sorted(holder_fields(redis_port, k)) == ["a", "c"] for k in keys)

        await until(both_hold, "C published the blocks beside A")

        node_a.kill()
        node_a.start()  # same node id, same port, nothing held
        async with EngramClient(node_a.address, namespace="ns") as a2:
            await cluster_joined(a2)
        holders = [await b_srv.service.cluster.holders(k, "ns", untagged=False) for k in keys]
        assert [[h.node_id for h in hs] for hs in holders] == [["c"]] * len(keys)
        assert all(holder_fields(redis_port, k) == ["c"] for k in keys)  # A's earlier entries are gone
        n, got = await b.get_prefix(fp, toks)
        assert n == len(toks) and got is not None and torch.equal(got, kv)
        assert (await b.stats()).cluster.remote_failures == 0


async def test_an_older_daemons_entries_are_read_until_its_node_publishes_a_boot(
        redis_port: int, b_and_c: tuple[RunningServer, RunningServer]) -> None:
    """A rolling upgrade: a daemon from before boots writes entries without one and no boot record; B reads them
    as before for a lookup's fill, whose key it computed in its caller's namespace, and skips them for a tenant's
    Get, whose caller names the key (the entry has no namespace tag: it may be another namespace's, and asking its
    holder tells so by the time). Once that node runs this version (a boot record of its own), such an entry is
    its earlier process's: skipped and removed."""
    import redis

    b_srv, _ = b_and_c
    assert b_srv.service is not None and b_srv.service.cluster is not None
    cluster = b_srv.service.cluster
    trust = ClusterTrust(b"cluster-secret", ttl_s=10.0)
    key = bytes(range(16))
    r = redis.Redis(port=redis_port)
    r.set("engram:{nodes}:node:old", trust.node_record("old", "127.0.0.1:1"), px=60_000)
    r.hset("engram:block:{" + key.hex() + "}", "old", trust.holder_record(key, "old", "dram", 4096, 7))

    async def b_joined() -> bool:
        return cluster.state == "ok"

    await until(b_joined, "B joined")
    # It publishes no grants record either: with cluster.peer_grants = "same" (the default) it is not read at all,
    # its grants unknown; a rolling upgrade from it shares blocks under "any"
    assert await cluster.holders(key, "ns", untagged=True) == []
    cluster.config.peer_grants = "any"
    assert [(h.node_id, h.checksum, h.boot) for h in await cluster.holders(key, "ns", untagged=True)] == \
        [("old", 7, None)]
    assert await cluster.holders(key, "ns", untagged=False) == []
    r.set("engram:{nodes}:boot:old", trust.boot_record("old", 1234), px=60_000)  # "old" restarted, upgraded
    assert await cluster.holders(key, "ns", untagged=True) == []
    assert holder_fields(redis_port, key) == []
    r.close()


async def test_a_get_of_a_model_a_restarted_daemon_no_longer_knows_is_unknown_model_and_no_peer_failure(
        redis_port: int, node_a: NodeProcess, b_and_c: tuple[RunningServer, RunningServer]) -> None:
    """A worker's Get of keys (learnt before A restarted) on A, which knows no model now: A copied the chain from
    a peer, refused each block as of an unknown model, logged two warnings and counted two remote failures per
    holder, and answered NOT_FOUND "no peer could supply it", on which the worker integrations do not register
    the model again. Now: UnknownModel, no fetch, nothing counted (asked by a client that never registered the
    model: the worker's own registers it again on that error, and its Get copies the chain from B)."""
    b_srv, _ = b_and_c
    spec = tiny_model()
    toks = tokens(3 * BLOCK_TOKENS, seed=2)
    kv = random_kv(spec, len(toks), seed=2)
    async with EngramClient(b_srv.address, namespace="ns") as b, \
            EngramClient(node_a.address, namespace="ns", data_channel=False) as a:
        fp = await b.register_model(spec)
        assert await a.register_model(spec) == fp  # the worker on A, before A's restart
        await cluster_joined(b)
        keys = list((await b.put(fp, toks, kv)).keys)
        await until(lambda: published(redis_port, keys), "B published its blocks")
        node_a.kill()
        node_a.start()
        await cluster_joined(a)
        async with EngramClient(node_a.address, namespace="ns", data_channel=False) as stranger:
            with pytest.raises(errors.UnknownModel):
                await stranger.get(fp, keys)
        assert (await a.stats()).cluster.remote_failures == 0
        got = torch.cat(await a.get(fp, keys), dim=2)  # the model registered again by the client itself
        assert torch.equal(got, kv)
        stats = (await a.stats()).cluster
        assert (stats.remote_hits, stats.remote_failures) == (3, 0)


async def test_a_dead_holders_failures_are_one_line_each_within_a_budget(
        redis_port: int, node_a: NodeProcess, b_and_c: tuple[RunningServer, RunningServer],
        caplog: pytest.LogCaptureFixture) -> None:
    """A killed, its node record still fresh: every lookup on B dials it and fails. Each failure was logged with
    grpc's four-line rendering of the error, every time. Now one line each, at most the budget's 20 a minute, each
    counted in remote_failures."""
    caplog.set_level(logging.WARNING, logger="engram.server.peers")
    b_srv, _ = b_and_c
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS, seed=3)
    async with EngramClient(node_a.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        await cluster_joined(b)
        keys = list((await a.put(fp, toks, random_kv(spec, len(toks), seed=3))).keys)
        await until(lambda: published(redis_port, keys), "A published its blocks")
        node_a.kill()
        for _ in range(25):
            assert (await b.lookup(fp, toks)).matched_tokens == 0
        said = [r.getMessage() for r in caplog.records if r.name == "engram.server.peers"]
        assert said and all("\n" not in m and m.startswith("peer fetch of ") and "UNAVAILABLE" in m for m in said), said
        assert len(said) == 20, len(said)
        assert (await b.stats()).cluster.remote_failures == 25


async def test_the_first_fetch_after_a_peer_restarts_reaches_it(
        redis_port: int, node_a: NodeProcess, b_and_c: tuple[RunningServer, RunningServer]) -> None:
    """B's channel to A, refused while A was down, waited out gRPC's reconnect backoff (up to 2 s), failing every
    call at once, after A was back: B's fetches from the restarted A missed for ~2.8 s. A's boot record is new
    after its restart: B opens a new channel to it, and its first fetch is served."""
    b_srv, _ = b_and_c
    assert b_srv.service is not None and b_srv.service.peers is not None
    peers = b_srv.service.peers
    spec = tiny_model()
    async with EngramClient(b_srv.address, namespace="ns") as b:
        await b.register_model(spec)
        await cluster_joined(b)
        async with EngramClient(node_a.address, namespace="ns") as a:
            fp = await a.register_model(spec)
            first, lost = tokens(BLOCK_TOKENS, seed=4), tokens(BLOCK_TOKENS, seed=5)
            keys = list((await a.put(fp, first, random_kv(spec, len(first), seed=4))).keys)
            keys += (await a.put(fp, lost, random_kv(spec, len(lost), seed=5))).keys
            await until(lambda: published(redis_port, keys), "A published its blocks")
            await until(lambda: hits(b, fp, first), "B fetched A's first block")
        before = peers._peers["a"].channel
        node_a.kill()
        for _ in range(10):  # B dials the dead A (its record still fresh) for the other, and backs off
            assert not await hits(b, fp, lost)
        node_a.start()
        async with EngramClient(node_a.address, namespace="ns") as a:
            assert await a.register_model(spec) == fp
            new = tokens(BLOCK_TOKENS, seed=6)
            kv = random_kv(spec, len(new), seed=6)
            keys = list((await a.put(fp, new, kv)).keys)
            await until(lambda: published(redis_port, keys), "the restarted A published its block")
            failures = (await b.stats()).cluster.remote_failures
            assert await hits(b, fp, new)  # the first try
            assert (await b.stats()).cluster.remote_failures == failures
            assert peers._peers["a"].channel is not before

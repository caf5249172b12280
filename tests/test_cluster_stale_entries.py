"""Redis restored with older data (a lagging replica promoted, a restore from an RDB), with a real redis-server and two
real daemons: holder entries of the live node A for blocks it has evicted since come back, carrying A's current boot.
Every lookup through B asked A, got nothing, and counted a remote failure, for up to record_ttl_s (1 h): nothing
removed them. Now the first reader that A answers without the block removes the entry (compare-and-delete: one A
wrote again meanwhile stays). And A, finding an older copy of its own node record, no longer says another daemon
shares its node id: it publishes its index again. The restore is simulated by writing the older data back (HSET of
the evicted block's holder field, SET of the node record), not by restarting Redis."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator

import pytest
import redis
from rich.console import Console

from engram import errors
from engram.cli.stats import stats_json, stats_renderable
from engram.client import EngramClient
from engram.server import RunningServer
from engram.trust import ClusterTrust

from helpers import BLOCK_TOKENS, cluster_daemon, cluster_joined, random_kv, tiny_model, tokens, until

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.fixture
async def a_and_b(redis_port: int) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    a = await cluster_daemon(redis_port, "a")
    b = await cluster_daemon(redis_port, "b")
    yield a, b
    await b.stop(0)
    await a.stop(0)


def record_key(key: bytes) -> str:
    return "engram:block:{" + key.hex() + "}"


async def evicted_entry_restored(r: redis.Redis, a: EngramClient, b: EngramClient, seed: int) -> tuple[bytes, bytes, str]:
    """A puts one block and publishes it; A evicts it (its entry goes); the entry is written back as a restore would.
    Returns the model, the block's key and the entry."""
    spec = tiny_model()
    toks = tokens(BLOCK_TOKENS, seed=seed)
    fp = await a.register_model(spec)
    await b.register_model(spec)
    await cluster_joined(a)
    await cluster_joined(b)
    key = bytes((await a.put(fp, toks, random_kv(spec, len(toks), seed=seed))).keys[0])

    async def published() -> bool:
        return r.hget(record_key(key), "a") is not None

    await until(published, "A published its block")
    entry = r.hget(record_key(key), "a")
    assert entry is not None
    assert list((await a.evict(key_prefixes=[key.hex()])).evicted) == [key]

    async def withdrawn() -> bool:
        return r.hget(record_key(key), "a") is None

    await until(withdrawn, "A withdrew its entry")
    r.hset(record_key(key), "a", entry)  # Redis restored with the older data
    return fp, key, entry.decode()


@pytest.mark.parametrize("call", ["lookup", "get"])
async def test_a_live_holders_entry_for_a_block_it_evicted_is_removed_by_the_first_reader_it_fails(
        redis_port: int, a_and_b: tuple[RunningServer, RunningServer], call: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """B's Lookup asks A, which lacks the block: one remote failure, one line saying the entry is removed, and the
    entry is gone; the next call asks no one and counts nothing. A Get of the key fails the same way but leaves the
    entry: a Get names keys itself, and a tenant naming another namespace's keys would get "not held" from a holder
    that holds them there (pruning on that let any tenant remove another's entries)."""
    caplog.set_level(logging.WARNING, logger="engram.server.peers")
    a_srv, b_srv = a_and_b
    r = redis.Redis(port=redis_port)
    async with EngramClient(a_srv.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
        fp, key, _ = await evicted_entry_restored(r, a, b, seed=1)
        toks = tokens(BLOCK_TOKENS, seed=1)

        async def ask() -> None:
            if call == "lookup":
                assert (await b.lookup(fp, toks)).matched_tokens == 0
            else:
                with pytest.raises(errors.NotFound):
                    await b.get(fp, [key])

        await ask()
        stats = (await b.stats()).cluster
        said = [m.getMessage() for m in caplog.records if m.name == "engram.server.peers"]
        if call == "get":
            assert (stats.remote_failures, stats.stale_entries_removed) == (1, 0)
            assert r.hget(record_key(key), "a") is not None
            assert len(said) == 1 and "holder entry is removed" not in said[0], said
        else:
            assert (stats.remote_failures, stats.stale_entries_removed) == (1, 1)
            shown = Console(width=200, record=True, file=io.StringIO())
            shown.print(stats_renderable(await b.stats()))  # engram stats says so too, and its --json
            assert re.search(r"stale holder entries removed\s+│\s+1", shown.export_text()), shown.export_text()
            assert json.loads(stats_json(await b.stats()))["cluster"]["stale_entries_removed"] == 1
            assert r.hget(record_key(key), "a") is None
            assert len(said) == 1 and "evicted meanwhile" in said[0] and "holder entry is removed" in said[0], said
            await ask()
            assert (await b.stats()).cluster.remote_failures == 1
    r.close()


async def test_a_holder_entry_written_again_since_it_was_read_is_kept(
        redis_port: int, a_and_b: tuple[RunningServer, RunningServer]) -> None:
    """B read A's restored entry; meanwhile A stored the block again and wrote its entry anew (another tier here):
    B's removal, after A answered without the block, compares and leaves A's new entry."""
    a_srv, b_srv = a_and_b
    assert b_srv.service is not None and b_srv.service.cluster is not None
    cluster = b_srv.service.cluster
    r = redis.Redis(port=redis_port)
    async with EngramClient(a_srv.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
        _, key, entry = await evicted_entry_restored(r, a, b, seed=2)
        [stale] = await cluster.holders(key, "ns", untagged=False)
        assert (stale.node_id, stale.record) == ("a", entry)
        trust = ClusterTrust(b"cluster-secret", ttl_s=10.0)
        rewritten = trust.holder_record(key, "a", "nvme", stale.size, stale.checksum, stale.boot, "ns")
        assert rewritten != entry
        r.hset(record_key(key), "a", rewritten)
        assert not await cluster.forget_unheld(key, stale)
        assert r.hget(record_key(key), "a") == rewritten.encode()
        assert [h.record for h in await cluster.holders(key, "ns", untagged=False)] == [rewritten]
        r.hset(record_key(key), "a", entry)  # the control: the entry as read goes
        assert await cluster.forget_unheld(key, stale)
        assert r.hget(record_key(key), "a") is None
    r.close()


async def test_an_older_copy_of_its_own_node_record_is_a_restore_not_another_daemon(
        redis_port: int, a_and_b: tuple[RunningServer, RunningServer], caplog: pytest.LogCaptureFixture) -> None:
    """Redis gives back a node record A wrote a few heartbeats ago: A logged an ERROR that another daemon writes its
    record, told to give each daemon its own node id, and went degraded. Now it says Redis holds an older copy, stays
    "ok", and publishes its index again (an entry the older data lacks is back)."""
    caplog.set_level(logging.INFO, logger="engram.cluster")
    a_srv, b_srv = a_and_b
    r = redis.Redis(port=redis_port)
    async with EngramClient(a_srv.address, namespace="ns") as a, EngramClient(b_srv.address, namespace="ns") as b:
        spec = tiny_model()
        toks = tokens(BLOCK_TOKENS, seed=3)
        fp = await a.register_model(spec)
        await cluster_joined(a)
        key = bytes((await a.put(fp, toks, random_kv(spec, len(toks), seed=3))).keys[0])

        async def published() -> bool:
            return r.hget(record_key(key), "a") is not None

        await until(published, "A published its block")
        older = r.get("engram:{nodes}:node:a")
        assert older is not None

        async def rewritten() -> bool:
            return r.get("engram:{nodes}:node:a") != older

        await until(rewritten, "A's next heartbeat")
        caplog.clear()
        r.hdel(record_key(key), "a")  # the older data predates the block
        r.set("engram:{nodes}:node:a", older, px=10_000)
        await until(published, "A published its index again")
        said = [(m.levelno, m.getMessage()) for m in caplog.records if m.name == "engram.cluster"]
        assert not [m for level, m in said if level >= logging.ERROR], said
        assert any("older copy of node a's record" in m for _, m in said), said
        assert str((await a.stats()).cluster.state) == "ok"
        assert str((await b.stats()).cluster.state) == "ok"
    r.close()


async def test_a_block_evicted_while_redis_did_not_answer_loses_its_entry_when_its_holder_rejoins(
        redis_port: int, a_and_b: tuple[RunningServer, RunningServer]) -> None:
    """A publishes two blocks, then Redis stops answering (SIGSTOP: a stall, or a partition between A and Redis)
    until A degrades; A evicts one block meanwhile; Redis answers again and A rejoins. The evicted block's entry is
    gone, the other's kept. Main dropped the removal (changes are not queued while degraded, and the queue is
    emptied) and its rejoin writes only the blocks held: the entry stayed, kept alive by any other holder's writes,
    and every Get of the key through another daemon asked A for it, for nothing."""
    a_srv, _ = a_and_b
    r = redis.Redis(port=redis_port)
    pid = int(r.info("server")["process_id"])
    spec = tiny_model()
    async with EngramClient(a_srv.address, namespace="ns") as a:
        fp = await a.register_model(spec)
        await cluster_joined(a)
        keys = [bytes((await a.put(fp, toks, random_kv(spec, len(toks), seed=i))).keys[0])
                for i, toks in enumerate(tokens(BLOCK_TOKENS, seed=s) for s in (30, 31))]

        async def published() -> bool:
            return all(r.hget(record_key(k), "a") is not None for k in keys)

        await until(published, "A published its blocks")
        os.kill(pid, signal.SIGSTOP)
        try:
            async def degraded() -> bool:
                return str((await a.stats()).cluster.state) == "degraded"

            await until(degraded, "A found Redis not answering")
            assert list((await a.evict(key_prefixes=[keys[0].hex()])).evicted) == [keys[0]]
        finally:
            os.kill(pid, signal.SIGCONT)

        async def rejoined() -> bool:
            return str((await a.stats()).cluster.state) == "ok"

        await until(rejoined, "A rejoined")
        assert r.hget(record_key(keys[0]), "a") is None, "the entry of the block A evicted while out stayed"
        assert r.hget(record_key(keys[1]), "a") is not None
    r.close()

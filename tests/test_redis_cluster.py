"""The cluster tier past one Redis: a real Redis Cluster of three masters (redis-server --cluster-enabled
yes on free ports, joined by `redis-cli --cluster create`, with a password), reached through redis-py's
cluster client. A prefix written through daemon A is a hit through daemon B with the same bytes, block
records spread over the shards, and every record of one block sits on one shard (its hash tag)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from engram.client import EngramClient
from engram.cluster import block_record_key
from engram.config import load_config
from engram.server import RunningServer, start_server

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                reason="needs redis-server and redis-cli")
PASSWORD = "cluster-pw"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int) -> list[int]:
    """n ports p whose cluster bus port p + 10000 is free too."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 < 65536 and _free(p + 10000) and p not in out:
            out.append(p)
    return out


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[int]]:
    ports = cluster_ports(3)
    procs = [subprocess.Popen(
        ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
         str(tmp_path / f"nodes-{p}.conf"), "--dir", str(tmp_path), "--save", "", "--appendonly", "no",
         "--requirepass", PASSWORD, "--masterauth", PASSWORD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in ports]
    cli = ["redis-cli", "-a", PASSWORD, "--no-auth-warning"]
    try:
        deadline = time.monotonic() + 10
        while not all(subprocess.run([*cli, "-p", str(p), "ping"], capture_output=True, text=True).stdout.strip()
                      == "PONG" for p in ports):
            assert time.monotonic() < deadline, "redis-server nodes did not start"
            time.sleep(0.05)
        subprocess.run([*cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in subprocess.run([*cli, "-p", str(p), "cluster", "info"],
                                                           capture_output=True, text=True).stdout for p in ports):
            assert time.monotonic() < deadline, "the Redis Cluster never reached cluster_state:ok"
            time.sleep(0.1)
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


async def test_a_prefix_crosses_daemons_through_a_redis_cluster(redis_cluster: list[int]) -> None:
    started: list[RunningServer] = []
    try:
        for name in ("a", "b"):
            started.append(await start_server(load_config(env={}, overrides={
                "server.port": 0, "tiers.dram.capacity": "64MiB", "cluster.redis_url": f"redis://:{PASSWORD}@127.0.0.1:{redis_cluster[0]}/0",
                "cluster.redis_cluster": True, "cluster.node_id": name, "cluster.heartbeat_s": 0.2,
                "cluster.ttl_s": 2.0, "cluster.secret": "s"})))
        a, b = started
        spec = tiny_model()
        toks = tokens(12 * BLOCK_TOKENS, seed=8)
        kv = random_kv(spec, len(toks), seed=8)
        async with EngramClient(a.address, namespace="ns") as ca, EngramClient(b.address, namespace="ns") as cb:
            fp = await ca.register_model(spec)
            await cb.register_model(spec)
            deadline = time.monotonic() + 20
            while not ((await ca.stats()).cluster.state == (await cb.stats()).cluster.state == "ok"):
                assert time.monotonic() < deadline, (await ca.stats()).cluster.reason
                await asyncio.sleep(0.05)
            assert (await cb.stats()).cluster.live_nodes == 2
            keys = (await ca.put(fp, toks, kv)).keys
            while (await cb.lookup(fp, toks)).matched_tokens < len(toks):
                assert time.monotonic() < deadline + 20, "daemon B never served the prefix daemon A stored"
                await asyncio.sleep(0.05)
            n, got = await cb.get_prefix(fp, toks)
            assert n == len(toks) and got is not None and torch.equal(got, kv)
            assert (await cb.stats()).cluster.remote_hits == 12
        rc = redis.RedisCluster(host="127.0.0.1", port=redis_cluster[0], password=PASSWORD)
        try:
            shards = set()
            for k in keys:
                name = block_record_key(k)
                slot = rc.keyslot(name)
                assert slot == rc.keyslot("{" + k.hex() + "}")  # the hash tag decides: a block's records, one shard
                assert set(rc.hkeys(name)) == {b"a", b"b"}  # both now hold it, in one hash
                shards.add(rc.get_node_from_key(name).port)
            assert len(shards) > 1  # and blocks spread over the masters
        finally:
            rc.close()
    finally:
        for srv in started:
            await srv.stop(0)


async def test_a_redis_cluster_that_goes_away_degrades_the_tier_and_the_daemon_still_serves_and_stops(
        redis_cluster: list[int], tmp_path: Path) -> None:
    """redis-py's cluster client raises RedisClusterException (not a RedisError) when no node answers: the
    heartbeat died with it, every Lookup past the local match failed INTERNAL, and stop() raised it, skipping the
    write-back flush (blocks acknowledged, never written to NVMe). Now the tier degrades, local calls go on,
    and stop flushes."""
    srv = await start_server(load_config(env={}, overrides={
        "server.port": 0, "tiers.dram.capacity": "64MiB", "tiers.nvme.path": str(tmp_path / "nvme"),
        "tiers.write_back_window_s": 600.0,
        "cluster.redis_url": f"redis://:{PASSWORD}@127.0.0.1:{redis_cluster[0]}/0", "cluster.redis_cluster": True,
        "cluster.node_id": "a", "cluster.heartbeat_s": 0.2, "cluster.ttl_s": 2.0, "cluster.secret": "s"}))
    stopped = False
    try:
        spec = tiny_model()
        async with EngramClient(srv.address, namespace="ns") as c:
            fp = await c.register_model(spec)
            deadline = time.monotonic() + 20
            while (await c.stats()).cluster.state != "ok":
                assert time.monotonic() < deadline, (await c.stats()).cluster.reason
                await asyncio.sleep(0.05)
            for p in redis_cluster:  # every node goes away
                subprocess.run(["redis-cli", "-a", PASSWORD, "--no-auth-warning", "-p", str(p), "shutdown", "nosave"],
                               capture_output=True, timeout=30)
            while (await c.stats()).cluster.state != "degraded":
                assert time.monotonic() < deadline + 20, "the tier never noticed the cluster was gone"
                await asyncio.sleep(0.05)
            toks = tokens(4 * BLOCK_TOKENS, seed=3)
            kv = random_kv(spec, len(toks), seed=3)
            await c.put(fp, toks, kv)  # its Lookup goes past the local match: it asked the cluster
            assert (await c.lookup(fp, tokens(4 * BLOCK_TOKENS, seed=4))).matched_tokens == 0
            n, got = await c.get_prefix(fp, toks)
            assert n == len(toks) and torch.equal(got, kv)
        await srv.stop(0)
        stopped = True
        assert len(list((tmp_path / "nvme" / "blocks").rglob("*.blk"))) == 4  # flushed at stop
    finally:
        if not stopped:
            await srv.stop(0)

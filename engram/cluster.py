"""The cluster tier: a shared index in Redis of which daemon holds which block, and fetches from peers.

Redis holds, per block, a hash `engram:block:<key>` of node id -> "tier|size|checksum", and per node a
liveness key `engram:node:<id>` = its advertised address, refreshed every heartbeat_s and expiring after
ttl_s: a dead node's entries are ignored (and removed when met). Each daemon publishes its own index
changes (ChainIndex listeners feed a queue, a task drains it). Keys are salted per namespace
(engram/keys.py), so the shared index names no tenant's prefix in a computable way.

When Redis is unreachable the daemon keeps serving its own tiers: the state turns "degraded" (with the
reason, in Stats), queued changes are dropped, and a task reconnects with exponential backoff; once back
it re-registers the node and republishes its whole index (Redis may have restarted empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engram.config import ClusterConfig
from engram.index import BlockMeta, ChainIndex

log = logging.getLogger("engram.cluster")
_BLOCK = "engram:block:"
_NODE = "engram:node:"


@dataclass(frozen=True)
class Holder:
    node_id: str
    address: str
    tier: str
    size: int
    checksum: int


@dataclass
class ClusterCounters:
    remote_hits: int = 0
    remote_bytes: int = 0
    remote_failures: int = 0
    published: int = 0
    reconnects: int = 0


class ClusterIndex:
    def __init__(self, config: ClusterConfig, index: ChainIndex, node_id: str, address: str) -> None:
        self.config = config
        self.index = index
        self.node_id = node_id
        self.address = address
        self.state, self.reason = "degraded", "not connected yet"
        self.counters = ClusterCounters()
        self._redis = aioredis.from_url(config.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._queue: asyncio.Queue[tuple[str, BlockMeta]] = asyncio.Queue(maxsize=100_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        index.listeners.append(self._changed)

    def _changed(self, event: str, meta: BlockMeta) -> None:
        if self.state == "ok":
            with contextlib.suppress(asyncio.QueueFull):  # full: the next resync republishes everything
                self._queue.put_nowait((event, meta))

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._publish())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await t
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    def _degrade(self, exc: BaseException) -> None:
        if self.state == "ok":
            log.warning("cluster: Redis unreachable (%s); serving local tiers only", exc)
        self.state, self.reason = "degraded", f"Redis unreachable: {exc}; reconnecting"
        while not self._queue.empty():
            self._queue.get_nowait()

    async def _heartbeat(self) -> None:
        backoff = 0.1
        ttl_ms = int(self.config.ttl_s * 1000)
        while True:
            try:
                await self._redis.set(_NODE + self.node_id, self.address, px=ttl_ms)
                if self.state != "ok":
                    await self._resync()
                    self.state, self.reason = "ok", ""
                    self.counters.reconnects += 1
                backoff = 0.1
                await asyncio.sleep(self.config.heartbeat_s)
            except (RedisError, OSError) as exc:
                self._degrade(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _resync(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for meta in list(self.index):
            pipe.hset(_BLOCK + meta.key.hex(), self.node_id, _entry(meta))
        await pipe.execute()
        self.counters.published += len(self.index)

    async def _publish(self) -> None:
        while True:
            event, meta = await self._queue.get()
            batch = [(event, meta)]
            while not self._queue.empty() and len(batch) < 512:
                batch.append(self._queue.get_nowait())
            try:
                pipe = self._redis.pipeline(transaction=False)
                for ev, m in batch:
                    if ev == "add":
                        pipe.hset(_BLOCK + m.key.hex(), self.node_id, _entry(m))
                    else:
                        pipe.hdel(_BLOCK + m.key.hex(), self.node_id)
                await pipe.execute()
                self.counters.published += len(batch)
            except (RedisError, OSError) as exc:
                self._degrade(exc)

    async def holders(self, key: bytes) -> list[Holder]:
        """Live peers holding a block; [] when degraded (no waiting on a Redis that is down)."""
        if self.state != "ok":
            return []
        try:
            entries = await self._redis.hgetall(_BLOCK + key.hex())
            nodes = [n.decode() for n in entries if n.decode() != self.node_id]
            if not nodes:
                return []
            addresses = await self._redis.mget([_NODE + n for n in nodes])
        except (RedisError, OSError) as exc:
            self._degrade(exc)
            return []
        out = []
        for node, addr in zip(nodes, addresses, strict=True):
            if addr is None:  # its heartbeat expired: the node is gone
                with contextlib.suppress(RedisError, OSError):
                    await self._redis.hdel(_BLOCK + key.hex(), node)
                continue
            tier, size, check = entries[node.encode()].decode().split("|")
            out.append(Holder(node, addr.decode(), tier, int(size), int(check)))
        return out

    async def live_nodes(self) -> int:
        if self.state != "ok":
            return 0
        try:
            return len([k async for k in self._redis.scan_iter(match=_NODE + "*")])
        except (RedisError, OSError):
            return 0


def _entry(meta: BlockMeta) -> str:
    return f"{meta.tier if meta.locations else 'dram'}|{meta.nbytes}|{meta.checksum}"

"""The cluster tier: a shared index in Redis of which daemon holds which block, and fetches from peers.

Records in Redis (every one signed with the cluster secret, engram/trust.py; Redis is not trusted):
- `engram:block:{<key hex>}`: a hash of node id -> "tier#tag@boot|size|checksum|sig", the nodes holding a block.
  The braces are a Redis Cluster hash tag: every record of one block lives on one shard. `tag` is the block's
  namespace's, keyed with the cluster secret (ClusterTrust.namespace_tag): a reader skips another namespace's
  entries before it asks anything more, so a tenant's Get of another namespace's key takes the time of one
  nobody holds (it asked the holder, and the time told the key exists: an audit, session 48).
- `engram:{nodes}:node:<id>` = "address|ts|sig" and `engram:{nodes}:boot:<id>` = "boot|sig" (when the node's
  process started, ms), refreshed every heartbeat_s and expiring after ttl_s (a dead node's entries are
  ignored, and removed when a reader of their namespace meets them), and the set `engram:{nodes}:ids` of node
  ids. The `{nodes}` tag keeps them on one shard, so one MGET reads the addresses and boots of many holders.
  `engram:{nodes}:grants:<id>` = "digest|sig": what decides access on the node (ClusterTrust.grants_digest:
  tenants' tokens and namespaces, admin tokens, the salt secret), compared by each peer that meets the node, which
  says in its log when they differ from its own (`_grants`). With cluster.peer_grants = "same" (the default) a
  daemon fetches only from holders whose record holds its own grants, read with their node records at each pick
  (`holders`), and serves FetchBlocks only to peers whose call sends the same signed record (`check_peer`).
A node restarted under its id (DRAM only, its blocks gone) cannot know which entries its earlier process left,
and another holder's writes keep a block's hash from expiring: so readers skip, and remove, an entry whose boot
is not its node's current one. An entry without a boot (a daemon from before boots) is read as before while its
node publishes no boot record (it still runs that version); once it does, the entry is its earlier process's.
An entry without a tag (a daemon from before tags: its current process's entries are all untagged) is read for a
lookup's fill, whose key the reader computed in its caller's namespace, and for a Get, whose caller names the
key, only without tenancy (every caller may name any namespace there): so a rolling upgrade goes on sharing
prefixes both ways, and no Get's time tells a tenant another namespace's keys; with tenancy, Gets by key of
blocks only older daemons hold miss until they are upgraded.
Redis restored with older data (a lagging replica promoted, a restore from an RDB) brings back entries of the
current boot for blocks their node has evicted since, which a republish (HSETs) does not remove: a reader
removes such an entry when the live holder answers that it lacks the block (`forget_unheld`). Every removal is
a compare-and-delete, so an entry its node wrote again since it was read stays, and is counted
(`stale_entries_removed` in Stats). The node itself tells such a restore by its own record coming back older
(one it wrote within ttl_s) and publishes its index again, where a record it never wrote means another daemon
shares its node id.
A record whose signature does not verify is ignored and counted (`untrusted_records` in Stats): it was
written by someone without the secret. Each daemon publishes its own index changes (ChainIndex listeners
feed a queue, a task drains it). Keys are salted per namespace (engram/keys.py), so the shared index names
no tenant's prefix in a computable way.

Redis may be one server (`redis://`, `rediss://` for TLS, with a password in the URL or in
`cluster.redis_password`) or a Redis Cluster (`cluster.redis_cluster`, redis-py's cluster client). When it
is unreachable the daemon keeps serving its own tiers: the state turns "degraded" (with the reason, in
Stats), queued changes are dropped (removals are kept for the republish, which writes only what is held), and a
task reconnects with exponential backoff; once back it re-registers the node, removes the entries of blocks removed
meanwhile and republishes its whole index (Redis may have restarted empty). A WARNING says the
first failure to join and each loss after a join (not every retry), and an INFO line each join; /metrics has
`engram_cluster_degraded`. A daemon whose Redis refused its password, or was never reachable, logged nothing
about it and answered health SERVING: only Stats said why (an audit, session 48).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError

from engram.config import ClusterConfig
from engram.errors import PermissionDenied
from engram.index import BlockMeta, ChainIndex
from engram.trust import CLOCK_SKEW_S, ClusterTrust

# What a Redis (or Redis Cluster: its errors are not RedisErrors) that is down, unreachable or wrong can raise.
REDIS_FAULTS = (RedisError, RedisClusterException, OSError)
# Blocks per pipeline when the whole index is published: building one costs the event loop ~4 us a block (65k
# blocks in one pipeline held every request for 284 ms)
RESYNC_BATCH = 4096
WITHDRAWN_MAX = 100_000  # removals kept while unpublished (degraded): past it, their entries wait out record_ttl_s
WARN_EVERY_S = 60.0  # an ignored record is said at most this often per node and reason (it is met at every lookup)

log = logging.getLogger("engram.cluster")
_NODES = "engram:{nodes}:"
_NODE = _NODES + "node:"
_NODE_IDS = _NODES + "ids"
_BOOT = _NODES + "boot:"
_GRANTS = _NODES + "grants:"  # "digest|sig": which namespaces the node's tenants may use (ClusterTrust.grants_digest)
# Removes a hash field only if it still holds what a reader saw: the node may have written it again meanwhile.
_PRUNE = ("if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) "
          "end return 0")


T = TypeVar("T")


async def _cancellable(command: Awaitable[T]) -> T:
    """A Redis command awaited for a caller's request, raising the cancel redis-py swallowed: it sends each
    command under asyncio.wait_for (socket_timeout), which on Python 3.11 returns the send's result and drops a
    cancel that lands as the send completes (CPython gh-86296), the cancel left pending (`Task.cancelling()`).
    A Lookup cancelled there (its client's cancel or deadline, a turn or three after the command began) went on
    with its peer fill for nobody, to the prefix's last block (an audit, session 52)."""
    task = asyncio.current_task()
    pending = 0 if task is None else task.cancelling()
    try:
        return await command
    finally:
        if task is not None and task.cancelling() > pending:
            raise asyncio.CancelledError


def block_record_key(key: bytes) -> str:
    """The Redis key of a block's holders: hash-tagged by the block key, so its records share one shard."""
    return "engram:block:{" + key.hex() + "}"


@dataclass(frozen=True)
class Holder:
    node_id: str
    address: str
    tier: str
    size: int
    checksum: int
    boot: int | None = None  # when the node's process started (its boot record); None: an older daemon
    record: str = ""  # the signed entry as read: what forget_unheld removes, if it is still there


@dataclass
class ClusterCounters:
    remote_hits: int = 0
    remote_bytes: int = 0
    remote_failures: int = 0
    published: int = 0
    reconnects: int = 0
    untrusted_records: int = 0  # records in Redis whose signature did not verify: ignored
    stale_entries_removed: int = 0  # holder entries no longer true (a dead node's, an earlier boot's, evicted)


def connect(config: ClusterConfig) -> Any:
    """A redis.asyncio client (or cluster client) for the configured URL, password and TLS files."""
    from engram.tenancy import resolve_secret

    kwargs: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    if config.redis_password:
        kwargs["password"] = resolve_secret(config.redis_password, "cluster.redis_password")
    if config.redis_url.startswith("rediss://"):
        if config.redis_ca_cert:
            kwargs["ssl_ca_certs"] = config.redis_ca_cert
        if config.redis_client_cert:
            kwargs["ssl_certfile"] = config.redis_client_cert
            kwargs["ssl_keyfile"] = config.redis_client_key
    if config.redis_cluster:
        return RedisCluster.from_url(config.redis_url, **kwargs)
    return aioredis.from_url(config.redis_url, **kwargs)


def _passwords(config: ClusterConfig) -> tuple[str, ...]:
    """The Redis passwords the config names: in cluster.redis_url, and cluster.redis_password resolved."""
    from engram.tenancy import resolve_secret

    url = urlsplit(config.redis_url).password or ""
    given = resolve_secret(config.redis_password, "cluster.redis_password") if config.redis_password else ""
    return tuple(p for p in {url, given} if p)


class ClusterIndex:
    def __init__(self, config: ClusterConfig, index: ChainIndex, node_id: str, address: str,
                 trust: ClusterTrust, grants: str = "") -> None:
        """grants: this daemon's tenants' grants (ClusterTrust.grants_digest), published for peers to compare
        with theirs; "" publishes none."""
        self.config = config
        self.index = index
        self.node_id = node_id
        self.address = address
        self.trust = trust
        self.boot = int(time.time() * 1000)  # this process's start: its holder entries carry it
        self.state, self.reason = "degraded", "not connected yet"
        self._said_unjoined = False  # the first failure to join is logged, not every retry
        self._secrets = _passwords(config)  # never in a reason or a log line (redis-py's errors could name them)
        self.counters = ClusterCounters()
        self._redis = connect(config)
        self._queue: asyncio.Queue[tuple[str, BlockMeta]] = asyncio.Queue(maxsize=100_000)
        # Blocks removed while their removal could not be published (degraded, a batch that failed, the queue
        # full): the next republish removes their entries. It writes only the blocks held, so the entry of one
        # evicted while Redis did not answer stayed (record_ttl_s, and longer while another holder wrote the
        # block's hash), and every Get of the key through another daemon asked this one for it (an audit, session 52).
        self._withdrawn: set[bytes] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        # While the index is published whole, changes queue up (from before its snapshot on) and are published
        # after it: a put or an eviction during a long republish was lost (never published, or a stale record).
        self._resyncing = 0  # republishes under way
        self._writes = asyncio.Lock()  # a republish and the publisher's batches, one at a time
        self._record_ms = int(config.record_ttl_s * 1000)
        self._last_record = ""  # the node record this process wrote last: another writer of it shares our id
        self._shared_id_at = -math.inf  # when another writer of our node record was last seen (`_heartbeat`)
        # The node records this process wrote within ttl_s (+ skew), with when: Redis restored older data (a
        # snapshot, a lagging replica) can bring back only one of these, as the records expire after ttl_s.
        self._recent_records: deque[tuple[float, str]] = deque()
        self._synced_at = 0.0
        self._warned: dict[tuple[str, str, bool], float] = {}  # (record, node, bad signature) -> last said
        self.grants = grants
        self._grants_seen: dict[str, str | None] = {}  # peer -> the grants digest it was last read with (`_grants`)
        index.listeners.append(self._changed)

    def _changed(self, event: str, meta: BlockMeta) -> None:
        if self.state == "ok" or self._resyncing:
            try:
                self._queue.put_nowait((event, meta))
                return
            except asyncio.QueueFull:  # the next resync republishes everything held, and withdraws what is not
                pass
        if event == "remove":
            self._withdraw(meta.key)

    def _withdraw(self, key: bytes) -> None:
        """Remember a removal not published, for the next republish (`_withdrawn`)."""
        if len(self._withdrawn) < WITHDRAWN_MAX:
            self._withdrawn.add(key)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._publish())]

    async def close(self) -> None:
        """Stop the heartbeat and the publisher. redis-py can swallow a cancellation that lands inside a
        command (redis/redis-py#2028, #2551: seen here as a heartbeat that went on sleeping and a close that
        never returned), so the loops also stop on `_closing`, and a task still running is cancelled again."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            while not t.done():
                await asyncio.wait({t}, timeout=0.5)
                t.cancel()
            try:
                t.result()
            except (asyncio.CancelledError, *REDIS_FAULTS):
                pass
            except Exception:  # a bug in a loop: said, but the daemon's shutdown goes on (its NVMe flush)
                log.exception("a cluster task had failed")
        with contextlib.suppress(*REDIS_FAULTS, TimeoutError):
            # What this node held is no longer held by a live node: its entries go (a crashed node's go with
            # their records' expiry, or as a reader finds the node dead).
            if self.state == "ok":
                async with asyncio.timeout(5.0):  # not wait_for, which on 3.11 may drop a cancel (_cancellable)
                    await self._forget_own()
        with contextlib.suppress(*REDIS_FAULTS):
            await self._redis.aclose()

    async def _forget_own(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for meta in list(self.index):
            pipe.hdel(block_record_key(meta.key), self.node_id)
        pipe.delete(_NODE + self.node_id, _BOOT + self.node_id, _GRANTS + self.node_id)
        pipe.srem(_NODE_IDS, self.node_id)
        await pipe.execute()

    def _degrade(self, exc: BaseException) -> None:
        was = self.state
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        if isinstance(exc, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text or "authenticated" in text:
            self.state, self.reason = "degraded", (f"Redis refused authentication ({text}): set cluster.redis_password "
                                                   "(or the password in cluster.redis_url); reconnecting")
        else:
            self.state, self.reason = "degraded", f"Redis unreachable: {text}; reconnecting"
        if was == "ok":
            log.warning("cluster: Redis unreachable (%s); serving local tiers only", text)
        elif not self.counters.reconnects and not self._said_unjoined:
            self._said_unjoined = True
            log.warning("cluster: cannot join (%s); serving local tiers only until it does", self.reason)
        while not self._queue.empty():
            event, meta = self._queue.get_nowait()
            if event == "remove":
                self._withdraw(meta.key)

    async def _heartbeat(self) -> None:
        backoff = 0.1
        ttl_ms = int(self.config.ttl_s * 1000)
        while not self._closing:
            try:
                record = self.trust.node_record(self.node_id, self.address)
                # GET: our previous record; none means Redis lost it (restarted empty, flushed, or it expired while
                # this process stalled and a peer then dropped our holder entries): publish the index again.
                previous = await self._redis.set(_NODE + self.node_id, record, px=ttl_ms, get=True)
                # The boot record before any entry of this process: a reader takes an entry with another boot
                # for an earlier process's.
                pipe = self._redis.pipeline(transaction=False)
                pipe.set(_BOOT + self.node_id, self.trust.boot_record(self.node_id, self.boot), px=ttl_ms)
                if self.grants:
                    pipe.set(_GRANTS + self.node_id, self.trust.grants_record(self.node_id, self.grants), px=ttl_ms)
                pipe.sadd(_NODE_IDS, self.node_id)
                pipe.smembers(_NODE_IDS)
                ids = sorted(n.decode(errors="replace") for n in (await pipe.execute())[-1])
                written, self._last_record = self._last_record, record
                seen = "" if previous is None else previous.decode(errors="replace")
                restored = bool(written) and seen != written and self._wrote_earlier(seen)
                self._recent_records.append((time.monotonic(), record))
                if restored:
                    log.warning("cluster: Redis holds an older copy of node %s's record (restored from a snapshot, "
                                "or a lagging replica took over): publishing this node's index again; entries of "
                                "blocks evicted since are removed as peers find them missing", self.node_id)
                elif written and previous is not None and seen != written:
                    # Since our last heartbeat another process wrote our record: two daemons share this node id
                    # (a fixed advertise address under scaling), and each would take the other's blocks for its own.
                    if self.state == "ok":
                        log.error("cluster: another daemon writes node %s's record; give each daemon its own "
                                  "cluster.node_id (or advertise address)", self.node_id)
                    self._shared_id_at = time.monotonic()
                    self.state, self.reason = "degraded", (
                        f"another daemon uses node id {self.node_id!r}: give each daemon its own cluster.node_id "
                        "(or cluster.advertise address); sharing is off until then")
                    await asyncio.sleep(self.config.heartbeat_s)
                    continue
                if self.state == "ok" and previous is not None and \
                        (restored or time.monotonic() - self._synced_at > self.config.record_ttl_s / 3):
                    # Every record this node holds written again: before it expires, or what the restore lost
                    await self._resync()
                    self._grants_seen.clear()  # and every peer's grants read again (one restarted with others)
                if self.state != "ok" and time.monotonic() - self._shared_id_at < self.config.ttl_s:
                    # Another writer of our record was seen within ttl_s: it may only have missed a heartbeat (a busy
                    # host). Rejoined at once, each daemon flapped between degraded and a rejoin that published its
                    # whole index again whenever their heartbeats interleaved so (a CI run, session 49).
                    await asyncio.sleep(self.config.heartbeat_s)
                    continue
                if self.state != "ok" or previous is None:
                    await self._resync()
                    self.state, self.reason = "ok", ""
                    self.counters.reconnects += 1
                    log.info("cluster: %s as node %s (advertising %s); %d blocks published",
                             "joined" if self.counters.reconnects == 1 else "rejoined", self.node_id, self.address,
                             len(self.index), extra={"fields": {"node_id": self.node_id, "address": self.address,
                                                                "reconnects": self.counters.reconnects}})
                    self._grants_seen.clear()
                await self._grants([n for n in ids if n != self.node_id and n not in self._grants_seen])
                backoff = 0.1
                await asyncio.sleep(self.config.heartbeat_s)
            except REDIS_FAULTS as exc:
                self._degrade(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # a bug, or a record no check foresaw: said, and the loop goes on
                # Anything else ended the heartbeat for good while Stats still said "ok": the node's record then
                # expired, peers dropped it, and it shared nothing (a review, session 53: a forged record's
                # signature raised TypeError here). Degraded, as with Redis gone, it rejoins at the next beat.
                if self.state == "ok":
                    log.exception("cluster: the heartbeat failed; serving local tiers only until it succeeds")
                self.state, self.reason = "degraded", f"the heartbeat failed ({type(exc).__name__}: {exc}); retrying"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _grants(self, peers: list[str]) -> None:
        """Compare the grants `peers` publish with this daemon's, and say (once per peer and grants, at the join and
        each republish) those that differ. Whether a tenant may act in a namespace is each daemon's own config, and
        a peer serves any namespace to a member (FetchBlocks names it): a tenant reads, through the daemon it calls,
        every peer's blocks of the namespaces that daemon grants it, so grants that differ let a tenant reach,
        through one daemon, blocks another daemon's grants keep from it, and nothing said so (session 53). What
        is enforced is not this (a log line) but `check_peer` and `holders`, at every call and pick. A peer that
        publishes none (an older daemon) is not named here."""
        if not self.grants or not peers:
            return
        if len(self._grants_seen) > 4096:  # node ids come from Redis: anyone who can write it names as many
            self._grants_seen.clear()
        peers = peers[:1024]
        records = await self._redis.mget([_GRANTS + n for n in peers])
        differ = []
        for node, raw in zip(peers, records, strict=True):
            digest = None if raw is None else self.trust.node_grants(node, raw.decode(errors="replace"))
            if raw is not None and digest is None:
                self._untrusted("grants record", node)
            self._grants_seen[node] = digest
            if digest is not None and digest != self.grants:
                differ.append(node)
        if differ:
            shared = ("this daemon shares no blocks with them (cluster.peer_grants = same)"
                      if self.config.peer_grants == "same" else
                      "a tenant reads every peer's blocks of the namespaces the daemon it calls grants it, so it may "
                      "reach through one daemon what another's grants keep from it (cluster.peer_grants = any)")
            log.warning("cluster: node%s %s grant%s otherwise than this daemon does (tenants' tokens or namespaces, "
                        "admin tokens, auth.salt_secret, or tenancy on or off): %s; give every daemon of the cluster "
                        "the same [auth]",
                        "s" if len(differ) > 1 else "", ", ".join(differ), "" if len(differ) > 1 else "s", shared,
                        extra={"fields": {"node_id": self.node_id, "nodes": differ}})

    def _wrote_earlier(self, record: str) -> bool:
        """Whether `record` is one this process wrote within the time a copy of it can live (ttl_s, + skew)."""
        horizon = time.monotonic() - self.config.ttl_s - CLOCK_SKEW_S
        while self._recent_records and self._recent_records[0][0] < horizon:
            self._recent_records.popleft()
        return any(record == r for _, r in self._recent_records)

    def _entry(self, meta: BlockMeta) -> str:
        tier = meta.tier if meta.locations else "dram"
        return self.trust.holder_record(meta.key, self.node_id, tier, meta.nbytes, meta.checksum, self.boot,
                                        meta.namespace)

    async def _resync(self) -> None:
        """Publish the whole index (joining, after an outage, or to renew the records' expiry); changes made
        meanwhile queue up and are published after it."""
        self._resyncing += 1
        try:
            async with self._writes:
                metas = list(self.index)
                gone = [k for k in self._withdrawn if k not in self.index]  # one stored again is written below
                self._withdrawn.clear()
                try:
                    for start in range(0, len(gone), RESYNC_BATCH):
                        pipe = self._redis.pipeline(transaction=False)
                        for key in gone[start : start + RESYNC_BATCH]:
                            pipe.hdel(block_record_key(key), self.node_id)
                        await pipe.execute()
                except BaseException:
                    for key in gone:  # tried again at the next republish
                        self._withdraw(key)
                    raise
                for start in range(0, len(metas), RESYNC_BATCH):  # a batch at a time: the loop serves in between
                    pipe = self._redis.pipeline(transaction=False)
                    for meta in metas[start : start + RESYNC_BATCH]:
                        self._write(pipe, meta)
                    await pipe.execute()
                self.counters.published += len(metas)
                self._synced_at = time.monotonic()
        finally:
            self._resyncing -= 1

    def _write(self, pipe: Any, meta: BlockMeta) -> None:
        name = block_record_key(meta.key)
        pipe.hset(name, self.node_id, self._entry(meta))
        pipe.pexpire(name, self._record_ms)

    async def _publish(self) -> None:
        while not self._closing:
            event, meta = await self._queue.get()
            batch = [(event, meta)]
            while not self._queue.empty() and len(batch) < 512:
                batch.append(self._queue.get_nowait())
            try:
                async with self._writes:
                    pipe = self._redis.pipeline(transaction=False)
                    for ev, m in batch:
                        if ev == "add":
                            self._write(pipe, m)
                        else:
                            pipe.hdel(block_record_key(m.key), self.node_id)
                    await pipe.execute()
                self.counters.published += len(batch)
            except REDIS_FAULTS as exc:
                for ev, m in batch:
                    if ev == "remove":
                        self._withdraw(m.key)
                self._degrade(exc)

    def _untrusted(self, what: str, node: str, record: str = "") -> None:
        """Count a record ignored and say why: a bad signature, or (a node record) a signed one dated too far
        from this daemon's clock. Said once a minute per node and reason, not at every lookup."""
        self.counters.untrusted_records += 1
        age = self.trust.node_record_age_s(node, record) if record else None
        if age is None:
            reason = "whose signature does not verify (written without the cluster secret, or altered)"
        else:
            reason = (f"signed but dated {abs(age):.0f} s {'behind' if age > 0 else 'ahead of'} this daemon's clock, "
                      f"more than cluster.ttl_s + {CLOCK_SKEW_S:g} s: the two daemons' clocks differ (sync them, "
                      "NTP), or the record was replayed; the node's blocks are not fetched until they agree")
        now, said = time.monotonic(), (what, node, age is None)
        if now - self._warned.get(said, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        if len(self._warned) >= 1024:  # node ids come from Redis: anyone who can write it names as many
            self._warned.clear()
        self._warned[said] = now
        log.warning("cluster: ignoring a %s for node %r %s", what, node, reason)

    async def holders(self, key: bytes, namespace: str, *, untagged: bool) -> list[Holder]:
        """Live peers holding a block in `namespace`, as their signed records say; [] when degraded (no waiting on a
        Redis that is down). Another namespace's entries are skipped before anything more is asked (the node
        records, then the peer): a Get naming another namespace's key took the time of those round trips, so a
        tenant told a key held elsewhere in the cluster from one nobody holds by the time alone. `untagged`: whether
        an entry without a namespace tag (an older daemon's) is read as before or skipped: read where the caller
        computed the key under its own namespace (a lookup's fill: it is of that namespace), skipped where a tenant
        named it (a Get with tenancy: it may be another's, and asking its holder tells so by the time)."""
        if self.state != "ok":
            return []
        name = block_record_key(key)
        try:
            entries = {n.decode(): v.decode() for n, v in (await _cancellable(self._redis.hgetall(name))).items()}
        except (*REDIS_FAULTS, UnicodeDecodeError) as exc:
            if not isinstance(exc, UnicodeDecodeError):
                self._degrade(exc)
            return []
        entries.pop(self.node_id, None)
        tag = self.trust.namespace_tag(key, namespace)
        signed = {}
        for node, raw in entries.items():
            entry = self.trust.holder_entry(key, node, raw)
            if entry is None:
                self._untrusted("holder record", node)
            elif entry.tag == tag or (entry.tag is None and untagged):
                signed[node] = entry
        if not signed:
            return []
        nodes, same = list(signed), self.config.peer_grants == "same"
        count = len(nodes)
        asked = [_NODE + n for n in nodes] + [_BOOT + n for n in nodes] + ([_GRANTS + n for n in nodes] if same else [])
        try:
            found = await _cancellable(self._redis.mget(asked))
        except REDIS_FAULTS as exc:
            self._degrade(exc)
            return []
        grants = found[2 * count :] if same else [None] * count
        out = []
        for node, record, boot_record, grants_record in zip(nodes, found[:count], found[count : 2 * count], grants,
                                                             strict=True):
            if record is None:  # its heartbeat expired: the node is gone
                await self._prune(name, node, entries[node])
                continue
            entry = signed[node]
            address = self.trust.node_address(node, record.decode(errors="replace"))
            boot = self._boot(node, boot_record)
            if address is None:
                self._untrusted("node record", node, record.decode(errors="replace"))
            elif boot is not None and entry.boot != boot:
                # Left by an earlier process of the node (restarted under its id since): what it held is gone.
                await self._prune(name, node, entries[node])
            elif same and not self._grants_match(node, grants_record):
                self._said_differs(node, "not fetching blocks from")
            else:
                out.append(Holder(node, address, entry.tier, entry.size, entry.checksum, boot, entries[node]))
        return out

    def _grants_match(self, node: str, record: bytes | None) -> bool:
        """Whether a holder's grants record (read with its node record, at each pick of a holder: a peer restarted
        under its id with other grants is told apart from its first heartbeat on) holds this daemon's grants. One
        missing (a daemon older than session 53, or its record expired) or not verifying differs: the blocks of a
        daemon whose grants may be wider may have been written by a tenant this one refuses there."""
        if record is None:
            return False
        digest = self.trust.node_grants(node, record.decode(errors="replace"))
        if digest is None:
            self._untrusted("grants record", node)
        return bool(digest) and digest == self.grants

    def check_peer(self, metadata: object) -> None:
        """Refuse a peer's FetchBlocks (PermissionDenied) under cluster.peer_grants = "same" unless the call proves
        its node id (ClusterTrust.peer_node) and sends that node's signed grants record holding this daemon's
        grants (ClusterTrust.peer_grants): the record its process publishes in Redis, compared at every call, so a
        peer restarted under its id with other grants is refused from its first call, nothing cached to wait out.
        A peer serves any namespace a member names, so a tenant read, through a daemon granting it a namespace,
        the blocks of that namespace another daemon held and refused it itself (session 53 said so in the log)."""
        if self.config.peer_grants != "same":
            return
        node = self.trust.peer_node(metadata)
        digest = self.trust.peer_grants(metadata, node) if node else None
        if digest and digest == self.grants:
            return
        self._said_differs(node or "(unnamed)", "refusing FetchBlocks of")
        raise PermissionDenied(
            "this daemon serves blocks only to peers whose [auth] grants are its own (cluster.peer_grants = same), and "
            "the calling daemon's [auth] differs (tenants' tokens or namespaces, admin tokens or auth.salt_secret), "
            "or it sends no grants (a daemon older than this one): give every daemon the same [auth], or set "
            "cluster.peer_grants = any on both to trust each other's grants")

    def _said_differs(self, node: str, doing: str) -> None:
        """Say, once a minute per node and way, that a peer's grants keep this daemon from sharing with it."""
        now, said = time.monotonic(), (doing, node, False)
        if now - self._warned.get(said, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        if len(self._warned) >= 1024:  # node ids come from Redis: anyone who can write it names as many
            self._warned.clear()
        self._warned[said] = now
        log.warning("cluster: %s node %r: its [auth] grants differ from this daemon's (tenants' tokens or "
                    "namespaces, admin tokens, auth.salt_secret), or it publishes none (cluster.peer_grants = same)",
                    doing, node, extra={"fields": {"node_id": self.node_id, "peer": node}})

    def _boot(self, node: str, record: bytes | None) -> int | None:
        """When a node's process started, as its signed boot record says; None when it publishes none (an older
        daemon) or one that does not verify (ignored and counted, as any record Redis may have made up)."""
        if record is None:
            return None
        boot = self.trust.node_boot(node, record.decode(errors="replace"))
        if boot is None:
            self._untrusted("boot record", node)
        return boot

    async def forget_unheld(self, key: bytes, holder: Holder) -> bool:
        """Remove `holder`'s entry for `key`, read by `holders`, after the holder answered that it lacks the block:
        Redis restored with older data brought it back (the holder's republish only writes what it holds), and
        each reader would otherwise ask for it, and fail, until record_ttl_s. Only a live holder's (its current
        boot: an older daemon's entry has none), and only if it is still the entry read: one the holder wrote
        again meanwhile stays. (One written again identical, the block stored again in the same tier within the
        round trip, goes too: its holder publishes it again at its next republish.) Whether it was removed."""
        if holder.boot is None or not holder.record or self.state != "ok":
            return False
        return await self._prune(block_record_key(key), holder.node_id, holder.record)

    async def _prune(self, name: str, node: str, entry: str) -> bool:
        """Remove a node's entry that is no longer true, unless the node wrote it again since it was read."""
        removed = 0
        with contextlib.suppress(*REDIS_FAULTS):
            try:
                removed = await _cancellable(self._redis.eval(_PRUNE, 1, name, node, entry))
            except ResponseError:  # scripting refused (an ACL, a managed Redis): removed as before, at the small
                removed = await _cancellable(self._redis.hdel(name, node))  # risk of an entry written again meanwhile
        self.counters.stale_entries_removed += int(bool(removed))
        return bool(removed)

    async def live_nodes(self) -> int:
        """Nodes with a fresh, signed heartbeat record, this one included."""
        if self.state != "ok":
            return 0
        try:
            ids = sorted(n.decode() for n in await _cancellable(self._redis.smembers(_NODE_IDS)))
            records = await _cancellable(self._redis.mget([_NODE + n for n in ids])) if ids else []
        except (*REDIS_FAULTS, UnicodeDecodeError):
            return 0
        gone = [n for n, r in zip(ids, records, strict=True) if r is None]
        if gone:
            with contextlib.suppress(*REDIS_FAULTS):
                await _cancellable(self._redis.srem(_NODE_IDS, *gone))
        return sum(1 for n, r in zip(ids, records, strict=True)
                   if r is not None and self.trust.node_address(n, r.decode(errors="replace")) is not None)

"""Peer fetch: on a local miss, find the blocks a query needs in the cluster index and copy them from the
daemon that holds them (FetchBlocks, authenticated with the peer token), verifying each before the local
store publishes it: against the MAC this daemon computes itself with the cluster secret (engram/trust.py:
Redis supplies nothing a block is checked against), the checksum of the signed holder record, and the key
its tokens hash to. The peer token goes only to addresses from signed, fresh node records."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import numpy as np

from engram.block import BlockHeader
from engram.cluster import ClusterIndex
from engram.errors import EngramError
from engram.keys import block_key, chain_keys
from engram.store import BlockStore
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire.channel import open_channel, stub_for
from engram.wire.stream import Reassembler, client_reassembler

log = logging.getLogger("engram.server.peers")

MAX_CHAIN = 256  # ancestors a Get-triggered fetch follows before it gives up (the payloads wait in memory)


class PeerFetcher:
    def __init__(self, cluster: ClusterIndex, store: BlockStore, *, token: str = "", root_cert: bytes | None = None,
                 timeout_s: float = 5.0, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """metadata: sent with the token on every call (ClusterTrust.peer_metadata: this daemon's node id)."""
        self.cluster = cluster
        self.store = store
        self.token = token
        self.metadata = metadata
        self.root_cert = root_cert
        self.timeout_s = timeout_s
        # node id -> (address, channel, stub): one channel per peer, replaced when the peer moves (a restart on
        # another port or host), so restarts do not pile up channels
        self._peers: dict[str, tuple[str, grpc.aio.Channel, Any]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _stub(self, node_id: str, address: str) -> Any:
        known = self._peers.get(node_id)
        if known is not None and known[0] == address:
            return known[2]
        if known is not None:
            task = asyncio.get_running_loop().create_task(known[1].close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        channel = open_channel(address, root_cert=self.root_cert)
        stub = stub_for(channel, self.token, self.metadata)
        self._peers[node_id] = (address, channel, stub)
        return stub

    async def fill(self, namespace: str, fingerprint: bytes, tokens: np.ndarray, have_tokens: int) -> int:
        """Copy the full blocks of `tokens` after the first `have_tokens` from peers, in chain order, until
        one is not found; returns how many were stored."""
        bt = self.store.spec(fingerprint).layout.block_tokens
        salt = self.store.namespaces.salt(namespace)
        parent = self.store.root(namespace, fingerprint)
        stored = 0
        for key, start, end in chain_keys(namespace, fingerprint, tokens, bt, salt):
            if end - start < bt:
                break
            if end <= have_tokens:
                parent = key
                continue
            if not await self._fetch_one(namespace, fingerprint, parent, key):
                break
            parent = key
            stored += 1
        return stored

    async def fetch_keys(self, namespace: str, fingerprint: bytes, keys: list[bytes]) -> int:
        """Copy blocks named by key from peers, with whatever of their chains this daemon lacks (a Get of
        keys the worker learnt from another daemon); returns how many blocks were stored."""
        stored = 0
        for key in keys:
            if not self.store.holds(namespace, key):
                stored += await self._fetch_chain(namespace, fingerprint, key)
        return stored

    async def _fetch_chain(self, namespace: str, fingerprint: bytes, key: bytes) -> int:
        """Download `key` and its missing ancestors (up to MAX_CHAIN), then store them parents first."""
        root = self.store.root(namespace, fingerprint)
        chain: list[tuple[bytes, bytes, BlockHeader, bytes]] = []  # (key, parent, header, payload), child first
        while len(chain) < MAX_CHAIN:
            got = await self._download(namespace, fingerprint, key, parent=None)
            if got is None:
                return 0
            parent, header, payload = got
            chain.append((key, parent, header, payload))
            if parent == root or self.store.holds(namespace, parent):
                break
            key = parent
        else:
            return 0
        stored = 0
        for key, parent, header, payload in reversed(chain):
            if not await self._store(namespace, fingerprint, key, parent, header, payload):
                break
            stored += 1
        return stored

    async def _fetch_one(self, namespace: str, fingerprint: bytes, parent: bytes, key: bytes) -> bool:
        got = await self._download(namespace, fingerprint, key, parent=parent)
        return got is not None and await self._store(namespace, fingerprint, key, parent, got[1], got[2])

    async def _download(self, namespace: str, fingerprint: bytes, key: bytes, *,
                        parent: bytes | None) -> tuple[bytes, BlockHeader, bytes] | None:
        """One block from the first live holder whose copy verifies against the advertised checksum:
        (its parent key, header, payload); None when no holder has it. `parent`, when known, must match."""
        for holder in await self.cluster.holders(key):
            try:
                got = None
                sent_parent = b""
                blocks: Reassembler[pb.BlockHeader] = client_reassembler(lambda h: h.payload_nbytes)
                mac = b""
                request = pb.FetchBlocksRequest(keys=[key], namespace=namespace, model_fingerprint=fingerprint)
                async for resp in self._stub(holder.node_id, holder.address).FetchBlocks(request,
                                                                                          timeout=self.timeout_s):
                    c = resp.chunk
                    if c.HasField("header"):
                        sent_parent, mac = resp.parent_key, resp.mac
                        if c.key != key or resp.namespace != namespace or \
                                resp.model_fingerprint != fingerprint or parent not in (None, sent_parent):
                            raise EngramError("the peer sent another block than the one asked for")
                    got = blocks.add(c.header if c.HasField("header") else None, c.data, c.last, 0) or got
                if got is None:
                    continue  # the peer evicted it meanwhile
                header = convert.header_from_pb(got[0], 0)
                if not self.cluster.trust.block_verifies(mac, key, sent_parent, namespace, fingerprint, header.codec,
                                                         got[1]):
                    raise EngramError("the block's MAC does not verify under the cluster secret: forged or damaged")
                if block_key(sent_parent, header.tokens) != key:  # the MAC binds key and parent; the key, its tokens
                    raise EngramError("the block's tokens do not hash to its key: altered on the way")
                if header.checksum != holder.checksum:
                    raise EngramError("the block's checksum differs from the one its holder record advertised")
                return sent_parent, header, got[1]
            except (grpc.aio.AioRpcError, EngramError) as exc:
                self.cluster.counters.remote_failures += 1
                log.warning("peer fetch of %s from %s failed: %s", key.hex(), holder.node_id, exc)
        return None

    async def _store(self, namespace: str, fingerprint: bytes, key: bytes, parent: bytes, header: BlockHeader,
                     payload: bytes) -> bool:
        try:
            await self.store.put(namespace, fingerprint, parent, header, payload)  # verifies it again
        except EngramError as exc:
            self.cluster.counters.remote_failures += 1
            log.warning("a peer's block %s did not verify: %s", key.hex(), exc)
            return False
        self.cluster.counters.remote_hits += 1
        self.cluster.counters.remote_bytes += len(payload)
        return True

    async def close(self) -> None:
        for _, channel, _ in self._peers.values():
            await channel.close()
        self._peers.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

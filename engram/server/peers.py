"""Peer fetch: on a local miss, find the blocks a query needs in the cluster index and copy them from the
daemon that holds them (FetchBlocks, authenticated with the peer token), verifying each before the local
store publishes it: against the MAC this daemon computes itself with the cluster secret (engram/trust.py:
Redis supplies nothing a block is checked against), the checksum of the signed holder record, and the key
its tokens hash to. The peer token goes only to addresses from signed, fresh node records."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

import grpc
import numpy as np

from engram.block import BlockHeader
from engram.cluster import ClusterIndex, Holder
from engram.errors import (
    DeadlineExceeded,
    EngramError,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    brief,
    restated,
)
from engram.keys import block_key
from engram.logbudget import LogBudget
from engram.store import BlockStore
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire.channel import open_channel, stub_for
from engram.wire.stream import Reassembler, client_reassembler

log = logging.getLogger("engram.server.peers")

FETCH_BATCH = 128  # blocks one FetchBlocks asks for when a chain is copied (fewer where the holder's limit is lower)
# Of a call's own deadline, what its copying from peers leaves for the answer (or a quarter of the time the call has,
# where that is less): copying to the deadline itself, a Lookup's answer of what it held came after it, and its
# caller got DEADLINE_EXCEEDED instead of a shorter match (a review, session 53)
ANSWER_MARGIN_S = 1.0
# What every Engram's refusal of a request for its size says (RESOURCE_EXHAUSTED, engram/server/requests.py: a
# FetchBlocks naming more keys than the holder's server.max_blocks_per_request), and no other RESOURCE_EXHAUSTED does
_REFUSED_FOR_SIZE = "split the request"


class _PeerFailed(EngramError):
    """This holder could not supply the block (gone, evicted it, sent something that does not verify): the next
    holder is tried."""


class _NotHeld(_PeerFailed):
    """The holder answered without the block its entry names: evicted meanwhile, or an entry Redis brought back
    from older data (a restore, a lagging replica): the reader removes the entry (ClusterIndex.forget_unheld)."""


class _TooMany(_PeerFailed):
    """The holder refused a FetchBlocks for its number of keys before sending a block (its own
    server.max_blocks_per_request): one that does not say its limit (an older daemon) is asked again with fewer."""


class _Unstorable(EngramError):
    """A block that verified could not be stored here (the tier full, a quota, its parent evicted meanwhile):
    copying more of the chain would be for nothing."""


class _Budget:
    """The blocks one call may still copy from peers (cluster.max_fetch_blocks), charged as each is stored, whichever
    holder sent it: a holder that copied part of a chain and then failed was charged nothing, only the next holder's
    copy, so a Get copied past the bound (session 53)."""

    __slots__ = ("copied", "left")

    def __init__(self, blocks: int) -> None:
        self.left, self.copied = blocks, 0

    def spend(self) -> None:
        self.left -= 1
        self.copied += 1


class _Peer(NamedTuple):
    address: str
    boot: int | None  # the peer's process the channel was opened for (its boot record)
    channel: grpc.aio.Channel
    stub: Any


class PeerFetcher:
    def __init__(self, cluster: ClusterIndex, store: BlockStore, *, token: str = "", root_cert: bytes | None = None,
                 timeout_s: float = 5.0, fill_timeout_s: float = 20.0, max_blocks: int = 4096,
                 metadata: tuple[tuple[str, str], ...] = (), untagged_gets: bool = False) -> None:
        """timeout_s: each block's (cluster.fetch_timeout_s); fill_timeout_s: one call's copying in all
        (cluster.fill_timeout_s). max_blocks: the most blocks one call copies (cluster.max_fetch_blocks). metadata:
        sent with the token on every call (ClusterTrust.peer_metadata: this daemon's node id). untagged_gets:
        whether a Get reads an older daemon's untagged holder entries (tenancy off: `_fetch_chain`)."""
        self.cluster = cluster
        self.store = store
        self.token = token
        self.metadata = metadata
        self.root_cert = root_cert
        self.timeout_s = timeout_s
        self.fill_timeout_s = fill_timeout_s
        self.max_blocks = max_blocks
        self.untagged_gets = untagged_gets
        # One channel per peer, replaced when the peer moves (a restart on another port or host), so restarts do
        # not pile up channels, or restarts in place (a new boot): the old channel, refused while the peer was
        # down, waits out its reconnect backoff (up to 2 s) failing every call at once, where a new one connects now
        self._peers: dict[str, _Peer] = {}
        # The keys a copy asks an older holder for a call, where it refused more (it does not say its limit, max_keys):
        # forgotten with its channel, when it moves or restarts (maybe upgraded, or its limit changed)
        self._batches: dict[str, int] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._failures_said = LogBudget()  # a dead or restarted holder fails every fetch that meets it
        self._expiries_said = LogBudget()  # a slow holder makes every lookup's fill run out

    def _stub(self, node_id: str, address: str, boot: int | None = None) -> Any:
        known = self._peers.get(node_id)
        if known is not None and (known.address, known.boot) == (address, boot):
            return known.stub
        if known is not None:
            self._batches.pop(node_id, None)
            task = asyncio.get_running_loop().create_task(known.channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        channel = open_channel(address, root_cert=self.root_cert)
        stub = stub_for(channel, self.token, self.metadata)
        self._peers[node_id] = _Peer(address, boot, channel, stub)
        return stub

    def _bound(self, deadline: float | None) -> tuple[float, str]:
        """When one call's copying must end (the loop's time), and what set it: cluster.fill_timeout_s, or the
        call's own `deadline` (the loop's time), less ANSWER_MARGIN_S for the answer, where that is sooner. Each
        block has cluster.fetch_timeout_s, and a fill of thousands of blocks from a slow peer held its call for
        minutes (session 53)."""
        now = asyncio.get_running_loop().time()
        ends = now + self.fill_timeout_s
        if deadline is not None:
            answer_by = deadline - min(ANSWER_MARGIN_S, max(deadline - now, 0.0) / 4)
            if answer_by < ends:
                return answer_by, "the call's deadline"
        return ends, f"cluster.fill_timeout_s ({self.fill_timeout_s:g} s)"

    async def fill(self, namespace: str, fingerprint: bytes, tokens: np.ndarray, have_tokens: int,
                   parent: bytes, *, deadline: float | None = None) -> int:
        """Copy the full blocks of `tokens` after the first `have_tokens` from peers, in chain order, until
        one is not found, cluster.max_fetch_blocks are copied or the time is up (`_bound`: the lookup answers
        what it holds then, said in the log); returns how many were stored. `parent` is the
        chain's key after `have_tokens` (the local walk's, PrefixWalk.whole): the keys up to it are not hashed
        again (the whole prefix was, ~140 ms of the event loop at a million tokens). Each key after it is hashed
        as its block is asked for, and each ask awaits Redis: the loop has its turns between them."""
        bt = self.store.spec(fingerprint).layout.block_tokens
        arr = np.ascontiguousarray(tokens, dtype="<i4")
        budget = _Budget(self.max_blocks)
        ends, why = self._bound(deadline)
        try:
            async with asyncio.timeout_at(ends) as bound:
                for start in range(have_tokens, len(arr) - bt + 1, bt):
                    if budget.left < 1:
                        break
                    key = block_key(parent, arr[start : start + bt])
                    try:
                        if not await self._copy_from_any(namespace, fingerprint, parent, [key], budget):
                            break
                    except _Unstorable:
                        break
                    parent = key
        except TimeoutError:
            if not bound.expired():
                raise
            held = self._expiries_said.take()
            if held is not None:
                log.warning("a lookup's copy from peers ran past %s after %d blocks: it answers what is held here%s",
                            why, budget.copied, f" ({held} more ran out before this one, not logged)" if held else "")
        return budget.copied

    async def fetch_keys(self, namespace: str, fingerprint: bytes, keys: list[bytes], *,
                         deadline: float | None = None) -> None:
        """Copy the blocks named by key that this daemon lacks from peers, with the ancestors it lacks (a Get of
        keys the worker learnt from another daemon), parents first, each stored as it arrives. A Get needs every
        key: the first one that cannot be had within cluster.max_fetch_blocks blocks in all ends the copying,
        NotFound saying why (nothing downloaded only to be dropped, no chain asked for again per key). A model not
        registered here is UnknownModel at once (a daemon restarted DRAM-only): nothing copied could be stored,
        and the worker integrations register the model again on that error, not on a NotFound. The copying has one
        bound in all (`_bound`): past it, DeadlineExceeded saying which and how far it got (what was copied stays)."""
        self.store.spec(fingerprint)
        budget = _Budget(self.max_blocks)
        ends, why = self._bound(deadline)
        try:
            async with asyncio.timeout_at(ends) as bound:
                # Last key first: a Get names a chain root-most first, so its last key's ancestors are most of the rest
                for i in reversed(range(len(keys))):
                    if not self.store.holds(namespace, keys[i]):
                        await self._fetch_chain(namespace, fingerprint, keys[i], i, budget)
        except TimeoutError:
            if not bound.expired():
                raise
            raise DeadlineExceeded(f"this Get's copying of blocks it lacks from the cluster's peers ran past {why}, "
                                   f"{budget.copied} blocks copied: a peer is slow or stopped; call again (what was "
                                   "copied is kept)") from None

    async def _fetch_chain(self, namespace: str, fingerprint: bytes, key: bytes, index: int, budget: _Budget) -> None:
        """Copy `key` and the ancestors this daemon lacks from a holder, within what is left of `budget`. The
        holder first lists the ancestors (FetchBlocks with `ancestors`), so a chain too long is refused before any
        of it is copied.

        The caller names the key, maybe another namespace's: only holders whose entry is tagged with the caller's
        namespace are asked (ClusterIndex.holders), so a key another namespace holds is answered as one nobody
        holds, in the same words and about the same time. The answers differed, and told any tenant which keys
        exist elsewhere in the cluster (an audit, session 48); then the time did, the holder asked before the
        refusal (4.4 ms against 1.6 ms). An older daemon's untagged entry may be any namespace's: asking its holder
        serves nothing of another (FetchBlocks answers only the namespace named, and the MAC binds it) but tells
        by the time, so with tenancy it is skipped (a Get by key of a block only older daemons hold misses until
        they are upgraded); without (`untagged_gets`), every caller may name any namespace and ask itself, and it
        is read. A holder that does not supply the key still gets the same answer, the reasons in the log. A
        budget spent is checked before the index is read, so it does not depend on the holders either."""
        what = f"block {index} ({brief(key)})"
        if budget.left < 1:
            raise NotFound(f"{what} is not stored here, and this Get has copied cluster.max_fetch_blocks "
                           f"({self.max_blocks}) blocks from peers already")
        unsupplied = NotFound(f"{what} is not stored here, and no live peer of the cluster supplied it")
        holders = await self.cluster.holders(key, namespace, untagged=self.untagged_gets)
        if not holders:
            raise unsupplied
        root = self.store.root(namespace, fingerprint)
        for holder in holders:
            left = budget.left  # less what an earlier holder copied before it failed
            try:
                ancestors, cut, batch = await self._ancestors(holder, namespace, fingerprint, key, left)
                chain: list[bytes] = [key]
                parent: bytes | None = None
                while parent is None:
                    for ancestor in ancestors:
                        if self.store.holds(namespace, ancestor):
                            parent = ancestor
                            break
                        chain.append(ancestor)
                    else:
                        if len(chain) > left:
                            raise NotFound(f"{what} is not stored here, and a peer holds it more than {left} blocks "
                                           "below anything this daemon holds, more than this Get may copy "
                                           f"(cluster.max_fetch_blocks = {self.max_blocks}): none of them was copied")
                        if not cut:
                            parent = root
                        elif not ancestors:
                            raise _PeerFailed("the peer cut a list of no ancestors short")
                        else:  # the holder's own request limit stopped the list: on from its last key
                            ancestors, cut, _ = await self._ancestors(holder, namespace, fingerprint, chain[-1],
                                                                      left - len(chain) + 1)
                chain.reverse()
                await self._copy(holder, namespace, fingerprint, parent, chain, budget, batch)
                return
            except _PeerFailed as exc:  # a Get names keys, maybe of another namespace: the entry is not judged
                await self._peer_failed(key, holder, exc, prune=False)
            except _Unstorable as exc:
                raise restated(NotFound, f"{what} is not stored here, and its chain from a peer could not be "
                               "stored: ", exc) from None
        raise unsupplied

    async def _ancestors(self, holder: Holder, namespace: str, fingerprint: bytes, key: bytes,
                         most: int) -> tuple[list[bytes], bool, int | None]:
        """Up to `most` of `key`'s ancestors on `holder`, nearest first; whether the holder's own request limit
        cut the list short of the root (server.max_blocks_per_request below `most`: the chain goes on from the
        list's last key; a holder that lists fewer took the 200th of a 300-block chain for the root's child, and the
        Get failed NOT_FOUND, an audit, session 52); and the most keys a copy from it may ask for a call: the holder's
        limit, where it says one (a holder under 128 refused every copy, RESOURCE_EXHAUSTED, and the Get was
        NOT_FOUND, session 53), or None where it says none (a daemon older than that: `_copy` finds it out)."""
        request = pb.FetchBlocksRequest(keys=[key], namespace=namespace, model_fingerprint=fingerprint,
                                        ancestors=most)
        call = self._stub(holder.node_id, holder.address, holder.boot).FetchBlocks(request, timeout=self.timeout_s)
        try:
            resp = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _PeerFailed(_rpc_failure(exc)) from None
        finally:  # its one answer read, or this Get cut: not left to the garbage collector (as `_blocks`)
            call.cancel()
        if resp is grpc.aio.EOF or resp.HasField("chunk") or len(resp.ancestors) > most:
            raise _PeerFailed("the peer does not list a block's ancestors (a daemon older than this one)")
        return list(resp.ancestors), resp.ancestors_cut, min(FETCH_BATCH, resp.max_keys) if resp.max_keys else None

    async def _copy_from_any(self, namespace: str, fingerprint: bytes, parent: bytes, keys: list[bytes],
                             budget: _Budget) -> bool:
        """Copy one block under a stored `parent` from the first live holder that supplies it."""
        for holder in await self.cluster.holders(keys[-1], namespace, untagged=True):
            try:
                await self._copy(holder, namespace, fingerprint, parent, keys, budget)
                return True
            except _PeerFailed as exc:
                await self._peer_failed(keys[-1], holder, exc)
        return False

    async def _peer_failed(self, key: bytes, holder: Holder, exc: Exception, *, prune: bool = True) -> None:
        """Count a holder that did not supply a block, and say why: one line each, a burst (a dead or restarted
        holder met by every lookup) bounded by `_failures_said`, the rest counted in the next line. A live holder
        that lacks the block its entry names has the entry removed, so the next lookup does not ask it again: only
        for a lookup's fill (`prune`), whose keys this daemon computed under the caller's namespace's salt, so the
        holder would hold the block in that namespace. A Get names keys itself: a tenant naming another
        namespace's keys in its own gets "not held" from a holder that holds them there, and pruning on that
        let any tenant remove another's entries (the isolation probe's peer fetch, session 46)."""
        self.cluster.counters.remote_failures += 1
        removed = prune and isinstance(exc, _NotHeld) and await self.cluster.forget_unheld(key, holder)
        held = self._failures_said.take()
        if held is not None:
            log.warning("peer fetch of %s from %s failed: %s%s%s", key.hex(), holder.node_id, exc,
                        "; its holder entry is removed from the index" if removed else "",
                        f" ({held} more failed before this one, not logged)" if held else "")

    async def _copy(self, holder: Holder, namespace: str, fingerprint: bytes, parent: bytes,
                    chain: list[bytes], budget: _Budget, most: int | None = None) -> None:
        """Copy `chain` (keys root-most first, the first a child of `parent`, the last the key `holder`'s record
        names) from `holder`, `most` keys a call, storing each block as it arrives (no more than one block's bytes
        wait here) and charging it to `budget`; _PeerFailed or _Unstorable when one was not stored.

        `most` None: the holder did not say its limit (a daemon from before FetchBlocksResponse.max_keys), so it is
        asked for FETCH_BATCH keys a call, or the fewer it took last, halved (down to one) while it refuses a call
        for its size before any block: one whose server.max_blocks_per_request is under 128 refused every copy,
        and the Get was NOT_FOUND (session 54)."""
        start = 0
        while start < len(chain):
            size = most or self._batches.get(holder.node_id, FETCH_BATCH)
            batch = chain[start : start + size]
            blocks = self._blocks(holder, namespace, fingerprint, parent, batch, last=start + len(batch) == len(chain))
            try:
                async with contextlib.aclosing(blocks):  # a block not stored ends the call to the peer at once
                    async for key, header, payload in blocks:
                        await self._store(namespace, fingerprint, key, parent, header, payload)
                        budget.spend()
                        parent = key
            except _TooMany as exc:
                if most or len(batch) == 1:
                    raise
                # the smaller of this and what a concurrent copy from the holder learned meanwhile
                self._batches[holder.node_id] = min(len(batch) // 2, self._batches.get(holder.node_id, FETCH_BATCH))
                log.info("peer %s refused a copy of %d blocks in one call (%s): it does not say its limit (a daemon "
                         "older than this one), so it is asked for %d", holder.node_id, len(batch), exc,
                         self._batches[holder.node_id])
                continue
            start += len(batch)

    async def _blocks(self, holder: Holder, namespace: str, fingerprint: bytes, parent: bytes, keys: list[bytes],
                      *, last: bool) -> AsyncGenerator[tuple[bytes, BlockHeader, bytes], None]:
        """The blocks `keys` (a chain under `parent`) from `holder`, in order, each verified: against the MAC this
        daemon computes with the cluster secret, the key its tokens hash to under the expected parent, and (the
        `last` batch's last block) the checksum the holder's signed record advertises. Each block has
        fetch_timeout_s to arrive."""
        request = pb.FetchBlocksRequest(keys=keys, namespace=namespace, model_fingerprint=fingerprint)
        call = self._stub(holder.node_id, holder.address, holder.boot).FetchBlocks(request)
        blocks: Reassembler[pb.BlockHeader] = client_reassembler(lambda h: h.payload_nbytes)
        loop = asyncio.get_running_loop()
        n, mac = 0, b""
        try:
            deadline = loop.time() + self.timeout_s
            while n < len(keys):
                async with asyncio.timeout_at(deadline):  # not around the yield: storing is not the peer's time
                    resp = await call.read()
                if resp is grpc.aio.EOF:
                    # It sends those of `keys` it holds, in order: after keys[:n], none of the rest (the last batch:
                    # the block the holder's entry names among them)
                    failed = _NotHeld if last else _PeerFailed
                    raise failed(f"the peer sent {n} of the {len(keys)} blocks asked for (evicted meanwhile)")
                c = resp.chunk
                if c.HasField("header"):
                    mac = resp.mac
                    if c.key != keys[n] or resp.namespace != namespace or \
                            resp.model_fingerprint != fingerprint or resp.parent_key != parent:
                        raise _PeerFailed("the peer sent another block than the one asked for")
                got = blocks.add(c.header if c.HasField("header") else None, c.data, c.last, 0)
                if got is None:
                    continue
                key = keys[n]
                header = convert.header_from_pb(got[0], 0)
                if not self.cluster.trust.block_verifies(mac, key, parent, namespace, fingerprint, header.codec,
                                                         got[1]):
                    raise _PeerFailed("the block's MAC does not verify under the cluster secret: forged or damaged")
                if block_key(parent, header.tokens) != key:  # the MAC binds key and parent; the key, its tokens
                    raise _PeerFailed("the block's tokens do not hash to its key: altered on the way")
                if last and n == len(keys) - 1 and header.checksum != holder.checksum:
                    raise _PeerFailed("the block's checksum differs from the one its holder record advertised")
                yield key, header, got[1]
                parent, n = key, n + 1
                deadline = loop.time() + self.timeout_s
        except grpc.aio.AioRpcError as exc:
            if n == 0 and len(keys) > 1 and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED \
                    and _REFUSED_FOR_SIZE in str(exc.details()):
                raise _TooMany(_rpc_failure(exc)) from None
            raise _PeerFailed(_rpc_failure(exc)) from None
        except TimeoutError:
            raise _PeerFailed(f"no block within cluster.fetch_timeout_s ({self.timeout_s:g} s)") from None
        except EngramError as exc:
            if isinstance(exc, _PeerFailed):
                raise
            raise _PeerFailed(str(exc)) from None
        finally:
            call.cancel()

    async def _store(self, namespace: str, fingerprint: bytes, key: bytes, parent: bytes, header: BlockHeader,
                     payload: bytes) -> None:
        try:
            await self.store.put(namespace, fingerprint, parent, header, payload)  # verifies it again
        except (ResourceExhausted, FailedPrecondition) as exc:
            # Not the peer's doing: no remote failure (a full pool was counted and logged as one, "did not verify")
            log.info("a peer's block %s was not stored: %s", key.hex(), exc)
            raise restated(_Unstorable, "", exc) from None  # (a full tier's figures kept from a tenant: TierFull)
        except EngramError as exc:  # counted and said once, as the holder's failure (_peer_failed)
            raise _PeerFailed(f"its block {brief(key)} did not verify here: {exc}") from None
        self.cluster.counters.remote_hits += 1
        self.cluster.counters.remote_bytes += len(payload)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close()
        self._peers.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _rpc_failure(exc: grpc.aio.AioRpcError) -> str:
    """A failed call in one line: its str() spans four, with grpc's debug string."""
    return f"{exc.code().name}: {' '.join(str(exc.details()).split())}"

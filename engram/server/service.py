"""The Engram gRPC service: translates RPCs into store calls and streams payloads in chunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
import torch

from engram import __version__, eviction
from engram.api import (
    CheckFinding,
    CheckReport,
    ClusterStats,
    Limits,
    ModelStats,
    NamespaceStats,
    ReplayStats,
    SessionMode,
)
from engram.api import Stats as StatsReply
from engram.block import BlockHeader, Payload, checksum
from engram.borrowed import in_thread
from engram.cluster import ClusterIndex
from engram.codec import stored
from engram.config import ServerConfig
from engram.errors import (
    DeadlineExceeded,
    EngramError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from engram.index import BlockMeta, PrefixWalk
from engram.inspection import Inspector
from engram.leases import Lease, LeaseTable
from engram.limits import check_namespace
from engram.loopturns import SLICE_BLOCKS, pause
from engram.server.arrival import each_request, one_request
from engram.server.auth import (
    caller,
    guard,
    is_admin,
    is_peer,
    namespace_for,
    session_owner,
    tenant_of,
    visible_namespaces,
)
from engram.server.errors import streaming, unary
from engram.server.forgetmodel import forget_model
from engram.server.modelroom import Holds, make_room
from engram.server.peers import PeerFetcher
from engram.server.prefixheader import cuda_handle, not_in_pools, prefix_header
from engram.server.recvbudget import ReceiveBudget
from engram.server.requests import (
    CONTROL_BYTES,
    TOP_LEVEL_SLACK,
    block_request_bytes,
    check_limit,
    decoded,
    key_request_bytes,
    safe_decoder,
    token_request_bytes,
)
from engram.sessions import Resumed, ResumeStage, Session, SessionManager, Window, holds_no_window
from engram.store import BlockStore, WritePolicy
from engram.store.durable import durable_tier
from engram.store.inplace import InPlacePuts
from engram.store.pins import PinShare
from engram.tenancy import Tenancy
from engram.tiers.pool import PoolTier, ipc_pool, shared_pool
from engram.trust import ClusterTrust
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire.stream import Reassembler, bytes_frames, chunk_frames, payload_step, pieces

if TYPE_CHECKING:
    from engram.server.dataport import DataPort

SERVICE_NAME = "engram.v1.Engram"

# The most often a Resume sends progress messages, whatever its client asks (ResumeRequest.progress_every_ms).
RESUME_PROGRESS_MIN_S = 0.01

# Turns of the loop a handler gives a cancel that came while it ran without awaiting to reach it (_cancel_lands):
# three in grpc 1.85, one more for slack.
CANCEL_TURNS = 4


def _chunks(key: bytes, header: pb.BlockHeader, payload: bytes | memoryview, step: int) -> list[pb.BlockChunk]:
    """A block as chunks under the message limit: the first carries its header and key."""
    return [pb.BlockChunk(header=header, key=key, data=piece, last=last) if i == 0 else
            pb.BlockChunk(data=piece, last=last) for i, (piece, last) in enumerate(pieces(payload, step))]


def _refs(metas: tuple[BlockMeta, ...] | list[BlockMeta], promised: str | None = None, homes: bool = False
          ) -> list[pb.BlockRef]:
    """engram.api.BlockRef's message for each block (built directly: a hit of a long prefix has hundreds).
    promised: the tier write-through acknowledges on (`_promised_tier`): a block without a copy there is
    marked not_durable, so that a client's put sends it rather than skip it as cached. homes: each block's tier is
    its home, the slowest holding a copy, not the fastest (`_shows_homes`)."""
    if homes:
        return [pb.BlockRef(key=m.key, num_tokens=m.num_tokens, tier=m.locations[-1], nbytes=m.nbytes,
                            not_durable=promised is not None and promised not in m.locations) for m in metas]
    if promised is None:
        return [pb.BlockRef(key=m.key, num_tokens=m.num_tokens, tier=m.tier, nbytes=m.nbytes) for m in metas]
    return [pb.BlockRef(key=m.key, num_tokens=m.num_tokens, tier=m.tier, nbytes=m.nbytes,
                        not_durable=promised not in m.locations) for m in metas]


def _shows_homes(store: BlockStore, namespace: str) -> bool:
    """Whether the call is shown each block's home tier (the slowest holding a copy) rather than the fastest: a
    tenant's, in a namespace other tenants share. The fastest moves with every tenant's reads (a Get copies a block
    up from NVMe into DRAM), and a Lookup, a probe above all, read from it which of the namespace's blocks the
    others had read (session 50's loose ends); engram.inspection.Inspector.tiers_seen shows the same."""
    return bool(tenant_of(None)) and store.namespaces.shared(namespace)


async def _walked_refs(walk: PrefixWalk, promised: str | None, homes: bool = False) -> list[pb.BlockRef]:
    """`_refs` of the blocks a walk keeps, `SLICE_BLOCKS` at a time with a turn of the event loop between slices
    (a long prefix's are a third of a second of Python); they end before a block removed meanwhile."""
    refs: list[pb.BlockRef] = []
    while len(refs) < walk.kept():
        if refs:
            walk.watch()
            await pause()
        refs += _refs(walk.blocks[len(refs) : min(walk.kept(), len(refs) + SLICE_BLOCKS)], promised, homes)
    del refs[walk.kept() :]
    return refs


def _resume_header(r: Resumed, with_global_kv: bool, homes: bool = False) -> pb.ResumeResponse:
    """A Resume's header: where it resumes, its window's shape, its blocks (and its global KV's shape). A block
    lost since the lookup, leased though it is (another reader found its only copy damaged), is FAILED_PRECONDITION,
    as one never put: read as it is, its tier was an IndexError, INTERNAL."""
    end = 0
    for meta in r.blocks:
        if not meta.locations:
            raise FailedPrecondition(f"the global KV of positions [{end}, {r.position}) is not stored (a block of it "
                                     "was lost: evicted, or its copy damaged); put it again, then Resume")
        end += meta.num_tokens
    w = r.window
    kv_header = None
    if with_global_kv:
        first = r.blocks[0]  # a Resume's prefix is not empty, and its blocks are all of one layout
        kv_header = pb.GlobalKVData(dtype=int(first.dtype),  # type: ignore[arg-type]
                                    shape=[*first.shape[:2], r.position, *first.shape[3:]])
    return pb.ResumeResponse(header=pb.ResumeHeader(
        position=r.position, source=r.source, replayed_tokens=r.replayed, token_layers=r.token_layers,
        replay_s=r.seconds, blocks=_refs(r.blocks, homes=homes),
        window=pb.SwaWindowData(prefix_len=w.prefix_len, start=w.start, dtype=int(w.dtype),  # type: ignore[arg-type]
                                shape=list(w.shape), checksum=w.checksum),
        global_kv=kv_header,
    ))


def _promised_tier(store: BlockStore) -> str | None:
    """Under write-through, the durable tier's name (a block is acknowledged once it has a copy there); None
    under write-back or without a durable tier, where no block is told apart."""
    if store.write_policy != WritePolicy.WRITE_THROUGH:
        return None
    d = durable_tier(store.placement)
    return None if d is None else store.placement.tiers[d].name


def _header_of(meta: BlockMeta, codec: str) -> BlockHeader:
    return BlockHeader(meta.token_array(), meta.dtype, meta.shape, meta.nbytes, meta.checksum, codec)


async def _unless_gone(work: Coroutine[Any, Any, None], gone: Awaitable[None]) -> None:
    """Await `work` unless `gone` returns first: then `work` is cancelled (a peer fetch does not go on for a
    client that has left) and ConnectionError is raised."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():  # here only by the watch: cancelled from outside, this call raised already
        raise ConnectionError("the client closed its connection while its Get waited on the cluster's peers")
    task.result()


def _deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on the loop's clock (what bounds its copying from peers), None where its caller set none."""
    left = context.time_remaining()
    return None if left is None else asyncio.get_running_loop().time() + left


def _sooner(deadline: float | None, answer_within_ms: int) -> float | None:
    """`deadline` (the loop's time, None: none) or the wait the caller says, `answer_within_ms` from now (0: none),
    the sooner: a data-channel Get has no deadline, and a GetPrefix's gRPC deadline is its lease's, past the time
    its client waits (engram/client.py `_granting`)."""
    if not answer_within_ms:
        return deadline
    waits = asyncio.get_running_loop().time() + answer_within_ms / 1000
    return waits if deadline is None else min(deadline, waits)


async def _cancel_lands() -> None:
    """Turns of the loop for a cancel that came while this handler ran without awaiting: grpc hears of its client's
    cancel (or deadline) in a task of its own, which cancels the handler's task from there, three turns after
    (grpc 1.85). A unary answer returned before then is dropped, and the handler never knows."""
    for _ in range(CANCEL_TURNS):
        await asyncio.sleep(0)


async def _answer_may_land(context: grpc.aio.ServicerContext, what: str) -> None:
    """Before a handler answers with a grant its caller learns of only from the answer (`what`: a reservation, a
    lease, a session whose id the daemon picked): CancelledError for a cancel that lands in the turns grpc takes
    (`_cancel_lands`), DeadlineExceeded once the call's deadline has passed. Either way the caller handles it by
    giving the grant back. A busy loop passes a cancel on later than those turns, and a deadline may pass with
    no cancel ever reaching the handler (grpc drops the answer, and its done callback says "not cancelled": a
    review, session 51), so the deadline is read here: exact for a caller that set one (the daemon's deadline is
    the client's, counted from the request's arrival, so never earlier). A cancel later still, or an answer
    dropped in flight, is not seen: EngramClient never cancels such a call, it lets it finish and gives the grant
    back itself (engram/client.py, `_granting`)."""
    await _cancel_lands()
    left = context.time_remaining()
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"the call's deadline passed before its answer ({what}) was sent: the daemon gave "
                               f"the {what} back; call again with a longer deadline")


def _window_from_pb(msg: pb.SwaWindowData) -> Window:
    return Window(msg.prefix_len, msg.start, convert.dtype_from_pb(msg.dtype, "window"),
                  convert.shape_from_pb(msg.shape, "window"),
                  msg.data, msg.checksum)


class ChainPut:
    """One Put's chain, block by block: each header checked before its payload is buffered, each full block
    stored as it completes, a partial block held until the chain proves to end with it."""

    def __init__(self, service: EngramService, stream: pb.PutHeader) -> None:
        self.service, self.stream = service, stream
        self.layout = service.store.spec(stream.model_fingerprint).layout
        self.parent = stream.parent_key or service.store.root(stream.namespace, stream.model_fingerprint)
        self.keys: list[bytes] = []
        self.stored = self.deduplicated = self.not_durable = 0
        self.tail: tuple[BlockHeader, Payload] | None = None  # a partial block, committed when the stream ends
        # Quota held for blocks received but not stored yet (the one arriving, and a held tail): a stream that
        # announces a block and sends most of it kept that buffer outside the quota (four half-sent 32 MiB blocks
        # grew the daemon 160 MiB past a 40 MiB quota, an audit). Given back as each is stored, and by release().
        self._held: list[int] = []
        self.pin_share = service.pin_share() if stream.pin else None
        # The model is in use from here to release(), between blocks too: it may not be forgotten meanwhile.
        service.store.begin_put(stream.namespace, stream.model_fingerprint)
        self._putting = True

    @property
    def index(self) -> int:
        """The index of the next block."""
        return len(self.keys)

    def check(self, header: BlockHeader) -> None:
        """A block's header, before any of its payload is buffered: its count, shape, and whether it could
        fit its namespace's quota and the top tier at all."""
        check_limit("Put blocks", self.index + 1, self.service.config.max_blocks_per_request)
        store = self.service.store
        nbytes = store.admit(self.stream.namespace, self.stream.model_fingerprint, header, index=self.index)
        store.hold(self.stream.namespace, nbytes, f"block {self.index}")
        self._held.append(nbytes)

    def _unhold(self) -> None:
        """The oldest block held is about to be stored (the store counts it from here) or dropped."""
        if self._held:
            self.service.store.release_held(self.stream.namespace, self._held.pop(0))

    def release(self) -> None:
        """The stream ended (stored, failed or cut): what it still holds goes back to the quota."""
        while self._held:
            self._unhold()
        if self._putting:
            self._putting = False
            self.service.store.end_put(self.stream.namespace, self.stream.model_fingerprint)

    def check_not_after_tail(self) -> None:
        if self.tail is not None:
            raise InvalidArgument(
                f"block {self.index - 1} has {self.tail[0].num_tokens} of {self.layout.block_tokens} tokens, but "
                "only a chain's last block may be partial; nothing of the partial block was stored"
            )

    async def add(self, header: BlockHeader, payload: Payload) -> None:
        self.check_not_after_tail()
        if header.num_tokens < self.layout.block_tokens:
            self.tail = (header, payload)  # a partial block must end the chain: held until the stream proves it
            self.keys.append(b"")
        else:
            self._unhold()
            self.parent = await self._commit(header, payload, self.index)
            self.keys.append(self.parent)

    async def _commit(self, header: BlockHeader, payload: Payload, index: int) -> bytes:
        s = self.stream
        outcome = await self.service.store.put(s.namespace, s.model_fingerprint, self.parent, header,
                                               payload, pin=s.pin, index=index, pin_share=self.pin_share)
        self.stored += outcome.stored
        self.deduplicated += not outcome.stored
        self.not_durable += not outcome.durable
        return outcome.key

    async def finish(self) -> pb.PutResponse:
        if self.tail is not None:
            self._unhold()
            self.keys[-1] = await self._commit(*self.tail, self.index - 1)
        return pb.PutResponse(keys=self.keys, stored=self.stored, deduplicated=self.deduplicated,
                              not_durable=self.not_durable)


class EngramService:
    def __init__(self, store: BlockStore, config: ServerConfig, sessions: SessionManager,
                 tenancy: Tenancy | None = None, *, same_host: bool = True) -> None:
        self.store = store
        self.tenancy = tenancy
        self.same_host = same_host  # zero-copy descriptors and in-place puts allowed (auth.same_host_paths)
        self.cluster: ClusterIndex | None = None  # set by the app once the daemon's address is known
        # Set by the app before gRPC serves when the daemon joins a cluster: FetchBlocks waits for the join (its
        # grants check needs the ClusterIndex), not served unchecked meanwhile (a review, session 54).
        self.joins_cluster = False
        self.trust: ClusterTrust | None = None  # the cluster secret's keys, with the cluster
        self.peers: PeerFetcher | None = None
        self.dataport: DataPort | None = None  # the data channel, once started (engram/server/dataport.py)
        self.config = config
        # Every put's receive buffers, the data channel's and Put streams' reassembly (server.receive_buffer_bytes).
        share = int(config.receive_buffer_bytes * config.receive_buffer_fraction_per_tenant) if tenancy is not None else 0
        self.receive_budget = ReceiveBudget(int(config.receive_buffer_bytes), share, config.receive_buffer_wait_s)
        self.sessions = sessions
        self.leases = LeaseTable(store, config.lease_s, config.max_leased_blocks_per_namespace)
        self.turns = sessions.turns  # a tenant's long walks, one at a time, its sessions' too (engram/loopturns.py)
        self.pool = shared_pool(store.tiers)  # None: no shared DRAM pool, Gets answer with bytes only
        self.ipc_pool = ipc_pool(store.tiers)  # the HBM pool, when workers can open it by CUDA IPC
        self._engine: Any = None  # the DMA engine of HBM promotions, made on first use
        self._promoting: asyncio.Task[None] | None = None  # one batch of HBM promotions at a time
        # Puts written in place into the shared pool (ReservePut / CommitPut), when there is one.
        self.inplace = InPlacePuts(store, self.pool, config.lease_s, max_fraction=config.max_reserved_pool_fraction,
                                   max_fraction_per_tenant=config.max_reserved_pool_fraction_per_tenant
                                   ) if self.pool is not None else None

    @unary
    async def RegisterModel(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RegisterModelResponse:
        req = decoded(request)
        spec = convert.model_from_pb(req.model)
        block = spec.layout.block_nbytes(spec.layout.block_tokens)
        if block > self.config.max_block_bytes:
            raise InvalidArgument(f"a block of this layout holds {block} bytes (raw); the daemon takes at most "
                                  f"server.max_block_bytes = {int(self.config.max_block_bytes)}: register it with "
                                  "fewer block_tokens")
        registry = self.store.registry
        tenant = self._tenant(context)  # a tenant's models count against its share, kept with them
        # Past a bound, registrations that hold nothing give their place up (engram/server/modelroom.py); a spec
        # refused anyway drops none.
        make_room(registry, Holds(self.store, self.sessions, self.inplace), registry.checked(spec).fingerprint,
                  tenant=tenant, namespaces=visible_namespaces(context) or (),
                  max_per_tenant=self.config.max_models_per_tenant, max_models=self.config.max_models)
        fp = registry.register(spec, tenant)
        return pb.RegisterModelResponse(model_fingerprint=fp, codec=self.store.spec(fp).codec,
                                        max_blocks_per_request=self.config.max_blocks_per_request,
                                        max_message_bytes=int(self.config.max_message_bytes),
                                        max_tokens_per_request=self.config.max_tokens_per_request)

    @unary
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        req = decoded(request)
        check_limit("Lookup tokens", len(req.tokens), self.config.max_tokens_per_request)
        ns = namespace_for(context, req.namespace)
        tokens = convert.tokens_from_pb(req.tokens)
        # A probe asks without using: the eviction order counts the read that follows, once (LookupRequest.probe).
        use = not req.probe
        self.check_model(req.model_fingerprint)
        walk, refs, matched = await self._walk(ns, req.model_fingerprint, tokens, use=use,
                                               deadline=_deadline_of(context))
        try:
            return pb.LookupResponse(matched_tokens=matched, blocks=refs)
        finally:
            walk.close()

    def _turn(self, fingerprint: bytes, tokens: Any) -> contextlib.AbstractAsyncContextManager[None]:
        """The caller's tenant's turn for a prefix longer than a slice (engram/loopturns.py); none for the rest."""
        if len(tokens) <= SLICE_BLOCKS * self.store.spec(fingerprint).layout.block_tokens:
            return contextlib.nullcontext()
        return self.turns.turn(tenant_of(None))

    async def _walk(self, ns: str, fingerprint: bytes, tokens: Any, *, use: bool | None = True,
                    deadline: float | None = None) -> tuple[PrefixWalk, list[pb.BlockRef], int]:
        """The stored prefix of `tokens`, walked and answered a slice at a time (BlockStore.lookup_walk,
        `_walked_refs`) in the caller's tenant's turn, and counted as a lookup of what it answers (`use`: whether
        its blocks count as used; None: the caller counts, its answer may be cut later); with the cluster tier, the
        missing full blocks are fetched from peers first, and the prefix walked again. The fetch waits outside the
        turn: a peer may take cluster.fetch_timeout_s per block, and the turn is for Python work on the loop (holding
        it there made a tenant's long calls, every caller's with tenancy off, wait for each other's peers: 4 calls on
        a frozen peer ended at 5, 10, 15, 15 s, a review, session 48); it ends by the call's `deadline` (the loop's
        time) or cluster.fill_timeout_s. Returns the walk (the caller closes it), its answer's refs and matched
        tokens."""
        walk = self.store.walk(ns, fingerprint, tokens)
        try:
            async with self._turn(fingerprint, tokens):
                await self.store.lookup_walk(walk)
                if self.peers is None:
                    return await self._answered(walk, use)
                walk.watch()  # before the fetch's awaits: a block removed meanwhile cuts the answer
            refill = await self.peers.fill(ns, fingerprint, tokens, *walk.whole(), deadline=deadline)
            if refill:
                walk.close()
                walk = self.store.walk(ns, fingerprint, tokens)
            async with self._turn(fingerprint, tokens):
                if refill:
                    await self.store.lookup_walk(walk)
                return await self._answered(walk, use)
        except BaseException:
            walk.close()
            raise

    async def _answered(self, walk: PrefixWalk, use: bool | None) -> tuple[PrefixWalk, list[pb.BlockRef], int]:
        """The walk's answer (`_walked_refs`) and its matched tokens, counted as a lookup of it unless `use` is None
        (taken in one step: a block removed during the uses that follow no longer changes the answer)."""
        refs = await _walked_refs(walk, _promised_tier(self.store), _shows_homes(self.store, walk.namespace))
        matched = walk.matched_tokens()
        if use is not None:
            await self.store.count_lookup(len(walk.tokens), walk.found(), matched, use=use)
        return walk, refs, matched

    @unary
    async def Put(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """A chain's blocks, each reassembled from its chunks once its announced size is taken from the daemon's
        receive budget (server.receive_buffer_bytes): the take waits reading nothing more of the stream (HTTP/2's
        flow control slows the sender) while the budget is spent; given back once the block is stored (a partial
        block's when the stream ends) and on every exit. Before its first message the stream takes
        server.max_message_bytes for the life of the call, as metadata: grpc reads each message whole for the
        handler, growing the stream's HTTP/2 window to fit it, before the handler sees a byte of it (a block's
        first chunk before its size is known), so 32 streams each announcing a 60 MiB message and sending all but
        its last byte held 1.9 GiB outside the budget (docs/RELIABILITY.md)."""
        chain: ChainPut | None = None
        blocks: Reassembler[BlockHeader] | None = None
        budget = self.receive_budget
        held = budget.holding(tenant_of(context) or None, "Put stream")
        try:
            await budget.take(held, int(self.config.max_message_bytes), meta=True, what="message (up to server.max_message_bytes)")
            async for raw in request_iterator:
                req = decoded(raw)
                item = req.WhichOneof("item")
                if chain is None:
                    if item != "header":
                        raise InvalidArgument("the first message of a Put stream must be a PutHeader")
                    chain = self.chain_put(req.header)
                    blocks = Reassembler(lambda h: h.payload_nbytes, check=chain.check)
                    continue
                if item != "chunk":
                    raise InvalidArgument("a Put stream carries one PutHeader, first; then only BlockChunks")
                assert blocks is not None
                chunk = req.chunk
                chain.check_not_after_tail()
                header = convert.header_from_pb(chunk.header, chain.index) if chunk.HasField("header") else None
                done = blocks.add(header, chunk.data, chunk.last, chain.index)
                if header is not None:  # checked by add: now the block's bytes, before more of them are read
                    await budget.take(held, header.payload_nbytes, meta=False)
                if done is not None:
                    await chain.add(*done)
                    if chain.tail is None:  # stored (a partial tail is held until the stream ends)
                        budget.give(held, held.payload, meta=False)
            if chain is None or blocks is None:
                raise InvalidArgument("empty Put stream: send a PutHeader, then the blocks")
            if blocks.open:
                assert blocks.header is not None
                raise InvalidArgument(
                    f"Put stream ended inside block {chain.index} ({blocks.received} of {blocks.header.payload_nbytes} "
                    f"bytes, no chunk with last=true); the {chain.index} blocks before it were stored"
                )
            return await chain.finish()
        finally:
            budget.give_all(held)
            if chain is not None:
                chain.release()  # quota held for blocks received and never stored

    def chain_put(self, header: pb.PutHeader) -> ChainPut:
        """A Put of one chain, whichever channel its bytes come on (gRPC chunks, the data channel)."""
        header.namespace = namespace_for(None, header.namespace)
        self.check_model(header.model_fingerprint)
        return ChainPut(self, header)

    def check_model(self, fingerprint: bytes) -> None:
        """UnknownModel when the caller's tenant has not registered the model, word for word what a fingerprint
        nobody registered gets (engram/registry.py): a tenant sees only its own models. Called just before the
        store first looks the model up, so that the two answers come at the same point of the call too."""
        self.store.registry.use(fingerprint, self._tenant(None))

    @streaming
    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetResponse | bytes]:
        req = decoded(request)
        try:
            ns, metas = await self.blocks_to_get(req, deadline=_deadline_of(context))
            # A block in a host pool is framed from its slot (views), held by _serve until every frame of it is
            # built: each frame copies its piece (chunk_bytes), a turn of the loop apart. A copy of the whole block
            # into bytes first (the pool's read) was one step of the daemon's loop: 16 MiB holding the GIL.
            async for kind, item in self._serve(ns, req.model_fingerprint, metas, zero_copy=req.zero_copy,
                                                cuda_ipc=req.cuda_ipc, decode=req.decode, views=True):
                if kind == "descriptor":
                    yield pb.GetResponse(descriptor=item)
                    continue
                key, header, payload = item
                serialized = header.SerializeToString()
                step = self._step(len(serialized) + len(key))
                for frame in chunk_frames(1, key, serialized, payload, step):  # GetResponse.chunk
                    yield frame  # serialized already (one copy of the payload, not three)
        finally:
            self.release_after_get(req)

    def _step(self, fixed: int) -> int:
        """Payload bytes a chunk of a block this daemon streams may carry: server.chunk_bytes, or less where the
        block's first message carries more beside its payload (`fixed` bytes) than the 4 KiB config leaves, so that
        no message passes server.max_message_bytes (the daemon's own send limit, and a peer's receive limit)."""
        return payload_step(self.config.chunk_bytes, self.config.max_message_bytes, fixed)

    def release_after_get(self, req: pb.GetRequest) -> None:
        """End the leases a Get was asked to end once answered (or failed): no ReleaseLeases round trip."""
        if req.release_lease_ids and len(req.release_lease_ids) <= self.config.max_blocks_per_request:
            with contextlib.suppress(EngramError):  # a namespace the caller may not use: its leases stay theirs
                self.leases.release_known(namespace_for(None, req.namespace), list(req.release_lease_ids),
                                          self._tenant(None))  # (as another tenant's there)

    async def blocks_to_get(self, req: pb.GetRequest, client_gone: Callable[[], Awaitable[None]] | None = None,
                            *, deadline: float | None = None) -> tuple[str, list[BlockMeta]]:
        """A Get's namespace and blocks, whichever channel answers it; keys this daemon lacks are copied from
        the cluster's peers first, by the call's `deadline` (the loop's time) or the caller's `answer_within_ms`,
        the sooner (neither: cluster.fill_timeout_s), or DeadlineExceeded. The data channel has no deadline of its
        own: its client, waiting timeout_s for the answer to begin, gave up first with a "daemon hung" of its own
        while the daemon copied on to fill_timeout_s (session 54). client_gone: returns when the caller has gone
        (the data channel's client closed its connection; gRPC cancels the call itself), which ends the copying:
        ConnectionError."""
        deadline = _sooner(deadline, req.answer_within_ms)
        check_limit("Get keys", len(req.keys), self.config.max_blocks_per_request)
        check_limit("Get release_lease_ids", len(req.release_lease_ids), self.config.max_blocks_per_request)
        ns = namespace_for(None, req.namespace)
        self.check_model(req.model_fingerprint)  # and an unknown model asks no peer for its blocks
        try:
            return ns, self.store.find(ns, req.model_fingerprint, list(req.keys))
        except NotFound:
            if self.peers is None:
                raise
            fetch = self.peers.fetch_keys(ns, req.model_fingerprint, list(req.keys), deadline=deadline)
            await (fetch if client_gone is None else _unless_gone(fetch, client_gone()))
            return ns, self.store.find(ns, req.model_fingerprint, list(req.keys))

    async def serve_bytes(self, ns: str, fingerprint: bytes, metas: list[BlockMeta], *, decode: bool
                          ) -> AsyncGenerator[tuple[bytes, pb.BlockHeader, bytes | memoryview], None]:
        """The blocks as (key, header, payload), in order, each held while it is being sent: the data
        channel's Get. A payload may be a view of its pool slot, valid until the next item is asked for."""
        async with contextlib.aclosing(self._serve(ns, fingerprint, metas, zero_copy=False, cuda_ipc=False,
                                                   decode=decode, views=True)) as blocks:
            async for _, item in blocks:
                yield item

    @unary
    async def GetPrefix(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PrefixHeader:
        req = decoded(request)
        check_limit("GetPrefix tokens", len(req.tokens), self.config.max_tokens_per_request)
        check_limit("GetPrefix release_lease_ids", len(req.release_lease_ids), self.config.max_blocks_per_request)
        ns = namespace_for(context, req.namespace)
        self.leases.release_known(ns, list(req.release_lease_ids), self._tenant(context))  # expired ones: ended
        tokens = convert.tokens_from_pb(req.tokens)
        self.check_model(req.model_fingerprint)
        # Its copying from peers ends in time for the answer its client waits for (GetPrefixRequest.answer_within_ms)
        deadline = _sooner(_deadline_of(context), req.answer_within_ms)
        walk, refs, _ = await self._walk(ns, req.model_fingerprint, tokens, use=None, deadline=deadline)
        try:
            return await self._prefix_answer(req, ns, tokens, walk, refs, context)
        finally:
            walk.close()

    async def _prefix_answer(self, req: pb.GetPrefixRequest, ns: str, tokens: Any, walk: PrefixWalk,
                             refs: list[pb.BlockRef], context: grpc.aio.ServicerContext) -> pb.PrefixHeader:
        """GetPrefix's answer for the prefix walked (engram/server/prefixheader.py), and the lookup counted by it,
        in one turn of the tenant's; blocks that a pool the caller maps lacks are copied up into the shared pool
        first, outside it (a batch of NVMe reads: the turn is for Python work on the loop, as for a peer fetch)."""
        fp = req.model_fingerprint
        codec = self.store.spec(fp).stored_codec
        pools = self._zero_copy_pools(req.zero_copy, req.cuda_ipc, False, codec)
        shared = self.pool if self.pool is not None and self.pool in pools else None
        async with self._turn(fp, tokens):
            up = await not_in_pools(walk, pools) if shared is not None else []
            if not up:
                return await self._prefix_header(req, ns, walk, refs, pools, codec, context)
        walk.watch()
        assert shared is not None
        with self.store.reading(walk.found()):
            await self.store.copy_up(up, shared.name)  # one batch; a block that left meanwhile cuts the answer
        async with self._turn(fp, tokens):
            return await self._prefix_header(req, ns, walk, refs, pools, codec, context)

    async def _prefix_header(self, req: pb.GetPrefixRequest, ns: str, walk: PrefixWalk, refs: list[pb.BlockRef],
                             pools: list[PoolTier], codec: str, context: grpc.aio.ServicerContext) -> pb.PrefixHeader:
        """The answer built a slice at a time, counted as a lookup of what it answers (a block removed between
        slices cuts it), in the caller's turn."""
        promote = ((self.pool, self.ipc_pool) if req.cuda_ipc and self.ipc_pool is not None and self.pool is not None
                   else None)
        header, dram_only = await prefix_header(self.store, self.leases, ns, walk, refs, pools, codec,
                                                hold_for_get=req.hold_for_get, promote=promote,
                                                owner=self._tenant(context))
        self._promote_later(dram_only)  # before the count's turns of the loop: none of them has left since
        try:
            await self.store.count_lookup(len(walk.tokens), walk.blocks[: len(header.blocks)], header.matched_tokens,
                                          use=False)  # each slice was used as it was answered (prefix_header)
            if header.lease_id:  # a cancel come during the last slice, which awaits nothing, lands (as ReservePut's)
                await _answer_may_land(context, "lease")
        except BaseException:  # cut (its deadline, its client gone): a lease no caller will hear of is dropped
            if header.lease_id:  # (it held every block of the prefix for lease_s: a cancel audit, session 49)
                self.leases.release_known(ns, [header.lease_id])  # (expired meanwhile: nothing to end; its own)
            raise
        return header

    def _promote_later(self, metas: list[BlockMeta]) -> None:
        """A worker on the GPU of the daemon's HBM pool hit these blocks in DRAM: copy them up in the background
        (one batched DMA, engram/transfer.py), so its next hit is a device-to-device copy through CUDA IPC."""
        if not metas or self._promoting is not None:
            return
        from engram.transfer import TransferEngine, promote

        if self._engine is None:
            self._engine = TransferEngine(self.ipc_pool.device)  # type: ignore[union-attr]

        async def run() -> None:
            try:
                with self.store.reading(metas):
                    await promote(self.store, metas, self._engine)  # type: ignore[arg-type]
            except EngramError:
                pass  # no room up there now: the blocks are served from DRAM
            finally:
                self._promoting = None

        self._promoting = asyncio.get_running_loop().create_task(run())

    async def _serve(self, ns: str, fingerprint: bytes, metas: list[BlockMeta], *, zero_copy: bool, cuda_ipc: bool,
                     decode: bool, views: bool = False) -> AsyncGenerator[tuple[str, Any], None]:
        """The blocks, in order, as ("descriptor", BlockDescriptor) under one lease for those in a pool the
        caller may map, and ("block", (key, header, payload)) for the rest (with `views`, a payload in a pool
        is a view of its slot, not a copy). Every block is held (not evicted) while the stream is open."""
        codec = self.store.spec(fingerprint).stored_codec
        pools = self._zero_copy_pools(zero_copy, cuda_ipc, decode, codec)
        in_pool = {}  # key -> the pool its descriptor points into (the first preferred pool holding it)
        for m in metas:
            pool = next((p for p in pools if p.name in m.locations), None)
            if pool is not None and not m.moving:
                in_pool[m.key] = pool
        lease = (self.leases.grant(ns, [m for m in metas if m.key in in_pool], self._tenant(None))  # before sending
                 if in_pool else None)
        try:
            with self.store.reading(metas):
                for meta in metas:
                    if lease is not None and meta.key in in_pool:
                        yield "descriptor", self._descriptor(meta, codec, lease, in_pool[meta.key])
                        continue
                    payload = await (self.store.read_view(meta) if views else self.store.read(meta))
                    block = _header_of(meta, codec)
                    if decode and not stored.is_raw(codec):
                        # Decoded and hashed in a worker thread that a cancelled Get waits for (borrowed.in_thread):
                        # the payload may be a view of the block's pool slot, held by `reading` only until this
                        # generator goes on; asyncio.to_thread's thread ran on after a cancel, reading a slot that
                        # another block could take meanwhile.
                        payload, raw_checksum = await in_thread(self._decoded, payload, meta)
                        block = dataclasses.replace(block, codec=stored.STREAMS if stored.is_streams(codec) else
                                                    stored.RAW, payload_nbytes=len(payload), checksum=raw_checksum)
                    yield "block", (meta.key, convert.header_to_pb(block), payload)
        except BaseException:
            if lease is not None:
                self.leases.drop(lease)  # the worker will not copy what it may not have received
            raise

    def _decoded(self, payload: bytes | memoryview, meta: BlockMeta) -> tuple[bytes | memoryview, int]:
        """A stored payload as raw elements (Get with decode), and their checksum: one worker thread's work."""
        raw = self.store.as_raw(payload, meta)
        return raw, checksum(raw)

    def _zero_copy_pools(self, zero_copy: bool, cuda_ipc: bool, decode: bool, codec: str) -> list[PoolTier]:
        """The pools whose blocks a call may answer with descriptors, in order of preference."""
        if not zero_copy or not self.same_host or (decode and not stored.is_raw(codec)):
            return []
        pools = [self.ipc_pool] if cuda_ipc and self.ipc_pool is not None else []
        return pools + ([self.pool] if self.pool is not None else [])

    def _descriptor(self, meta: BlockMeta, codec: str, lease: Lease, pool: PoolTier) -> pb.BlockDescriptor:
        """A Get's descriptor of a block in a pool the caller maps (GetPrefix's: engram/server/prefixheader.py)."""
        assert pool.segment is not None
        slot = pool.slot(meta.key)
        self.store.served(meta, pool.name)  # counted like every other hit: the worker copies it in place
        desc = pb.BlockDescriptor(
            key=meta.key, header=convert.header_to_pb(_header_of(meta, codec)), segment_path=str(pool.segment.path),
            segment_id=pool.segment.layout.segment_id, offset=slot.offset, generation=slot.generation,
            lease_id=lease.id, lease_expires_in_s=max(0.0, lease.expires - time.monotonic()))
        if pool is self.ipc_pool:
            desc.cuda.CopyFrom(cuda_handle(pool))
        return desc

    @unary
    async def ReservePut(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ReservePutResponse:
        req = decoded(request)
        check_limit("ReservePut blocks", len(req.blocks), self.config.max_blocks_per_request)
        ns = namespace_for(context, req.namespace)
        if self.inplace is None or not self.same_host:
            raise FailedPrecondition("this daemon takes no in-place puts (no shared DRAM pool, or auth.same_host_paths "
                                     "refuses them under tenancy): put blocks as bytes (Put)")
        parent = req.parent_key or self.store.root(ns, req.model_fingerprint)
        headers = [convert.header_from_pb(h, i) for i, h in enumerate(req.blocks)]
        self.check_model(req.model_fingerprint)
        res = await self.inplace.reserve(ns, req.model_fingerprint, parent, headers, pin=req.pin,
                                         owner=self._tenant(context),  # its share of the pool's reserved room
                                         pin_share=self.pin_share() if req.pin else None)
        # An answer that cannot reach its caller leaves slots nobody writes or commits, held two terms (the lapse):
        # they are freed now. `reserve` may run to its end without awaiting (the pool has room), so a cancel or
        # deadline come meanwhile had not reached this handler: its answer was dropped, the reservation kept
        # (session 49's cancel audit).
        try:
            await _answer_may_land(context, "reservation")
        except BaseException:
            self.inplace.release_unanswered(res)
            raise
        seg = self.inplace.pool.segment
        assert seg is not None
        slots = [pb.BlockDescriptor(key=r.meta.key, segment_path=str(seg.path), segment_id=seg.layout.segment_id,
                                    offset=r.slot.offset, generation=r.slot.generation, lease_id=res.id)
                 if r.slot is not None else pb.BlockDescriptor(key=r.meta.key) for r in res.blocks]
        return pb.ReservePutResponse(reservation_id=res.id, keys=[r.meta.key for r in res.blocks], slots=slots,
                                     cached=[r.slot is None for r in res.blocks], refused=res.refused,
                                     expires_in_s=max(0.0, res.expires - time.monotonic()))

    @unary
    async def CommitPut(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        req = decoded(request)
        ns = namespace_for(context, req.namespace)
        if self.inplace is None:
            raise FailedPrecondition("this daemon has no shared DRAM pool: nothing was reserved")
        outcomes = await self.inplace.commit(self.inplace.get(ns, req.reservation_id, self._tenant(context)),
                                             req.blocks)
        return pb.PutResponse(keys=[o.key for o in outcomes], stored=sum(o.stored for o in outcomes),
                              deduplicated=sum(not o.stored and not o.skipped for o in outcomes),
                              not_durable=sum(not o.durable for o in outcomes))

    @unary
    async def ReleaseLeases(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ReleaseLeasesResponse:
        """Leases end; an id of an open reservation (the lease_id of its slots) gives it up, its uncommitted slots
        freed at once (InPlacePuts.give_up): how a client whose caller left before a ReservePut's answer came lets
        go of what the answer granted. Every id must name one or the other (NotFound, and nothing is released), of
        the caller's tenant (an admin's: any of the namespace's): in a namespace tenants share, one tenant ended
        another's leases and reservations by id (a review, session 51)."""
        req = decoded(request)
        check_limit("ReleaseLeases ids", len(req.lease_ids), self.config.max_blocks_per_request)
        ns, owner = namespace_for(context, req.namespace), self._tenant(context)
        given_up = {i for i in req.lease_ids if self.inplace is not None and self.inplace.holds(ns, i, owner)}
        released = self.leases.release(ns, list(req.lease_ids), others=given_up, owner=owner)
        for reservation_id in given_up:
            self.inplace.give_up(ns, reservation_id, owner)  # type: ignore[union-attr]
        return pb.ReleaseLeasesResponse(released=released + len(given_up))

    @streaming
    async def FetchBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FetchBlocksResponse]:
        req = decoded(request)
        if not self._is_peer_call(context):
            raise PermissionDenied("FetchBlocks serves the cluster's daemons: call it with the cluster's peer token")
        if self.tenancy is None or caller(context).peer:  # an admin reads any namespace here anyway
            if self.cluster is not None:
                self.cluster.check_peer(context.invocation_metadata())  # its [auth] grants must be this daemon's
            elif self.joins_cluster:  # between gRPC's start and the join: the grants check has nothing to go by
                raise Unavailable("this daemon is joining the cluster: FetchBlocks is served once it has joined")
        check_limit("FetchBlocks keys", len(req.keys), self.config.max_blocks_per_request)
        ns = check_namespace(req.namespace)
        if req.ancestors:
            most = min(req.ancestors, self.config.max_blocks_per_request)
            ancestors, rest = self._ancestors(ns, req.model_fingerprint, req.keys[:1], most)
            yield self._ancestors_answer(ancestors, rest and most < req.ancestors)
            return
        # Only the namespace and model asked for: a peer names both, and a key of another namespace is absent.
        metas = [m for k in req.keys
                 if (m := self.store.index.get_in(ns, k)) is not None and m.model_fingerprint == req.model_fingerprint]
        with self.store.reading(metas):
            for meta in metas:
                payload = await self.store.read(meta, promote=False)
                codec = self.store.spec(meta.model_fingerprint).stored_codec  # the header's: what a peer's MAC covers
                header = convert.header_to_pb(_header_of(meta, codec))
                mac = b"" if self.trust is None else self.trust.block_mac(
                    meta.key, meta.parent, meta.namespace, meta.model_fingerprint, codec, payload)
                first = pb.FetchBlocksResponse(chunk=pb.BlockChunk(header=header, key=meta.key),
                                               parent_key=meta.parent, namespace=meta.namespace,
                                               model_fingerprint=meta.model_fingerprint, mac=mac)
                for i, msg in enumerate(_chunks(meta.key, header, payload, self._step(first.ByteSize()))):
                    if i:
                        yield pb.FetchBlocksResponse(chunk=msg)
                        continue
                    first.chunk.CopyFrom(msg)
                    yield first

    def _ancestors_answer(self, ancestors: list[bytes], cut: bool) -> pb.FetchBlocksResponse:
        """FetchBlocks' answer to a listing: the ancestors, whether this daemon's limit cut them short, and that
        limit, the most keys a peer's copy may name a call (max_keys; a daemon from before it says none)."""
        return pb.FetchBlocksResponse(ancestors=ancestors, ancestors_cut=cut, max_keys=self.config.max_blocks_per_request)

    def _ancestors(self, ns: str, fingerprint: bytes, keys: list[bytes], most: int) -> tuple[list[bytes], bool]:
        """Up to `most` ancestors of a block held here, nearest first, the chain's root not included (FetchBlocks
        with `ancestors`): a peer asked for a key deep in a chain learns what it lacks before copying any. And
        whether more lie beyond them (`most` stopped the list short of the root)."""
        meta = self.store.index.get_in(ns, keys[0]) if keys else None
        if meta is None or meta.model_fingerprint != fingerprint:
            return [], False
        root, out = self.store.root(ns, fingerprint), list[bytes]()
        while meta is not None and meta.parent != root and len(out) < most:
            out.append(meta.parent)
            meta = self.store.index.get_in(ns, meta.parent)
        return out, meta is not None and meta.parent != root

    def _is_peer_call(self, context: grpc.aio.ServicerContext) -> bool:
        """A peer (or, with tenancy, an admin). With tenancy off every caller is trusted, except here when the
        daemon is in a cluster: it listens where peers reach it, so FetchBlocks still needs the peer token."""
        if self.trust is not None and self.tenancy is None:
            return self.trust.is_peer_call(context.invocation_metadata())
        return is_peer(context)

    @unary
    async def Pin(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        req = decoded(request)
        check_limit("Pin keys", len(req.keys), self.config.max_blocks_per_request)
        ns = namespace_for(context, req.namespace)
        self.check_model(req.model_fingerprint)
        changed = self.store.pin(ns, req.model_fingerprint, list(req.keys), unpin=req.unpin, share=self.pin_share())
        return pb.PinResponse(changed=changed)

    def pin_share(self) -> PinShare | None:
        """The current caller's share of pinned bytes, over all its namespaces (engram/store/pins.py); None for an
        admin, and with tenancy off: they act on the whole daemon, and their pins are the operator's."""
        who = caller(None)
        if self.tenancy is None or who.admin:
            return None
        return PinShare.of(who.namespaces, self.config.max_pinned_fraction_per_tenant, self.store.tiers, who.name)

    @unary
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        decoded(request)
        scope = visible_namespaces(context)
        if scope is None:  # every namespace with blocks or sessions (evicted whole, its sessions may live on)
            every = sorted({*self.store.namespaces_in_use(), *(s.namespace for s in self.sessions.sessions())})
            return convert.to_pb(await self.stats(every), pb.StatsResponse)
        in_use = set(self.store.namespaces_in_use())
        tenant = self._tenant(context)
        mine = [ns for ns in scope if ns in in_use or self.sessions.count_in(ns, tenant)]
        return convert.to_pb(await self.tenant_stats(mine, scope), pb.StatsResponse)

    async def stats(self, namespaces: list[str]) -> StatsReply:
        """The daemon's figures, every namespace's: an admin's Stats, or anyone's with tenancy off."""
        store = self.store
        c = store.counters
        pending = store.write_back_pending()
        return StatsReply(
            tiers=store.tier_stats(), models=self._model_stats(None),
            lookups=c.lookups, lookup_hit_tokens=c.lookup_hit_tokens, lookup_miss_tokens=c.lookup_miss_tokens,
            blocks_put=c.blocks_put,
            blocks_deduplicated=c.blocks_deduplicated, blocks_served=c.blocks_served, bytes_served=c.bytes_served,
            limits=self._limits(),
            version=__version__, uptime_s=time.time() - store.started, write_policy=str(store.write_policy),
            corrupt_blocks=c.corrupt_blocks, replay=self._replay_stats(),
            namespaces=tuple(self._namespace_stats(ns) for ns in namespaces),
            cluster=await self._cluster_stats(),
            blocks_evicted_on_request=c.blocks_evicted_on_request, blocks_not_durable=c.blocks_not_durable,
            blocks_flushed=c.blocks_flushed, write_back_pending_blocks=pending.blocks,
            write_back_pending_bytes=pending.bytes, write_back_oldest_s=pending.oldest_s, leases=len(self.leases),
            default_codec=store.registry.default_codec, default_codec_reason=store.registry.default_reason,
            codec_backend=store.codec_backend, codec_errors=store.quality.codec_errors(),
            codec_error_blocks=store.quality.errors.blocks, codec_error_skipped=store.quality.skipped,
            codec_fallbacks=store.quality.codec_fallbacks(None), eviction=eviction.stats(store.placement.model),
            blocks_prefetched=c.blocks_prefetched, sessions_closed_idle=self.sessions.closed_idle,
        )

    async def tenant_stats(self, namespaces: list[str], scope: list[str]) -> StatsReply:
        """A tenant's Stats: figures of its namespaces (`namespaces`: those of `scope`, its own, holding blocks or
        sessions) and the daemon's fixed ones (capacities, limits, codec, version), nothing else. A daemon-wide
        figure that moves with another tenant's calls tells what it does: the tiers' used bytes after its put, or
        bytes served after its hit, divided by the model's public bytes per token (its last block is partial) is
        the exact length of its prompt, and so are the lookup counters. Built field by field, so a figure added
        to Stats later is the admin's until someone decides it may be a tenant's (StatsResponse.scoped lists
        which are 0 here). A model none of the namespaces holds, or that the tenant has not registered (another
        tenant's blocks in a namespace they share), is left out: which models others use is theirs."""
        store = self.store
        # A namespace evicted whole keeps its counts. Those of a namespace other tenants share too are left out: kept
        # per namespace, not per tenant, they counted every tenant's puts and reads there (Bob's Get moved Carol's
        # bytes_served by his prompt's bytes: a review, session 50)
        own = store.counters.of_namespaces([ns for ns in scope if not store.namespaces.shared(ns)])
        cl = self.cluster
        cluster = ClusterStats(state="off") if cl is None else ClusterStats(
            state=cl.state, reason=cl.reason, node_id=cl.node_id, live_nodes=await cl.live_nodes())
        sm, tenant = self.sessions, self._tenant(None)
        # Its own sessions, also in a namespace it shares with other tenants (there, every tenant's were counted)
        return StatsReply(
            tiers=store.own_tier_stats(namespaces, tenant), models=self._model_stats(namespaces, tenant),
            blocks_put=own.blocks_put, blocks_deduplicated=own.blocks_deduplicated,
            blocks_served=own.blocks_served, bytes_served=own.bytes_served, limits=self._limits(),
            version=__version__, uptime_s=time.time() - store.started, write_policy=str(store.write_policy),
            replay=ReplayStats(sessions=sm.count(namespaces, tenant), hot_sessions=sm.hot_count(namespaces, tenant),
                               persisted_window_bytes=sm.window_bytes(persisted=True, namespaces=namespaces,
                                                                      owner=tenant),
                               hot_window_bytes=sm.window_bytes(persisted=False, namespaces=namespaces, owner=tenant),
                               session_tokens=sm.live_tokens.held_by(tenant),
                               session_tokens_bound=sm.live_tokens.max_tokens_per_tenant),
            namespaces=tuple(self._namespace_stats(ns, owner=tenant) for ns in namespaces), cluster=cluster,
            default_codec=store.registry.default_codec, default_codec_reason=store.registry.default_reason,
            codec_backend=store.codec_backend, codec_fallbacks=store.quality.codec_fallbacks(namespaces),
            scoped=True,
        )

    def _model_stats(self, namespaces: list[str] | None, tenant: str = "") -> tuple[ModelStats, ...]:
        """Every registered model's usage, or of `namespaces` only and then only the models they hold that `tenant`
        registered."""
        store = self.store
        models = []
        for m in store.model_usage(namespaces):
            if namespaces is not None and (not m.blocks or not store.registry.knows(m.fingerprint, tenant)):
                continue
            spec = store.spec(m.fingerprint)
            models.append(ModelStats(
                model_fingerprint=m.fingerprint, name=m.name, blocks=m.blocks, stored_bytes=m.bytes, tokens=m.tokens,
                codec=m.codec, raw_bytes=m.raw_bytes, all_layers_bytes=m.tokens * spec.layout.all_layers_bytes_per_token(),
                replayable=holds_no_window(spec.layout) or self.sessions.runtime.model_for(spec) is not None))
        return tuple(models)

    def _limits(self) -> Limits:
        cfg = self.config
        return Limits(max_message_bytes=int(cfg.max_message_bytes), chunk_bytes=int(cfg.chunk_bytes),
                      max_blocks_per_request=cfg.max_blocks_per_request,
                      max_tokens_per_request=cfg.max_tokens_per_request)

    async def _cluster_stats(self) -> ClusterStats:
        cl = self.cluster
        if cl is None:
            return ClusterStats(state="off")
        c = cl.counters
        return ClusterStats(state=cl.state, reason=cl.reason, node_id=cl.node_id, live_nodes=await cl.live_nodes(),
                            remote_hits=c.remote_hits, remote_bytes=c.remote_bytes,
                            remote_failures=c.remote_failures, published=c.published, reconnects=c.reconnects,
                            untrusted_records=c.untrusted_records, stale_entries_removed=c.stale_entries_removed)

    def _namespace_stats(self, ns: str, *, with_salt: bool = False, owner: str | None = None) -> NamespaceStats:
        """`owner`: the tenant asking, whose own sessions it counts, with the blocks they reference and the bytes
        their references add (None: every owner's, an admin's view)."""
        u = self.store.namespace_usage(ns, owner)
        return NamespaceStats(namespace=ns, key_salt=self.store.namespaces.salt(ns) if with_salt else b"",
                              quota_bytes=self.store.namespaces.quota(ns), blocks=u.blocks,
                              physical_bytes=u.physical_bytes, logical_bytes=u.logical_bytes,
                              referenced_blocks=u.referenced_blocks, sessions=self.sessions.count_in(ns, owner))

    @unary
    async def DescribeNamespace(self, request: Any, context: grpc.aio.ServicerContext) -> pb.NamespaceStats:
        ns = namespace_for(context, decoded(request).namespace)
        owner = None if is_admin(context) else self._tenant(context)
        return convert.to_pb(self._namespace_stats(ns, with_salt=True, owner=owner), pb.NamespaceStats)

    def _replay_stats(self) -> ReplayStats:
        sm = self.sessions
        rc = sm.runtime.counters
        return ReplayStats(sessions=sm.count(), hot_sessions=sm.hot_count(),
                           persisted_window_bytes=sm.window_bytes(persisted=True),
                           hot_window_bytes=sm.window_bytes(persisted=False),
                           replays=rc.replays, replayed_tokens=rc.replayed_tokens, replay_seconds=rc.seconds,
                           windows_dropped_cold=sm.windows_dropped_cold, session_tokens=sm.live_tokens.held,
                           session_tokens_bound=sm.live_tokens.max_tokens)

    @unary
    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> pb.CheckResponse:
        req = decoded(request)
        if not is_admin(context):
            raise PermissionDenied("Check scans every namespace's blocks: call it with an admin token")
        report = await self.store.check(fix=req.fix)
        findings = tuple(CheckFinding(path, problem, fixed) for path, problem, fixed in report.findings)
        return convert.to_pb(CheckReport(report.scanned, report.valid, findings), pb.CheckResponse)

    @unary
    async def ForgetModel(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ForgetModelResponse:
        req = decoded(request)
        if not is_admin(context):
            raise PermissionDenied("ForgetModel removes a model every tenant may use, with its blocks in every "
                                   "namespace: call it with an admin token")
        done = await forget_model(req.model_fingerprint, Inspector(self.store, self.sessions), self.inplace,
                                  force=req.force)
        return convert.to_pb(done, pb.ForgetModelResponse)

    # ---- sessions ----------------------------------------------------------------------------------

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """Whose share of the replay queue, of the persisted windows and of the model registry a call counts
        against, and whose models it sees: its token's (""; none, with tenancy off or for an admin, who acts on the
        whole daemon)."""
        return tenant_of(context)

    def _session_info(self, s: Session) -> pb.SessionInfo:
        """A session call's answer, as its caller may see it: the model's fingerprint only where the caller's tenant
        registered the model (a tenant sees only its models, engram/registry.py)."""
        seen = self.store.registry.knows(s.fingerprint, self._tenant(None))
        return convert.to_pb(s.info(model_seen=seen), pb.SessionInfo)

    @unary
    async def OpenSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = decoded(request)
        mode = convert.enum_from_pb(SessionMode, req.mode, "mode")
        self.sessions.check_length(len(req.tokens))  # the session's bound: splitting the request would not pass it
        check_limit("OpenSession tokens", len(req.tokens), self.config.max_tokens_per_request)
        ns, tokens = namespace_for(context, req.namespace), convert.tokens_from_pb(req.tokens)
        self.check_model(req.model_fingerprint)
        tenant = self._tenant(context)
        s = self.sessions.open(ns, req.model_fingerprint, mode, req.approx_k, req.session_id, tokens, tenant=tenant,
                               hold=False)
        await self._hold_new(s, tenant, context, picked=not req.session_id)  # a long prefix a slice at a time
        return self._session_info(s)

    async def _hold_new(self, s: Session, tenant: str, context: grpc.aio.ServicerContext, *, picked: bool) -> None:
        """A new session's prefix held (SessionManager.hold_in_slices) before it is answered. One whose id the
        daemon `picked` is named to its caller by the answer alone: a call that ends without it (cut: its client's
        cancel or deadline; or failed) ends the session, which stayed open, named to nobody, holding its blocks and
        counted among its tenant's sessions until server.session_idle_s (a day by default). A cancel come while it
        ran without awaiting (a short prefix) lands first, and a call whose deadline passed is cut
        (`_answer_may_land`). One whose id the caller chose stays (the caller may use or close it)."""
        try:
            await self.sessions.hold_in_slices(s, tenant)
            if picked:
                await _answer_may_land(context, "session")
        except BaseException:
            if picked and self.sessions.is_open(s):
                self.sessions.end(s)
            raise

    @unary
    async def AppendSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = decoded(request)
        ns, n = namespace_for(context, req.session.namespace), len(req.tokens)
        owner = session_owner(context, req.session.owner)
        if n > self.sessions.max_session_tokens:  # the session's bound, before the tokens are converted
            s = self.sessions.get(ns, req.session.session_id, self._tenant(context), owner)
            self.sessions.check_length(len(s.tokens) + n)
        check_limit("AppendSession tokens", n, self.config.max_tokens_per_request)
        window = _window_from_pb(req.window) if req.HasField("window") else None
        tenant = self._tenant(context)
        s = self.sessions.append(ns, req.session.session_id, convert.tokens_from_pb(req.tokens), window,
                                 req.expect_back_ms, tenant=tenant, owner=owner, hold=False)
        await self.sessions.hold_in_slices(s, tenant)
        return self._session_info(s)

    @unary
    async def ForkSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = decoded(request)
        tenant = self._tenant(context)
        s = self.sessions.fork(namespace_for(context, req.parent.namespace), req.parent.session_id, req.session_id,
                               req.position, tenant=tenant, owner=session_owner(context, req.parent.owner),
                               hold=False)
        await self._hold_new(s, tenant, context, picked=not req.session_id)
        return self._session_info(s)

    @unary
    async def SuspendSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = decoded(request)
        s = self.sessions.suspend(namespace_for(context, req.namespace), req.session_id, tenant=self._tenant(context),
                                  owner=session_owner(context, req.owner))
        return self._session_info(s)

    @unary
    async def CloseSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = decoded(request)
        s = await self.sessions.close_in_slices(namespace_for(context, req.namespace), req.session_id,
                                                tenant=self._tenant(context), owner=session_owner(context, req.owner))
        return self._session_info(s)

    @streaming
    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ResumeResponse | bytes]:
        req = decoded(request)
        if req.with_global_kv and not req.global_kv_by_block:
            raise FailedPrecondition(
                "this Resume asks for the global KV as one tensor (a client from before ResumeRequest."
                "global_kv_by_block); the daemon sends it block by block, decoding each as it goes: upgrade the "
                "client, or Resume without the global KV and Get its blocks")
        stage, t0 = ResumeStage(), time.monotonic()
        resuming = asyncio.ensure_future(self.sessions.resume(
            namespace_for(context, req.session.namespace), req.session.session_id, req.position,
            tenant=self._tenant(context), owner=session_owner(context, req.session.owner), stage=stage))
        resuming.add_done_callback(lambda done: done.cancelled() or done.exception())  # one the client left is seen
        r: Resumed | None = None
        try:
            # Until the answer, a message each progress_every_ms: the client's bound on the wait for each message
            # (its timeout_s) cut a replay that outlasted it, though the daemon was working (a gap of session 45).
            every = max(req.progress_every_ms / 1000, RESUME_PROGRESS_MIN_S)
            while req.progress_every_ms and not (await asyncio.wait({resuming}, timeout=every))[0]:
                yield pb.ResumeResponse(progress=pb.ResumeProgress(stage=stage.name, seconds=time.monotonic() - t0))
            r = await resuming
        finally:
            resuming.cancel()  # the client went: a wait for a turn ends, a running replay keeps its turn till done
            if r is None:  # nobody takes its answer: one that comes all the same gives its blocks' leases back
                resuming.add_done_callback(self._release_unanswered)
        # The blocks come leased (SessionManager.resume) and stay so until the header naming them is built, and with
        # the global KV until the stream ends, as a Get holds its blocks.
        leased = r.blocks
        try:
            header = _resume_header(r, req.with_global_kv, bool(r.blocks) and _shows_homes(self.store,
                                                                                       r.blocks[0].namespace))
            if not req.with_global_kv:  # the rest is the window's bytes: a slow reader holds no block for them
                self.store.release(leased)
                leased = ()
            yield header
            w = r.window
            step = self.config.chunk_bytes
            for frame in bytes_frames(2, w.data, step):  # ResumeResponse.window_chunk, serialized
                yield frame
            if not req.with_global_kv:
                return
            async for kv in self.sessions.global_kv_blocks(r.blocks, r.position):
                data = memoryview(kv.contiguous().view(torch.uint8).numpy().data).cast("B")
                yield pb.ResumeResponse(global_kv_block=pb.GlobalKVBlock(tokens=kv.shape[2], checksum=checksum(data)))
                for frame in bytes_frames(3, data, step):  # ResumeResponse.global_kv_chunk
                    yield frame
        finally:
            self.store.release(leased)

    def _release_unanswered(self, done: asyncio.Future[Resumed]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.store.release(done.result().blocks)

    @unary
    async def DataEndpoint(self, request: Any, context: grpc.aio.ServicerContext) -> pb.DataEndpointResponse:
        decoded(request)
        return self.dataport.endpoint() if self.dataport is not None else pb.DataEndpointResponse()

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers built by hand (rather than add_EngramServicer_to_server) so that undecodable
        request bytes reach the handler and get INVALID_ARGUMENT, and so that each method's decoder takes
        only as many bytes as its kind of request can need (server/requests.py): Put's chunks and
        AppendSession's window the whole server.max_message_bytes, a control call CONTROL_BYTES."""
        cfg = self.config
        big = int(cfg.max_message_bytes)
        tokens = token_request_bytes(cfg.max_tokens_per_request, cfg.max_blocks_per_request)
        keys = key_request_bytes(cfg.max_blocks_per_request)
        blocks = block_request_bytes(cfg.max_tokens_per_request, cfg.max_blocks_per_request)
        per_block = f" (server.max_blocks_per_request = {cfg.max_blocks_per_request})"

        def ser(msg: Any) -> bytes:
            return msg if isinstance(msg, bytes) else msg.SerializeToString()  # Get yields serialized frames

        def dec(cls: Any, max_bytes: int = CONTROL_BYTES, max_fields: int | None = None) -> Any:
            return safe_decoder(cls, min(max_bytes, big), max_fields, per_block if max_fields else "")

        # Every request is taken as a stream (engram/server/arrival.py): the guard runs at the headers, and a
        # request that does not arrive within server.stream_stall_s ends the call.
        stall_s = cfg.stream_stall_s

        def unary_unary(fn: Any, decoder: Any) -> grpc.RpcMethodHandler:
            return grpc.stream_unary_rpc_method_handler(guard(one_request(fn, stall_s), self.tenancy), decoder, ser)

        def unary_stream(fn: Any, decoder: Any) -> grpc.RpcMethodHandler:
            return grpc.stream_stream_rpc_method_handler(guard(one_request(fn, stall_s), self.tenancy), decoder, ser)

        handlers = {
            "RegisterModel": unary_unary(self.RegisterModel, dec(pb.RegisterModelRequest)),
            "Lookup": unary_unary(self.Lookup, dec(pb.LookupRequest, tokens)),
            "Put": grpc.stream_unary_rpc_method_handler(guard(each_request(self.Put, stall_s), self.tenancy),
                                                        dec(pb.PutRequest, big), ser),
            "Get": unary_stream(self.Get, dec(pb.GetRequest, keys)),
            "GetPrefix": unary_unary(self.GetPrefix, dec(pb.GetPrefixRequest, tokens)),
            "ReservePut": unary_unary(self.ReservePut, dec(pb.ReservePutRequest, blocks,
                                                           cfg.max_blocks_per_request + TOP_LEVEL_SLACK)),
            "CommitPut": unary_unary(self.CommitPut, dec(pb.CommitPutRequest)),
            "Pin": unary_unary(self.Pin, dec(pb.PinRequest, keys)),
            "Stats": unary_unary(self.Stats, dec(pb.StatsRequest)),
            "Check": unary_unary(self.Check, dec(pb.CheckRequest)),
            "ForgetModel": unary_unary(self.ForgetModel, dec(pb.ForgetModelRequest)),
            "OpenSession": unary_unary(self.OpenSession, dec(pb.OpenSessionRequest, tokens)),
            "AppendSession": unary_unary(self.AppendSession, dec(pb.AppendSessionRequest, big)),
            "ForkSession": unary_unary(self.ForkSession, dec(pb.ForkSessionRequest)),
            "SuspendSession": unary_unary(self.SuspendSession, dec(pb.SessionRef)),
            "CloseSession": unary_unary(self.CloseSession, dec(pb.SessionRef)),
            "Resume": unary_stream(self.Resume, dec(pb.ResumeRequest)),
            "ReleaseLeases": unary_unary(self.ReleaseLeases, dec(pb.ReleaseLeasesRequest, keys)),
            "FetchBlocks": unary_stream(self.FetchBlocks, dec(pb.FetchBlocksRequest, keys)),
            "DataEndpoint": unary_unary(self.DataEndpoint, dec(pb.DataEndpointRequest)),
            "DescribeNamespace": unary_unary(self.DescribeNamespace, dec(pb.DescribeNamespaceRequest)),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

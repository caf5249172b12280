"""The Engram gRPC service: translates RPCs into store calls and streams payloads in chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import torch

from engram import __version__
from engram.block import BlockHeader, checksum
from engram.cluster import ClusterIndex
from engram.config import ServerConfig
from engram.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from engram.index import BlockMeta
from engram.leases import Lease, LeaseTable
from engram.peers import PeerFetcher
from engram.server import convert
from engram.server.auth import guard, is_admin, is_peer, namespace_for, visible_namespaces
from engram.server.errors import streaming, unary
from engram.sessions import Mode, Session, SessionManager, Window
from engram.store import BlockStore
from engram.tenancy import Tenancy
from engram.tiers.pool import PoolTier, ipc_pool, shared_pool
from engram.v1 import engram_pb2 as pb

SERVICE_NAME = "engram.v1.Engram"


class _Undecodable:
    """What a request deserializer returns for bytes that are not a valid message, so the handler can
    answer INVALID_ARGUMENT instead of gRPC's generic INTERNAL."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error


def _safe_decoder(message_cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except Exception as exc:
            return _Undecodable(message_cls.DESCRIPTOR.full_name, exc)

    return decode


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"request is not a valid {request.message_type} message: {request.error}")
    return request


def _check_limit(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ResourceExhausted(f"{what}: {count} exceeds the server's limit of {limit}; split the request")


_MODE_OF = {pb.REPLAY_MODE_UNSPECIFIED: Mode.EXACT, pb.REPLAY_MODE_EXACT: Mode.EXACT,
            pb.REPLAY_MODE_APPROX: Mode.APPROX, pb.REPLAY_MODE_PERSIST: Mode.PERSIST}
_PB_MODE = {Mode.EXACT: pb.REPLAY_MODE_EXACT, Mode.APPROX: pb.REPLAY_MODE_APPROX, Mode.PERSIST: pb.REPLAY_MODE_PERSIST}


def _session_info(s: Session) -> pb.SessionInfo:
    w = s.window
    return pb.SessionInfo(session_id=s.id, namespace=s.namespace, model_fingerprint=s.fingerprint,
                          tokens=len(s.tokens), mode=_PB_MODE[s.mode], approx_k=s.approx_k, hot=w is not None,
                          window_prefix_len=w.prefix_len if w else 0, parent=s.parent, created_s=s.created)


def _chunks(key: bytes, header: pb.BlockHeader, payload: bytes, step: int) -> list[pb.BlockChunk]:
    """A block as chunks under the message limit: the first carries its header and key."""
    view = memoryview(payload)
    offsets = range(0, len(payload), step) if payload else [0]
    return [pb.BlockChunk(header=header, key=key, data=bytes(view[off : off + step]), last=off + step >= len(payload))
            if off == 0 else pb.BlockChunk(data=bytes(view[off : off + step]), last=off + step >= len(payload))
            for off in offsets]


def _window_from_pb(msg: pb.SwaWindowData) -> Window:
    return Window(msg.prefix_len, msg.start, convert.dtype_from_pb(msg.dtype, "window"), tuple(msg.shape),
                  msg.data, msg.checksum)


class EngramService:
    def __init__(self, store: BlockStore, config: ServerConfig, sessions: SessionManager,
                 tenancy: Tenancy | None = None) -> None:
        self.store = store
        self.tenancy = tenancy
        self.cluster: ClusterIndex | None = None  # set by the app once the daemon's address is known
        self.peers: PeerFetcher | None = None
        self.config = config
        self.sessions = sessions
        self.leases = LeaseTable(store, config.lease_s)
        self.pool = shared_pool(store.tiers)  # None: no shared DRAM pool, Gets answer with bytes only
        self.ipc_pool = ipc_pool(store.tiers)  # the HBM pool, when workers can open it by CUDA IPC

    @unary
    async def RegisterModel(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RegisterModelResponse:
        req = _decoded(request)
        spec = convert.model_from_pb(req.model)
        fp = self.store.registry.register(spec)
        return pb.RegisterModelResponse(model_fingerprint=fp, codec=self.store.registry.get(fp).codec)

    @unary
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        req = _decoded(request)
        _check_limit("Lookup tokens", len(req.tokens), self.config.max_tokens_per_request)
        ns = namespace_for(context, req.namespace)
        tokens = np.asarray(req.tokens, dtype="<i4")
        match = self.store.lookup(ns, req.model_fingerprint, tokens)
        if self.peers is not None:  # the cluster tier: fetch the missing full blocks from peers
            have = sum(m.num_tokens for m in match.blocks if m.full)
            if await self.peers.fill(ns, req.model_fingerprint, tokens, have):
                match = self.store.lookup(ns, req.model_fingerprint, tokens)
        return pb.LookupResponse(
            matched_tokens=match.matched_tokens,
            blocks=[pb.BlockRef(key=m.key, num_tokens=m.num_tokens, tier=m.tier, nbytes=m.nbytes) for m in match.blocks],
        )

    @unary
    async def Put(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        keys: list[bytes] = []
        stored = deduplicated = 0
        stream: pb.PutHeader | None = None
        parent = b""
        header: BlockHeader | None = None
        parts: list[bytes] = []
        received = 0
        tail: tuple[BlockHeader, bytes] | None = None  # a partial block, committed when the stream ends
        async for raw in request_iterator:
            req = _decoded(raw)
            item = req.WhichOneof("item")
            if stream is None:
                if item != "header":
                    raise InvalidArgument("the first message of a Put stream must be a PutHeader")
                stream = req.header
                stream.namespace = namespace_for(context, stream.namespace)
                spec = self.store.registry.get(stream.model_fingerprint)
                parent = stream.parent_key or self.store.root(stream.namespace, stream.model_fingerprint)
                continue
            if item != "chunk":
                raise InvalidArgument("a Put stream carries one PutHeader, first; then only BlockChunks")
            chunk = req.chunk
            index = len(keys)
            if tail is not None:
                raise InvalidArgument(
                    f"block {index - 1} has {tail[0].num_tokens} of {spec.layout.block_tokens} tokens, but only a "
                    "chain's last block may be partial; nothing of the partial block was stored"
                )
            if header is None:
                if not chunk.HasField("header"):
                    raise InvalidArgument(f"block {index}: its first chunk must carry the BlockHeader")
                _check_limit("Put blocks", index + 1, self.config.max_blocks_per_request)
                header = convert.header_from_pb(chunk.header, index)
                header.validate(spec.layout, index=index)  # before any payload is buffered
            elif chunk.HasField("header"):
                raise InvalidArgument(f"block {index}: a second BlockHeader arrived before the block's last chunk")
            received += len(chunk.data)
            if received > header.payload_nbytes:
                raise InvalidArgument(
                    f"block {index}: received more payload bytes than the {header.payload_nbytes} announced"
                )
            parts.append(chunk.data)
            if not chunk.last:
                continue
            payload = parts[0] if len(parts) == 1 else b"".join(parts)
            if header.num_tokens < spec.layout.block_tokens:
                # A partial block must end the chain: hold it until the stream proves that it does.
                tail = (header, payload)
                keys.append(b"")
            else:
                outcome = await self.store.put(
                    stream.namespace, stream.model_fingerprint, parent, header, payload, pin=stream.pin, index=index
                )
                keys.append(outcome.key)
                stored += outcome.stored
                deduplicated += not outcome.stored
                parent = outcome.key
            header, parts, received = None, [], 0
        if stream is None:
            raise InvalidArgument("empty Put stream: send a PutHeader, then the blocks")
        if header is not None:
            raise InvalidArgument(
                f"Put stream ended inside block {len(keys)} ({received} of {header.payload_nbytes} bytes, no "
                f"chunk with last=true); the {len(keys)} blocks before it were stored"
            )
        if tail is not None:
            outcome = await self.store.put(
                stream.namespace, stream.model_fingerprint, parent, tail[0], tail[1], pin=stream.pin,
                index=len(keys) - 1,
            )
            keys[-1] = outcome.key
            stored += outcome.stored
            deduplicated += not outcome.stored
        return pb.PutResponse(keys=keys, stored=stored, deduplicated=deduplicated)

    @streaming
    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GetResponse]:
        req = _decoded(request)
        _check_limit("Get keys", len(req.keys), self.config.max_blocks_per_request)
        ns = namespace_for(context, req.namespace)
        try:
            metas = self.store.find(ns, req.model_fingerprint, list(req.keys))
        except NotFound:
            if self.peers is None:
                raise
            # The cluster tier: keys this daemon lacks are copied from the peers that hold them.
            await self.peers.fetch_keys(ns, req.model_fingerprint, list(req.keys))
            metas = self.store.find(ns, req.model_fingerprint, list(req.keys))
        codec = self.store.registry.get(req.model_fingerprint).codec
        step = self.config.chunk_bytes
        pools = self._zero_copy_pools(req, codec)
        in_pool = {}  # key -> the pool its descriptor points into (the first preferred pool holding it)
        for m in metas:
            pool = next((p for p in pools if p.name in m.locations), None)
            if pool is not None and not m.moving:
                in_pool[m.key] = pool
        lease = self.leases.grant(ns, [m for m in metas if m.key in in_pool]) if in_pool else None  # before sending
        self.store.acquire(metas)
        try:
            for meta in metas:
                if lease is not None and meta.key in in_pool:
                    yield pb.GetResponse(descriptor=self._descriptor(meta, codec, lease, in_pool[meta.key]))
                    continue
                payload = await self.store.read(meta)
                block = BlockHeader(meta.token_array(), meta.dtype, meta.shape, meta.nbytes, meta.checksum, codec)
                if req.decode and codec != "raw":
                    payload = await asyncio.to_thread(self._decode, payload)
                    block = dataclasses.replace(block, codec="raw", payload_nbytes=len(payload),
                                                checksum=checksum(payload))
                for msg in _chunks(meta.key, convert.header_to_pb(block), payload, step):
                    yield pb.GetResponse(chunk=msg)
        except BaseException:
            if lease is not None:
                self.leases.drop(lease)  # the worker will not copy what it may not have received
            raise
        finally:
            self.store.release(metas)

    def _zero_copy_pools(self, req: Any, codec: str) -> list[PoolTier]:
        """The pools whose blocks this Get may answer with descriptors, in order of preference."""
        if not req.zero_copy or (req.decode and codec != "raw"):
            return []
        pools = [self.ipc_pool] if req.cuda_ipc and self.ipc_pool is not None else []
        return pools + ([self.pool] if self.pool is not None else [])

    def _descriptor(self, meta: BlockMeta, codec: str, lease: Lease, pool: PoolTier) -> pb.BlockDescriptor:
        assert pool.segment is not None
        slot = pool.slot(meta.key)
        c = self.store.counters
        c.blocks_served += 1
        c.bytes_served += meta.nbytes
        c.tiers[pool.name].hits += 1
        block = BlockHeader(meta.token_array(), meta.dtype, meta.shape, meta.nbytes, meta.checksum, codec)
        desc = pb.BlockDescriptor(
            key=meta.key, header=convert.header_to_pb(block), segment_path=str(pool.segment.path),
            segment_id=pool.segment.layout.segment_id, offset=slot.offset, generation=slot.generation,
            lease_id=lease.id, lease_expires_in_s=max(0.0, lease.expires - time.monotonic()))
        if pool is self.ipc_pool:
            dev, handle, size, offset, ref, ref_off, event, sync = pool.cuda_ipc()
            desc.cuda.CopyFrom(pb.CudaIpcHandle(
                device=dev, handle=handle, storage_bytes=size, storage_offset=offset,  # type: ignore[arg-type]
                ref_counter_handle=ref, ref_counter_offset=ref_off, event_handle=event or b"",  # type: ignore[arg-type]
                event_sync_required=sync))  # type: ignore[arg-type]
        return desc

    @unary
    async def ReleaseLeases(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ReleaseLeasesResponse:
        req = _decoded(request)
        _check_limit("ReleaseLeases ids", len(req.lease_ids), self.config.max_blocks_per_request)
        released = self.leases.release(namespace_for(context, req.namespace), list(req.lease_ids))
        return pb.ReleaseLeasesResponse(released=released)
    @streaming
    async def FetchBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.FetchBlocksResponse]:
        req = _decoded(request)
        if not is_peer(context):
            raise PermissionDenied("FetchBlocks serves the cluster's daemons: call it with cluster.peer_token")
        _check_limit("FetchBlocks keys", len(req.keys), self.config.max_blocks_per_request)
        metas = [m for k in req.keys if (m := self.store.index.get(k)) is not None]
        self.store.acquire(metas)
        try:
            for meta in metas:
                payload = await self.store.read(meta, promote=False)
                codec = self.store.registry.get(meta.model_fingerprint).codec
                block = BlockHeader(meta.token_array(), meta.dtype, meta.shape, meta.nbytes, meta.checksum, codec)
                for i, msg in enumerate(_chunks(meta.key, convert.header_to_pb(block), payload, self.config.chunk_bytes)):
                    if i:
                        yield pb.FetchBlocksResponse(chunk=msg)
                    else:
                        yield pb.FetchBlocksResponse(chunk=msg, parent_key=meta.parent, namespace=meta.namespace,
                                                     model_fingerprint=meta.model_fingerprint)
        finally:
            self.store.release(metas)

    def _decode(self, blob: bytes) -> bytes:
        from engram.codec import blockformat

        kv = blockformat.decode(blob, backend=self.store.codec_backend, where="stored block")
        return kv.contiguous().view(torch.uint8).numpy().tobytes()

    @unary
    async def Pin(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PinResponse:
        req = _decoded(request)
        _check_limit("Pin keys", len(req.keys), self.config.max_blocks_per_request)
        changed = self.store.pin(namespace_for(context, req.namespace), req.model_fingerprint, list(req.keys), unpin=req.unpin)
        return pb.PinResponse(changed=changed)

    @unary
    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        _decoded(request)
        store = self.store
        c = store.counters
        tiers = []
        tier_tokens: dict[str, int] = {}
        for meta in store.index:
            for name in meta.locations:
                tier_tokens[name] = tier_tokens.get(name, 0) + meta.num_tokens
        for tier in store.tiers:
            usage = tier.usage()
            tc = c.tiers[tier.name]
            health = store.health[tier.name]
            tiers.append(pb.TierStats(
                name=usage.name, capacity_bytes=usage.capacity_bytes, used_bytes=usage.used_bytes,
                blocks=usage.blocks, hits=tc.hits, misses=tc.misses, evictions=tc.evictions,
                pinned_blocks=store.pinned_blocks(tier.name), state=health.state, state_reason=health.reason,
                demotions=tc.demotions, promotions=tc.promotions, io_errors=tc.io_errors,
                corrupt_blocks=tc.corrupt_blocks, enospc=tc.enospc, tokens=tier_tokens.get(tier.name, 0),
                demoted_bytes=tc.demoted_bytes, promoted_bytes=tc.promoted_bytes,
            ))
        models = [
            pb.ModelStats(model_fingerprint=m.fingerprint, name=m.name, blocks=m.blocks, stored_bytes=m.bytes,
                          tokens=m.tokens, codec=m.codec, raw_bytes=m.raw_bytes,
                          all_layers_bytes=m.tokens * store.registry.get(m.fingerprint).layout.all_layers_bytes_per_token(),
                          replayable=self.sessions.runtime.model_for(store.registry.get(m.fingerprint)) is not None)
            for m in store.model_usage()
        ]
        cfg = self.config
        return pb.StatsResponse(
            tiers=tiers, models=models, lookups=c.lookups, lookup_hit_tokens=c.lookup_hit_tokens,
            lookup_miss_tokens=c.lookup_miss_tokens, blocks_put=c.blocks_put,
            blocks_deduplicated=c.blocks_deduplicated, blocks_served=c.blocks_served, bytes_served=c.bytes_served,
            limits=pb.Limits(max_message_bytes=cfg.max_message_bytes, chunk_bytes=cfg.chunk_bytes,
                             max_blocks_per_request=cfg.max_blocks_per_request,
                             max_tokens_per_request=cfg.max_tokens_per_request),
            version=__version__, uptime_s=time.time() - store.started, write_policy=str(store.write_policy),
            corrupt_blocks=c.corrupt_blocks, replay=self._replay_stats(),
            namespaces=[self._namespace_stats(ns) for ns in visible_namespaces(context, store.index.namespaces())],
            cluster=await self._cluster_stats(),
            blocks_evicted_on_request=c.blocks_evicted_on_request,
        )

    async def _cluster_stats(self) -> pb.ClusterStats:
        cl = self.cluster
        if cl is None:
            return pb.ClusterStats(state="off")
        c = cl.counters
        return pb.ClusterStats(state=cl.state, reason=cl.reason, node_id=cl.node_id, live_nodes=await cl.live_nodes(),
                               remote_hits=c.remote_hits, remote_bytes=c.remote_bytes,
                               remote_failures=c.remote_failures, published=c.published, reconnects=c.reconnects)

    def _namespace_stats(self, ns: str) -> pb.NamespaceStats:
        u = self.store.namespace_usage(ns)
        return pb.NamespaceStats(namespace=ns, quota_bytes=self.store.namespaces.quota(ns), blocks=u.blocks,
                                 physical_bytes=u.physical_bytes, logical_bytes=u.logical_bytes,
                                 referenced_blocks=u.referenced_blocks, sessions=self.sessions.count_in(ns))

    @unary
    async def DescribeNamespace(self, request: Any, context: grpc.aio.ServicerContext) -> pb.NamespaceStats:
        ns = namespace_for(context, _decoded(request).namespace)
        info = self._namespace_stats(ns)
        info.key_salt = self.store.namespaces.salt(ns)
        return info

    def _replay_stats(self) -> pb.ReplayStats:
        sm = self.sessions
        rc = sm.runtime.counters
        return pb.ReplayStats(sessions=len(sm), hot_sessions=sm.hot_count(),
                              persisted_window_bytes=sm.window_bytes(persisted=True),
                              hot_window_bytes=sm.window_bytes(persisted=False), replays=rc.replays,
                              replayed_tokens=rc.replayed_tokens, replay_seconds=rc.seconds)

    @unary
    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> pb.CheckResponse:
        req = _decoded(request)
        if not is_admin(context):
            raise PermissionDenied("Check scans every namespace's blocks: call it with an admin token")
        report = await self.store.check(fix=req.fix)
        return pb.CheckResponse(scanned=report.scanned, valid=report.valid, findings=[
            pb.CheckFinding(path=path, problem=problem, fixed=fixed) for path, problem, fixed in report.findings])

    # ---- sessions ----------------------------------------------------------------------------------

    @unary
    async def OpenSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = _decoded(request)
        if req.mode not in _MODE_OF:
            raise InvalidArgument(f"unknown replay mode {req.mode}")
        _check_limit("OpenSession tokens", len(req.tokens), self.config.max_tokens_per_request)
        s = self.sessions.open(namespace_for(context, req.namespace), req.model_fingerprint, _MODE_OF[req.mode], req.approx_k,
                               req.session_id, np.asarray(req.tokens, dtype=np.int32))
        return _session_info(s)

    @unary
    async def AppendSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = _decoded(request)
        _check_limit("AppendSession tokens", len(req.tokens), self.config.max_tokens_per_request)
        window = _window_from_pb(req.window) if req.HasField("window") else None
        s = self.sessions.append(namespace_for(context, req.session.namespace), req.session.session_id,
                                 np.asarray(req.tokens, dtype=np.int32), window)
        return _session_info(s)

    @unary
    async def ForkSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = _decoded(request)
        s = self.sessions.fork(namespace_for(context, req.parent.namespace), req.parent.session_id, req.session_id, req.position)
        return _session_info(s)

    @unary
    async def SuspendSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = _decoded(request)
        return _session_info(self.sessions.suspend(namespace_for(context, req.namespace), req.session_id))

    @unary
    async def CloseSession(self, request: Any, context: grpc.aio.ServicerContext) -> pb.SessionInfo:
        req = _decoded(request)
        return _session_info(self.sessions.close(namespace_for(context, req.namespace), req.session_id))

    @streaming
    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ResumeResponse]:
        req = _decoded(request)
        r = await self.sessions.resume(namespace_for(context, req.session.namespace), req.session.session_id, req.position)
        w = r.window
        yield pb.ResumeResponse(header=pb.ResumeHeader(
            position=r.position, source=r.source, replayed_tokens=r.replayed, token_layers=r.token_layers,
            replay_s=r.seconds,
            blocks=[pb.BlockRef(key=m.key, num_tokens=m.num_tokens, tier=m.tier, nbytes=m.nbytes) for m in r.blocks],
            window=pb.SwaWindowData(prefix_len=w.prefix_len, start=w.start, dtype=int(w.dtype),  # type: ignore[arg-type]
                                    shape=list(w.shape), checksum=w.checksum),
        ))
        step = self.config.chunk_bytes
        for off in range(0, len(w.data), step):
            yield pb.ResumeResponse(window_chunk=w.data[off : off + step])

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers built by hand (rather than add_EngramServicer_to_server) so that undecodable
        request bytes reach the handler and get INVALID_ARGUMENT."""

        def ser(msg: Any) -> bytes:
            return msg.SerializeToString()

        handlers = {
            "RegisterModel": grpc.unary_unary_rpc_method_handler(
                guard(self.RegisterModel, self.tenancy), _safe_decoder(pb.RegisterModelRequest), ser),
            "Lookup": grpc.unary_unary_rpc_method_handler(guard(self.Lookup, self.tenancy), _safe_decoder(pb.LookupRequest), ser),
            "Put": grpc.stream_unary_rpc_method_handler(guard(self.Put, self.tenancy), _safe_decoder(pb.PutRequest), ser),
            "Get": grpc.unary_stream_rpc_method_handler(guard(self.Get, self.tenancy), _safe_decoder(pb.GetRequest), ser),
            "Pin": grpc.unary_unary_rpc_method_handler(guard(self.Pin, self.tenancy), _safe_decoder(pb.PinRequest), ser),
            "Stats": grpc.unary_unary_rpc_method_handler(guard(self.Stats, self.tenancy), _safe_decoder(pb.StatsRequest), ser),
            "Check": grpc.unary_unary_rpc_method_handler(guard(self.Check, self.tenancy), _safe_decoder(pb.CheckRequest), ser),
            "OpenSession": grpc.unary_unary_rpc_method_handler(
                guard(self.OpenSession, self.tenancy), _safe_decoder(pb.OpenSessionRequest), ser),
            "AppendSession": grpc.unary_unary_rpc_method_handler(
                guard(self.AppendSession, self.tenancy), _safe_decoder(pb.AppendSessionRequest), ser),
            "ForkSession": grpc.unary_unary_rpc_method_handler(
                guard(self.ForkSession, self.tenancy), _safe_decoder(pb.ForkSessionRequest), ser),
            "SuspendSession": grpc.unary_unary_rpc_method_handler(
                guard(self.SuspendSession, self.tenancy), _safe_decoder(pb.SessionRef), ser),
            "CloseSession": grpc.unary_unary_rpc_method_handler(
                guard(self.CloseSession, self.tenancy), _safe_decoder(pb.SessionRef), ser),
            "Resume": grpc.unary_stream_rpc_method_handler(guard(self.Resume, self.tenancy), _safe_decoder(pb.ResumeRequest), ser),
            "ReleaseLeases": grpc.unary_unary_rpc_method_handler(
                guard(self.ReleaseLeases, self.tenancy), _safe_decoder(pb.ReleaseLeasesRequest), ser),
            "FetchBlocks": grpc.unary_stream_rpc_method_handler(
                guard(self.FetchBlocks, self.tenancy), _safe_decoder(pb.FetchBlocksRequest), ser),
            "DescribeNamespace": grpc.unary_unary_rpc_method_handler(
                guard(self.DescribeNamespace, self.tenancy), _safe_decoder(pb.DescribeNamespaceRequest), ser),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

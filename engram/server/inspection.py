"""The inspection RPCs (ListNamespaces, ListSessions, DescribeBlocks, Evict): the gRPC edge of
engram/inspection.py. Listings across tenants and `all_namespaces` need an admin caller; everything else
resolves its namespace through the tenancy seam like every other RPC."""

from __future__ import annotations

import time
from typing import Any

import grpc

from engram.errors import InvalidArgument, PermissionDenied
from engram.inspection import BlockDetail, Inspector, SessionSummary
from engram.server.auth import guard, is_admin, namespace_for
from engram.server.errors import unary
from engram.server.service import SERVICE_NAME, _check_limit, _decoded, _safe_decoder, _session_info
from engram.tenancy import Tenancy
from engram.v1 import engram_pb2 as pb


def summary_to_pb(s: SessionSummary) -> pb.SessionSummary:
    return pb.SessionSummary(info=_session_info(s.session), cached_tokens=s.cached_tokens, blocks=len(s.blocks),
                             tiers=list(s.tiers), stored_bytes=s.stored_bytes, age_s=s.age_s)


def detail_to_pb(d: BlockDetail, now: float) -> pb.BlockDetail:
    m = d.meta
    return pb.BlockDetail(
        key=m.key, parent=m.parent, namespace=m.namespace, model_fingerprint=m.model_fingerprint,
        num_tokens=m.num_tokens, full=m.full, tiers=list(m.locations), codec=d.codec, checksum=m.checksum,
        nbytes=m.nbytes, pins=m.pins, children=m.children, sessions=d.sessions, refcount=d.refcount,
        leases=m.leases, hits=m.hits, age_s=now - m.created, start_token=d.start_token)


def _scope(context: grpc.aio.ServicerContext, namespace: str, all_namespaces: bool, what: str) -> str | None:
    """The namespace to search, or None for every namespace (admin only)."""
    if all_namespaces:
        if not is_admin(context):
            raise PermissionDenied(f"{what} across every namespace needs an admin token; name one namespace")
        return None
    return namespace_for(context, namespace)


class InspectionService:
    def __init__(self, inspector: Inspector, max_blocks_per_request: int, tenancy: Tenancy | None = None) -> None:
        self.inspector = inspector
        self.tenancy = tenancy  # every handler authenticates through engram.server.auth.guard
        self.max_blocks = max_blocks_per_request

    @unary
    async def ListNamespaces(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ListNamespacesResponse:
        _decoded(request)
        if not is_admin(context):
            raise PermissionDenied("ListNamespaces shows every tenant: call it with an admin token")
        return pb.ListNamespacesResponse(namespaces=[
            pb.NamespaceSummary(namespace=n.namespace, blocks=n.blocks, stored_bytes=n.stored_bytes, tokens=n.tokens,
                                pinned_blocks=n.pinned_blocks, sessions=n.sessions)
            for n in self.inspector.namespaces()])

    @unary
    async def ListSessions(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ListSessionsResponse:
        req = _decoded(request)
        ns = _scope(context, req.namespace, req.all_namespaces, "ListSessions")
        return pb.ListSessionsResponse(sessions=[summary_to_pb(s) for s in self.inspector.session_list(ns)])

    @unary
    async def DescribeBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> pb.DescribeBlocksResponse:
        req = _decoded(request)
        insp = self.inspector
        if bool(req.session_id) == bool(req.key_prefixes):
            raise InvalidArgument("DescribeBlocks takes a session_id or key_prefixes, exactly one of them")
        _check_limit("DescribeBlocks keys", len(req.key_prefixes), self.max_blocks)
        if req.session_id:
            s = insp.sessions.get(namespace_for(context, req.namespace), req.session_id)
            summary = insp.summary(s)
            details = insp.describe(summary.blocks)
            now = time.time()
            return pb.DescribeBlocksResponse(blocks=[detail_to_pb(d, now) for d in details],
                                             session=summary_to_pb(summary))
        ns = _scope(context, req.namespace, req.all_namespaces, "DescribeBlocks")
        details = insp.describe(insp.resolve(ns, list(req.key_prefixes)))
        now = time.time()
        return pb.DescribeBlocksResponse(blocks=[detail_to_pb(d, now) for d in details])

    @unary
    async def Evict(self, request: Any, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        req = _decoded(request)
        insp = self.inspector
        if sum((bool(req.key_prefixes), bool(req.session_id), req.whole_namespace)) != 1:
            raise InvalidArgument("Evict takes exactly one of key_prefixes, session_id or whole_namespace")
        _check_limit("Evict keys", len(req.key_prefixes), self.max_blocks)
        if req.key_prefixes:
            metas = insp.resolve(_scope(context, req.namespace, req.all_namespaces, "Evict"), list(req.key_prefixes))
        elif req.session_id:
            metas = insp.session_blocks_to_evict(insp.sessions.get(namespace_for(context, req.namespace),
                                                                   req.session_id))
        else:
            if req.all_namespaces:
                raise InvalidArgument("whole_namespace evicts one namespace: name it, without all_namespaces")
            metas = insp.namespace_blocks(namespace_for(context, req.namespace))
        out = await insp.evict(metas, force=req.force)
        return pb.EvictResponse(evicted=list(out.evicted), skipped=list(out.skipped), unpinned=out.unpinned)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Served under the Engram service name beside EngramService's own handler (gRPC asks each)."""

        def ser(msg: Any) -> bytes:
            return msg.SerializeToString()

        def h(fn: Any, cls: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(guard(fn, self.tenancy), _safe_decoder(cls), ser)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "ListNamespaces": h(self.ListNamespaces, pb.ListNamespacesRequest),
            "ListSessions": h(self.ListSessions, pb.ListSessionsRequest),
            "DescribeBlocks": h(self.DescribeBlocks, pb.DescribeBlocksRequest),
            "Evict": h(self.Evict, pb.EvictRequest),
        })

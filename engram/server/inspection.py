"""The inspection RPCs (ListNamespaces, ListSessions, DescribeBlocks, Evict): the gRPC edge of
engram/inspection.py. Listings across tenants, `all_namespaces`, and evicting a namespace other tenants share whole
need an admin caller; everything else resolves its namespace through the tenancy seam like every other RPC."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from engram.api import BlockDescription
from engram.errors import InvalidArgument, NotFound, PermissionDenied
from engram.inspection import Inspector
from engram.server.arrival import one_request
from engram.server.auth import guard, is_admin, namespace_for, session_owner, tenant_of
from engram.server.errors import unary
from engram.server.requests import check_limit, decoded, key_request_bytes, safe_decoder
from engram.server.service import SERVICE_NAME
from engram.tenancy import Tenancy
from engram.v1 import engram_pb2 as pb
from engram.wire import convert


def _scope(context: grpc.aio.ServicerContext, namespace: str, all_namespaces: bool, what: str) -> str | None:
    """The namespace to search, or None for every namespace (admin only)."""
    if all_namespaces:
        if not is_admin(context):
            raise PermissionDenied(f"{what} across every namespace needs an admin token; name one namespace")
        return None
    return namespace_for(context, namespace)


class InspectionService:
    def __init__(self, inspector: Inspector, max_blocks_per_request: int, tenancy: Tenancy | None = None,
                 stream_stall_s: float = 30.0) -> None:
        self.inspector = inspector
        self.tenancy = tenancy  # every handler authenticates through engram.server.auth.guard
        self.max_blocks = max_blocks_per_request
        self.stall_s = stream_stall_s  # a request that does not arrive within it ends the call (server/arrival.py)

    @unary
    async def ListNamespaces(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ListNamespacesResponse:
        decoded(request)
        if not is_admin(context):
            raise PermissionDenied("ListNamespaces shows every tenant: call it with an admin token")
        return pb.ListNamespacesResponse(namespaces=[convert.to_pb(n, pb.NamespaceSummary)
                                                     for n in self.inspector.namespaces()])

    @unary
    async def ListSessions(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ListSessionsResponse:
        req = decoded(request)
        ns = _scope(context, req.namespace, req.all_namespaces, "ListSessions")
        insp, tenant = self.inspector, tenant_of(context)
        out = pb.ListSessionsResponse()
        for i, s in enumerate(insp.sessions_in(ns, tenant)):
            if i:  # each session's chain is a match of its tokens (up to 2^21): other calls run between them, so
                await asyncio.sleep(0)  # one tenant's listing of many long sessions does not stall every other
            summary = insp.chain(s, tenant).summary(model_seen=insp.sees_model(s.fingerprint, tenant))
            out.sessions.append(convert.to_pb(summary, pb.SessionSummary))
        return out

    @unary
    async def DescribeBlocks(self, request: Any, context: grpc.aio.ServicerContext) -> pb.DescribeBlocksResponse:
        req = decoded(request)
        insp = self.inspector
        if bool(req.session_id) == bool(req.key_prefixes):
            raise InvalidArgument("DescribeBlocks takes a session_id or key_prefixes, exactly one of them")
        check_limit("DescribeBlocks keys", len(req.key_prefixes), self.max_blocks)
        tenant = tenant_of(context)
        if req.session_id:
            s = insp.sessions.get(namespace_for(context, req.namespace), req.session_id, tenant,
                                  session_owner(context, req.session_owner))
            chain = insp.chain(s, tenant)
            description = BlockDescription(tuple(insp.describe(chain.blocks, s, tenant=tenant)),
                                           chain.summary(model_seen=insp.sees_model(s.fingerprint, tenant)))
        else:
            ns = _scope(context, req.namespace, req.all_namespaces, "DescribeBlocks")
            description = BlockDescription(tuple(insp.describe(insp.resolve(ns, list(req.key_prefixes)),
                                                            tenant=tenant)))
        return convert.to_pb(description, pb.DescribeBlocksResponse)

    @unary
    async def Evict(self, request: Any, context: grpc.aio.ServicerContext) -> pb.EvictResponse:
        req = decoded(request)
        insp = self.inspector
        if sum((bool(req.key_prefixes), bool(req.session_id), req.whole_namespace)) != 1:
            raise InvalidArgument("Evict takes exactly one of key_prefixes, session_id or whole_namespace")
        check_limit("Evict keys", len(req.key_prefixes), self.max_blocks)
        if req.key_prefixes:
            metas = insp.resolve(_scope(context, req.namespace, req.all_namespaces, "Evict"), list(req.key_prefixes))
        elif req.session_id:
            metas = insp.session_blocks_to_evict(insp.sessions.get(namespace_for(context, req.namespace),
                                                                   req.session_id, tenant_of(context),
                                                                   session_owner(context, req.session_owner)),
                                                 tenant_of(context))
        else:
            if req.all_namespaces:
                raise InvalidArgument("whole_namespace evicts one namespace: name it, without all_namespaces")
            ns = namespace_for(context, req.namespace)
            if tenant_of(context) and insp.store.namespaces.shared(ns):
                # Every tenant's cache there, not the caller's alone: the operator's call (a tenant's would also
                # list in one answer every block the others hold)
                raise PermissionDenied(f"namespace {ns!r} is shared with other tenants: evicting it whole needs an "
                                       "admin token; evict your sessions' blocks (session_id) or blocks by key")
            metas = insp.namespace_blocks(ns)
            if not metas:  # as a key prefix that matches nothing: a typo must not look like success
                raise NotFound(f"namespace {ns!r} holds no blocks: nothing to evict (`engram ls` lists namespaces)")
        return convert.to_pb(await insp.evict(metas, force=req.force, tenant=tenant_of(context)), pb.EvictResponse)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Served under the Engram service name beside EngramService's own handler (gRPC asks each)."""

        def ser(msg: Any) -> bytes:
            return msg.SerializeToString()

        def h(fn: Any, cls: Any) -> grpc.RpcMethodHandler:  # key prefixes at most: no call here needs more
            decoder = safe_decoder(cls, key_request_bytes(self.max_blocks))
            return grpc.stream_unary_rpc_method_handler(guard(one_request(fn, self.stall_s), self.tenancy), decoder,
                                                        ser)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "ListNamespaces": h(self.ListNamespaces, pb.ListNamespacesRequest),
            "ListSessions": h(self.ListSessions, pb.ListSessionsRequest),
            "DescribeBlocks": h(self.DescribeBlocks, pb.DescribeBlocksRequest),
            "Evict": h(self.Evict, pb.EvictRequest),
        })

"""The daemon's control and inspection calls: stats, check, ping, the listings, describe, evict and pin.

`ControlClient` moves no KV, so it imports neither torch nor the codecs: the CLI's inspection commands use it
and start in a fraction of a second. `EngramClient` (engram/client.py) extends it with the data path (put,
get, sessions). Replies are engram.api dataclasses; gRPC errors come back as the domain errors of
engram.errors, with the server's message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import grpc

from engram import clientuse, errors
from engram.api import (
    BlockDescription,
    CheckReport,
    EvictResult,
    ForgetResult,
    NamespaceStats,
    NamespaceSummary,
    SessionSummary,
    Stats,
)
from engram.v1 import engram_pb2 as pb
from engram.wire import convert, deadline, tlshint
from engram.wire.channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_socket_path,
    header_safe,
    open_channel,
    stub_for,
)
from engram.wire.deadline import DEFAULT_TIMEOUT_S
from engram.wire.status import error_from_rpc

__all__ = ["ControlClient"]

T = TypeVar("T")


@clientuse.given_up_on_close
class ControlClient:
    def __init__(self, address: str, *, namespace: str = "default", token: str = "", root_cert: bytes | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """address: host:port or unix:/path. token: the tenant's bearer token (tenancy on); root_cert: PEM root
        certificate, for a daemon serving TLS. namespace: the default of every call; with a token, "" means
        the token's first. max_message_bytes: the largest message this client sends; it takes any the daemon
        sends (which its own server.max_message_bytes bounds, and a Get's chunks its server.chunk_bytes: a
        client whose limit was below those could fetch no block over gRPC). timeout_s: the longest any call
        waits on the daemon: a unary call's deadline, and a stream's (Get, Put, Resume, the data channel) longest
        wait for its next message or bytes, however long the stream; past it the call fails DeadlineExceeded (an
        Unavailable) and the client goes on (engram/wire/deadline.py)."""
        if not address.strip():  # grpc took it and every call failed UNAVAILABLE/INTERNAL, the daemon blamed
            raise errors.InvalidArgument("the daemon's address is empty: give host:port or unix:/path/engram.sock")
        check_socket_path(address)
        if not header_safe(token):
            raise errors.InvalidArgument("the token holds a space, a control or a non-ASCII character; a bearer "
                                         "token is printable ASCII")
        self.timeout_s = deadline.checked(timeout_s)
        self.address = address
        self.namespace = namespace
        clientuse.starting()
        self._made_in = os.getpid()
        self._closed = False
        self._closing = False  # close() has begun: the calls it cuts raise ClientClosed (clientuse.given_up_on_close)
        self._tls = root_cert is not None
        self._channel = open_channel(address, root_cert=root_cert, max_message_bytes=max_message_bytes,
                                     max_receive_bytes=-1)
        self._live_stub = stub_for(self._channel, token)

    @property
    def _stub(self) -> Any:
        """The daemon's stub while the client is open: after close(), ClientClosed (grpc said UsageError "Channel
        is closed"), and in a forked child ClientForked (engram/clientuse.py). Every call the client makes starts
        here."""
        self._check_open()
        return self._live_stub

    def _check_open(self) -> None:
        clientuse.check_process(self._made_in)
        if self._closed:
            raise clientuse.closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel (the context manager does it). A later call raises ClientClosed, and so do the calls
        other tasks have in flight, given up."""
        self._closing = True
        self._closed = True
        await self._channel.close()

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any, *, work_bytes: int = 0,
                    work_blocks: int = 0, timeout_s: float | None = None) -> T:
        """`method(request)`'s answer (within timeout_s, or the caller's own, and the time the daemon's work before
        it answers takes: deadline.work_s), its gRPC failure as the domain error. That bound is the call's gRPC
        deadline too (deadline.unary): made without one, the daemon did not know it, and a Lookup's copying from
        the cluster's peers went on past it to cluster.fill_timeout_s while its client gave up (session 54)."""
        try:
            return await deadline.unary(method, request, self.timeout_s if timeout_s is None else timeout_s,  # type: ignore[no-any-return]
                                        self.address, work_bytes, work_blocks)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from exc

    async def _failed(self, exc: grpc.aio.AioRpcError) -> errors.EngramError:
        """The domain error of a failed call (error_from_rpc); where the daemon closed this plain-text client's
        connection because it serves TLS, an Unavailable saying so (engram/wire/tlshint.py)."""
        return await tlshint.explained(error_from_rpc(exc), exc, self.address, self._tls, self.timeout_s)

    async def _store_wide(self, method: Callable[..., Awaitable[T]], request: Any, timeout_s: float | None,
                          work: Callable[[Stats], tuple[int, int]]) -> T:
        """A call whose work goes through a part of the store before it answers (Check, Evict, ForgetModel):
        minutes on a large store. Bounded by the caller's timeout_s when given; else by the client's timeout_s
        and the time of that part, (bytes, blocks) = work(Stats), at deadline's floor rates. The Stats call first
        costs a round trip and finds a hung daemon within timeout_s."""
        if timeout_s is not None:
            return await self._call(method, request, timeout_s=deadline.checked(timeout_s))
        nbytes, blocks = work(await self.stats())
        return await self._call(method, request, work_bytes=nbytes, work_blocks=blocks)

    @property
    def _open_channel(self) -> grpc.aio.Channel:
        self._check_open()
        return self._channel

    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace

    async def ping(self) -> float:
        """Seconds for one round trip of the standard health check (which needs no token); Unavailable when the
        daemon does not answer (within timeout_s: DeadlineExceeded) or is not serving."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        t0 = time.perf_counter()
        resp = await self._call(health_pb2_grpc.HealthStub(self._open_channel).Check, health_pb2.HealthCheckRequest())
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            from engram.errors import Unavailable

            raise Unavailable(f"the daemon at {self.address} answers but is not serving (shutting down?)")
        return time.perf_counter() - t0

    async def stats(self) -> Stats:
        """Tiers, models, counters, replay, cluster and the namespaces this caller may see (all, for an admin)."""
        return convert.from_pb(Stats, await self._call(self._stub.Stats, pb.StatsRequest()))

    async def check(self, *, fix: bool = False, timeout_s: float | None = None) -> CheckReport:
        """Verify every stored copy (payload checksums, block files); with fix, drop the broken ones. Admin only.
        The daemon reads every copy before it answers, minutes on a store of tens of GiB: the call waits the
        client's timeout_s and every tier's bytes and blocks at deadline's floor rates (learned from Stats
        first), or `timeout_s` seconds when given."""
        def work(st: Stats) -> tuple[int, int]:
            return sum(t.used_bytes for t in st.tiers), sum(t.blocks for t in st.tiers)

        resp = await self._store_wide(self._stub.Check, pb.CheckRequest(fix=fix), timeout_s, work)
        return convert.from_pb(CheckReport, resp)

    async def describe_namespace(self, namespace: str | None = None) -> NamespaceStats:
        """The namespace's key salt, quota, and physical against logical bytes."""
        req = pb.DescribeNamespaceRequest(namespace=self._ns(namespace))
        return convert.from_pb(NamespaceStats, await self._call(self._stub.DescribeNamespace, req))

    # ---- inspection (engram ls / show / evict / pin) ---------------------------------------------

    async def list_namespaces(self) -> tuple[NamespaceSummary, ...]:
        """Every namespace with its blocks, bytes and sessions. Admin only (or tenancy off)."""
        resp = await self._call(self._stub.ListNamespaces, pb.ListNamespacesRequest())
        return tuple(convert.from_pb(NamespaceSummary, n) for n in resp.namespaces)

    async def list_sessions(self, *, namespace: str | None = None, all_namespaces: bool = False
                            ) -> tuple[SessionSummary, ...]:
        """The sessions of one namespace, or of every namespace (all_namespaces: admin only)."""
        req = pb.ListSessionsRequest(namespace=self._ns(namespace), all_namespaces=all_namespaces)
        resp = await self._call(self._stub.ListSessions, req)
        return tuple(convert.from_pb(SessionSummary, s) for s in resp.sessions)

    async def describe_blocks(self, *, session_id: str = "", key_prefixes: Sequence[str] = (),
                              namespace: str | None = None, all_namespaces: bool = False, session_owner: str = ""
                              ) -> BlockDescription:
        """A session's block chain (session_id), or the blocks named by hex keys or unique key prefixes: tiers,
        codec, checksum, refcount, pins. NotFound when nothing matches; InvalidArgument for an ambiguous prefix.
        `session_owner`: an admin's, the tenant whose session_id it is (ids are per tenant)."""
        prefixes = list(key_prefixes)
        step = self._request_bound(len(prefixes))
        reply = pb.DescribeBlocksResponse()
        for start in range(0, max(len(prefixes), 1), step):  # in parts, as puts and gets
            req = pb.DescribeBlocksRequest(namespace=self._ns(namespace), all_namespaces=all_namespaces,
                                           session_id=session_id, key_prefixes=prefixes[start : start + step],
                                           session_owner=session_owner)
            reply.MergeFrom(await self._call(self._stub.DescribeBlocks, req))
        return convert.from_pb(BlockDescription, reply)

    def _request_bound(self, n: int) -> int:
        """How many keys one request may name: the daemon's bound once a data-path client has registered a
        model (RegisterModelResponse says it), else all of them in one."""
        return getattr(self, "_max_blocks", None) or n or 1

    async def evict(self, *, key_prefixes: Sequence[str] = (), session_id: str = "", whole_namespace: bool = False,
                    force: bool = False, namespace: str | None = None, all_namespaces: bool = False,
                    timeout_s: float | None = None, session_owner: str = "") -> EvictResult:
        """Evict blocks by key (with every block extending them), the blocks only a session uses, or a whole
        namespace. Pinned blocks refuse the request unless force; blocks being read are skipped and reported.
        A tenant's evict in a namespace other tenants share removes only what no one else holds: blocks another's
        session or pin holds, or a read is using, stay, reported in `in_use` (the reason not told), and only its own
        pins refuse it; evicting such a namespace whole is an admin's call (PermissionDenied).
        NotFound when nothing matches (a key prefix, or a namespace holding no blocks). The daemon removes one
        block after another before it answers, minutes for a large namespace: the call waits the client's
        timeout_s and the namespace's blocks (every visible one's, when it is not listed) at
        deadline.WORK_BLOCKS_PER_S (learned from Stats first), or `timeout_s` seconds when given. `session_owner`:
        an admin's, the tenant whose session_id it is (ids are per tenant)."""
        ns = self._ns(namespace)
        req = pb.EvictRequest(namespace=ns, all_namespaces=all_namespaces, key_prefixes=list(key_prefixes),
                              session_id=session_id, whole_namespace=whole_namespace, force=force,
                              session_owner=session_owner)

        def work(st: Stats) -> tuple[int, int]:
            mine = [n.blocks for n in st.namespaces if n.namespace == ns and not all_namespaces]
            return 0, sum(mine) if mine else sum(n.blocks for n in st.namespaces)

        return convert.from_pb(EvictResult, await self._store_wide(self._stub.Evict, req, timeout_s, work))

    async def forget_model(self, fingerprint: bytes, *, force: bool = False, timeout_s: float | None = None
                           ) -> ForgetResult:
        """Forget a model (admin only): evict every block of it in every namespace and tier, then remove it from the
        registry, every tenant's registration and its file. FailedPrecondition, with nothing changed, while a live
        session, an in-place reservation or a put in flight uses it or one of its blocks is pinned, unless force
        (closes its sessions and evicts pinned blocks; puts and reservations still refuse it); also when a block
        stays busy being read, the model then still registered (run it again). UnknownModel when the daemon
        neither knows the model nor holds a block of it. A worker still running registers it again at its next
        call: stop the workers of a retired model first. The daemon evicts every block of the model before it
        answers: the call waits as evict's does, for the model's blocks, or `timeout_s` seconds when given."""
        req = pb.ForgetModelRequest(model_fingerprint=fingerprint, force=force)

        def work(st: Stats) -> tuple[int, int]:  # a model no longer registered may still hold blocks: all, then
            mine = [m.blocks for m in st.models if m.model_fingerprint == fingerprint]
            return 0, sum(mine) if mine else sum(n.blocks for n in st.namespaces)

        return convert.from_pb(ForgetResult,
                               await self._store_wide(self._stub.ForgetModel, req, timeout_s, work))

    async def pin(self, fingerprint: bytes, keys: Sequence[bytes], *, unpin: bool = False,
                  namespace: str | None = None) -> int:
        """Pin blocks (never evicted; moved down a tier only when nothing unpinned can be) or, with unpin, remove
        one pin from each; returns how many changed."""
        changed, keys = 0, list(keys)
        step = self._request_bound(len(keys))
        for start in range(0, max(len(keys), 1), step):
            req = pb.PinRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint,
                                keys=keys[start : start + step], unpin=unpin)
            changed += (await self._call(self._stub.Pin, req)).changed
        return changed

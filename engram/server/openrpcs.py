"""The gRPC services anyone may call, without a token: health checking and reflection, kept to a share of their own.

They are served beside Engram's own service (engram/server/app.py) on the one server whose only bound is
`server.max_concurrent_rpcs`, and the tenants' shares (engram/server/auth.py) count only the calls a token
admits. A peer with no token that opened that many Health/Watch streams (or reflection streams it never wrote
to), which never end on their own, held every slot: every tenant's call was refused RESOURCE_EXHAUSTED "Concurrent
RPC limit exceeded!" for as long as it liked (an audit, session 43). `OpenServiceGuard` lets at most
`server.max_concurrent_open_rpcs` of them run at once and refuses the next at once (which frees its slot).

It also answers bytes those services cannot decode with INVALID_ARGUMENT: grpcio's own handlers let the
parse error out as UNKNOWN, with a traceback in the daemon's log for every such request, anyone's to send.

And a request longer than OPEN_REQUEST_MAX_BYTES is refused RESOURCE_EXHAUSTED before it is parsed. Their
requests name a service, a file or a symbol; the server's message bound (server.max_message_bytes, 16 MiB) is for
blocks. grpcio's health servicer keeps a Watch's service name as a key for as long as the stream lives: 8 Watches
naming 32 MiB services took a tenancy-on daemon from 265 to 1090 MiB, for as long as the peer liked, and 819 MiB
stayed after it left (an audit, session 48).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from engram.server.arrival import first_request
from engram.server.errors import forget_abort
from engram.wire.stream import answered


def _methods(*services: ServiceDescriptor) -> frozenset[str]:
    """Each service's methods as gRPC names them on the wire ("/package.Service/Method")."""
    return frozenset(f"/{service.full_name}/{method.name}" for service in services for method in service.methods)


# The open services' methods, exactly, from the modules that register them (engram/server/app.py): not name
# prefixes, under which a service added later beside them would have been taken as open, and one of another name
# (another reflection version) would have escaped their share. tests/test_server_errors.py checks that every
# method the daemon registers is one of these or checks a token.
OPEN_METHODS = _methods(health_pb2.DESCRIPTOR.services_by_name["Health"],
                        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
# The longest request message they take, in bytes: a health check names a service ("engram.v1.Engram"), a
# reflection request a file, a symbol or an extension (a few hundred bytes at most).
OPEN_REQUEST_MAX_BYTES = 4096


class _Undecodable:
    """A request the service's deserializer refused (the handler answers INVALID_ARGUMENT). The parser's message,
    not its error, whose traceback's frames hold the request, this: a reference cycle (server/errors.py)."""

    def __init__(self, message: str) -> None:
        self.message = message


class _TooLong:
    """A request past OPEN_REQUEST_MAX_BYTES, left unparsed (the handler answers RESOURCE_EXHAUSTED)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class OpenServiceGuard(grpc.aio.ServerInterceptor):
    """At most `limit` calls to the open services in flight; their requests decoded without a traceback."""

    def __init__(self, limit: int, stall_s: float = 30.0) -> None:
        self.limit = limit
        self.stall_s = stall_s  # a unary request that does not arrive within it ends the call (server/arrival.py)
        self.in_flight = 0

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in OPEN_METHODS:
            return handler
        decode = handler.request_deserializer

        def safe(data: bytes) -> Any:
            if len(data) > OPEN_REQUEST_MAX_BYTES:
                return _TooLong(len(data))
            try:
                return decode(data) if decode is not None else data
            except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
                return _Undecodable(str(exc))

        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                    if getattr(handler, k) is not None)
        inner = getattr(handler, kind)
        streams_in = kind.startswith("stream")
        # A unary request is taken as a stream (engram/server/arrival.py): the call counts against the share from
        # its headers on, not once its message arrives, and a message that does not come ends the call.
        as_stream = "stream_" + kind.split("_", 1)[1]

        async def guarded(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if self.in_flight >= self.limit:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"{self.limit} calls to the health and reflection services are in flight, "
                                        "as many as server.max_concurrent_open_rpcs allows; try again later")
                self.in_flight += 1
                try:
                    if streams_in:
                        request = _checked(requests, context, method)
                    else:
                        request = await first_request(requests, context, self.stall_s, method)
                        if isinstance(request, _Undecodable | _TooLong):
                            await _refuse(context, method, request)
                    return await answered(inner(request, context), context)  # the wrapper is one coroutine
                finally:
                    self.in_flight -= 1
            except grpc.aio.AbortError as exc:  # cut from the frames, which hold the call's state (server/errors.py)
                forget_abort(exc)
                return None

        return handler._replace(request_deserializer=safe, request_streaming=True,
                                **{kind: None, as_stream: guarded})


async def _refuse(context: grpc.aio.ServicerContext, method: str, request: _Undecodable | _TooLong) -> None:
    if isinstance(request, _TooLong):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{method}: a request of {request.nbytes} bytes; the health and reflection services take "
                            f"at most {OPEN_REQUEST_MAX_BYTES}")
    else:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method}: the request is not a valid message ({request.message[:200]})")


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str
                   ) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable | _TooLong):
            await _refuse(context, method, request)
        yield request

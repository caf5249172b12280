"""Requests must arrive: a call whose client sent its headers and then nothing held a slot for ever.

grpc.aio counts a call against server.max_concurrent_rpcs from its headers on and, for a method registered as
unary-request, reads the request message before any handler of ours runs, with no time limit. A peer with no
token that opened that many calls and never sent their messages (a stream-unary call to a unary method does just
that) held every slot: every tenant's call was RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!" for as long as
it liked (session 44). A client-streaming Put that stopped sending held its slot for ever too.

So every method takes its request as a stream (the same bytes on the wire: a unary request is a stream of one
message). The handler runs at the headers: `guard` (engram/server/auth.py) authenticates the call and counts it
against its tenant's share before anything waits on the client, so a caller without a token is refused at once
and a tenant's silent calls fill only its own share. Then each request message must arrive within
server.stream_stall_s, or the call ends DEADLINE_EXCEEDED and its slot is free.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


def _late(what: str, stall_s: float) -> str:
    return (f"{what} did not arrive within {stall_s:g}s (server.stream_stall_s) of the call's headers or the message "
            "before it; the daemon ended the call")


async def first_request(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, stall_s: float, name: str) -> Any:
    """The call's one request message, within `stall_s`."""
    try:
        async with asyncio.timeout(stall_s):
            request = await anext(requests, _NONE)
    except TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _late(f"the {name} request", stall_s))
    if request is _NONE:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the call ended without its request message")
    return request


_NONE = object()


def one_request(behavior: Callable[..., Any], stall_s: float) -> Callable[..., Any]:
    """A unary-request behaviour (coroutine or async generator) as a stream-request one: it is called with the
    call's one message once that arrives within `stall_s`. Register it with a stream_unary / stream_stream
    method handler (grpc.stream_unary_rpc_method_handler(guard(one_request(fn, s), tenancy), ...))."""
    name = behavior.__name__
    if inspect.isasyncgenfunction(behavior):

        @functools.wraps(behavior)
        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await first_request(requests, context, stall_s, name)
            async for item in behavior(request, context):
                yield item

        return stream

    @functools.wraps(behavior)
    async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await first_request(requests, context, stall_s, name), context)

    return unary


def each_request(behavior: Callable[..., Any], stall_s: float) -> Callable[..., Any]:
    """A stream-request behaviour whose messages must each arrive within `stall_s` of the one before (of the
    headers, for the first)."""
    name = behavior.__name__

    @functools.wraps(behavior)
    async def streamed(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_each_within(requests, context, stall_s, name), context)

    return streamed


async def _each_within(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, stall_s: float,
                       name: str) -> AsyncIterator[Any]:
    while True:
        try:
            async with asyncio.timeout(stall_s):
                request = await anext(requests, _NONE)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _late(f"the next message of this {name} stream",
                                                                         stall_s))
        if request is _NONE:
            return
        yield request

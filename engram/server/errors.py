"""Handler wrappers: a domain error ends the call with its status (the mapping is engram/wire/status.py);
anything else is a bug, logged and answered INTERNAL, and the daemon keeps serving.

They set the status rather than call `context.abort`: grpc keeps the AbortError that abort raises in the call's
state until the call is dropped, and the error's traceback (and the domain error's, its __context__) holds the
handler frames that hold the context, which holds that state: a reference cycle per failed call. Only a full
collection frees one, and the daemon's collector (engram/collector.py) froze those that lived into the oldest
generation: a daemon answering failed calls grew 1-4 MB per 1,000 until the hourly full collection (an audit,
session 45). The aborts left (a call refused before its handler runs, a request that does not arrive) go through
`forget_abort` where they leave Engram's wrappers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc

from engram import errors
from engram.wire.status import status_of

log = logging.getLogger("engram.server")

R = TypeVar("R")


def status_for(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status of a domain error, or INTERNAL (logged) for anything else."""
    if isinstance(exc, errors.EngramError):
        from engram.server.auth import told  # (auth imports this module)

        return status_of(exc), told(exc)
    log.exception("internal error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """Abort the call with the status of a domain error, or INTERNAL (logged) for anything else: for code that
    must stop the call where it is (the caller's wrapper passes the AbortError to `forget_abort`)."""
    await context.abort(*status_for(exc, method))


def end_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """Set the call's status to that of a domain error, or INTERNAL (logged) for anything else: grpc sends it
    when the handler returns (the response, if any, is discarded)."""
    code, details = status_for(exc, method)
    context.set_code(code)
    context.set_details(details)


def forget_abort(exc: grpc.aio.AbortError) -> None:
    """Cut what the AbortError of `context.abort`, which grpc keeps in the call's state, links to: the frames
    of its traceback (which hold the context, so the state) and the error it was raised in. The wrapper that
    caught it then returns: grpc raises the error again itself, from its own frames, which hold nothing."""
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None


def unary(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Wrap a unary-response handler: domain errors end the call with their status; a bug ends it with
    INTERNAL and is logged, and the daemon keeps serving."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, KeyboardInterrupt):
            raise
        except Exception as exc:
            end_with(context, exc, fn.__name__)
            return cast(R, None)  # discarded: the status is not OK

    return wrapper


def streaming(fn: Callable[..., AsyncIterator[R]]) -> Callable[..., AsyncIterator[R]]:
    """The same for server-streaming handlers (async generators) of a service with a `config` (ServerConfig).
    The wrapper writes the messages itself, each within server.stream_stall_s: a client that reads none for that
    long (HTTP/2's flow control holds the write) had the handler, the block it was sending and the blocks' holds
    kept for as long as it stayed; now the stream ends DEADLINE_EXCEEDED and the handler is closed at once. (grpc
    sends that status after the message it holds, whenever the client reads; the call stays open in grpc until
    then: grpc.aio gives a server no way to reset a stream.)"""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[R]:
        stall_s = self.config.stream_stall_s
        try:
            async with contextlib.aclosing(cast(AsyncGenerator[R, None], fn(self, request, context))) as items:
                async for item in items:
                    try:
                        async with asyncio.timeout(stall_s):
                            await context.write(item)
                    except TimeoutError:
                        break
                    except grpc.aio.InternalError:  # the client went (its process killed) as the write began
                        log.debug("%s: the client went mid-stream", fn.__name__)
                        context.set_code(grpc.StatusCode.CANCELLED)
                        context.set_details("the client went mid-stream")
                        return
                else:
                    return
            details = (f"the client took no message of this {fn.__name__} stream within {stall_s:g}s "
                       "(server.stream_stall_s: a write ends once the client has read about an HTTP/2 window, a "
                       "few MiB, ahead of it); the daemon ended it")
            log.warning("%s", details)
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(details)
        except (grpc.aio.AbortError, KeyboardInterrupt):
            raise
        except Exception as exc:
            # Not context.abort, which returns once the status is sent: after every message the client has not
            # taken. The handler ends now and grpc sends the status when it can (the guard's tenant share is back).
            end_with(context, exc, fn.__name__)
        return
        yield  # an async generator for grpc, which finds nothing left to write

    return wrapper

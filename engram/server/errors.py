"""Handler wrappers: a domain error aborts the call with its status (the mapping is engram/wire/status.py);
anything else is a bug, logged and answered INTERNAL, and the daemon keeps serving."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from engram import errors
from engram.wire.status import status_of

log = logging.getLogger("engram.server")

R = TypeVar("R")


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """Abort the call with the status of a domain error, or INTERNAL (logged) for anything else."""
    if isinstance(exc, errors.EngramError):
        await context.abort(status_of(exc), str(exc))
    log.exception("internal error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


def unary(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Wrap a unary-response handler: domain errors abort with their status; a bug aborts with INTERNAL
    and is logged, and the daemon keeps serving."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, KeyboardInterrupt):
            raise
        except Exception as exc:
            await abort_with(context, exc, fn.__name__)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


def streaming(fn: Callable[..., AsyncIterator[R]]) -> Callable[..., AsyncIterator[R]]:
    """The same for server-streaming handlers (async generators)."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[R]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (grpc.aio.AbortError, KeyboardInterrupt):
            raise
        except Exception as exc:
            await abort_with(context, exc, fn.__name__)

    return wrapper

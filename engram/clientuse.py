"""When a client may still make calls: in the process that made it, until close(), which ends the calls then in
flight too.

Why: `SyncEngramClient.close()` stopped the client's event loop and left the calls other threads had in flight on
it unresolved: those threads blocked forever on a data-channel or in-place put, and a gRPC call got a bare
CancelledError (an audit, session 48), though every call of the client is bounded by timeout_s. A call after
close failed RuntimeError "Event loop is closed" (and Python warned of a coroutine never awaited), or on the
async client grpc's UsageError "Channel is closed". Each now raises ClientClosed, saying which it was.

gRPC's core and the client's event-loop thread do not survive fork(): a forked child (multiprocessing's default
start method on Linux) calling its parent's SyncEngramClient waited forever, and one making a client of its own
after its parent had made one crashed (SIGSEGV) or failed DeadlineExceeded blaming a healthy daemon (the same
audit). gRPC is not made fork-safe here: both are refused at once with ClientForked, which says to make clients
after the fork or start workers with the spawn (or forkserver) start method.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from engram import errors

C = TypeVar("C", bound=type)

AFTER_CLOSE = "the client is closed (close() was called): make a new client to go on"
WHILE_RUNNING = ("the client was closed (close(), from another thread or task) while this call ran: the call was "
                 "given up, and what it did at the daemon before is not known (a put may be stored in part; put "
                 "again on a new client)")


def closed() -> errors.ClientClosed:
    return errors.ClientClosed(AFTER_CLOSE)


def closed_while_running() -> errors.ClientClosed:
    return errors.ClientClosed(WHILE_RUNNING)


def given_up_on_close(cls: C) -> C:
    """The async client's calls, each raising ClientClosed (WHILE_RUNNING) when close() ends it from another task.

    Why: close() closes the channels under the calls other tasks await, which then failed however the cut reached
    them: a bare asyncio.CancelledError (gRPC and in-place puts), which the task reads as its own cancellation,
    grpc's UsageError "Channel is closed", or the closed client of the call's next step (an audit, session 48).
    Wraps each public coroutine method `cls` defines (close aside); the client sets `_closing` when close() begins.
    A caller cancelling its own task still gets CancelledError."""
    for name, method in list(vars(cls).items()):
        if not name.startswith("_") and name != "close" and inspect.iscoroutinefunction(method):
            setattr(cls, name, _given_up_on_close(method))
    return cls


def _given_up_on_close(method: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closing:  # called after close() began (it may still be releasing leases): refused at once; run,
            raise closed()  # close cut it to a bare CancelledError (a review, session 49)
        try:
            return await method(self, *args, **kwargs)
        except (asyncio.CancelledError, Exception) as exc:
            if self._closing and _cut_by_close(exc):
                raise closed_while_running() from None
            raise

    return call


def _cut_by_close(exc: BaseException) -> bool:
    """Whether `exc` is how a closed channel ends a call: not the caller's own cancellation, nor an answer."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is None or task.cancelling() == 0
    return isinstance(exc, (grpc.aio.UsageError, errors.ClientClosed, errors.Unavailable, OSError))


_started_in: int | None = None  # the process whose gRPC the first client of this one started (a fork copies it)

HOW = ("make each client in the process that uses it, after the fork, or start worker processes with the 'spawn' "
       "(or 'forkserver') start method: multiprocessing.get_context('spawn'), or in vLLM "
       "VLLM_WORKER_MULTIPROC_METHOD=spawn")


def starting() -> None:
    """A client is being made: ClientForked in a fork of a process that had made one (its gRPC is unusable here)."""
    global _started_in
    pid = os.getpid()
    if _started_in is None:
        _started_in = pid
    elif _started_in != pid:
        raise errors.ClientForked(f"this process ({pid}) was forked from process {_started_in}, which had made an "
                                  "Engram client: gRPC does not survive fork(), and a client made here hangs or "
                                  f"crashes; {HOW}")


def check_process(made_in: int) -> None:
    """ClientForked when this is not the process the client was made in."""
    pid = os.getpid()
    if pid != made_in:
        raise errors.ClientForked(f"this client was made in process {made_in}, and this process ({pid}) is a fork "
                                  "of it: the client's gRPC channel and event-loop thread do not survive fork(); "
                                  f"{HOW}")

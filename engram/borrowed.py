"""Work over a borrowed buffer in a worker thread, ended before its caller goes on, even a cancelled one.

asyncio.to_thread's thread runs on after the task awaiting it is cancelled. Over a buffer its caller reuses or
lets go once it goes on (the data channel's receive buffer, filled by the next block; a pool slot's view, valid
only while its block is held) the thread would read bytes that change under it, or hold an export that makes a
resize or a `memoryview.release` raise BufferError. So a cancelled caller waits for the thread (a hash of
16 MiB: a few ms) before its cancellation goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in the loop's default executor; returns (or raises) only once it has ended."""
    return await to_its_end(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def to_its_end(done: asyncio.Future[T]) -> T:
    """The future's result once it has ended, even when the caller is cancelled meanwhile (the cancellation goes on
    after it): work over a borrowed buffer that cancelling would not stop (a thread, a helper process writing
    into a pool slot)."""
    cancelled: asyncio.CancelledError | None = None
    while not done.done():
        try:
            await asyncio.wait((done,))
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc  # the first one goes on once the work is done; the rest are the same
    if cancelled is not None:
        if not done.cancelled():
            done.exception()  # the work's own error, if any, is not logged as never retrieved: the cancellation goes on
        raise cancelled
    return done.result()

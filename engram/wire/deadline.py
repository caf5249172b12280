"""How long a client waits for its daemon: every wait on the daemon is bounded by the client's `timeout_s`.

Why: a daemon that stops answering (a hung or stopped process, a frozen host, a peer gone without a reset) held
a worker's call for as long as it stalled: vLLM's scheduler loop behind one lookup, a load before the forward,
an engine's start behind its model's registration (an audit, session 45: still blocked after 20 s, and nothing
could be set). The bound takes two shapes:

- A unary call (Lookup, GetPrefix, RegisterModel, ReservePut, CommitPut, the control calls) has a deadline of
  timeout_s. Its answer is small; what the daemon does before it is bounded too, and the two calls that move KV
  first (a GetPrefix bringing a 4 GiB, 32K-token raw prefix up from NVMe; a write-through CommitPut) get their
  bytes' time at WORK_BYTES_PER_S more, and a CommitPut its blocks' at WORK_BLOCKS_PER_S (many small ones).
  The bound is the call's gRPC deadline too (`unary`), so the daemon knows it: a Lookup's copying from the
  cluster's peers ends in time to answer what is held (server/peers.py `_bound`). Bounded on the client's side
  alone, the daemon filled on to cluster.fill_timeout_s (20 s) and a client of a shorter timeout_s gave up
  first, DeadlineExceeded where the daemon would have answered a shorter match (session 54). The calls that
  grant what only their answer names keep a longer gRPC deadline (engram/client.py `_granting`); a GetPrefix
  says its client's wait in its request instead (GetPrefixRequest.answer_within_ms).
- The admin calls whose work is the store's (Check reads every stored copy; Evict and ForgetModel remove one
  file after another) take minutes on a large store, and answer only then. Their client asks Stats first (which
  also finds a hung daemon within timeout_s) and gives them the time of the part of the store they go through:
  its bytes at WORK_BYTES_PER_S and its blocks at WORK_BLOCKS_PER_S more (control.py). Before, `check()` failed
  DeadlineExceeded after timeout_s on any store of more than a few GiB while the daemon worked on.
- A stream that moves KV (a Get's or a Resume's messages, a Put's, the data channel's bytes either way) is
  never cut for being long, only for making no progress: timeout_s without a message taken or received (a
  byte, on the data channel, where the daemon reading more of a request counts too: wire/data.py Conn's
  reading_counts). Its first message and, after a Put's last, its answer are waits of that kind, and so they
  hold the daemon's work before it answers (blocks copied from peers, the last blocks' stores; over gRPC,
  whose flow-control window lets a Put's messages run a few MiB ahead of the daemon, those of a window). A
  Resume's replay may outlast timeout_s, so its client asks for a progress message every third of it
  (ResumeRequest.progress_every_ms), each a message like any other. A deadline scaled by the bytes was the other choice: it needs a floor rate, which either cuts a
  healthy transfer on a loaded host or waits far too long on a stopped one.

A wait that runs out cancels the call and raises DeadlineExceeded (an Unavailable) naming the timeout and where
it is set (a call whose answer grants what only it names is not cancelled: it runs on, and the client gives the
grant back, engram/client.py `_granting`); the client is usable at once, and its calls succeed again once the daemon answers. The CLI's commands
give their own bounds (10 s; `engram check` 600 s).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from engram import errors

# A healthy daemon answers a unary call in milliseconds and a hit's GetPrefix within seconds (a long prefix
# brought up from NVMe, a first pool mapping); a stream keeps moving. 30 s leaves a loaded daemon ten times that
# and still ends a hang in tens of seconds, as the daemon's own stall bounds do (server.stream_stall_s).
DEFAULT_TIMEOUT_S = 30.0

# A unary call that moves KV inside the daemon before it answers (GetPrefix bringing a prefix up from NVMe into
# the pool; CommitPut writing its blocks through to NVMe) gets timeout_s plus its bytes at this rate: a healthy
# daemon on a slow disk (a 4 GiB, 32K-token raw prefix at 128 MiB/s: 32 s) is waited for, and a hang of such a
# call still ends (an audit, session 45: a 2.4 s load from a slow NVMe failed every time at timeout_s = 1 s).
WORK_BYTES_PER_S = 128 * 2**20

# Work done block by block (a file removed and its journal entry; a file opened, read and closed by a check): a
# 2-core host under load evicted about 2,500 blocks a second from its NVMe tier (0.4 ms each) and checked 30,000
# small files a second. A floor of 5 ms a block waits for a disk ten times slower than that.
WORK_BLOCKS_PER_S = 200


WHERE = ("EngramClient(timeout_s=...), or 'timeout_s' in the vLLM connector's kv_connector_extra_config")

# What gRPC's client says when a call's own deadline passes (grpc 1.85); a daemon's DEADLINE_EXCEEDED says why
GRPC_EXPIRED = "Deadline Exceeded"
# The longest gRPC deadline a call is given (a century): gRPC ends a call at once, DEADLINE_EXCEEDED, whose deadline is
# past its clock's range (about 7e9 s from now, grpc 1.85), and timeout_s may be any finite number (sys.maxsize: "wait
# as long as it takes"); the client's own bound, awaited on the loop, still holds the rest (a review, session 54)
GRPC_MOST_S = 100 * 365 * 86400.0


def checked(timeout_s: float) -> float:
    """timeout_s as a client takes it: positive and finite (a bound that never ends is the hang this prevents)."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        raise errors.InvalidArgument(f"timeout_s must be a number of seconds, got {timeout_s!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise errors.InvalidArgument(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")
    return value


def expired(address: str, what: str, timeout_s: float) -> errors.DeadlineExceeded:
    """The error of a wait that ran out: what the daemon did not do, the bound, and where it is set."""
    return errors.DeadlineExceeded(f"the daemon at {address} did not {what} within {timeout_s:g} s (the client's "
                                   f"timeout_s: {WHERE}); it is hung, stopped or overloaded, or its host is "
                                   "unreachable")


def work_s(nbytes: int = 0, blocks: int = 0) -> float:
    """The longest a healthy daemon takes to go through `nbytes` of KV in `blocks` blocks (the floor rates)."""
    return max(0, nbytes) / WORK_BYTES_PER_S + max(0, blocks) / WORK_BLOCKS_PER_S


def grpc_timeout(seconds: float) -> float:
    """`seconds` as a call's gRPC deadline: at most GRPC_MOST_S, which gRPC holds (past its range it ends the call
    at once)."""
    return min(seconds, GRPC_MOST_S)


async def unary(method: Callable[..., Any], request: Any, timeout_s: float, address: str, work_bytes: int = 0,
                work_blocks: int = 0) -> Any:
    """`method(request)`'s answer, the call made with its bound (`answer`'s) as its gRPC deadline: the daemon
    learns how long its caller waits, and its copying from peers ends in time to answer (server/peers.py)."""
    call = method(request, timeout=grpc_timeout(timeout_s + work_s(work_bytes, work_blocks)))
    return await answer(call, timeout_s, address, work_bytes, work_blocks)


async def answer(call: Any, timeout_s: float, address: str, work_bytes: int = 0, work_blocks: int = 0) -> Any:
    """A unary call's answer, awaited at most timeout_s, and the time the daemon's work before it answers takes
    (`work_bytes` of KV, `work_blocks` blocks: work_s); the call is cancelled when it does not come. A call made
    with that bound as its gRPC deadline (`unary`) may end by gRPC's timer first: the same DeadlineExceeded."""
    more = work_s(work_bytes, work_blocks)
    what = (f"answer (given {more:.3g} s more for the {work_bytes} bytes, {work_blocks} blocks of KV it goes "
            "through first)") if more else "answer"
    try:
        return await _within(call, asyncio.timeout(timeout_s + more), timeout_s, address, what)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or exc.details() != GRPC_EXPIRED:
            raise
        raise expired(address, what, timeout_s) from None


async def _within(call: Any, bound: asyncio.Timeout, timeout_s: float, address: str, what: str) -> Any:
    """The call's answer within `bound`; past it the call is cancelled and DeadlineExceeded says `what` was not
    done (a TimeoutError not of this bound goes on as it is)."""
    try:
        async with bound:
            return await call
    except TimeoutError:
        if not bound.expired():
            raise
        call.cancel()
        raise expired(address, what, timeout_s) from None


async def messages(call: Any, timeout_s: float, address: str, what: str) -> AsyncIterator[Any]:
    """A server stream's messages, each awaited at most timeout_s: the time between messages is bounded, not
    the stream's length, nor what the caller does with a message (the bound is not held across the yield)."""
    stream = call.__aiter__()
    while True:
        bound = asyncio.timeout(timeout_s)
        try:
            async with bound:
                message = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not bound.expired():
                raise
            call.cancel()
            raise expired(address, f"send the next message of {what}", timeout_s) from None
        yield message


class Progress:
    """A stall bound for a call whose progress this task does not see itself (a client stream's requests are
    taken by gRPC's own task): `moved`, at each request taken, puts the end timeout_s later."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._bound: asyncio.Timeout | None = None

    def moved(self) -> None:
        if self._bound is not None and not self._bound.expired():
            self._bound.reschedule(asyncio.get_running_loop().time() + self.timeout_s)

    async def wait(self, call: Any, address: str, what: str) -> Any:
        """The call's answer, once it comes; DeadlineExceeded (the call cancelled) once timeout_s passes without
        a request taken, or after the last without the answer."""
        bound = self._bound = asyncio.timeout(self.timeout_s)
        try:
            return await _within(call, bound, self.timeout_s, address, f"take the next part of {what}, nor answer it")
        finally:
            self._bound = None

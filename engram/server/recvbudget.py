"""The daemon-wide budget of puts' receive buffers (server.receive_buffer_bytes), one for both ways a put's bytes
come in: bytes a data-channel connection takes before it buffers a request's metadata or a block's payload, and a
gRPC Put stream before it reassembles a block from its chunks; given back when the buffer is let go.

Why: each data connection may buffer up to a block (REUSE_MAX kept between blocks, a larger block whole) and a
PUT's metadata (~21 MiB at the default limits), and each Put stream a block of up to server.max_block_bytes (256
MiB), so server.max_concurrent_rpcs connections or streams sending large puts could make the daemon hold tens of
GiB (512 x 64 MiB, an audit, session 45; 32 Put streams each sending 28 of a 32 MiB block grew it by 1.3 GiB). One
that finds the budget spent waits, reading nothing, so TCP's (HTTP/2's) flow control slows its sender; past
server.receive_buffer_wait_s it is refused RESOURCE_EXHAUSTED (a data connection's request body drained, the
connection kept).

A Put stream also takes server.max_message_bytes as metadata, before its first message and for the whole call: the
room for the message grpc reads for it whole, growing the stream's HTTP/2 window to fit, before the handler sees a
byte of it (a block's first chunk, before the block's size is known); one that cannot have it reads nothing, so its
sender may push at most the stream's window (server.grpc_stream_window_bytes) into grpc meanwhile.

Why it cannot deadlock: a holder holds two kinds of bytes, `meta` (a data request's metadata, held for the request;
a Put stream's message room, held for the call) and `payload` (its block buffer). Only a holder of metadata waits
for more (a payload); payload holders only wait for their sockets and the store, and a connection or stream lets
its buffer go before it waits for a larger one or for its next request's metadata (a Put stream waits for a block's
take holding only its message room). Metadata may
hold at most half the budget (half of a tenant's share), and no single take may be larger than that half, so once
the payload holders finish, every waiter's take fits. Waiters are served first come first served for the
daemon-wide bound, so a large payload is not starved by small ones; a waiter held back by its own tenant's share is
passed over, not waited behind.

Per-tenant share (tenancy on; admins, and every caller with tenancy off, count in the total only): a tenant's
connections and streams together hold at most server.receive_buffer_fraction_per_tenant of the budget, so one
tenant's slow (or trickling) senders cannot take every byte from the others. With tenancy off one client can hold
the whole budget, as it can hold every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engram import errors


@dataclass(eq=False)
class Holding:
    """What one data connection or Put stream holds of the budget: its request's metadata and its payload buffer,
    in bytes."""

    tenant: str | None  # whose share it counts against; None: the total only
    path: str = "data channel"  # where its bytes come in, for refusals: "data channel", "Put stream"
    meta: int = 0
    payload: int = 0


@dataclass(eq=False)
class _Waiter:
    holding: Holding
    n: int
    meta: bool
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ReceiveBudget:
    """total bytes for every connection's buffers (0: no bound), tenant_share bytes for one tenant's (0: none),
    wait_s: the longest a take waits before RESOURCE_EXHAUSTED; reclaim: called when a take must wait, to give back
    the buffers connections keep idle (kept for their next block, they would otherwise hold the waiter back for
    their whole keeping time)."""

    def __init__(self, total: int, tenant_share: int, wait_s: float, reclaim: Callable[[], None] = lambda: None) -> None:
        self.total, self.tenant_share, self.wait_s, self.reclaim = total, tenant_share, wait_s, reclaim
        self.used = self.meta_used = 0
        self._tenant_used: dict[str, int] = {}
        self._tenant_meta: dict[str, int] = {}
        self._waiters: deque[_Waiter] = deque()
        self.waits = self.refusals = 0  # takes that had to wait, and those refused after receive_buffer_wait_s

    def holding(self, tenant: str | None, path: str = "data channel") -> Holding:
        """A connection's or stream's account (tenant: its principal's name, or None: no share of its own)."""
        return Holding(tenant if self.tenant_share else None, path)

    def most(self, h: Holding) -> int:
        """The largest take that can always be granted in time: half of the budget, or of its tenant's share."""
        limit = min(self.total, self.tenant_share) if h.tenant is not None else self.total
        return limit // 2

    def try_take(self, h: Holding, n: int, *, meta: bool) -> bool:
        """Take n bytes now if they fit with nobody waiting before; False: `take` would wait (or refuse)."""
        if self.total and n > 0 and (self._waiters or n > self.most(h) or self._fits(h, n, meta) is not True):
            return False
        self._add(h, n, meta)
        return True

    async def take(self, h: Holding, n: int, *, meta: bool, what: str = "") -> None:
        """Take n bytes for `h`'s metadata (meta) or payload buffer, waiting up to wait_s for room; ResourceExhausted
        when none came, or when n can never be granted. what: the bytes' name in a refusal."""
        if self.try_take(h, n, meta=meta):
            return
        what = what or ("request's metadata" if meta else "block")
        if n > self.most(h):
            raise errors.ResourceExhausted(
                f"{h.path}: a {what} of {n} bytes exceeds the {self.most(h)} bytes one put may buffer (half "
                f"of server.receive_buffer_bytes = {self.total}{', or of its tenant share' if h.tenant else ''}); raise "
                "server.receive_buffer_bytes or send smaller requests")
        waiter = _Waiter(h, n, meta)
        self._waiters.append(waiter)
        self._wake()
        if not waiter.ready.done():
            self.reclaim()
        if not waiter.ready.done():
            self.waits += 1
        try:
            async with asyncio.timeout(self.wait_s):
                await waiter.ready
        except BaseException as exc:
            if waiter.ready.done() and not waiter.ready.cancelled():
                self._sub(h, n, meta)  # granted as the wait ended: not taken after all
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            self._wake()
            if not isinstance(exc, TimeoutError):
                raise
            self.refusals += 1
            share = " (its tenant's share: server.receive_buffer_fraction_per_tenant)" if h.tenant else ""
            raise errors.ResourceExhausted(
                f"{h.path}: the daemon's receive buffers (server.receive_buffer_bytes = {self.total}){share} stayed "
                f"full for server.receive_buffer_wait_s = {self.wait_s:g}s; this {what} of {n} bytes was not received: "
                "try again later") from None

    def give(self, h: Holding, n: int, *, meta: bool) -> None:
        """Give back n bytes of `h`'s metadata or payload buffer (the buffer let go)."""
        if n > 0:
            self._sub(h, n, meta)
            self._wake()

    def give_all(self, h: Holding) -> None:
        """Everything `h` holds: its connection ended."""
        self.give(h, h.meta, meta=True)
        self.give(h, h.payload, meta=False)

    def _fits(self, h: Holding, n: int, meta: bool) -> bool | str:
        """True; or why not: "total" (the daemon-wide bound: later waiters wait behind it) or "own" (the bound
        on metadata, or its tenant's share: passed over)."""
        if self.used + n > self.total:
            return "total"
        if meta and self.meta_used + n > self.total // 2:
            return "own"
        if h.tenant is not None:
            share = self.tenant_share
            if self._tenant_used.get(h.tenant, 0) + n > share:
                return "own"
            if meta and self._tenant_meta.get(h.tenant, 0) + n > share // 2:
                return "own"
        return True

    def _wake(self) -> None:
        for waiter in list(self._waiters):
            if waiter.ready.done():
                continue
            fits = self._fits(waiter.holding, waiter.n, waiter.meta)
            if fits is True:
                self._waiters.remove(waiter)
                self._add(waiter.holding, waiter.n, waiter.meta)
                waiter.ready.set_result(None)
            elif fits == "total":
                return  # first come first served: a later, smaller take does not pass it

    def _add(self, h: Holding, n: int, meta: bool) -> None:
        self.used += n
        if meta:
            h.meta += n
            self.meta_used += n
        else:
            h.payload += n
        if h.tenant is not None:
            self._tenant_used[h.tenant] = self._tenant_used.get(h.tenant, 0) + n
            if meta:
                self._tenant_meta[h.tenant] = self._tenant_meta.get(h.tenant, 0) + n

    def _sub(self, h: Holding, n: int, meta: bool) -> None:
        self.used -= n
        if meta:
            h.meta -= n
            self.meta_used -= n
        else:
            h.payload -= n
        if h.tenant is not None:
            _drop(self._tenant_used, h.tenant, n)
            if meta:
                _drop(self._tenant_meta, h.tenant, n)


def _drop(counts: dict[str, int], key: str, n: int) -> None:
    left = counts[key] - n
    if left:
        counts[key] = left
    else:
        del counts[key]

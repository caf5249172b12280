"""Long work on the daemon's event loop, done in slices and taken in turns per tenant.

A Lookup or GetPrefix of a million-token prefix walks, and answers, tens of thousands of blocks in Python on the
event loop; so does a session call re-resolving (and referencing) a session's prefix (engram/sessions.py). Done
in one go it held every call of every tenant for a third of a second, and with a tenant's 32 such calls in flight
for 12 s (an audit, session 48). Done in slices (`SLICE_BLOCKS`, a millisecond or two each)
with a turn of the loop between them, each call lets others in; but 32 calls in flight still put 32 slices
between every two steps of another tenant's call. So a tenant's long calls also take turns: one at a time does
its slices, the rest wait for it holding nothing but their request, and another tenant's call waits at most
about a slice per tenant doing such work, whatever their number of calls. The loop's total work, and so each
tenant's throughput, is the same."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

SLICE_BLOCKS = 256  # blocks a call walks or answers between turns of the loop: about a millisecond of Python


async def pause() -> None:
    """Let every other ready callback of the loop run once."""
    await asyncio.sleep(0)


class LoopTurns:
    """One long call at a time per tenant ("" is everyone with tenancy off, and admins)."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # calls holding or awaiting each tenant's lock: dropped at zero

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks[tenant] = asyncio.Lock()
        self._users[tenant] = self._users.get(tenant, 0) + 1
        try:
            async with lock:
                yield
        finally:
            left = self._users[tenant] - 1
            if left:
                self._users[tenant] = left
            else:
                del self._users[tenant], self._locks[tenant]

    def waiting(self, tenant: str) -> int:
        """Calls of the tenant holding or awaiting its turn."""
        return self._users.get(tenant, 0)

"""A client's models registered again when the daemon has forgotten them, and the call made once more.

A daemon forgets a registration: one restarted without a model registry (DRAM only: the registry is kept on the
NVMe tier) knows no model; one whose registry needed room dropped a registration that held nothing
(engram/server/modelroom.py); an admin forgot the model (ForgetModel); an upgrade read a model file from before
per-tenant visibility, which shows the model only to the tenant that added it. Every call naming the
fingerprint then failed UnknownModel, for as long as the worker ran. `EngramClient` remembers each model it
registered, and a call decorated here that fails UnknownModel registers that model again (its fingerprint is
a hash of the spec as registered, codec included: the same one) and runs once more, whole; a second
UnknownModel is raised. A call made inside another (a put's own lookup) leaves that to the outer one, so one
public call registers at most once. The worker integrations go through the same path (integrations/registration.py).

Only calls that can be repeated whole are decorated: each reads, or stores content-addressed blocks the caller
still holds whole (a repeated put deduplicates what the first stored); none hands a stream it cannot give again
to the daemon. The daemon checks the model before it stores or changes anything, so a call refused
UnknownModel did nothing, except a chain put in parts whose later part was refused after a restart (the
earlier parts were lost with the restart, and the repeat stores them again).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from engram.errors import UnknownModel
from engram.logbudget import LogBudget

log = logging.getLogger("engram.client")

P = ParamSpec("P")
T = TypeVar("T")

# Set while a decorated call runs (per task: asyncio copies it into the tasks the call starts), so that the calls
# it makes leave registering again to it.
_inside: ContextVar[bool] = ContextVar("engram_model_call", default=False)


class RegistersAgain(Protocol):
    async def register_again(self, fingerprint: bytes, cause: UnknownModel) -> bool:
        """Register the model again if this client registered it (True), else False."""
        ...


C = TypeVar("C", bound=RegistersAgain)


def registering_again(method: Callable[Concatenate[C, bytes, P], Coroutine[Any, Any, T]]
                      ) -> Callable[Concatenate[C, bytes, P], Coroutine[Any, Any, T]]:
    """`method(self, fingerprint, ...)` made once more, whole, after registering the model again, when the daemon
    answers it UnknownModel and this client registered that model."""

    @functools.wraps(method)
    async def call(self: C, fingerprint: bytes, *args: P.args, **kwargs: P.kwargs) -> T:
        if _inside.get():
            return await method(self, fingerprint, *args, **kwargs)
        token = _inside.set(True)
        try:
            try:
                return await method(self, fingerprint, *args, **kwargs)
            except UnknownModel as exc:
                if not await self.register_again(fingerprint, exc):
                    raise
            return await method(self, fingerprint, *args, **kwargs)
        finally:
            _inside.reset(token)

    return call


_said = LogBudget()  # a daemon forgetting a model every few moments would otherwise fill the worker's log


def say_registering_again(name: str, cause: Any) -> None:
    if (held := _said.take()) is not None:
        log.warning("Engram does not know model %s (%s): registering it again (the daemon restarted, dropped the "
                    "registration or forgot the model?)%s", name, cause, f"; {held} such lines held back" if held else "")

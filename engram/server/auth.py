"""Who may name which namespace: the one place the service asks before it touches a namespace's data.

Every RPC handler is wrapped by `guard`, which authenticates the call (engram/tenancy.py) and records its
principal for the call's task; every RPC that carries a namespace passes it through `namespace_for` and
uses what comes back, so tenant isolation is enforced here and nowhere else. With tenancy off (the
default), the daemon trusts its callers (it listens on loopback or a unix socket) and every namespace is
open to every caller.

Codes: no token or an unknown token is UNAUTHENTICATED; naming a namespace the token does not grant is
PERMISSION_DENIED, with the same message whether or not that namespace holds anything (so it reveals
nothing). Blocks and sessions are named inside a namespace: another namespace's key or session id is
NOT_FOUND, exactly like one that does not exist, so probing by key or id learns nothing.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from engram.errors import EngramError, PermissionDenied
from engram.limits import check_namespace
from engram.server.errors import abort_with, forget_abort
from engram.tenancy import OPEN, Principal, Tenancy

# Set by `guard` in each RPC's own task (grpc.aio runs every RPC in a task of its own), read below.
_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("engram_principal", default=None)


def _current() -> Principal:
    p = _principal.get()
    if p is None:  # fail closed: a handler that was not wrapped by `guard` gets nothing
        raise PermissionDenied("this call was not authenticated")
    return p


def namespace_for(context: Any, requested: str) -> str:
    """The namespace this call may act in: the one asked for (or, if none, the token's first)."""
    p = _current()
    check_namespace(requested)  # before the grant: a bound, not a secret, so it reveals nothing
    if p is OPEN:
        return requested
    ns = requested or (p.namespaces[0] if p.namespaces else "")
    if not p.may_use(ns):
        raise PermissionDenied(f"this token may not act in namespace {ns!r}; it may use "
                               f"{', '.join(p.namespaces) or 'no namespace'}")
    return ns


def caller(context: Any) -> Principal:
    """Who the call acts as (OPEN with tenancy off): for per-tenant shares of the daemon's resources."""
    return _current()


def tenant_of(context: Any) -> str:
    """The tenant whose shares the call counts against and whose models it sees: its token's name; "" for an
    admin, and with tenancy off (OPEN): they act on the whole daemon."""
    p = _current()
    return "" if p.admin else p.name


def session_owner(context: Any, owner: str) -> str:
    """The owner a session call names (SessionRef.owner): an admin's, as given ("": found by id alone,
    SessionManager.get); a tenant's calls reach its own sessions only, so it names none (or itself): another's is
    PERMISSION_DENIED whatever sessions exist, and tells nothing of them."""
    p = _current()
    if p.admin or owner in ("", p.name):
        return owner if p.admin else ""
    raise PermissionDenied("only an admin names a session's owner (SessionRef.owner); a tenant's calls reach its own "
                           "sessions: leave it empty")


def is_admin(context: Any) -> bool:
    """Whether the caller may act on the whole daemon (check, evict across namespaces, list them)."""
    return _current().admin


def told(exc: EngramError) -> str:
    """What the call's caller is told of a domain error (`EngramError.told`): as an admin (tenancy off, every caller
    is one), or as a tenant; a caller not authenticated (a refusal before it was) as a tenant."""
    p = _principal.get()
    return exc.told(p is not None and p.admin)


def is_peer(context: Any) -> bool:
    """Whether the caller is another daemon of the cluster (or an admin): it may fetch blocks by key."""
    p = _current()
    return p.peer or p.admin


def visible_namespaces(context: Any) -> list[str] | None:
    """The namespaces whose figures the caller may see in Stats: None for every one (an admin, or
    tenancy off), else the token's own."""
    p = _current()
    return None if p.admin else list(p.namespaces)


def guard(behavior: Callable[..., Any], tenancy: Tenancy | None) -> Callable[..., Any]:
    """Wrap an RPC behaviour (coroutine or async generator): authenticate, then run as that principal."""

    async def principal_of(context: Any) -> Principal:
        """The caller, its call counted against its share (`Tenancy.enter`): the caller must `leave`."""
        if tenancy is None:
            return OPEN
        try:
            p = tenancy.authenticate(context.invocation_metadata())
            tenancy.enter(p)
            return p
        except Exception as exc:
            await abort_with(context, exc, behavior.__name__)
            raise

    # A call aborted (refused here, or its request late: engram/server/arrival.py) ends here, its AbortError
    # cut from the frames (engram/server/errors.py says why): grpc raises it again once the wrapper returns.
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                p = await principal_of(context)
                _principal.set(p)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    if tenancy is not None:
                        tenancy.leave(p)
            except grpc.aio.AbortError as exc:
                forget_abort(exc)

        return stream

    async def unary(request: Any, context: Any) -> Any:
        try:
            p = await principal_of(context)
            _principal.set(p)
            try:
                return await behavior(request, context)
            finally:
                if tenancy is not None:
                    tenancy.leave(p)
        except grpc.aio.AbortError as exc:
            forget_abort(exc)
            return None

    return unary

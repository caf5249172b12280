"""Who may name which namespace: the one place the service asks before it touches a namespace's data.

Every RPC that carries a namespace passes it through `namespace_for` and uses what comes back, so tenant
isolation is enforced here and nowhere else. With no tenants configured (the default), the daemon trusts
its callers (it listens on loopback or a unix socket) and every namespace is open to every caller.
"""

from __future__ import annotations

from typing import Any


def namespace_for(context: Any, requested: str) -> str:
    """The namespace this call may act in. Tenancy off: the one the caller asked for."""
    return requested


def is_admin(context: Any) -> bool:
    """Whether the caller may act on the whole daemon (check, evict across namespaces, list them)."""
    return True

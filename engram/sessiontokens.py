"""The daemon memory live sessions' tokens hold: 4 bytes a token (an int32 array), up to
server.max_tokens_per_request a session, kept until the session is closed or idle past server.session_idle_s (a
day). Each namespace's quota counts them, but a tenant has no quota by default: one tenant's abandoned sessions
of 2M tokens held 8 MiB each, 4,096 of them a namespace (an audit, session 45: 32 GiB a namespace, with no bound
for the daemon). Here they have a daemon-wide bound (server.max_live_session_tokens) and each tenant a share of it
(server.max_live_session_tokens_per_tenant), as persisted windows do.

Tokens are counted by the array that owns their memory, not by session: a fork holds a view of its parent's
tokens (no copy), so the two are counted once, and the array stays counted, to the tenant whose call made it and
in its namespace's quota, while any session still holds it (a fork outliving its parent keeps it). A fork by
another tenant gets a copy: sharing would keep the first tenant's array counted against its share for as long as
the other's fork lives."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engram.errors import ResourceExhausted

if TYPE_CHECKING:
    from engram.store import BlockStore


@dataclass
class _Owned:
    """An array holding sessions' tokens, the sessions that hold it (or views of it), and whom it counts against."""

    array: np.ndarray
    namespace: str
    tenant: str  # "": no share (tenancy off, an admin)
    users: int = 1


def _owner(tokens: np.ndarray) -> object:
    """The object that owns the memory of `tokens` (numpy points a view of a view at the first array)."""
    return tokens if tokens.base is None else tokens.base


class SessionTokens:
    """The tokens live sessions hold, counted against the daemon's bound, each tenant's share and each namespace's
    quota (store.hold). 0: no bound."""

    def __init__(self, store: BlockStore, max_tokens: int = 0, max_tokens_per_tenant: int = 0) -> None:
        self.store = store
        self.max_tokens = max_tokens
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self._owned: dict[int, _Owned] = {}  # id of the owning array -> its record (which keeps the id taken)
        self.held = 0  # tokens of every live session, each array once
        self._of: collections.Counter[str] = collections.Counter()  # tenant -> the tokens of arrays it made

    def held_by(self, tenant: str) -> int:
        return self._of[tenant]

    def tenant_of(self, tokens: np.ndarray) -> str:
        """Whom a session's tokens count against."""
        return self._owned[id(_owner(tokens))].tenant

    def take(self, tokens: np.ndarray, namespace: str, tenant: str, what: str,
             replacing: np.ndarray | None = None) -> np.ndarray:
        """The array a session keeps as its tokens, counted: `tokens` itself, shared where it is (a view of) an
        array a session of the same namespace and tenant holds, else an array of its own. `replacing`, the
        session's tokens before (an append), is given back, and what it frees counts as room for the new array.
        ResourceExhausted, with nothing counted or given back, when they do not fit; `what` names them for the
        quota's refusal."""
        owned = self._owned.get(id(_owner(tokens)))
        if owned is not None and owned.namespace == namespace and owned.tenant == tenant:
            owned.users += 1  # no new memory
            self.give_back(replacing)
            return tokens
        if owned is not None or tokens.base is not None:  # another's tokens, or a view of memory no session
            tokens = tokens.copy()  # holds: an array of its own
        old = self._owned.get(id(_owner(replacing))) if replacing is not None else None
        freed = old if old is not None and old.users == 1 else None  # the session was the last to hold it
        self._check(tokens.size, tenant, freed)
        delta = tokens.nbytes - (freed.array.nbytes if freed is not None else 0)  # the session's namespace's
        if delta > 0:
            self.store.hold(namespace, delta, what)
        elif delta < 0:
            self.store.release_held(namespace, -delta)
        self._owned[id(tokens)] = _Owned(tokens, namespace, tenant)
        self._count(tenant, tokens.size)
        if replacing is not None:
            self._let_go(replacing, quota=freed is None)  # a freed array's bytes went back in `delta`
        return tokens

    def give_back(self, tokens: np.ndarray | None) -> None:
        """A session no longer holds `tokens` (closed, or its tokens replaced)."""
        if tokens is not None:
            self._let_go(tokens, quota=True)

    def _let_go(self, tokens: np.ndarray, *, quota: bool) -> None:
        key = id(_owner(tokens))
        owned = self._owned[key]
        owned.users -= 1
        if owned.users:
            return
        del self._owned[key]
        self._count(owned.tenant, -owned.array.size)
        if quota:
            self.store.release_held(owned.namespace, owned.array.nbytes)

    def _check(self, n: int, tenant: str, freed: _Owned | None) -> None:
        """Refuse an array of `n` tokens that does not fit `tenant`'s share or the daemon's bound, `freed` (an
        array the call lets go of) given back first. The share's refusal says what the caller's own sessions
        hold; the daemon's says nothing of what the others' do."""
        share = self.max_tokens_per_tenant
        if tenant and share:
            mine, back = self._of[tenant], freed.array.size if freed is not None and freed.tenant == tenant else 0
            if mine - back + n > share:
                instead = f" (in place of its {back})" if back else ""
                raise ResourceExhausted(
                    f"a session of {n} tokens{instead} does not fit your token's share of the tokens live sessions "
                    f"hold: its sessions hold {mine} of its {share} (server.max_live_session_tokens_per_tenant); close "
                    "sessions it no longer needs (a session idle past server.session_idle_s is closed by the daemon)")
        if self.max_tokens and self.held - (freed.array.size if freed is not None else 0) + n > self.max_tokens:
            raise ResourceExhausted(
                f"a session of {n} tokens does not fit the daemon's bound on the tokens live sessions hold "
                "(server.max_live_session_tokens); close sessions you no longer need, or retry later")

    def _count(self, tenant: str, delta: int) -> None:
        self.held += delta
        if tenant:
            n = self._of[tenant] + delta
            if n:
                self._of[tenant] = n
            else:
                del self._of[tenant]  # none left: the table holds only tenants whose sessions hold tokens

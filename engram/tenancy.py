"""Tenants: who a bearer token is, which namespaces it may act in, each namespace's key salt and quota.

Tenancy is off unless `[auth]` names tenants or admin tokens; then every call must carry
`authorization: Bearer <token>` (engram/server/auth.py checks it). Each namespace's key salt is an HMAC of
the daemon's `auth.salt_secret` and the namespace, so keys are the same on every daemon sharing the secret
(prefixes match across a cluster and across restarts) but cannot be computed by anyone without the salt:
a tenant learns only its own namespaces' salts (DescribeNamespace). Tokens may be written in the config, in
`auth.tenants_file`, or as `env:VAR` / `file:PATH` references, so secrets need not sit in the config file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from engram.config import AuthConfig, ConfigError, _apply_tree, check_tenant
from engram.errors import ResourceExhausted, Unauthenticated
from engram.tomlfile import read_toml

SALT_BYTES = 16


class NamespacePolicy(Protocol):
    """What the store asks about a namespace: the salt inside its keys and its quota (0: none)."""

    def salt(self, namespace: str) -> bytes: ...

    def quota(self, namespace: str) -> int: ...

    # The live sessions `tenant` may hold in the namespace ("": admins, tenancy off); 0: the daemon's default
    def max_sessions(self, namespace: str, tenant: str = "") -> int: ...

    def counted(self, namespace: str) -> bool: ...  # its activity is counted apart (a tenant's Stats reads it)

    def shared(self, namespace: str) -> bool: ...  # more than one tenant may act in it


class OpenNamespaces:
    """Tenancy off: no salt (keys as before tenancy existed), no quota."""

    def salt(self, namespace: str) -> bytes:
        return b""

    def quota(self, namespace: str) -> int:
        return 0

    def max_sessions(self, namespace: str, tenant: str = "") -> int:
        return 0

    def counted(self, namespace: str) -> bool:
        return False  # no tenant's Stats to scope: counting every namespace ever used apart only grows

    def shared(self, namespace: str) -> bool:
        return False


@dataclass(frozen=True)
class Principal:
    """Who a call acts as. Admins act on the whole daemon; peers (other daemons) only fetch blocks."""

    name: str
    namespaces: tuple[str, ...] = ()  # the first is the default when a call names none
    admin: bool = False
    peer: bool = False

    def may_use(self, namespace: str) -> bool:
        return self.admin or namespace in self.namespaces


OPEN = Principal("open", admin=True, peer=True)  # tenancy off: every caller may do everything


MAX_SECRET_BYTES = 64 * 1024  # a token or salt is tens of bytes; a file:PATH secret is read this far at most


def resolve_secret(value: str, where: str) -> str:
    """A literal secret, or env:VAR, or file:PATH (its content, whitespace stripped)."""
    if value.startswith("env:"):
        var = value[4:]
        if var not in os.environ:
            raise ConfigError(f"{where}: environment variable {var} is not set")
        return os.environ[var]
    if value.startswith("file:"):
        try:
            with open(value[5:], "rb") as fh:
                data = fh.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {value[5:]}: {exc}") from None
        # Bounded and decoded here: file:/dev/zero was read until MemoryError, a binary file raised
        # UnicodeDecodeError (tracebacks, exit 1; found in session 49)
        if len(data) > MAX_SECRET_BYTES:
            raise ConfigError(f"{where}: {value[5:]} holds more than {MAX_SECRET_BYTES // 1024} KiB, read no "
                              "further: no secret is that long; give a file holding the secret alone")
        try:
            return data.decode().strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: {value[5:]} is not UTF-8 text; give a file holding the secret alone") \
                from None
    return value


TENANTS_FILE_KEYS = ("tenants", "admin_tokens")  # what auth.tenants_file may hold; the rest of [auth] is the config's


def _apply_tenants_file(auth: AuthConfig, path: str) -> list[str]:
    """Merge auth.tenants_file into `auth`; the names of the tenants it gives a table. Unknown keys are errors
    naming the file, as they are in the config: a typo (quota_byts) or a key of [auth] the file cannot set
    (salt_secret) was read as nothing, and the daemon started without it."""
    where = f"auth.tenants_file {path}"
    tree = read_toml(path, where)
    for key in tree:
        if key not in TENANTS_FILE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}: a tenants file holds [tenants.NAME] tables and "
                              "admin_tokens; the other keys of [auth] belong in the config")
    try:
        _apply_tree(auth, tree)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return list(tree.get("tenants", {}))  # a table of tables: _apply_tree refused anything else


def _token_digest(token: str) -> bytes:
    # Tokens are looked up by digest, so the table never holds (or compares) the secrets themselves.
    return hashlib.sha256(token.encode()).digest()


@dataclass
class Tenancy:
    secret: bytes
    principals: dict[bytes, Principal] = field(default_factory=dict)  # token digest -> principal
    quotas: dict[str, int] = field(default_factory=dict)  # namespace -> bytes
    session_limits: dict[str, int] = field(default_factory=dict)  # namespace -> the admins' live sessions
    tenant_session_limits: dict[str, int] = field(default_factory=dict)  # tenant -> its live sessions a namespace
    max_calls: int = 0  # calls one tenant may have in flight (server.max_concurrent_rpcs_per_tenant); 0: no bound
    # In a cluster: the node id a peer's call proves (ClusterTrust.peer_node), "" for none
    peer_node: Callable[[object], str] | None = None
    _salts: dict[str, bytes] = field(default_factory=dict)
    _tenant_namespaces: set[str] = field(default_factory=set)  # every namespace some tenant is given
    _shared: set[str] = field(default_factory=set)  # those given to more than one tenant
    _calls: dict[str, dict[str, int]] = field(default_factory=dict)  # "rpc" / "data" -> tenant -> in flight

    @classmethod
    def from_config(cls, auth: AuthConfig, peer_token: str = "") -> Tenancy | None:
        if not auth.enabled:
            return None
        # Copies: a table the file gives a tenant of the config's is merged over it, not into the config itself
        merged = AuthConfig(tenants={name: replace(tc) for name, tc in auth.tenants.items()},
                            admin_tokens=auth.admin_tokens)
        if auth.tenants_file:
            for name in _apply_tenants_file(merged, auth.tenants_file):  # the config's own were checked as it loaded
                check_tenant(name, merged.tenants[name], f"auth.tenants_file {auth.tenants_file}: tenants.{name}")
        t = cls(resolve_secret(auth.salt_secret, "auth.salt_secret").encode())
        for name, tc in merged.tenants.items():
            # Each once, in the order given: one named twice was listed twice in the tenant's Stats, and its
            # blocks, bytes and pinned bytes (against its pin share) counted twice
            spaces = tuple(dict.fromkeys(n.strip() for n in tc.namespaces.split(",") if n.strip())) or (name,)
            t._add(resolve_secret(tc.token, f"auth.tenants.{name}.token"), Principal(name, spaces))
            t._shared.update(t._tenant_namespaces.intersection(spaces))
            t._tenant_namespaces.update(spaces)
            if tc.max_sessions:
                t.tenant_session_limits[name] = tc.max_sessions
            for ns in spaces:
                if tc.quota:  # a namespace shared by tenants gets the smallest of their quotas
                    t.quotas[ns] = min(t.quotas.get(ns, tc.quota), tc.quota)
                if tc.max_sessions:  # and the smallest of their session limits (the admins' there)
                    t.session_limits[ns] = min(t.session_limits.get(ns, tc.max_sessions), tc.max_sessions)
        for i, tok in enumerate(filter(None, (x.strip() for x in merged.admin_tokens.split(",")))):
            t._add(resolve_secret(tok, "auth.admin_tokens"), Principal(f"admin-{i}", admin=True))
        if peer_token:
            t._add(resolve_secret(peer_token, "cluster.peer_token"), Principal("peer", peer=True))
        return t

    def _add(self, token: str, principal: Principal) -> None:
        if not token:
            raise ConfigError(f"{principal.name}: its token is empty")
        digest = _token_digest(token)
        if digest in self.principals:
            raise ConfigError(f"{principal.name} and {self.principals[digest].name} have the same token; give "
                              "every tenant its own")
        self.principals[digest] = principal

    def check_apart(self, token: str, where: str) -> None:
        """A secret of the operator's (`where`: server.metrics_token, whose /metrics shows every tenant's figures) must
        be no tenant's or peer's token: a tenant scraped them with the token it calls with. An admin's may be it."""
        p = self.principals.get(_token_digest(token))
        if p is not None and not p.admin:
            who = "a cluster peer" if p.peer else f"tenant {p.name}"
            raise ConfigError(f"{where} is the token of {who}, which would read every tenant's figures with it; give "
                              f"{where} a secret of its own (or an admin token)")

    def enter(self, p: Principal, what: str = "rpc") -> None:
        """A call of `p` starts ("rpc"), or a data-channel connection of it opens ("data": a share of its own, the
        same size); RESOURCE_EXHAUSTED past its share of the daemon's (admins have none: they act on the whole
        daemon). Each enter is paired with a `leave`."""
        counts = self._calls.setdefault(what, {})
        n = counts.get(p.name, 0)
        if self.max_calls and not p.admin and n >= self.max_calls:
            held = "calls in flight" if what == "rpc" else "data-channel connections open"
            raise ResourceExhausted(f"this token has {n} {held}, its limit (server.max_concurrent_rpcs_per_tenant); "
                                    "end idle streams or wait for answers")
        counts[p.name] = n + 1

    def leave(self, p: Principal, what: str = "rpc") -> None:
        counts = self._calls[what]
        n = counts[p.name] - 1
        if n:
            counts[p.name] = n
        else:
            del counts[p.name]

    def authenticate(self, metadata: object) -> Principal:
        """The principal of a call's `authorization: Bearer <token>` metadata."""
        token = None
        for key, value in metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                scheme, _, rest = str(value).partition(" ")
                if scheme.lower() == "bearer" and rest.strip():
                    token = rest.strip()
        if token is None:
            raise Unauthenticated("this daemon requires a token: send metadata 'authorization: Bearer <token>' "
                                  "(EngramClient(token=...))")
        principal = self.principals.get(_token_digest(token))
        if principal is None:
            raise Unauthenticated("unknown token: use one the daemon's [auth] config lists")
        if principal.peer and self.peer_node is not None and (node := self.peer_node(metadata)):
            # Each daemon its own share of calls: under the one "peer" principal, one peer's calls starved the rest.
            return Principal(f"peer:{node}", peer=True)
        return principal

    def salt(self, namespace: str) -> bytes:
        salt = self._salts.get(namespace)
        if salt is None:
            msg = b"engram/namespace-salt/v1\0" + namespace.encode()
            salt = self._salts[namespace] = hmac.new(self.secret, msg, hashlib.sha256).digest()[:SALT_BYTES]
        return salt

    def quota(self, namespace: str) -> int:
        return self.quotas.get(namespace, 0)

    def max_sessions(self, namespace: str, tenant: str = "") -> int:
        """A tenant's own (`auth.tenants.NAME.max_sessions`), in each of its namespaces: in a namespace tenants
        share, each tenant's sessions count against its own limit alone (one tenant filling a shared limit refused
        every other's sessions there, and its refusal told how many sessions they held). The admins' (""): the
        smallest of the namespace's tenants' limits."""
        if tenant:
            return self.tenant_session_limits.get(tenant, 0)
        return self.session_limits.get(namespace, 0)

    def tenants(self) -> list[Principal]:
        """Every tenant (not the admins, not the peers)."""
        return [p for p in self.principals.values() if not (p.admin or p.peer)]

    def grants(self) -> list[bytes]:
        """What decides who may act where on this daemon, for the daemons of a cluster to compare (ClusterTrust.
        grants_digest, keyed again with the cluster secret): each tenant's token (its digest) with its name and
        namespaces, each admin token's digest, and an HMAC of auth.salt_secret; no token or secret in clear. The
        peer token is left out (cluster config: peers with another one cannot call each other at all)."""
        parts = [b"salt\0" + hmac.new(self.secret, b"engram/grants/salt-secret", hashlib.sha256).digest()]
        for digest, p in self.principals.items():
            if p.admin:
                parts.append(b"admin\0" + digest)
            elif not p.peer:
                spaces = ",".join(sorted(set(p.namespaces)))
                parts.append(b"tenant\0" + digest + b"\0" + p.name.encode() + b"\0" + spaces.encode())
        return sorted(parts)

    def counted(self, namespace: str) -> bool:
        """Only a tenant's namespaces: the config bounds them, where an admin may name any number."""
        return namespace in self._tenant_namespaces

    def shared(self, namespace: str) -> bool:
        """Whether several tenants may act in the namespace: a figure that moves with any tenant's reads there
        (a block's hits and leases) would tell each what the others do."""
        return namespace in self._shared

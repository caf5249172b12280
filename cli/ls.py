"""`engram ls`: namespaces (block, byte, session counts) and sessions (length, cached prefix, tiers, age,
replay mode, hot or cold). Without --namespace it lists every namespace, which needs an admin caller."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from rich.console import Group
from rich.table import Table

from engram import errors
from engram.api import NamespaceSummary, SessionSummary
from engram.control import ControlClient

from .common import call, console, nothing_in, target
from .format import age, dumps, to_dict
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .stats import human_bytes


@dataclass(frozen=True)
class Listing:
    namespaces: tuple[NamespaceSummary, ...] | None  # None when one namespace was asked for
    sessions: tuple[SessionSummary, ...]


async def fetch(client: ControlClient, namespace: str | None) -> Listing:
    """With -n, NotFound (exit 3, as `stats -n`) when the namespace holds no session and no block either: an empty
    table said nothing of a typo. A namespace of blocks alone lists no sessions."""
    if namespace is not None:
        sessions = await client.list_sessions(namespace=namespace)
        if not sessions and namespace not in {n.namespace for n in (await client.stats()).namespaces}:
            raise nothing_in(namespace)
        return Listing(None, sessions)
    try:
        namespaces = await client.list_namespaces()
    except errors.PermissionDenied as exc:
        raise await _name_your_own(client, exc) from None
    return Listing(namespaces, await client.list_sessions(all_namespaces=True))


async def _name_your_own(client: ControlClient, refused: errors.PermissionDenied) -> errors.PermissionDenied:
    """A tenant's `ls` without -n (every tenant's namespaces: an admin's call), told that -n lists its own and
    which those are: the daemon's refusal alone said only to call it with an admin token (an audit, session 48)."""
    try:
        mine = [n.namespace for n in (await client.stats()).namespaces]
    except errors.EngramError:
        mine = []
    which = " or ".join(f"-n {ns}" for ns in mine[:5]) + (" ..." if len(mine) > 5 else "") or "-n NAMESPACE"
    return errors.PermissionDenied(f"{refused}; without -n, `engram ls` lists every tenant's namespaces: a tenant "
                                   f"lists its own with {which}")


def sessions_table(sessions: tuple[SessionSummary, ...], title: str = "sessions") -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("namespace", "session", "model", "tokens", "cached", "blocks", "tiers", "age", "mode", "state"):
        table.add_column(col, justify="right" if col in ("tokens", "cached", "blocks", "age") else "left")
    for s in sessions:
        i = s.info
        table.add_row(i.namespace, i.session_id, i.model_fingerprint.hex()[:12], str(i.tokens), str(s.cached_tokens),
                      str(s.blocks), ",".join(s.tiers) or "-", age(s.age_s), i.mode.value, i.state)
    return table


def renderable(listing: Listing) -> Group:
    parts = []
    if listing.namespaces is not None:
        ns = Table(title="namespaces", title_justify="left")
        for col in ("namespace", "blocks", "tokens", "stored", "pinned", "sessions"):
            ns.add_column(col, justify="left" if col == "namespace" else "right")
        for n in listing.namespaces:
            ns.add_row(n.namespace, str(n.blocks), str(n.tokens), human_bytes(n.stored_bytes), str(n.pinned_blocks),
                       str(n.sessions))
        parts.append(ns)
    parts.append(sessions_table(listing.sessions))
    return Group(*parts)


def as_json(listing: Listing) -> str:
    data = {"sessions": to_dict(listing.sessions)}
    if listing.namespaces is not None:
        data["namespaces"] = to_dict(listing.namespaces)
    return dumps(data)


def ls(config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
       json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None) -> None:
    """Namespaces and sessions of a running daemon."""
    listing = call(target(config, address, token, tls_ca), lambda c: fetch(c, namespace))
    if json_:
        typer.echo(as_json(listing))
    else:
        console.print(renderable(listing))

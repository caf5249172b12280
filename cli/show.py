"""`engram show SESSION|BLOCK`: a session's block chain, or one block by hex key or unique hex prefix:
its tokens, the tiers holding it, codec, checksum, pins and what references it."""

from __future__ import annotations

import string
from typing import Annotated

import typer
from rich.console import Group
from rich.table import Table

from engram import errors
from engram.api import BlockDescription, BlockDetail, SessionSummary
from engram.control import ControlClient

from .common import EXIT_BAD_INPUT, call, console, fail, target
from .format import age, dumps, to_dict
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .stats import human_bytes

KEY_DIGITS = 16  # of 32: a unique prefix that every command accepts; --json prints whole keys


async def my_namespaces(client: ControlClient) -> list[str]:
    """A tenant's namespaces that hold blocks or sessions (its Stats lists exactly those)."""
    return [n.namespace for n in (await client.stats()).namespaces]


async def visible_sessions(client: ControlClient) -> tuple[SessionSummary, ...]:
    """Every session the caller may see: all namespaces for an admin (or with tenancy off), every namespace of
    its token for a tenant."""
    try:
        return await client.list_sessions(all_namespaces=True)
    except errors.PermissionDenied:
        found: list[SessionSummary] = []
        for ns in await my_namespaces(client):
            found += await client.list_sessions(namespace=ns)
        return tuple(found)


async def describe_keys(client: ControlClient, prefixes: list[str], namespace: str | None) -> BlockDescription:
    """Blocks by hex key (prefix): in the namespace named, else in every namespace the caller may see (all of
    them for an admin; for a tenant, each of its token's; a prefix found in two is ambiguous)."""
    if namespace is not None:
        return await client.describe_blocks(key_prefixes=prefixes, namespace=namespace)
    try:
        return await client.describe_blocks(key_prefixes=prefixes, all_namespaces=True)
    except errors.PermissionDenied:
        pass
    mine = await my_namespaces(client)
    blocks = []
    for p in prefixes:
        hits: list[BlockDetail] = []
        for ns in mine:
            try:
                hits += (await client.describe_blocks(key_prefixes=[p], namespace=ns)).blocks
            except errors.NotFound:
                continue
        if not hits:
            raise errors.NotFound(f"no stored block has a key starting with {p} in any namespace you may see")
        if len(hits) > 1:
            raise errors.InvalidArgument(f"key prefix {p} matches blocks in namespaces "
                                         f"{', '.join(sorted(b.namespace for b in hits))}; name one with --namespace")
        blocks += hits
    return BlockDescription(tuple(blocks))


async def session_namespace(client: ControlClient, session_id: str, namespace: str | None) -> str | None:
    """The namespace holding `session_id`: the one named, else the only one that has such a session (None when
    none has; InvalidArgument when several have, since -n must choose)."""
    if namespace is not None:
        return namespace
    found = sorted({s.info.namespace for s in await visible_sessions(client) if s.info.session_id == session_id})
    if len(found) > 1:
        raise errors.InvalidArgument(f"session {session_id!r} exists in namespaces {', '.join(found)}; "
                                     "name one with --namespace")
    return found[0] if found else None


async def describe(client: ControlClient, name: str, namespace: str | None) -> BlockDescription:
    """A session of that id first (in the namespace named, else in the one namespace that has it); else a block
    key (prefix), searched in every namespace the caller may see unless one is named."""
    ns = await session_namespace(client, name, namespace)
    if ns is not None:
        try:
            return await client.describe_blocks(session_id=name, namespace=ns)
        except errors.NotFound:
            if namespace is None:
                raise
    if not name or any(c not in string.hexdigits for c in name):
        where = f"in namespace {namespace!r}" if namespace is not None else "in any namespace you may see"
        raise errors.NotFound(f"no session {name!r} {where}, and it is not a hex block key; `engram ls` lists "
                              "sessions") from None
    try:
        return await describe_keys(client, [name], namespace)
    except errors.NotFound:
        raise errors.NotFound(f"no session and no block named {name!r}"
                              + (f" in namespace {namespace!r}" if namespace else "")
                              + "; `engram ls` lists sessions") from None


def blocks_table(resp: BlockDescription) -> Table:
    table = Table(title="blocks", title_justify="left")
    for col in ("#", "key", "tokens", "from", "tiers", "codec", "bytes", "checksum", "refs", "pins", "children",
                "sessions", "hits", "age"):
        table.add_column(col, justify="left" if col in ("key", "tiers", "codec", "checksum") else "right")
    for n, b in enumerate(resp.blocks):
        table.add_row(str(n), b.key.hex()[:KEY_DIGITS], str(b.num_tokens) + ("" if b.full else " (partial)"), str(b.start_token),
                      ",".join(b.tiers), b.codec, human_bytes(b.nbytes), f"{b.checksum:016x}", str(b.refcount),
                      str(b.pins), str(b.children), str(b.sessions), str(b.hits), age(b.age_s))
    return table


def renderable(resp: BlockDescription) -> Group:
    if resp.session is None:
        b = resp.blocks[0]
        head = (f"block {b.key.hex()} in namespace {b.namespace!r}, model {b.model_fingerprint.hex()[:12]}, "
                f"parent {b.parent.hex()}")
        return Group(head, blocks_table(resp))
    s = resp.session
    i = s.info
    head = (f"session {i.session_id} in namespace {i.namespace!r}: {i.tokens} tokens, {s.cached_tokens} cached in "
            f"{s.blocks} blocks ({human_bytes(s.stored_bytes)}), tiers {','.join(s.tiers) or '-'}, mode "
            f"{i.mode.value}, {i.state}, age {age(s.age_s)}" + (f", forked from {i.parent}" if i.parent else "")
            + (f", its client said back in {i.expect_back_ms / 1000:g} s" if i.expect_back_ms else ""))
    return Group(head, blocks_table(resp))


def show(name: Annotated[str, typer.Argument(metavar="SESSION|BLOCK",
                                             help="A session id, or a block key / unique key prefix (hex).")],
         config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
         json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None) -> None:
    """A session's block chain, or one block: where it lives, codec, checksum, refcount."""
    if not name.strip():  # names nothing: bad input, not an unknown session (exit 3)
        raise fail("name a session id or a block key (prefix); got an empty name", EXIT_BAD_INPUT)
    resp = call(target(config, address, token, tls_ca), lambda c: describe(c, name, namespace))
    if json_:
        typer.echo(dumps(to_dict(resp)))
    else:
        console.print(renderable(resp))

"""`engram show SESSION|BLOCK`: a session's block chain, or one block by hex key or unique hex prefix:
its tokens, the tiers holding it, codec, checksum, pins and what references it."""

from __future__ import annotations

import string
from typing import Annotated

import typer
from rich.console import Group
from rich.table import Table

from engram import errors
from engram.api import BlockDescription
from engram.client import EngramClient

from .common import address_of, call, console, load
from .format import age, dumps, to_dict
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt
from .stats import human_bytes

KEY_DIGITS = 16  # of 32: a unique prefix that every command accepts; --json prints whole keys
DEFAULT_NAMESPACE = "default"  # the client library's default, where sessions live unless named


async def describe(client: EngramClient, target: str, namespace: str | None) -> BlockDescription:
    """A session of that id first; else a block key (prefix), searched in every namespace unless one is named."""
    try:
        return await client.describe_blocks(session_id=target, namespace=namespace or DEFAULT_NAMESPACE)
    except errors.NotFound:
        if not target or any(c not in string.hexdigits for c in target):
            raise errors.NotFound(f"no session {target!r} in namespace {namespace or DEFAULT_NAMESPACE!r}, and it is "
                                  "not a hex block key; `engram ls` lists sessions") from None
    try:
        return await client.describe_blocks(key_prefixes=[target], namespace=namespace or "",
                                            all_namespaces=namespace is None)
    except errors.NotFound:
        raise errors.NotFound(f"no session and no block named {target!r}"
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
            f"{i.mode.value}, {i.state}, age {age(s.age_s)}" + (f", forked from {i.parent}" if i.parent else ""))
    return Group(head, blocks_table(resp))


def show(target: Annotated[str, typer.Argument(help="A session id, or a block key / unique key prefix (hex).")],
         config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
         json_: JsonOpt = False) -> None:
    """A session's block chain, or one block: where it lives, codec, checksum, refcount."""
    resp = call(address_of(load(config), address), lambda c: describe(c, target, namespace))
    if json_:
        typer.echo(dumps(to_dict(resp)))
    else:
        console.print(renderable(resp))

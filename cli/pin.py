"""`engram pin` / `engram unpin`: blocks by key (or unique key prefix), or a session's whole chain.
Pins count: a block pinned twice needs two unpins. A pinned block is never evicted."""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated, NamedTuple

import typer

from engram import errors
from engram.control import ControlClient

from .common import EXIT_BAD_INPUT, PartlyDone, Target, call, console, fail, namespaces, partly_done, target
from .format import dumps
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .show import describe_keys, session_namespace

KeysArg = Annotated[list[str] | None, typer.Argument(help="Block keys or unique hex key prefixes.")]
SessionOpt = Annotated[str | None, typer.Option("--session", "-s", help="Every block of this session's chain.")]


async def _pin(client: ControlClient, keys: list[str], session: str | None, namespace: str | None, unpin: bool
               ) -> tuple[int, list[bytes]]:
    if session is not None:
        ns = await session_namespace(client, session, namespace)
        if ns is None:
            raise errors.NotFound(f"no session {session!r} in any namespace you may see; `engram ls` lists sessions")
        resp = await client.describe_blocks(session_id=session, namespace=ns)
    else:
        resp = await describe_keys(client, keys, namespace)
    groups: dict[tuple[str, bytes], list[bytes]] = defaultdict(list)
    for b in resp.blocks:
        groups[(b.namespace, b.model_fingerprint)].append(b.key)
    return await _each_group(client, groups, unpin), [b.key for b in resp.blocks]


class Done(NamedTuple):
    """One Pin call that went through: its namespace, model, keys and how many blocks it changed."""

    namespace: str
    fingerprint: bytes
    keys: list[bytes]
    changed: int


async def _each_group(client: ControlClient, groups: dict[tuple[str, bytes], list[bytes]], unpin: bool) -> int:
    """One Pin call per namespace and model (a call names one of each). When a later one is refused (a pin past
    the tenant's share, counted per call) the pins the earlier ones added are lifted again, one unpin per pin
    (pins count), so a refused `engram pin` changes nothing. An unpin is not put back (pinning again could pass
    the share), nor a pin whose lifting failed: PartlyDone, saying what stays changed."""
    done: list[Done] = []
    for (ns, fp), group in groups.items():
        try:
            changed = await client.pin(fp, group, unpin=unpin, namespace=ns)
        except errors.EngramError as exc:
            if not any(d.changed for d in done):
                raise
            if unpin:
                raise _partly(exc, done) from None
            await _lift(client, done, exc)
            raise
        done.append(Done(ns, fp, group, changed))
    return sum(d.changed for d in done)


async def _lift(client: ControlClient, done: list[Done], cause: errors.EngramError) -> None:
    for i, d in enumerate(done):
        try:
            await client.pin(d.fingerprint, d.keys, unpin=True, namespace=d.namespace)
        except errors.EngramError:
            raise _partly(cause, done[i:]) from None


def _partly(cause: errors.EngramError, done: list[Done]) -> PartlyDone:
    return PartlyDone(cause, sum(d.changed for d in done), list(dict.fromkeys(d.namespace for d in done if d.changed)))


def _run(keys: list[str] | None, session: str | None, where: Target, namespace: str | None, json_: bool,
         unpin: bool) -> None:
    if bool(keys) == (session is not None):
        raise fail("name block keys or --session ID (one of them)", EXIT_BAD_INPUT)
    verb = "unpinned" if unpin else "pinned"
    try:
        changed, named = call(where, lambda c: _pin(c, keys or [], session, namespace, unpin))
    except PartlyDone as partly:
        raise partly_done(where, partly, f"{partly.done} blocks stay {verb} in {namespaces(partly.namespaces)} "
                          "by the calls before it") from None
    if json_:
        typer.echo(dumps({"changed": changed, "keys": [k.hex() for k in named]}))
    else:
        console.print(f"{verb} {changed} of {len(named)} blocks" +
                      (" (the others were not pinned)" if unpin and changed < len(named) else ""))


def pin(keys: KeysArg = None, session: SessionOpt = None, config: ConfigOpt = None, address: AddressOpt = None,
        namespace: NamespaceOpt = None, json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None
        ) -> None:
    """Pin blocks so that they are never evicted."""
    _run(keys, session, target(config, address, token, tls_ca), namespace, json_, unpin=False)


def unpin(keys: KeysArg = None, session: SessionOpt = None, config: ConfigOpt = None, address: AddressOpt = None,
          namespace: NamespaceOpt = None, json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None
        ) -> None:
    """Remove one pin from each block."""
    _run(keys, session, target(config, address, token, tls_ca), namespace, json_, unpin=True)

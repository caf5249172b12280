"""`engram evict`: remove blocks by key (or unique key prefix), by session, or a whole namespace.

Prefix closure: a block's descendants (blocks that extend it) are evicted with it, so nothing stored is
left unreachable. Pinned blocks refuse the request unless --force; blocks being read right now are
skipped and reported. Evicting a session removes only the blocks no other session uses; the session
itself stays (its next Resume needs its blocks put again)."""

from __future__ import annotations

from typing import Annotated

import typer

from engram import errors
from engram.api import BlockDetail, EvictResult
from engram.control import ControlClient

from .common import (
    EXIT_BAD_INPUT,
    STORE_WIDE,
    PartlyDone,
    call,
    console,
    fail,
    namespaces,
    partly_done,
    target,
)
from .format import dumps, to_dict
from .options import AddressOpt, ConfigOpt, JsonOpt, NamespaceOpt, TlsCaOpt, TokenOpt
from .show import describe_keys, session_namespace


async def evict_keys(client: ControlClient, keys: list[str], namespace: str | None, force: bool) -> EvictResult:
    """By key (prefix): in the namespace named, else in every namespace the caller may see (an admin's in one
    call; a tenant's, each found block in its own namespace, one call per namespace: see `_refusals_first`).
    PartlyDone when a call after the first is refused: what the earlier ones evicted stays evicted."""
    try:
        return await client.evict(key_prefixes=keys, force=force, namespace=namespace or "",
                                  all_namespaces=namespace is None)
    except errors.PermissionDenied:
        if namespace is not None:
            raise
    by_ns: dict[str, list[BlockDetail]] = {}
    for b in (await describe_keys(client, keys, None)).blocks:
        by_ns.setdefault(b.namespace, []).append(b)
    done, acted = EvictResult((), (), 0), list[str]()
    for ns in _refusals_first(by_ns, force):
        try:
            got = await client.evict(key_prefixes=[b.key.hex() for b in by_ns[ns]], force=force, namespace=ns)
        except errors.EngramError as exc:
            if not done.evicted:
                raise
            raise PartlyDone(exc, done, acted) from None
        done = EvictResult(done.evicted + got.evicted, done.skipped + got.skipped, done.unpinned + got.unpinned,
                           done.operator_pinned + got.operator_pinned, done.in_use + got.in_use)
        acted += [ns] if got.evicted else []
    return done


def _refusals_first(by_ns: dict[str, list[BlockDetail]], force: bool) -> list[str]:
    """The namespaces in the order their calls go: one call cannot evict in two (all_namespaces is an admin's),
    and the daemon has no dry run, so a refusal (a pinned block in the closure, without --force) after the first
    call would leave the earlier calls done. First the namespaces whose call is refused for sure (a named block is
    pinned), then those where it may be (a named block has descendants, which the caller cannot list), last
    those where it cannot be (unpinned leaves alone): only two namespaces of the second kind can half-apply."""
    def risk(ns: str) -> int:
        if force:
            return 0
        if any(b.pins for b in by_ns[ns]):
            return 0
        return 1 if any(b.children for b in by_ns[ns]) else 2

    return sorted(by_ns, key=risk)


async def evict_session(client: ControlClient, session: str, namespace: str | None, force: bool) -> EvictResult:
    ns = await session_namespace(client, session, namespace)
    if ns is None:
        raise errors.NotFound(f"no session {session!r} in any namespace you may see; `engram ls` lists sessions")
    return await client.evict(session_id=session, force=force, namespace=ns)


def evict(keys: Annotated[list[str] | None, typer.Argument(help="Block keys or unique hex key prefixes.")] = None,
          session: Annotated[str | None, typer.Option("--session", "-s", help="Evict the blocks only this session uses.")] = None,
          whole_namespace: Annotated[bool, typer.Option("--whole-namespace", help="Evict every block of --namespace.")] = False,
          force: Annotated[bool, typer.Option("--force", help="Evict pinned blocks too.")] = False,
          config: ConfigOpt = None, address: AddressOpt = None, namespace: NamespaceOpt = None,
          json_: JsonOpt = False, token: TokenOpt = None, tls_ca: TlsCaOpt = None) -> None:
    """Evict blocks (and their descendants) by key, by session, or a whole namespace."""
    if sum((bool(keys), session is not None, whole_namespace)) != 1:
        raise fail("name what to evict: block keys, --session ID, or --whole-namespace --namespace NS (one of them)",
                   EXIT_BAD_INPUT)
    if whole_namespace and namespace is None:
        raise fail("--whole-namespace needs --namespace NS", EXIT_BAD_INPUT)
    addr = target(config, address, token, tls_ca)
    if keys:
        try:
            resp = call(addr, lambda c: evict_keys(c, keys, namespace, force), timeout_s=STORE_WIDE)
        except PartlyDone as partly:
            assert isinstance(partly.done, EvictResult)
            _print(partly.done, json_)
            raise partly_done(addr, partly, f"the {len(partly.done.evicted)} blocks listed were evicted before it, "
                              f"in {namespaces(partly.namespaces)}") from None
    elif session is not None:
        resp = call(addr, lambda c: evict_session(c, session, namespace, force), timeout_s=STORE_WIDE)
    else:
        resp = call(addr, lambda c: c.evict(whole_namespace=True, force=force, namespace=namespace),
                    timeout_s=STORE_WIDE)
    _print(resp, json_)


def _print(resp: EvictResult, json_: bool) -> None:
    if json_:
        typer.echo(dumps(to_dict(resp)))
        return
    console.print(f"evicted {len(resp.evicted)} blocks" + (f" ({resp.unpinned} were pinned)" if resp.unpinned else ""))
    for key in resp.evicted:
        console.print(f"  {key.hex()}")
    if resp.skipped:
        console.print(f"skipped {len(resp.skipped)} blocks being read or moved right now; run it again")
    if resp.operator_pinned:
        console.print(f"kept {len(resp.operator_pinned)} blocks pinned by an operator or another tenant (a pin not "
                      "yours holds them or a block extending them): only an admin's --force evicts them")
    if resp.in_use:
        console.print(f"kept {len(resp.in_use)} blocks another user of this shared namespace holds or reads (or a "
                      "block extending them): they go when no one else holds them")

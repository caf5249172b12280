"""`engram models forget`: remove a model (a retired checkpoint) from a running daemon, with every block of it.

An admin call (ForgetModel): every block of the model is evicted, in every namespace and tier, then the model
leaves the registry with its file and every tenant's registration. A model in use (a live session, a put in
flight or an in-place reservation) or with pinned blocks is refused, nothing changed, unless --force (which closes
its sessions and evicts pinned blocks; puts still refuse it). Stop the workers that use the model first: a client
still running registers it again at its next call. The model is named by its fingerprint, whole or a unique hex
prefix of one the daemon knows (`engram stats` lists them)."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from engram import errors
from engram.api import ForgetResult
from engram.control import ControlClient
from engram.layout import FINGERPRINT_BYTES

from .common import EXIT_BAD_INPUT, STORE_WIDE, call, console, fail, target
from .format import dumps, to_dict
from .options import AddressOpt, ConfigOpt, JsonOpt, TlsCaOpt, TokenOpt

models_app = typer.Typer(help="The daemon's registered models: forget one.", no_args_is_help=True)


async def resolve(client: ControlClient, prefix: str) -> bytes:
    """A whole fingerprint as it is (the daemon may hold blocks of a model it no longer knows); a prefix resolved
    among the models the caller sees."""
    if len(prefix) == 2 * FINGERPRINT_BYTES:
        return bytes.fromhex(prefix)
    found = [m.model_fingerprint for m in (await client.stats()).models if m.model_fingerprint.hex().startswith(prefix)]
    if not found:
        raise errors.NotFound(f"no model this daemon knows has a fingerprint starting {prefix}; `engram stats` "
                              "lists them")
    if len(found) > 1:
        raise errors.InvalidArgument(f"{len(found)} models' fingerprints start {prefix} "
                                     f"({', '.join(fp.hex() for fp in found[:4])}): give more of it")
    return found[0]


async def forget_model(client: ControlClient, prefix: str, force: bool) -> ForgetResult:
    return await client.forget_model(await resolve(client, prefix), force=force)


@models_app.command()
def forget(fingerprint: Annotated[str, typer.Argument(help="The model's fingerprint, or a unique hex prefix of it.")],
           force: Annotated[bool, typer.Option("--force", help="Close the model's live sessions and evict its "
                                                               "pinned blocks too.")] = False,
           config: ConfigOpt = None, address: AddressOpt = None, json_: JsonOpt = False, token: TokenOpt = None,
           tls_ca: TlsCaOpt = None) -> None:
    """Forget a model: evict every block of it, then remove its registration (admin only)."""
    prefix = fingerprint.strip().lower()
    if not re.fullmatch(f"[0-9a-f]{{1,{2 * FINGERPRINT_BYTES}}}", prefix):
        raise fail(f"{fingerprint!r} is not a model fingerprint: {2 * FINGERPRINT_BYTES} hex digits, or a prefix of "
                   "them", EXIT_BAD_INPUT)
    # Its blocks are evicted one by one (NVMe files removed): the client waits their time (ControlClient.forget_model)
    done = call(target(config, address, token, tls_ca), lambda c: forget_model(c, prefix, force), timeout_s=STORE_WIDE)
    if json_:
        typer.echo(dumps(to_dict(done)))
        return
    console.print(f"forgot model {done.model_fingerprint.hex()}: evicted {done.evicted} blocks"
                  + (f" ({done.unpinned} were pinned)" if done.unpinned else "")
                  + (f", closed {done.sessions_closed} sessions" if done.sessions_closed else "")
                  + (f"; registered by {', '.join(done.tenants)}" if done.tenants else ""))

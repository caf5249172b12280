"""Forgetting a model on an operator's word (ForgetModel, `engram models forget`): its blocks and registration go.

A retired checkpoint's model stayed registered, its blocks stored until pressure evicted them, and an operator had no
way to remove them short of deleting files under a stopped daemon. ForgetModel (admin only) evicts every block of
the model, in every namespace and tier, then removes the model, every tenant's registration of it, and its file.

It refuses (FAILED_PRECONDITION, nothing changed) while anything uses the model, as the registry's own drops do
(modelroom.py): a live session (its calls read the model's layout), an in-place reservation (its commit looks the
model up again), a put in flight (it publishes its block after awaits), or a pinned block. With force the sessions
are closed and pinned blocks evicted. Reservations and puts are never overridden: they end within seconds (a
reservation within a lease term), and a block published for a model no longer registered would be stored and
unreadable. The model leaves the registry only once nothing holds it, checked with no await before the removal: a
block being read or moved is tried again for about a second; whatever still holds it then (a reader, or a worker
that registered the model again and put or opened a session meanwhile) leaves it registered, FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engram.api import ForgetResult
from engram.errors import UNKNOWN_MODEL, FailedPrecondition, UnknownModel, brief

if TYPE_CHECKING:
    from engram.index import BlockMeta
    from engram.inspection import Inspector
    from engram.store import BlockStore
    from engram.store.inplace import InPlacePuts

log = logging.getLogger("engram.registry")

TRIES = 10  # evictions of what is left, PAUSE_S apart: readers of its blocks finish meanwhile
PAUSE_S = 0.1


def blocks_of(store: BlockStore, fingerprint: bytes) -> list[BlockMeta]:
    """Every stored block of the model, every namespace's."""
    index = store.index
    return [m for ns in index.namespaces() if index.holds_model(fingerprint, [ns])
            for m in index.blocks_in(ns) if m.model_fingerprint == fingerprint]


def _putting(store: BlockStore, inplace: InPlacePuts | None, fingerprint: bytes) -> str:
    """What is putting blocks of the model now ("": nothing)."""
    puts = sum(1 for _, fp in store.models_being_put() if fp == fingerprint)
    held = sum(1 for _, fp in (inplace.models_in_use() if inplace is not None else ()) if fp == fingerprint)
    what = [f"{n} {kind}" for n, kind in ((puts, "namespace(s) with puts in flight"),
                                           (held, "namespace(s) with in-place reservations")) if n]
    return ", ".join(what)


async def forget_model(fingerprint: bytes, inspector: Inspector, inplace: InPlacePuts | None, *, force: bool
                       ) -> ForgetResult:
    """Evict every block of the model and remove it from the registry (module docstring)."""
    store, sessions = inspector.store, inspector.sessions
    registry = store.registry
    shown = brief(fingerprint)
    if fingerprint not in registry and not store.index.holds_model(fingerprint):
        raise UnknownModel(f"{UNKNOWN_MODEL} {shown}: this daemon neither knows the model nor holds a block of it")
    if putting := _putting(store, inplace, fingerprint):
        raise FailedPrecondition(f"model {shown} is being put now ({putting}): nothing was changed; run it again "
                                 "once they end (a reservation within server.lease_s), after stopping the workers "
                                 "that use the model")
    live = [s for s in sessions.sessions() if s.fingerprint == fingerprint]
    if live and not force:
        raise FailedPrecondition(f"{len(live)} live session(s) use model {shown} (e.g. {live[0].id!r} in namespace "
                                 f"{live[0].namespace!r}): nothing was changed; close them, or pass force to close "
                                 "them with it")
    pinned = sum(1 for m in blocks_of(store, fingerprint) if m.pins)
    if pinned and not force:
        raise FailedPrecondition(f"{pinned} block(s) of model {shown} are pinned: nothing was changed; unpin them "
                                 "(engram unpin), or pass force to evict them with it")
    for s in live:
        sessions.end(s)
    evicted = unpinned = 0
    for tries_left in range(TRIES, 0, -1):
        if metas := blocks_of(store, fingerprint):
            done = await inspector.evict(metas, force=force)
            evicted += len(done.evicted)
            unpinned += done.unpinned
        # From here to the removal no await: nothing starts holding the model in between.
        left = len(blocks_of(store, fingerprint))
        users = sum(1 for _, fp in sessions.models_in_use() if fp == fingerprint)
        putting = _putting(store, inplace, fingerprint)
        if not (left or users or putting):
            break
        if tries_left == 1:
            busy = ", ".join(what for what in (f"{left} block(s) being read or moved" if left else "",
                                               f"{users} live session(s) opened since" if users else "",
                                               putting) if what)
            raise FailedPrecondition(f"model {shown} stays registered: {busy}; {evicted} of its blocks were evicted. "
                                     "Run it again (stop the workers that use the model first: a client registers "
                                     "it again by itself)")
        await asyncio.sleep(PAUSE_S)
    tenants = tuple(sorted(registry.registrants(fingerprint)))
    if fingerprint in registry:
        registry.forget(fingerprint)
    log.info("forgot model %s on an admin's request: %d block(s) evicted (%d pinned), %d session(s) closed, "
             "registered by %s", shown, evicted, unpinned, len(live), ", ".join(tenants) or "no tenant")
    return ForgetResult(model_fingerprint=fingerprint, evicted=evicted, unpinned=unpinned, sessions_closed=len(live), tenants=tenants)

"""Room in the model registry: a registration that holds nothing gives its place up to a new one.

A deployment registers a new model per checkpoint (a new weights_id). Registrations were never dropped, so after
`server.max_models_per_tenant` of them a tenant could register no other model, ever: not once its blocks were
evicted, not after a restart (an audit, session 45); with tenancy off the same at `server.max_models`, for
everyone. A registration past a bound now first drops registrations that hold nothing, the least recently
registered or used first: past the tenant's share, its own that hold nothing in its namespaces; past the
registry's bound, models no tenant registered (any model, with tenancy off) that hold nothing anywhere. A model
goes from the registry, with its file, only once no tenant registered it and nothing holds it.

What holds a model: a stored block (its model decodes it, and matches it again at a restart), a live session,
an in-place reservation, a put in flight (it looked the model up and publishes its block after awaits). All is
read and dropped without an await in between, so nothing starts holding a model while it is dropped. A worker
whose registration was dropped gets UnknownModel at its next call and registers again (the worker integrations
do so by themselves).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from functools import cached_property
from typing import TYPE_CHECKING

from engram.errors import ResourceExhausted, brief
from engram.logbudget import LogBudget

if TYPE_CHECKING:
    from engram.registry import ModelRegistry
    from engram.sessions import SessionManager
    from engram.store.core import BlockStore
    from engram.store.inplace import InPlacePuts

log = logging.getLogger("engram.registry")
_said = LogBudget()  # a tenant cycling through models drops one registration per call


class Holds:
    """What holds each model now, read once per registration that needs room."""

    def __init__(self, store: BlockStore, sessions: SessionManager, inplace: InPlacePuts | None) -> None:
        self.store, self.sessions, self.inplace = store, sessions, inplace

    @cached_property
    def _in_use(self) -> set[tuple[str, bytes]]:
        """(namespace, model) of every session, reservation and put in flight."""
        used = self.sessions.models_in_use() | self.store.models_being_put()
        return used | self.inplace.models_in_use() if self.inplace is not None else used

    @cached_property
    def _models_in_use(self) -> set[bytes]:
        return {fp for _, fp in self._in_use}

    def model(self, fingerprint: bytes, namespaces: Collection[str] | None = None) -> bool:
        """Whether anything holds the model in one of `namespaces` (None: in any namespace)."""
        if self.store.index.holds_model(fingerprint, namespaces):
            return True
        if namespaces is None:
            return fingerprint in self._models_in_use
        return any((ns, fingerprint) in self._in_use for ns in namespaces)


def make_room(registry: ModelRegistry, holds: Holds, fingerprint: bytes, *, tenant: str,
              namespaces: Collection[str], max_per_tenant: int, max_models: int) -> None:
    """Drop what must go for `tenant` ("": none) to register the model within both bounds; ResourceExhausted,
    with nothing dropped, when what holds nothing is not enough."""
    if registry.knows(fingerprint, tenant):
        return  # registering a model of one's own again is free (for "": one the daemon knows)
    drops: list[bytes] = []  # the tenant's registrations to drop
    if tenant:
        over = registry.registered_by(tenant) + 1 - max_per_tenant
        if over > 0:
            idle = [fp for fp in registry.registrations(tenant) if not holds.model(fp, namespaces)]
            if len(idle) < over:
                raise ResourceExhausted(
                    f"this token has registered {registry.registered_by(tenant)} models, its share "
                    "(server.max_models_per_tenant), and each holds blocks, sessions or puts in its namespaces; "
                    "register one of those, or evict or close what one holds")
            drops = idle[:over]
    # A tenant counts a new record whether or not the daemon knows the model: a full registry refusing it only for
    # an unknown one would tell which models other tenants run.
    gone = [fp for fp in drops if registry.registrants(fp) == {tenant} and not holds.model(fp)]
    over = len(registry) - len(gone) + 1 - max_models
    forgets: list[bytes] = []
    if over > 0:
        forgets = [fp for fp in registry.unowned() if fp != fingerprint and not holds.model(fp)][:over]
        if len(forgets) < over:
            if tenant:
                raise ResourceExhausted("this daemon's model registry is full (server.max_models) of models that "
                                        "hold blocks, sessions or puts, or that other tenants registered; register "
                                        "one of the models this token registered, or ask the operator to raise "
                                        "the limit")
            raise ResourceExhausted(f"this daemon already knows {len(registry)} models (server.max_models), each "
                                    "holding blocks, sessions or puts, or registered by a tenant; register one of "
                                    "those, evict what one holds, or raise the limit")
    for fp in drops:
        registry.drop(fp, tenant)
    for fp in (*gone, *forgets):
        registry.forget(fp)
    if (drops or forgets) and (held := _said.take()) is not None:
        log.info("model registry: made room for model %s%s: dropped %d registration(s) holding nothing%s, "
                 "forgot %d model(s)%s", brief(fingerprint), f" of tenant {tenant!r}" if tenant else "", len(drops),
                 f" ({', '.join(brief(fp) for fp in drops)})" if drops else "", len(gone) + len(forgets),
                 f"; {held} such lines held back" if held else "")

"""A worker integration's model as registered with its daemon, registered again when the daemon has forgotten it.

A daemon that restarts without a model registry (DRAM only: the registry is kept on the NVMe tier) knows no
model, and every call naming the fingerprint a worker registered before fails UnknownModel; nothing registered it
again, so a worker's loads and stores failed for as long as it ran. The transformers integration and the vLLM
connector make their calls through `Registration.call`, which on that error registers the model again and calls
once more: the fingerprint is a hash of the spec, the same one unless the daemon's default codec changed. A call
that fails again raises, for the integration to count as it did (a load as a miss, a store as a failure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from engram.errors import UnknownModel
from engram.layout import ModelSpec

log = logging.getLogger("engram.integrations")

T = TypeVar("T")


class Registration:
    """A model spec and the fingerprint the daemon gave it, through a (sync) client."""

    def __init__(self, client: Any, spec: ModelSpec, fingerprint: bytes = b"") -> None:
        """fingerprint: the one a registration already returned; b"": registered by the first use."""
        self.client = client
        self.spec = spec
        self._fingerprint = fingerprint

    @property
    def fingerprint(self) -> bytes:
        """The model's fingerprint, registering it first if it is not yet (raises as the registration does)."""
        return self._fingerprint or self.register()

    def register(self, client: Any = None) -> bytes:
        """Register the model through `client` (default: this one's); returns its fingerprint."""
        self._fingerprint = (client or self.client).register_model(self.spec)
        return self._fingerprint

    def call(self, fn: Callable[[bytes], T], client: Any = None) -> T:
        """fn(fingerprint), for a call fn makes on `client` (default: this one's); when the daemon or that client
        does not know the model, registered again through it and called once more."""
        fingerprint = self.fingerprint
        try:
            return fn(fingerprint)
        except UnknownModel as exc:
            log.warning("Engram does not know model %s (%s): registering it again (the daemon restarted?)",
                        self.spec.name, exc)
            return fn(self.register(client))

"""A worker integration's model as registered with its daemon, through each client its calls go on.

A daemon that forgets a model (restarted without a model registry, a registration dropped for room, an admin's
ForgetModel) answers every call naming it UnknownModel. The client that registered the model registers it again
and makes the call once more by itself (engram/reregister.py); so the transformers integration and the vLLM
connector make their calls through `Registration.call`, which makes sure the client a call goes on has
registered the model (registering it through that client first if not). A call that fails again raises, for
the integration to count as it did (a load as a miss, a store as a failure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from engram.layout import ModelSpec

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
        """fn(fingerprint), for a call fn makes on `client` (default: this one's), which has registered the model
        (through it first if not): when the daemon has forgotten the model, the client registers it again and
        makes its call once more."""
        through = client or self.client
        if not self._fingerprint or not through.knows_model(self._fingerprint):
            self.register(through)
        return fn(self._fingerprint)

"""The models a daemon knows, by fingerprint. Blocks are only accepted for registered models."""

from __future__ import annotations

from engram.errors import NotFound
from engram.layout import ModelSpec


class ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[bytes, ModelSpec] = {}

    def register(self, spec: ModelSpec) -> bytes:
        fp = spec.fingerprint
        self._models.setdefault(fp, spec)
        return fp

    def get(self, fingerprint: bytes) -> ModelSpec:
        try:
            return self._models[fingerprint]
        except KeyError:
            shown = fingerprint.hex() or "<empty>"
            raise NotFound(
                f"unknown model fingerprint {shown}; call RegisterModel with the model's layout first"
            ) from None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

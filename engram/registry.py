"""The models a daemon knows, by fingerprint. Blocks are only accepted for registered models.

With a directory (the NVMe tier's), every registered model is also written there (temp file, fsync,
rename), so that after a restart the blocks on disk can be matched to their models again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from engram.errors import UNKNOWN_MODEL, InvalidArgument, StorageFull, StorageIOError, UnknownModel, brief
from engram.layout import DType, ModelSpec
from engram.private import FILE_MODE, private_dir

log = logging.getLogger("engram.registry")


class ModelRegistry:
    def __init__(self, directory: str | Path | None = None, *, default_codec: str = "raw", default_reason: str = ""
                 ) -> None:
        self.default_codec = default_codec
        self.default_reason = default_reason  # why this default (codec.default, or what auto found)
        self._models: dict[bytes, ModelSpec] = {}
        # Who added each model (a tenant's name; saved in its file, so a tenant's share of server.max_models_per_tenant
        # outlives a restart: counted in memory only, one tenant filled the registry over a few restarts).
        self._added_by: dict[bytes, str] = {}
        self._dir = Path(directory) if directory else None
        if self._dir is not None:
            private_dir(self._dir)
            self._load()

    def _load(self) -> None:
        assert self._dir is not None
        for path in sorted(self._dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                spec = ModelSpec.from_dict(data)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable model file %s: %s", path, exc)
                continue
            if spec.fingerprint.hex() != path.stem:
                log.warning("ignoring model file %s: its content has fingerprint %s", path, spec.fingerprint.hex())
                continue
            self._models[spec.fingerprint] = spec
            if isinstance(added := data.get("added_by"), str) and added:
                self._added_by[spec.fingerprint] = added

    def with_codec(self, spec: ModelSpec) -> ModelSpec:
        """The spec as registered: its codec defaulted to the daemon's (the codec is part of the fingerprint)."""
        if spec.codec:
            return spec
        return dataclasses.replace(spec, codec="raw" if spec.layout.dtype == DType.FP64 else self.default_codec)

    def added_by(self, who: str) -> int:
        """How many of the registered models `who` added (a tenant's share of the registry)."""
        return sum(1 for name in self._added_by.values() if name == who)

    def register(self, spec: ModelSpec, added_by: str = "") -> bytes:
        """Register a model (its codec defaulted to the daemon's); returns its fingerprint. `added_by`: the tenant
        that adds it, when it is new (kept with it)."""
        spec = self.with_codec(spec)
        from engram.codec.base import codec_by_name

        codec_by_name(spec.codec)  # an unknown codec is InvalidArgument
        if spec.layout.dtype == DType.FP64 and spec.stored_codec != "raw":
            raise InvalidArgument(f"a float64 layout is stored raw only (it exists for exactness tests of replay); "
                                  f"register it with codec raw, not {spec.codec}")
        for stream in (*spec.layout.streams, *spec.layout.window_streams):
            if stream.codec:
                try:
                    codec_by_name(stream.codec)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"stream {stream.name}: {exc}") from None
        fp = spec.fingerprint
        if fp not in self._models:
            if self._dir is not None:
                self._persist(fp, spec, added_by)
            self._models[fp] = spec
            if added_by:
                self._added_by[fp] = added_by
        return fp

    def _persist(self, fp: bytes, spec: ModelSpec, added_by: str) -> None:
        """The model's file, written before it is registered (so a restart knows it); a full disk is
        StorageFull, another failure StorageIOError (each a status the caller can act on, not INTERNAL)."""
        assert self._dir is not None
        final = self._dir / f"{fp.hex()}.json"
        tmp = final.with_suffix(".tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "w") as fh:
                json.dump({**spec.to_dict(), **({"added_by": added_by} if added_by else {})}, fh, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            why = f"the model registry in {self._dir} cannot be written ({exc.strerror or exc})"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFull(f"{why}: the disk is full; free space on it, then register the model again") from None
            raise StorageIOError(f"{why}; register the model again once the directory is writable") from None

    def get(self, fingerprint: bytes) -> ModelSpec:
        try:
            return self._models[fingerprint]
        except KeyError:
            shown = brief(fingerprint)
            raise UnknownModel(f"{UNKNOWN_MODEL} {shown}; call RegisterModel with the model's layout first") from None

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self._models

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

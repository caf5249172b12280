"""The models a daemon knows, by fingerprint. Blocks are only accepted for registered models.

With a directory (the NVMe tier's), every registered model is also written there (temp file, fsync,
rename), so that after a restart the blocks on disk can be matched to their models again.

With tenancy on, each model keeps the tenants that registered it, and a tenant sees only those models: one it
has not registered is, to it, exactly an unknown fingerprint (`get`), else its calls told which models other
tenants run. The model itself is stored once, whoever registers it (its fingerprint hashes the spec alone).
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
        # The tenants (names) that registered each model: who sees it, and whose share of
        # server.max_models_per_tenant it counts against. Saved in its file, so both outlive a restart (a share
        # counted in memory only let one tenant fill the registry over a few restarts).
        self._tenants: dict[bytes, set[str]] = {}
        # When each registration was last registered or used (a tick; "": no tenant): which one gives its place
        # up first when it holds nothing (engram/server/modelroom.py). In memory: after a restart none was.
        self._used: dict[tuple[bytes, str], int] = {}
        self._tick = 0
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
            self._tenants[spec.fingerprint] = _tenants_of(data)

    def with_codec(self, spec: ModelSpec) -> ModelSpec:
        """The spec as registered: its codec defaulted to the daemon's (the codec is part of the fingerprint)."""
        if spec.codec:
            return spec
        return dataclasses.replace(spec, codec="raw" if spec.layout.dtype == DType.FP64 else self.default_codec)

    def registered_by(self, tenant: str) -> int:
        """How many models `tenant` registered (its share of the registry)."""
        return sum(1 for names in self._tenants.values() if tenant in names)

    def registrations(self, tenant: str) -> list[bytes]:
        """The models `tenant` registered, the least recently registered or used first."""
        mine = [fp for fp, names in self._tenants.items() if tenant in names]
        return sorted(mine, key=lambda fp: self._used.get((fp, tenant), 0))

    def unowned(self) -> list[bytes]:
        """The models no tenant registered (tenancy off, admins, or every tenant's registration dropped), the least
        recently registered or used first."""
        last: dict[bytes, int] = {}
        for (fp, _), tick in self._used.items():
            last[fp] = max(last.get(fp, 0), tick)
        return sorted((fp for fp, names in self._tenants.items() if not names), key=lambda fp: last.get(fp, 0))

    def registrants(self, fingerprint: bytes) -> frozenset[str]:
        return frozenset(self._tenants.get(fingerprint, ()))

    def knows(self, fingerprint: bytes, tenant: str = "") -> bool:
        """Whether the model is registered, and registered by `tenant` ("": no tenant, which sees every model)."""
        names = self._tenants.get(fingerprint)
        return names is not None and (not tenant or tenant in names)

    def register(self, spec: ModelSpec, tenant: str = "") -> bytes:
        """Register a model (its codec defaulted to the daemon's); returns its fingerprint. `tenant`: who registers
        it ("": no tenant: tenancy off, or an admin), kept with the model, new or not."""
        spec = self.checked(spec)
        fp = spec.fingerprint
        names = self._tenants.get(fp)
        if names is None or (tenant and tenant not in names):
            spec = self._models.get(fp, spec)
            grown = (names or set()) | ({tenant} if tenant else set())
            if self._dir is not None:  # a tenant added to a known model is written too (and takes as long)
                self._persist(fp, spec, grown)
            self._models[fp] = spec
            self._tenants[fp] = grown
        self._touch(fp, tenant)
        return fp

    def checked(self, spec: ModelSpec) -> ModelSpec:
        """The spec as it would be registered (`with_codec`); InvalidArgument for a codec the daemon lacks."""
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
        return spec

    def drop(self, fingerprint: bytes, tenant: str) -> None:
        """Drop `tenant`'s registration of the model (its file written without it first, so a restart agrees); the
        model stays, for its other tenants and its blocks. The caller checked that it holds nothing."""
        names = self._tenants.get(fingerprint)
        if names is None or tenant not in names:
            return
        left = names - {tenant}
        if self._dir is not None:
            self._persist(fingerprint, self._models[fingerprint], left)
        self._tenants[fingerprint] = left
        self._used.pop((fingerprint, tenant), None)

    def forget(self, fingerprint: bytes) -> None:
        """Remove the model, every tenant's registration of it and its file. The caller checked that nothing holds
        it (no block: a block needs its model to be read, and to be matched to it at a restart) and that no tenant
        registered it (modelroom.py) or an admin asked for it (forgetmodel.py)."""
        if fingerprint not in self._models:
            return
        if self._dir is not None:
            path = self._dir / f"{fingerprint.hex()}.json"
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise StorageIOError(f"the model registry in {self._dir} cannot be written ({exc.strerror or exc}); "
                                     "register the model again once the directory is writable") from None
        del self._models[fingerprint], self._tenants[fingerprint]
        for key in [k for k in self._used if k[0] == fingerprint]:
            del self._used[key]

    def _touch(self, fingerprint: bytes, tenant: str) -> None:
        self._tick += 1
        self._used[(fingerprint, tenant)] = self._tick

    def _persist(self, fp: bytes, spec: ModelSpec, tenants: set[str]) -> None:
        """The model's file, written before it is registered (so a restart knows it); a full disk is
        StorageFull, another failure StorageIOError (each a status the caller can act on, not INTERNAL)."""
        assert self._dir is not None
        final = self._dir / f"{fp.hex()}.json"
        tmp = final.with_suffix(".tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), "w") as fh:
                json.dump({**spec.to_dict(), "tenants": sorted(tenants)}, fh, sort_keys=True)
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

    def get(self, fingerprint: bytes, tenant: str = "") -> ModelSpec:
        """The model, as `tenant` sees it: one it has not registered is UnknownModel, word for word the answer to a
        fingerprint nobody registered ("": no tenant, which sees every model)."""
        if not self.knows(fingerprint, tenant):
            shown = brief(fingerprint)
            raise UnknownModel(f"{UNKNOWN_MODEL} {shown}; call RegisterModel with the model's layout first")
        return self._models[fingerprint]

    def use(self, fingerprint: bytes, tenant: str = "") -> ModelSpec:
        """`get` for a call that uses the model: its registration is the most recently used now."""
        spec = self.get(fingerprint, tenant)
        self._touch(fingerprint, tenant)
        return spec

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self._models

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)


def _tenants_of(record: dict[str, object]) -> set[str]:
    """The tenants a model file names. A file from before `tenants` (docs/FORMAT.md) names at most the tenant that
    added the model (`added_by`), the one registration it recorded: others' were never written down, and counting
    them as every tenant would show the model to tenants that never used it. Those register it again (the worker
    integrations do so by themselves on UnknownModel, as after a restart without a registry)."""
    names = record.get("tenants")
    if isinstance(names, list):
        return {n for n in names if isinstance(n, str) and n}
    added = record.get("added_by")
    return {added} if isinstance(added, str) and added else set()

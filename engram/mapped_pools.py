"""The daemon's shared pools as a worker maps them: each once per use, and let go once its daemon is gone.

A worker outlives its daemon's restarts, and every daemon start makes a pool of its own (a file named by a new
random segment id; the start removes the files of daemons that died, engram/tiers/shm.py). A mapping kept for
a dead daemon's pool holds that whole pool's pages (the daemon prefaults them, or pins them on a GPU host,
where the worker registered its mapping with CUDA too): one pool more per restart, in every worker, for as
long as it runs. So mapping a pool first forgets every mapping whose file was removed.

Forgetting does not unmap or unregister anything: a load or put in flight may still be copying out of (or
into) the old mapping through the objects it holds. The mapping goes when its last holder lets go (a
MappedSegment unregisters from CUDA then, engram/loader.py; the mmap unmaps with its last view). Nothing a
caller is given views a pool: zero-copy Gets and loads copy out of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True)
class _Mapped:
    mapping: Any
    tag: bytes  # what a descriptor names it by: the segment id (the CUDA IPC handle for the HBM pool)
    file: tuple[int, int]  # (st_dev, st_ino) of the pool file when it was mapped


def _file_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


class MappedPools:
    """Mappings by (use, pool file path). Uses: "read" (zero-copy Gets), "load" (the hit path, registered with
    CUDA on a GPU), "write" (in-place puts), "hbm" (the daemon's HBM pool by CUDA IPC, under its generation
    table's file). A lookup is a dict probe; a miss also stats each file mapped (a few)."""

    def __init__(self) -> None:
        self._maps: dict[tuple[str, str], _Mapped] = {}

    def get(self, use: str, path: str, tag: bytes, open_: Callable[[], T]) -> T:
        """The mapping of the pool at `path` for `use`, mapped by `open_` unless mapped already with this tag.
        OSError when the file cannot be opened (another host, container or mount namespace)."""
        entry = self._maps.get((use, path))
        if entry is not None and entry.tag == tag:
            return cast(T, entry.mapping)
        self._forget_removed()
        # Its identity before it is opened: a file put in its place meanwhile is forgotten at the next miss.
        file = _file_of(path)
        mapping = open_()
        self._maps[(use, path)] = _Mapped(mapping, tag, file)
        return mapping

    def held(self) -> list[tuple[str, str]]:
        """(use, path) of each mapping kept."""
        return list(self._maps)

    def clear(self) -> None:
        """Forget every mapping (the client closes): each goes with its last holder."""
        self._maps.clear()

    def _forget_removed(self) -> None:
        for key, entry in list(self._maps.items()):
            try:
                removed = _file_of(key[1]) != entry.file
            except OSError:
                removed = True
            if removed:
                del self._maps[key]

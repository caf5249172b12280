"""Byte accounting for tiers that count bytes (a pool counts pages instead: engram/tiers/slots.py). Apart from
the Tier protocol (engram/tiers/base.py) so that it compiles with the DRAM tier (engram/compiled.py): mypyc
compiles no runtime-checkable Protocol. The DRAM tier is one (both compiled); the NVMe tier, interpreted, holds
one: an interpreted subclass of a compiled class fails at its first instance."""

from __future__ import annotations


class ByteBudget:
    """The byte accounting of a tier that counts bytes (DRAM's private dict, NVMe's files; a pool counts
    pages instead): bytes stored plus bytes reserved for writes in flight, never above capacity. The tier
    adds to `stored` on a write and takes from it on a delete."""

    def __init__(self, capacity_bytes: int, what: str) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{what} capacity must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.stored = 0
        self._reserved = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self.stored + self._reserved

    def reserve(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes > self._capacity:
            return False
        self._reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        if nbytes > self._reserved:
            raise AssertionError(f"unreserve({nbytes}) exceeds the {self._reserved} bytes reserved")
        self._reserved -= nbytes

"""The contract every storage tier keeps (DRAM now; NVMe, HBM and the cluster tier later).

A tier stores opaque payloads by key. It does not decide *what* to evict or where a victim goes: the
store (engram/store/) owns the eviction order (engram/eviction.py), pins, leases and the moves between
tiers, so the rules live in one place. Space is reserved before a write (`reserve`) and returned if the write fails
(`unreserve`), so concurrent writers cannot overfill a tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from engram.block import BlockRecord, Payload
from engram.errors import DataLoss


@dataclass(frozen=True)
class TierUsage:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int


class StaleRecord(DataLoss):
    """A read found the block's file sound (it verifies against its own header) and naming the block the tier's
    record names (key, parent, model, namespace, tokens, shape, dtype, size) but holding other bytes: the record,
    which the tier trusted from its index journal, is stale (a build from before the journal wrote the block
    again under its key). `payload` is the file's, `found` its record. The store re-indexes the block under the
    file's checksum where that is safe (NvmeTier.adopt), else drops the copy as damaged, as any DataLoss."""

    def __init__(self, message: str, payload: bytes, found: BlockRecord) -> None:
        super().__init__(message)
        self.payload = payload
        self.found = found


def same_block(a: BlockRecord, b: BlockRecord) -> bool:
    """Whether two records describe the same block, whatever its bytes (the checksum is left out)."""
    return (a.key == b.key and a.parent == b.parent and a.model_fingerprint == b.model_fingerprint
            and a.namespace == b.namespace and a.dtype == b.dtype and a.full == b.full
            and tuple(a.shape) == tuple(b.shape) and bytes(a.tokens) == bytes(b.tokens) and a.nbytes == b.nbytes)


@runtime_checkable
class Tier(Protocol):
    name: str

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int:
        """Bytes held or reserved."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def reserve(self, nbytes: int) -> bool:
        """Claim space for a coming write; False when it does not fit right now."""
        ...

    def unreserve(self, nbytes: int) -> None: ...

    def space_for(self, rec: BlockRecord) -> int:
        """Bytes to reserve before writing this block (its payload, plus any per-block overhead)."""
        ...

    async def write(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        """Store a payload for which `reserved` bytes were reserved; the reservation is consumed whether
        the write succeeds or fails."""
        ...

    async def read(self, key: bytes) -> bytes | memoryview: ...

    async def delete(self, key: bytes) -> int:
        """Remove a block; returns the bytes freed (0 when absent)."""
        ...

    def usage(self) -> TierUsage: ...

    async def close(self) -> None: ...


class ImmediateTier(Protocol):
    """A tier whose write and delete never wait (memory: the DRAM pool, HBM, the private DRAM dict), so that its
    async `delete` only calls `delete_now`, and its `write` `write_now` but for a payload of COPY_OFF_LOOP_BYTES or
    more, which the DRAM pool copies in a worker thread (engram/block.py). The store's placement calls them directly for such tiers
    (engram/store/placement.py): a miss into a full tier writes one copy and deletes another, and a coroutine
    for each measured 6% of a put's cost in the compiled store (benchmarks/put_cost.py). A subclass that changes
    `write` or `delete` must change these too; a wrapper that forwards attributes is not taken for one (the
    placement asks the class)."""

    def write_now(self, rec: BlockRecord, payload: Payload, reserved: int) -> None: ...

    def delete_now(self, key: bytes) -> int: ...

"""The store facade: the one place that knows blocks, tiers, pins and leases.

Everything above it (the gRPC service, the demo, benchmarks) calls the store; tiers below it only hold
bytes. The store decides what a tier may evict (never a pinned block, never one a reader holds a lease
on), publishes a block in the index only after its payload is written (so no reader can see a block
before its bytes are there), and verifies every payload's checksum when it is read back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engram.block import BlockHeader, checksum
from engram.errors import DataLoss, FailedPrecondition, NotFound, ResourceExhausted
from engram.eviction import LeafLRU
from engram.index import BlockMeta, ChainIndex, PrefixMatch
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.registry import ModelRegistry
from engram.tiers.base import Tier


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class StoreCounters:
    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    blocks_put: int = 0
    blocks_deduplicated: int = 0
    blocks_served: int = 0
    bytes_served: int = 0
    corrupt_blocks: int = 0
    tiers: dict[str, TierCounters] = field(default_factory=dict)


@dataclass(frozen=True)
class PutOutcome:
    key: bytes
    stored: bool  # False: the block was already present (deduplicated)


@dataclass(frozen=True)
class ModelUsage:
    fingerprint: bytes
    name: str
    blocks: int
    bytes: int
    tokens: int


class BlockStore:
    def __init__(self, tiers: Sequence[Tier], registry: ModelRegistry) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)  # fastest first
        self._tier_by_name = {t.name: t for t in self.tiers}
        self.registry = registry
        self.index = ChainIndex()
        self._lru = {t.name: LeafLRU(t.name) for t in self.tiers}
        self.counters = StoreCounters(tiers={t.name: TierCounters() for t in self.tiers})
        self.started = time.time()

    # ---- queries -------------------------------------------------------------------------------

    def lookup(self, namespace: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray) -> PrefixMatch:
        spec = self.registry.get(model_fingerprint)
        arr = np.asarray(tokens, dtype="<i4")
        match = self.index.match(namespace, model_fingerprint, arr, spec.layout.block_tokens)
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += match.matched_tokens
        self.counters.lookup_miss_tokens += len(arr) - match.matched_tokens
        self._touch_chain(match.blocks)
        return match

    def find(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes]) -> list[BlockMeta]:
        """Metadata for keys in this namespace and model; NotFound names the first missing key."""
        self.registry.get(model_fingerprint)
        metas = []
        for i, key in enumerate(keys):
            meta = self.index.get(key)
            # A block of another namespace is reported exactly like an absent one: no probing.
            if meta is None or meta.namespace != namespace or meta.model_fingerprint != model_fingerprint:
                raise NotFound(f"block {i} ({key.hex() or '<empty>'}) is not stored in this namespace and model")
            metas.append(meta)
        return metas

    # ---- writes --------------------------------------------------------------------------------

    async def put(
        self,
        namespace: str,
        model_fingerprint: bytes,
        parent: bytes,
        header: BlockHeader,
        payload: bytes,
        *,
        pin: bool = False,
        index: int = 0,
    ) -> PutOutcome:
        """Validate, dedupe and store one block under the key its parent and tokens hash to."""
        spec = self.registry.get(model_fingerprint)
        layout = spec.layout
        header.validate(layout, index=index)
        header.verify_payload(payload, index=index)
        root = root_key(namespace, model_fingerprint)
        if parent != root:
            pmeta = self.index.get(parent)
            if pmeta is None or pmeta.namespace != namespace or pmeta.model_fingerprint != model_fingerprint:
                raise FailedPrecondition(
                    f"block {index}: parent block {parent.hex() or '<empty>'} is not stored (it may have been "
                    "evicted); Lookup again and put the chain from its first missing block"
                )
            if not pmeta.full:
                raise FailedPrecondition(
                    f"block {index}: its parent is a partial block; only a chain's last block may have fewer "
                    "than block_tokens tokens"
                )
        key = block_key(parent, header.tokens)
        tokens = tokens_to_bytes(header.tokens)
        existing = self.index.get(key)
        if existing is not None:
            if existing.tokens != tokens:
                raise FailedPrecondition(f"block {index}: key {key.hex()} is stored with other tokens (hash collision)")
            self.counters.blocks_deduplicated += 1
            if pin:
                existing.pins += 1
            self._touch(existing)
            return PutOutcome(key, stored=False)

        tier = self.tiers[0]
        await self._make_room(tier, len(payload))
        try:
            await tier.write(key, payload)
        except BaseException:
            tier.unreserve(len(payload))
            raise
        meta = BlockMeta(
            key=key, parent=parent, namespace=namespace, model_fingerprint=model_fingerprint, tokens=tokens,
            num_tokens=header.num_tokens, dtype=header.dtype, shape=tuple(header.shape), nbytes=len(payload),
            checksum=header.checksum, tier=tier.name, full=header.num_tokens == layout.block_tokens,
            pins=1 if pin else 0,
        )
        self.index.add(meta)  # published only now that the bytes are in the tier
        self._touch(meta)
        self.counters.blocks_put += 1
        if meta.full:
            await self._drop_superseded_partials(meta)
        return PutOutcome(key, stored=True)

    async def _drop_superseded_partials(self, full: BlockMeta) -> None:
        """A full block makes the partial tails under the same parent that it extends redundant."""
        for cand in self.index.partial_children(full.parent):
            if cand.evictable and full.tokens.startswith(cand.tokens):
                await self._remove(cand)

    # ---- reads ---------------------------------------------------------------------------------

    def acquire(self, metas: Sequence[BlockMeta]) -> None:
        """Lease blocks for reading: a leased block is not evicted until `release`."""
        for meta in metas:
            meta.leases += 1
        self._touch_chain(metas)

    def release(self, metas: Sequence[BlockMeta]) -> None:
        for meta in metas:
            meta.leases -= 1
            if meta.leases < 0:
                raise AssertionError(f"block {meta.key.hex()} released more often than acquired")

    async def read(self, meta: BlockMeta) -> bytes:
        """The block's payload, verified against its checksum; a corrupt block is dropped, never served."""
        tier = self._tier_by_name[meta.tier]
        payload = await tier.read(meta.key)
        if checksum(payload) != meta.checksum:
            self.counters.corrupt_blocks += 1
            await self._remove(meta, force=True)
            raise DataLoss(f"block {meta.key.hex()} failed its checksum in tier {tier.name} and was dropped")
        meta.hits += 1
        self.counters.tiers[tier.name].hits += 1
        self.counters.blocks_served += 1
        self.counters.bytes_served += len(payload)
        return payload

    # ---- pins ----------------------------------------------------------------------------------

    def pin(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes], *, unpin: bool = False) -> int:
        """Pin (or unpin) blocks; returns how many changed. Pins count, so two pinners need two unpins."""
        metas = self.find(namespace, model_fingerprint, keys)
        changed = 0
        for meta in metas:
            if unpin:
                if meta.pins > 0:
                    meta.pins -= 1
                    changed += 1
            else:
                meta.pins += 1
                changed += 1
        return changed

    # ---- eviction ------------------------------------------------------------------------------

    async def _make_room(self, tier: Tier, nbytes: int) -> None:
        if nbytes > tier.capacity_bytes:
            raise ResourceExhausted(
                f"a block of {nbytes} bytes exceeds the {tier.name} tier's capacity of {tier.capacity_bytes} "
                f"bytes; raise tiers.{tier.name}.capacity or use smaller blocks"
            )
        while not tier.reserve(nbytes):
            victim = self._lru[tier.name].victim(self.index.get, len(tier))
            if victim is None:
                raise ResourceExhausted(
                    f"the {tier.name} tier is full ({tier.used_bytes} of {tier.capacity_bytes} bytes) and every "
                    "block in it is pinned or being read; unpin blocks or raise its capacity"
                )
            await self._remove(victim)
            self.counters.tiers[tier.name].evictions += 1

    async def _remove(self, meta: BlockMeta, *, force: bool = False) -> None:
        if not force and not meta.evictable:
            raise AssertionError("removing a pinned or leased block")
        _, new_leaf = self.index.remove(meta.key)
        if new_leaf is not None:
            self._lru[new_leaf.tier].became_leaf(new_leaf)
        await self._tier_by_name[meta.tier].delete(meta.key)

    def _touch(self, meta: BlockMeta) -> None:
        self._lru[meta.tier].touch(meta)

    def _touch_chain(self, metas: Sequence[BlockMeta]) -> None:
        for meta in metas:
            self._touch(meta)

    # ---- stats ---------------------------------------------------------------------------------

    def model_usage(self) -> list[ModelUsage]:
        acc: dict[bytes, list[int]] = {}
        for meta in self.index:
            row = acc.setdefault(meta.model_fingerprint, [0, 0, 0])
            row[0] += 1
            row[1] += meta.nbytes
            row[2] += meta.num_tokens
        return [
            ModelUsage(spec.fingerprint, spec.name, *acc.get(spec.fingerprint, [0, 0, 0])) for spec in self.registry
        ]

    def pinned_blocks(self, tier_name: str) -> int:
        return sum(1 for m in self.index if m.tier == tier_name and m.pins > 0)

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()

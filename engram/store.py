"""The store facade: the one place that knows blocks, tiers, pins, leases and the moves between tiers.

Everything above it (the gRPC service, the demo, benchmarks) calls the store; tiers below it only hold
bytes. The rules kept here:
- A block is published in the index only after its payload is written, and a copy in another tier counts
  only once its write has completed (moves are two-phase: write the new copy, then add it to the block's
  locations, then drop the old copy), so no reader ever sees a block or a copy before its bytes.
- A pinned block, a leased block (one a reader is streaming) and a moving block are never evicted.
- Eviction from a tier that has a lower tier demotes (write-back); from the last tier, it deletes, and
  then only leaves (engram/eviction.py), so every stored block stays reachable from its root.
- Every payload is verified against its checksum when read; a corrupt copy is dropped and the next copy
  (or DATA_LOSS) is served, never the corrupt bytes.
- A tier whose filesystem is full (ENOSPC) is marked degraded: the store works without it (the tier above
  becomes the last) and tries it again after `retry_s`; an I/O error fails that block, not the tier.
Backpressure is structural: a put that needs room waits for the demotions that make it, and the gRPC
server bounds concurrent RPCs, so a burst of puts cannot grow memory past the tiers' budgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engram.block import BlockHeader, BlockRecord, checksum
from engram.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StorageFull,
    Unavailable,
)
from engram.eviction import LeafLRU, tick
from engram.index import BlockMeta, ChainIndex, PrefixMatch
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.registry import ModelRegistry
from engram.tenancy import NamespacePolicy, OpenNamespaces
from engram.tiers.base import Tier


class WritePolicy(enum.StrEnum):
    WRITE_BACK = "write-back"  # puts land in the top tier; lower tiers receive blocks when it is full
    WRITE_THROUGH = "write-through"  # a put is acknowledged once it is also in the next tier (durable)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0  # reads served by a lower tier because this one had no copy
    evictions: int = 0
    demotions: int = 0  # blocks copied down out of this tier
    promotions: int = 0  # blocks copied up into this tier on a hit
    demoted_bytes: int = 0
    promoted_bytes: int = 0
    io_errors: int = 0
    corrupt_blocks: int = 0
    enospc: int = 0


@dataclass
class TierHealth:
    state: str = "ok"  # "ok" or "degraded"
    reason: str = ""
    retry_at: float = 0.0


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
    blocks_evicted_on_request: int = 0  # by `remove` (engram evict), not by tier pressure
    tiers: dict[str, TierCounters] = field(default_factory=dict)


@dataclass(frozen=True)
class PutOutcome:
    key: bytes
    stored: bool  # False: the block was already present (deduplicated)


@dataclass(frozen=True)
class ModelUsage:
    fingerprint: bytes
    name: str
    codec: str
    blocks: int
    bytes: int  # as stored
    tokens: int
    raw_bytes: int  # as raw elements of the layout's dtype


@dataclass(frozen=True)
class NamespaceUsage:
    blocks: int
    physical_bytes: int  # each stored block once
    logical_bytes: int  # each block once per session referencing it (once if none does): what dedupe saves
    referenced_blocks: int


@dataclass
class StoreReport:
    """What a recovery or a check found: per tier, valid blocks and problems (path, what, fixed)."""

    scanned: int = 0
    valid: int = 0
    findings: list[tuple[str, str, bool]] = field(default_factory=list)
    recovered_blocks: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings


_TIER_FAULTS = (ResourceExhausted, Unavailable, DataLoss, OSError)


class BlockStore:
    def __init__(self, tiers: Sequence[Tier], registry: ModelRegistry, *,
                 write_policy: WritePolicy = WritePolicy.WRITE_BACK, retry_s: float = 5.0,
                 codec_backend: str = "reference", namespaces: NamespacePolicy | None = None) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)  # fastest first
        self._rank = {t.name: i for i, t in enumerate(self.tiers)}
        self.registry = registry
        self.write_policy = write_policy
        self.retry_s = retry_s
        self.codec_backend = codec_backend  # where raw puts are encoded: "reference" or "triton"
        self.index = ChainIndex()
        self.namespaces = namespaces or OpenNamespaces()  # key salts and quotas (engram/tenancy.py)
        self._quota_pending: dict[str, int] = {}  # bytes of puts in flight, per namespace
        self._lru = {t.name: LeafLRU(t.name) for t in self.tiers}
        self.health = {t.name: TierHealth() for t in self.tiers}
        self.counters = StoreCounters(tiers={t.name: TierCounters() for t in self.tiers})
        self._pending: dict[bytes, asyncio.Event] = {}  # puts in flight, by key
        self._busy = 0  # moves in progress plus leases held: what may free a victim soon
        self._freed = asyncio.Condition()  # notified when a move ends or a lease is released
        self.wait_for_room_s = 10.0
        self.started = time.time()

    # ---- queries -------------------------------------------------------------------------------

    def root(self, namespace: str, model_fingerprint: bytes) -> bytes:
        """The parent key of a chain's first block in this namespace (salted when tenancy is on)."""
        return root_key(namespace, model_fingerprint, self.namespaces.salt(namespace))

    def lookup(self, namespace: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray) -> PrefixMatch:
        spec = self.registry.get(model_fingerprint)
        arr = np.asarray(tokens, dtype="<i4")
        match = self.index.match(namespace, model_fingerprint, arr, spec.layout.block_tokens,
                                 self.namespaces.salt(namespace))
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += match.matched_tokens
        self.counters.lookup_miss_tokens += len(arr) - match.matched_tokens
        for meta in match.blocks:
            self._touch(meta)
        return match

    def find(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes]) -> list[BlockMeta]:
        """Metadata for keys in this namespace and model; NotFound names the first missing key."""
        self.registry.get(model_fingerprint)
        metas = []
        for i, key in enumerate(keys):
            meta = self.index.get_in(namespace, key)
            # A block of another namespace is reported exactly like an absent one (and never even looked at).
            if meta is None or meta.model_fingerprint != model_fingerprint:
                raise NotFound(f"block {i} ({key.hex() or '<empty>'}) is not stored in this namespace and model")
            metas.append(meta)
        return metas

    # ---- writes --------------------------------------------------------------------------------

    async def put(self, namespace: str, model_fingerprint: bytes, parent: bytes, header: BlockHeader,
                  payload: bytes, *, pin: bool = False, index: int = 0) -> PutOutcome:
        """Validate, dedupe and store one block under the key its parent and tokens hash to."""
        spec = self.registry.get(model_fingerprint)
        layout = spec.layout
        header.validate(layout, index=index)
        header.verify_payload(payload, index=index)
        header, payload = await self._stored_form(spec.codec or "raw", header, payload, index)
        pmeta = None
        if parent != self.root(namespace, model_fingerprint):
            pmeta = self.index.get_in(namespace, parent)
            if pmeta is None or pmeta.model_fingerprint != model_fingerprint:
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
        while (pending := self._pending.get(key)) is not None:
            await pending.wait()  # the same block is being stored by another put: dedupe against it
        existing = self.index.get_in(namespace, key)
        if existing is not None:
            if existing.tokens != tokens:
                raise FailedPrecondition(f"block {index}: key {key.hex()} is stored with other tokens (hash collision)")
            self.counters.blocks_deduplicated += 1
            if pin:
                existing.pins += 1
            self._touch(existing)
            return PutOutcome(key, stored=False)

        meta = BlockMeta(
            key=key, parent=parent, namespace=namespace, model_fingerprint=model_fingerprint, tokens=tokens,
            num_tokens=header.num_tokens, dtype=header.dtype, shape=tuple(header.shape), nbytes=len(payload),
            checksum=header.checksum, locations=[], full=header.num_tokens == layout.block_tokens,
            pins=1 if pin else 0,
        )
        tick(meta)
        self._charge_quota(namespace, len(payload), index)
        done = self._pending[key] = asyncio.Event()
        # Until the block is indexed its parent is a leaf, which making room could delete, orphaning the new
        # block: count the coming child now (the parent may still be demoted: it stays reachable).
        if pmeta is not None:
            pmeta.children += 1
        try:
            await self._place(meta, 0, payload)
            if self.write_policy == WritePolicy.WRITE_THROUGH:
                lower = self._lower(0)
                if lower is not None:
                    # A failure is counted (and ENOSPC degrades the tier); the block stays in DRAM.
                    with contextlib.suppress(*_TIER_FAULTS):
                        await self._place(meta, lower, payload)
            self.index.add(meta)  # published only now that the bytes are in their tiers
        except BaseException:
            for name in list(meta.locations):
                await self._drop_copy(meta, name)
            raise
        finally:
            if pmeta is not None:
                pmeta.children -= 1
                if pmeta.children == 0:  # the put failed: the parent is a leaf again, and a victim
                    for name in pmeta.locations:
                        self._lru[name].add(pmeta)
            del self._pending[key]
            self._quota_pending[namespace] -= len(payload)
            done.set()
        self.counters.blocks_put += 1
        if meta.full:
            await self._drop_superseded_partials(meta)
        return PutOutcome(key, stored=True)

    def _charge_quota(self, namespace: str, nbytes: int, index: int) -> None:
        """Count a new block against its namespace's quota (physical bytes: a deduplicated block is free)."""
        quota = self.namespaces.quota(namespace)
        pending = self._quota_pending.get(namespace, 0)
        used = self.index.physical_bytes(namespace) + pending
        if quota and used + nbytes > quota:
            raise ResourceExhausted(
                f"block {index}: namespace {namespace!r} holds {used} of its {quota}-byte quota and this block needs "
                f"{nbytes} more; close sessions and unpin blocks so they can be evicted, or raise the tenant's quota"
            )
        self._quota_pending[namespace] = pending + nbytes

    async def _stored_form(self, codec: str, header: BlockHeader, payload: bytes, index: int
                           ) -> tuple[BlockHeader, bytes]:
        """The block as the model stores it: raw elements are encoded here when the model's codec is a
        quantizing one; a block the worker already encoded must be in the model's codec and verify."""
        from engram.codec import base, blockformat

        if header.codec == codec:
            if codec != "raw":
                fmt = blockformat.parse(payload, f"block {index}")
                if fmt.shape != tuple(header.shape) or fmt.dtype != header.dtype:
                    raise InvalidArgument(f"block {index}: its v1 header says shape {fmt.shape} {fmt.dtype.name}, "
                                          f"its BlockHeader {tuple(header.shape)} {header.dtype.name}")
            return header, payload
        if header.codec != "raw":
            raise InvalidArgument(f"block {index}: this model stores {codec} blocks; send raw elements (the daemon "
                                  f"encodes them) or {codec} blocks, not {header.codec}")
        dtype = header.dtype.torch_dtype
        kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header.shape)
        blob = await asyncio.to_thread(blockformat.encode, kv, base.codec_by_name(codec), backend=self.codec_backend)
        return dataclasses.replace(header, codec=codec, payload_nbytes=len(blob), checksum=checksum(blob)), blob

    async def _drop_superseded_partials(self, full: BlockMeta) -> None:
        """A full block makes the partial tails under the same parent that it extends redundant."""
        for cand in self.index.partial_children(full.namespace, full.parent):
            if cand.evictable and full.tokens.startswith(cand.tokens):
                await self._delete_block(cand)

    # ---- reads ---------------------------------------------------------------------------------

    def acquire(self, metas: Sequence[BlockMeta]) -> None:
        """Lease blocks for reading: a leased block is not evicted until `release`."""
        for meta in metas:
            meta.leases += 1
            self._touch(meta)
        self._busy += len(metas)

    def release(self, metas: Sequence[BlockMeta]) -> None:
        for meta in metas:
            meta.leases -= 1
            if meta.leases < 0:
                raise AssertionError(f"block {meta.key.hex()} released more often than acquired")
        self._busy -= len(metas)
        self._notify_freed()

    def _notify_freed(self) -> None:
        async def notify() -> None:
            async with self._freed:
                self._freed.notify_all()

        if self._freed._waiters:  # type: ignore[attr-defined]
            asyncio.get_running_loop().create_task(notify())

    async def read(self, meta: BlockMeta, *, promote: bool = True) -> bytes:
        """The block's payload from its fastest verified copy; a corrupt or unreadable copy is dropped and
        the next tried. A hit below the top tier is copied up (promotion) unless promote is False."""
        reasons = []
        for name in list(meta.locations):
            tier = self.tiers[self._rank[name]]
            tc = self.counters.tiers[name]
            try:
                payload = await tier.read(meta.key)
                if checksum(payload) != meta.checksum:
                    raise DataLoss(f"block {meta.key.hex()} failed its checksum in tier {name}")
            except (DataLoss, Unavailable, OSError) as exc:
                if isinstance(exc, DataLoss):
                    tc.corrupt_blocks += 1
                    self.counters.corrupt_blocks += 1
                else:
                    tc.io_errors += 1
                reasons.append(str(exc))
                await self._drop_copy(meta, name)
                continue
            tc.hits += 1
            meta.hits += 1
            self.counters.blocks_served += 1
            self.counters.bytes_served += len(payload)
            rank = self._rank[name]
            for upper in self.tiers[:rank]:
                self.counters.tiers[upper.name].misses += 1
            if promote and rank > 0 and not meta.moving and self.tiers[0].name not in meta.locations:
                await self._promote(meta, payload)
            return payload
        self._unindex(meta)
        raise DataLoss(f"block {meta.key.hex()}: no tier holds a valid copy any more ({'; '.join(reasons)}); "
                       "it was dropped")

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

    async def remove(self, meta: BlockMeta) -> None:
        """Delete a block on request (engram evict). Only a leaf that no reader or move holds: the caller
        removes descendants first (prefix closure) and lifts pins it was told to override."""
        if meta.children or not meta.evictable:
            raise FailedPrecondition(f"block {meta.key.hex()} has children, is pinned, or is being read or moved")
        await self._delete_block(meta)
        self.counters.blocks_evicted_on_request += 1

    # ---- placement, eviction, moves ---------------------------------------------------------------

    def _available(self, i: int) -> bool:
        h = self.health[self.tiers[i].name]
        return h.state == "ok" or time.monotonic() >= h.retry_at

    def _lower(self, i: int) -> int | None:
        for j in range(i + 1, len(self.tiers)):
            if self._available(j):
                return j
        return None

    async def begin_copy(self, meta: BlockMeta, tier_name: str) -> int:
        """Phase one of a copy that someone else performs (engram/transfer.py's batched moves): mark the
        block moving and make room in the tier; returns the bytes reserved there. Never waits for room."""
        i = self._rank[tier_name]
        meta.moving = True
        self._busy += 1
        try:
            need = self.tiers[i].space_for(meta.record())
            await self._make_room(i, need, wait=False)
        except BaseException:
            self.end_copy(meta, tier_name, ok=False)
            raise
        return need

    def begin_copy_now(self, meta: BlockMeta, tier_name: str) -> int | None:
        """begin_copy when the tier has room already, with no await (a batch books hundreds of blocks, and
        the copy engine idles while it does); None when room must be made first: call begin_copy."""
        tier = self.tiers[self._rank[tier_name]]
        need = tier.space_for(meta.record())
        if not tier.reserve(need):
            return None
        meta.moving = True
        self._busy += 1
        return need

    def end_copy(self, meta: BlockMeta, tier_name: str, *, ok: bool) -> None:
        """Phase two: the new copy joins the block's locations only if its bytes landed (ok)."""
        if ok:
            upward = self._rank[tier_name] < min(map(self._rank.__getitem__, meta.locations), default=0)
            meta.locations.append(tier_name)
            meta.locations.sort(key=self._rank.__getitem__)
            self._lru[tier_name].add(meta)
            if upward:
                self.counters.tiers[tier_name].promotions += 1
        meta.moving = False
        self._busy -= 1
        self._notify_freed()

    async def drop_copy(self, meta: BlockMeta, tier_name: str) -> None:
        """Drop one copy of a block that another tier also holds (a caller's own demotion policy)."""
        if tier_name not in meta.locations or len(meta.locations) < 2 or meta.moving or meta.leases:
            raise FailedPrecondition(f"block {meta.key.hex()}: its {tier_name} copy is not a spare copy that "
                                     "may be dropped (the only copy, being read, or moving)")
        await self._drop_copy(meta, tier_name)

    async def _place(self, meta: BlockMeta, i: int, payload: bytes, *, wait: bool = True) -> None:
        """Make room in tier i and write a copy there; the copy counts once the write completed."""
        tier = self.tiers[i]
        rec = meta.record()
        need = tier.space_for(rec)
        await self._make_room(i, need, wait=wait)
        try:
            await tier.write(rec, payload, need)
        except BaseException as exc:
            self._tier_failed(i, exc)
            raise
        self._tier_ok(i)
        meta.locations.append(tier.name)
        meta.locations.sort(key=self._rank.__getitem__)
        self._lru[tier.name].add(meta)

    async def _make_room(self, i: int, need: int, *, wait: bool = True) -> None:
        """Reserve `need` bytes in tier i, evicting (demoting) as needed. With wait, and when every
        candidate is moving or leased, wait for one to come free; promotions pass wait=False because
        their reader holds leases itself, and waiting on each other's leases would deadlock."""
        tier = self.tiers[i]
        if need > tier.capacity_bytes:
            raise ResourceExhausted(
                f"a block of {need} bytes exceeds the {tier.name} tier's capacity of {tier.capacity_bytes} "
                f"bytes; raise tiers.{tier.name}.capacity or use smaller blocks"
            )
        lru = self._lru[tier.name]
        demote = True
        deadline = time.monotonic() + self.wait_for_room_s
        while not tier.reserve(need):
            lower = self._lower(i) if demote else None
            victim = lru.victim(self.index.get, len(tier), leaf_only=lower is None)
            if victim is None and wait and self._busy and time.monotonic() < deadline:
                # Every candidate is moving or being read: one of those ends soon and frees a victim.
                async with self._freed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._freed.wait(), max(0.0, deadline - time.monotonic()))
                continue
            if victim is None:
                raise ResourceExhausted(
                    f"the {tier.name} tier is full ({tier.used_bytes} of {tier.capacity_bytes} bytes) and every "
                    "block in it is pinned, being read or moving; unpin blocks or raise its capacity"
                )
            if len(victim.locations) > 1:
                await self._drop_copy(victim, tier.name)  # a lower tier already holds it
            elif lower is not None:
                try:
                    await self._demote(victim, i, lower)
                except _TIER_FAULTS:
                    demote = False  # the lower tier cannot take it: delete leaves here instead
                    continue
            else:
                await self._delete_block(victim)
            self.counters.tiers[tier.name].evictions += 1

    async def _demote(self, meta: BlockMeta, i: int, j: int) -> None:
        meta.moving = True
        self._busy += 1
        try:
            payload = await self.tiers[i].read(meta.key)
            await self._place(meta, j, payload)
        finally:
            meta.moving = False
            self._busy -= 1
            self._notify_freed()
        self.counters.tiers[self.tiers[i].name].demotions += 1
        self.counters.tiers[self.tiers[i].name].demoted_bytes += len(payload)
        await self._drop_copy(meta, self.tiers[i].name)

    async def _promote(self, meta: BlockMeta, payload: bytes) -> None:
        meta.moving = True
        self._busy += 1
        try:
            await self._place(meta, 0, payload, wait=False)
            self.counters.tiers[self.tiers[0].name].promotions += 1
            self.counters.tiers[self.tiers[0].name].promoted_bytes += len(payload)
        except ResourceExhausted:
            pass  # no room up there right now: the block is served from where it is
        finally:
            meta.moving = False
            self._busy -= 1
            self._notify_freed()

    async def _drop_copy(self, meta: BlockMeta, name: str) -> None:
        if name in meta.locations:
            meta.locations.remove(name)
        try:
            await self.tiers[self._rank[name]].delete(meta.key)
        except OSError:
            self.counters.tiers[name].io_errors += 1

    async def _delete_block(self, meta: BlockMeta) -> None:
        if not meta.evictable:
            raise AssertionError("deleting a pinned, leased or moving block")
        self._unindex(meta)
        for name in list(meta.locations):
            await self._drop_copy(meta, name)

    def _unindex(self, meta: BlockMeta) -> None:
        if self.index.get(meta.key) is not meta:
            return
        _, new_leaf = self.index.remove(meta.key)
        if new_leaf is not None:
            for name in new_leaf.locations:
                self._lru[name].add(new_leaf)

    def _tier_failed(self, i: int, exc: BaseException) -> None:
        name = self.tiers[i].name
        if isinstance(exc, StorageFull):
            self.counters.tiers[name].enospc += 1
            h = self.health[name]
            h.state, h.reason = "degraded", f"{exc}; retrying every {self.retry_s:g}s"
            h.retry_at = time.monotonic() + self.retry_s
        elif isinstance(exc, Unavailable | OSError):
            self.counters.tiers[name].io_errors += 1

    def _tier_ok(self, i: int) -> None:
        h = self.health[self.tiers[i].name]
        if h.state != "ok":
            h.state, h.reason = "ok", ""
            for upper in self.tiers[:i]:  # they evicted leaf-only meanwhile and dropped inner entries
                self._lru[upper.name].rebuild(self.index)

    def _touch(self, meta: BlockMeta) -> None:
        tick(meta)
        for name in meta.locations:
            self._lru[name].touch(meta)

    # ---- recovery and check --------------------------------------------------------------------

    async def recover(self) -> StoreReport:
        """Rebuild the index from the tiers that outlive the process (NVMe): torn, corrupt and stray
        files are removed, and so are blocks whose parent is gone (unreachable). Blocks of a model that is
        not registered (its model file was lost) are kept: they match again once it is registered."""
        report = StoreReport()
        for tier in self.tiers:
            recover = getattr(tier, "recover", None)
            if recover is None:
                continue
            tr = await recover()
            report.scanned += tr.scanned
            report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
            records = {rec.key: rec for rec, _ in tr.records}
            reachable = self._reachable(records)
            for rec in sorted(records.values(), key=lambda r: reachable.get(r.key, -1)):
                if rec.key in reachable and rec.key not in self.index:
                    meta = BlockMeta.from_record(rec, [tier.name])
                    tick(meta)
                    self.index.add(meta)
                    self._lru[tier.name].add(meta)
                    report.recovered_blocks += 1
                elif rec.key not in reachable:
                    await tier.delete(rec.key)
                    report.findings.append((f"{tier.name}:{rec.key.hex()}", "its parent block is gone (orphan)", True))
            report.valid += report.recovered_blocks
        return report

    def _reachable(self, records: dict[bytes, BlockRecord]) -> dict[bytes, int]:
        """Depth of every record whose chain reaches its root through records or indexed blocks, so the
        caller can add parents before children; orphans are left out."""
        depth: dict[bytes, int | None] = {}
        for key in records:
            path: list[bytes] = []
            k = key
            parent_depth: int | None
            while True:
                if k in depth:
                    parent_depth = depth[k]
                    break
                rec = records.get(k)
                if rec is None or k in path:
                    if rec is not None and k not in path:
                        path.append(k)
                    parent_depth = None
                    break
                path.append(k)
                if rec.parent == self.root(rec.namespace, rec.model_fingerprint) or rec.parent in self.index:
                    parent_depth = -1
                    break
                k = rec.parent
            for n, pk in enumerate(reversed(path)):
                depth[pk] = None if parent_depth is None else parent_depth + 1 + n
        return {k: d for k, d in depth.items() if d is not None}

    async def check(self, *, fix: bool) -> StoreReport:
        """Verify every stored copy (DRAM payloads, NVMe files); with fix, drop what is broken."""
        report = StoreReport()
        for tier in self.tiers:
            tier_check = getattr(tier, "check", None)
            if tier_check is not None:
                tr = await tier_check(fix=fix)
                report.scanned += tr.scanned
                report.valid += tr.valid
                report.findings += [(f.path, f.problem, f.fixed) for f in tr.findings]
                on_disk = {rec.key for rec, _ in tr.records}
                for meta in list(self.index):
                    if tier.name in meta.locations and meta.key not in on_disk:
                        report.findings.append((meta.key.hex(), f"indexed in {tier.name} but its file is invalid "
                                                "or missing", fix))
                        if fix:
                            tier.forget(meta.key)  # type: ignore[attr-defined]
                            meta.locations.remove(tier.name)
                            if not meta.locations:
                                self._unindex(meta)
                continue
            for meta in list(self.index):
                if tier.name not in meta.locations:
                    continue
                report.scanned += 1
                payload = await tier.read(meta.key)
                if checksum(payload) == meta.checksum:
                    report.valid += 1
                    continue
                report.findings.append((f"{tier.name}:{meta.key.hex()}", "payload checksum mismatch", fix))
                if fix:
                    await self._drop_copy(meta, tier.name)
                    if not meta.locations:
                        self._unindex(meta)
        return report

    # ---- stats ---------------------------------------------------------------------------------

    def model_usage(self) -> list[ModelUsage]:
        acc: dict[bytes, list[int]] = {}
        for meta in self.index:
            row = acc.setdefault(meta.model_fingerprint, [0, 0, 0])
            row[0] += 1
            row[1] += meta.nbytes
            row[2] += meta.num_tokens
        out = []
        for spec in self.registry:
            blocks, nbytes, tokens = acc.get(spec.fingerprint, [0, 0, 0])
            out.append(ModelUsage(spec.fingerprint, spec.name, spec.codec, blocks, nbytes, tokens,
                                  tokens * spec.layout.bytes_per_token()))
        return out

    def reference(self, metas: Sequence[BlockMeta], delta: int) -> None:
        """Add (+1) or drop (-1) one session's reference to blocks; eviction prefers unreferenced blocks."""
        for meta in metas:
            was = meta.refs > 0
            meta.refs += delta
            if meta.refs < 0:
                raise AssertionError(f"block {meta.key.hex()} unreferenced more often than referenced")
            if was != (meta.refs > 0) and self.index.get(meta.key) is meta:
                for name in meta.locations:
                    self._lru[name].touch(meta)  # re-queued in its new class (engram/eviction.py)

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        blocks = self.index.blocks_in(namespace)
        return NamespaceUsage(len(blocks), self.index.physical_bytes(namespace),
                              sum(m.nbytes * max(1, m.refs) for m in blocks), sum(1 for m in blocks if m.refs))

    def pinned_blocks(self, tier_name: str) -> int:
        return sum(1 for m in self.index if tier_name in m.locations and m.pins > 0)

    async def close(self) -> None:
        for tier in self.tiers:
            await tier.close()

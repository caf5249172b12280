"""BlockStore: the one object that knows blocks, their tiers, pins and leases. Its callers (the gRPC
service, inspection, sessions, peers, transfers, the demo and benchmarks) use its verbs (lookup, match,
find, put, read, reading, served, pin, remove, tier_stats, ...) and never its index or tiers directly.

The rules kept here:
- A block is published in the index only after its payload is written (its copies are placed by
  engram/store/placement.py, which keeps the rules of moves between tiers), so no reader ever sees a block
  before its bytes.
- A pinned block, a leased block (one a reader holds) and a moving block are never evicted.
- Every payload is verified against its checksum when read; a corrupt copy is dropped and the next copy
  (or DATA_LOSS) is served, never the corrupt bytes.
- A block whose durable (NVMe) copy is dropped as damaged while memory holds a copy is written to NVMe again
  (`drop_damaged_copy`, the one place every damage path drops a copy through).
- Every block served is counted in one place (`served`), whichever path served it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from engram import limits
from engram.api import TierStats
from engram.block import (
    CHECKSUM_OFF_LOOP_BYTES,
    BlockHeader,
    BlockRecord,
    Payload,
    checksum,
    checksum_off_loop,
    copy_off_loop,
)
from engram.borrowed import in_thread, to_its_end
from engram.codec import stored
from engram.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    brief,
)
from engram.eviction import CLOCK, Expected
from engram.index import BlockMeta, ChainIndex, PrefixMatch, PrefixWalk, Tally
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.layout import DType, ModelSpec, StreamSpec
from engram.logbudget import LogBudget
from engram.loopturns import SLICE_BLOCKS, pause
from engram.registry import ModelRegistry
from engram.store import durable, recovery
from engram.store.counters import (
    ModelUsage,
    NamespaceUsage,
    StoreCounters,
    TierCounters,
    TierHealth,
    own_tier_stats,
    tier_stats,
)
from engram.store.flusher import Flusher, FlushResult, Pending
from engram.store.pins import PinShare, SharesOf
from engram.store.placement import Placement
from engram.store.quality import QualityWatch, Sample, persisted_kinds
from engram.tenancy import NamespacePolicy, OpenNamespaces
from engram.tiers.base import StaleRecord, Tier
from engram.tiers.dram import DramTier
from engram.tiers.pool import PoolTier

log = logging.getLogger("engram.store")
ROOTS_KEPT = 4096  # root keys `root` keeps hashed (namespaces x models), all forgotten once more are asked


class WritePolicy(enum.StrEnum):
    WRITE_BACK = "write-back"  # puts land in the top tier; lower tiers receive blocks when it is full
    WRITE_THROUGH = "write-through"  # a put is acknowledged once it is also in the next tier (durable)


class PutOutcome(NamedTuple):
    """What a put of one block did. A named tuple, as BlockRecord (engram/block.py): every put builds one, and a
    frozen dataclass costs three times as much to build."""

    key: bytes
    stored: bool  # False: the block was already present (deduplicated, unless skipped)
    durable: bool = True  # False: write-through acknowledged it without a durable copy (engram/store/durable.py)
    skipped: bool = False  # an in-place put's block stored when reserved: never written, so not deduplicated either


def _outcome(key: bytes, stored: bool, durable: bool) -> PutOutcome:
    """PutOutcome(key, stored, durable) without the Python frame of a named tuple's __new__ (every put builds one;
    compiled, that frame was 2% of a replayed miss): tuple.__new__, as that __new__ does."""
    return tuple.__new__(PutOutcome, (key, stored, durable, False))


def _encoded(payload: Payload, dtype: DType, shape: tuple[int, ...], codec: str, lossless: bool, backend: str
             ) -> tuple[torch.Tensor, bytes, int]:
    """A raw put's elements in a quantizing model's stored form (a v1 block of the raw codec when `lossless`), with
    its checksum, as one worker thread's work (engram/borrowed.py): the elements are copied out of the payload
    there (a sample keeps them past the put, and the data channel's buffer is reused after it), where that 16 MiB
    copy held the event loop (benchmarks/RESULTS.md put_get, session 50). Returns the elements too."""
    kv = stored.decode(payload, stored.RAW, dtype, shape)
    blob = stored.encode_lossless(kv) if lossless else stored.encode(kv, codec, backend=backend)
    return kv, blob, checksum(blob)


def _streams_stored(payload: Payload, streams: Sequence[StreamSpec], shape: tuple[int, ...], backend: str,
                    where: str) -> tuple[Payload, int | None]:
    """A stream layout's block in its stored form and that form's checksum, or the payload itself and None when
    it was sent so: encoded, compared and hashed in one worker thread (a 16 MiB compare held the loop too)."""
    blob = stored.stored_streams(payload, streams, shape, backend=backend, where=where)
    if blob is payload or blob == payload:
        return payload, None
    return blob, checksum(blob)


class BlockStore:
    def __init__(self, tiers: Sequence[Tier], registry: ModelRegistry, *,
                 write_policy: WritePolicy = WritePolicy.WRITE_BACK, retry_s: float = 5.0,
                 codec_backend: str = "reference", namespaces: NamespacePolicy | None = None,
                 on_nvme_failure: str = "fail", write_back_window_s: float = 5.0,
                 write_back_window_bytes: int = 2**30, quality: QualityWatch | None = None,
                 eviction: str = "learned") -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.registry = registry
        self.write_policy = write_policy
        self.on_nvme_failure = durable.OnNvmeFailure(on_nvme_failure)  # write-through without NVMe: fail or degrade
        self.codec_backend = codec_backend  # where raw puts are encoded: "cpu", "reference" or "triton"
        # error of the blocks encoded here, sampled, and the lossless fallback (engram/store/quality.py)
        self.quality = quality or QualityWatch(0, backend=codec_backend)
        self.index = ChainIndex()
        self.namespaces = namespaces or OpenNamespaces()  # key salts and quotas (engram/tenancy.py)
        self._roots: dict[tuple[str, bytes, bytes], bytes] = {}  # (namespace, model, salt) -> root key (`root`)
        self.counters = StoreCounters(tiers={t.name: TierCounters() for t in tiers}, counted=self.namespaces.counted)
        self.placement = Placement(list(tiers), self.index, self.counters, self.damaged_in_a_move, retry_s=retry_s)
        self.index.rank = self.placement.rank  # where each tier's copies go in a block's locations (and its home)
        if eviction not in ("learned", "lru"):
            raise ValueError(f"eviction is learned or lru, got {eviction!r}")
        if eviction == "lru":  # the model still counts (Stats shows what it would learn) but never ranks
            self.placement.model.min_evidence = 1 << 62
        self._quota_pending: dict[str, int] = {}  # bytes of puts in flight, per namespace
        self._held: dict[str, int] = {}  # bytes a namespace holds outside the index (persisted windows)
        # Puts in flight, by key, each with the events of the puts of the same block waiting for it (made only
        # when one waits: most puts have none, and an asyncio.Event per put cost a microsecond each)
        self._pending: dict[bytes, list[asyncio.Event]] = {}
        # Puts in flight (and open Put streams) per (namespace, model): a put looks its model up first and
        # publishes its block after awaits, so the model may not be forgotten meanwhile (engram/server/modelroom.py)
        self._putting: dict[tuple[str, bytes], int] = {}
        self.background: set[asyncio.Task[None]] = set()  # work started by recovery; cancelled by close
        # Blocks held only in volatile tiers go to NVMe in the background (the loss window; engram/store/flusher.py).
        self.flusher = Flusher(self, window_s=write_back_window_s, window_bytes=write_back_window_bytes) \
            if durable.durable_tier(self.placement) is not None else None
        # The durable tier records pins beside its blocks, so a restart pins those that come back (store/pins.py)
        rank = durable.durable_tier(self.placement)
        self.index.pins_listener = None if rank is None else getattr(self.placement.tiers[rank], "note_pins", None)
        self.started = time.time()
        self.drop_log = LogBudget()  # copies dropped as damaged: one line each, a burst bounded (note_dropped)

    def on_cold(self, listener: Callable[[BlockMeta], None]) -> None:
        """Call `listener(meta)` whenever a block's last copy in a memory tier (HBM, DRAM) is dropped: demoted
        to NVMe, or deleted. Sessions drop the rebuilt windows that only made sense beside hot blocks."""
        self.placement.went_cold.append(listener)

    # Views kept for readers of the store's state (tests, benchmarks); callers act through the verbs.
    @property
    def tiers(self) -> list[Tier]:
        return self.placement.tiers

    @property
    def health(self) -> dict[str, TierHealth]:
        return self.placement.health

    @property
    def wait_for_room_s(self) -> float:
        return self.placement.wait_for_room_s

    @wait_for_room_s.setter
    def wait_for_room_s(self, seconds: float) -> None:
        self.placement.wait_for_room_s = seconds

    def __len__(self) -> int:
        return len(self.index)

    # ---- queries -------------------------------------------------------------------------------

    def spec(self, model_fingerprint: bytes) -> ModelSpec:
        """The registered model (NotFound says to register it)."""
        return self.registry.get(model_fingerprint)

    def root(self, namespace: str, model_fingerprint: bytes) -> bytes:
        """The parent key of a chain's first block in this namespace (salted when tenancy is on). Kept once
        hashed (every put_chain asks), by namespace, model and salt; forgotten all at once past ROOTS_KEPT."""
        salt = self.namespaces.salt(namespace)
        at = (namespace, model_fingerprint, salt)
        key = self._roots.get(at)
        if key is None:
            if len(self._roots) >= ROOTS_KEPT:
                self._roots.clear()
            key = self._roots[at] = root_key(namespace, model_fingerprint, salt)
        return key

    def match(self, namespace: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray) -> PrefixMatch:
        """The stored prefix of `tokens`, without counting a lookup or touching recency (inspection, and
        sessions re-resolving what they reference)."""
        spec = self.spec(model_fingerprint)
        return self.index.match(namespace, model_fingerprint, np.asarray(tokens, dtype="<i4"),
                                spec.layout.block_tokens, self.namespaces.salt(namespace))

    def lookup(self, namespace: str, model_fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *,
               use: bool = True) -> PrefixMatch:
        """`match`, counted as a lookup, and a use of every matched block; use=False: a client's probe
        (LookupRequest.probe), counted as a lookup but not as a use (the read that follows is the use)."""
        arr = np.asarray(tokens, dtype="<i4")
        match = self.match(namespace, model_fingerprint, arr)
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += match.matched_tokens
        self.counters.lookup_miss_tokens += len(arr) - match.matched_tokens
        if use:
            self.placement.use_all(match.blocks)
        return match

    def walk(self, namespace: str, model_fingerprint: bytes, tokens: np.ndarray) -> PrefixWalk:
        """A `match` to be walked a slice at a time (`lookup_walk`); the caller closes it."""
        spec = self.spec(model_fingerprint)
        return self.index.walk(namespace, model_fingerprint, tokens, spec.layout.block_tokens,
                               self.namespaces.salt(namespace))

    async def lookup_walk(self, walk: PrefixWalk) -> None:
        """Walk to its end, `SLICE_BLOCKS` at a time with a turn of the event loop between slices (a long prefix);
        a walk done in one slice never awaits. Watched from its first turn, so the answer ends before a block
        removed meanwhile. Nothing is counted: the caller counts what it answers (`count_lookup`)."""
        while not walk.step(SLICE_BLOCKS):
            walk.watch()
            await pause()

    async def count_lookup(self, asked: int, answered: Sequence[BlockMeta], matched: int, *, use: bool = True
                           ) -> None:
        """Count a lookup of `asked` tokens by its answer: the blocks and tokens the caller answered, which a block
        removed between a walk's slices cut (the blocks past the cut were neither hits nor uses). use=False: a
        client's probe, counted as a lookup but not as a use (`lookup`). The uses go `SLICE_BLOCKS` at a time with a
        turn of the event loop between slices (a long prefix's are tens of milliseconds)."""
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += matched
        self.counters.lookup_miss_tokens += asked - matched
        if not use:
            return
        for start in range(0, len(answered), SLICE_BLOCKS):
            if start:
                await pause()
            self.placement.use_all(answered[start : start + SLICE_BLOCKS])

    def lookup_keys(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes]) -> PrefixMatch:
        """`lookup` for a caller that derived the chain's keys itself (the trace replayer hashes each distinct
        block once for a whole trace, not at every lookup): the longest run of stored full blocks under
        `keys`, counted as a lookup and a use of every matched block. A key names its prefix, so there are no
        tokens to compare and no partial tail to look for."""
        bt = self.spec(model_fingerprint).layout.block_tokens
        match = self.index.match_keys(namespace, model_fingerprint, keys)
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += match.matched_tokens
        self.counters.lookup_miss_tokens += len(keys) * bt - match.matched_tokens
        self.placement.use_all(match.blocks)
        return match

    def find(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes]) -> list[BlockMeta]:
        """Metadata for keys in this namespace and model; NotFound names the first missing key (and its place
        among `keys`: a client's Get in parts counts from 0 in each part, so the key is what a caller can use)."""
        self.spec(model_fingerprint)
        metas = []
        for i, key in enumerate(keys):
            meta = self.index.get_in(namespace, key)
            # A block of another namespace is reported exactly like an absent one (and never even looked at).
            if meta is None or meta.model_fingerprint != model_fingerprint:
                raise NotFound(f"block {brief(key)} is not stored in this namespace and model "
                               f"(key {i} of the {len(keys)} this request named)")
            metas.append(meta)
        return metas

    def holds(self, namespace: str, key: bytes) -> bool:
        return self.index.get_in(namespace, key) is not None

    def block(self, key: bytes) -> BlockMeta | None:
        """A block by key in any namespace: for the daemon's own bookkeeping (peers, inspection by admins)."""
        return self.index.get(key)

    def blocks(self, namespace: str | None = None) -> list[BlockMeta]:
        """Every stored block, or one namespace's."""
        return list(self.index) if namespace is None else self.index.blocks_in(namespace)

    def children(self, key: bytes) -> list[BlockMeta]:
        return self.index.children_of(key)

    def namespaces_in_use(self) -> list[str]:
        return self.index.namespaces()

    def tier_rank(self, name: str) -> int:
        return self.placement.rank[name]

    # ---- writes --------------------------------------------------------------------------------

    def admit(self, namespace: str, model_fingerprint: bytes, header: BlockHeader, *, index: int = 0) -> int:
        """Refuse a block whose header announces more than its namespace's quota or the top tier can take,
        before its payload is buffered: a Put streams a block's bytes after its header, and buffering
        first let one put of a 4 GiB block grow the daemon by a GiB on a 64 MiB tier. (Room made by
        eviction is the put's business; this asks only whether the block could ever fit.) Returns the bytes
        the block will be stored in."""
        spec = self.spec(model_fingerprint)
        header.validate(spec.layout, index=index, model_codec=spec.codec)
        nbytes = stored.stored_nbytes(spec.stored_codec, tuple(header.shape), header.dtype, spec.streams)
        top = self.placement.tiers[0]
        if nbytes > top.capacity_bytes:  # (a raw payload the daemon encodes is bounded by max_block_bytes)
            raise ResourceExhausted(
                f"block {index}: {nbytes} bytes cannot fit the {top.name} tier's "
                f"capacity of {top.capacity_bytes} bytes; raise tiers.{top.name}.capacity or register the model "
                "with fewer block_tokens")
        self._check_quota(namespace, nbytes, index)
        return nbytes

    def quota_used(self, namespace: str) -> int:
        """What counts against a namespace's quota: its stored blocks (every block once), its puts in
        flight and what it holds outside the index (persisted session windows)."""
        return (self.index.physical_bytes(namespace) + self._quota_pending.get(namespace, 0)
                + self._held.get(namespace, 0))

    def _check_quota(self, namespace: str, nbytes: int, index: int | None, what: str = "this block") -> None:
        quota = self.namespaces.quota(namespace)
        if not quota:
            return  # none: what is used need not be added up (every put comes here)
        used = self.quota_used(namespace)
        if used + nbytes > quota:
            where = f"block {index}: " if index is not None else ""
            raise ResourceExhausted(
                f"{where}namespace {namespace!r} holds {used} of its {quota}-byte quota and {what} needs "
                f"{nbytes} more; close sessions and unpin blocks so they can be evicted, or raise the tenant's quota"
            )

    def hold(self, namespace: str, nbytes: int, what: str) -> None:
        """Count bytes a namespace keeps outside the index (a persisted window) against its quota;
        ResourceExhausted when they do not fit. `release_held` gives them back."""
        self._check_quota(namespace, nbytes, None, what)
        self._held[namespace] = self._held.get(namespace, 0) + nbytes

    def release_held(self, namespace: str, nbytes: int) -> None:
        left = self._held.get(namespace, 0) - nbytes
        if left < 0:
            raise AssertionError(f"namespace {namespace!r} released more held bytes than it held")
        if left:
            self._held[namespace] = left
        else:
            self._held.pop(namespace, None)

    def begin_put(self, namespace: str, model_fingerprint: bytes) -> None:
        """A put of the model's blocks into the namespace starts: the model is in use until `end_put`."""
        key = (namespace, model_fingerprint)
        self._putting[key] = self._putting.get(key, 0) + 1

    def end_put(self, namespace: str, model_fingerprint: bytes) -> None:
        key = (namespace, model_fingerprint)
        left = self._putting[key] - 1
        if left:
            self._putting[key] = left
        else:
            del self._putting[key]

    def models_being_put(self) -> set[tuple[str, bytes]]:
        """(namespace, model) of every put in flight."""
        return set(self._putting)

    async def put(self, namespace: str, model_fingerprint: bytes, parent: bytes, header: BlockHeader,
                  payload: Payload, *, pin: bool = False, index: int = 0, pin_share: PinShare | None = None
                  ) -> PutOutcome:
        """Validate, dedupe and store one block under the key its parent and tokens hash to. With pin and a
        `pin_share` (the caller's, engram/store/pins.py), a block whose pin would pass the share is refused, whole
        (RESOURCE_EXHAUSTED, as past a quota): stored unpinned, it would be evicted while its caller counts on it."""
        self.begin_put(namespace, model_fingerprint)
        try:
            return await self._put(namespace, model_fingerprint, parent, header, payload, pin=pin, index=index,
                                   pin_share=pin_share)
        finally:
            self.end_put(namespace, model_fingerprint)

    async def _put(self, namespace: str, model_fingerprint: bytes, parent: bytes, header: BlockHeader,
                   payload: Payload, *, pin: bool, index: int, pin_share: PinShare | None) -> PutOutcome:
        limits.check_namespace(namespace)  # also for blocks that did not come through a Put (peers)
        spec = self.spec(model_fingerprint)
        layout = spec.layout
        header.validate(layout, index=index, model_codec=spec.codec)
        await header.verify_payload(payload, index=index)  # hashed off the loop when large; ended before it returns
        header, payload, sample = await self._stored_form(namespace, spec, header, payload, index)
        pmeta = None
        if parent != self.root(namespace, model_fingerprint):
            pmeta = self.index.get_in(namespace, parent)
            if pmeta is None or pmeta.model_fingerprint != model_fingerprint:
                raise FailedPrecondition(
                    f"block {index}: parent block {brief(parent)} is not stored (it may have been "
                    "evicted); Lookup again and put the chain from its first missing block"
                )
            if not pmeta.full:
                raise FailedPrecondition(
                    f"block {index}: its parent is a partial block; only a chain's last block may have fewer "
                    "than block_tokens tokens"
                )
        key = block_key(parent, header.tokens)
        return await self._store(namespace, model_fingerprint, parent, pmeta, key, tokens_to_bytes(header.tokens),
                                 header.num_tokens, layout.block_tokens, header.dtype, tuple(header.shape),
                                 header.checksum, payload, pin=pin, index=index, sample=sample, pin_share=pin_share)

    async def put_chain(self, namespace: str, model_fingerprint: bytes, parent: bytes,
                        blocks: Sequence[tuple[bytes, bytes]], payload: bytes, payload_checksum: int
                        ) -> list[BlockMeta]:
        """The trace replayer's put (engram/trace/replay.py): a chain of full blocks under `parent` (the root or
        a stored block), given as (key, tokens as int32 bytes) that the caller derived itself, every block with
        the same raw `payload`. What `put` checks of a client's block is skipped (the header against the
        layout, the payload's checksum, the codec, hashing the key from the tokens: the caller's own blocks,
        right by construction); what decides where blocks go is the same code as `put`'s (dedupe, quota,
        room made by each tier's eviction order with demotion, publishing in the index). Stops at the first
        block that no tier can take; returns the blocks stored (put, or found already stored), in order."""
        self.begin_put(namespace, model_fingerprint)
        try:
            return await self._put_chain(namespace, model_fingerprint, parent, blocks, payload, payload_checksum)
        finally:
            self.end_put(namespace, model_fingerprint)

    async def _put_chain(self, namespace: str, model_fingerprint: bytes, parent: bytes,
                         blocks: Sequence[tuple[bytes, bytes]], payload: bytes, payload_checksum: int
                         ) -> list[BlockMeta]:
        limits.check_namespace(namespace)
        spec = self.spec(model_fingerprint)
        layout = spec.layout
        bt = layout.block_tokens
        if not stored.is_raw(spec.stored_codec) or len(payload) != layout.block_nbytes(bt):
            raise InvalidArgument(f"put_chain takes raw full blocks of {layout.block_nbytes(bt)} bytes of a model "
                                  f"stored raw, got {len(payload)} bytes for codec {spec.stored_codec}")
        pmeta = None
        if parent != self.root(namespace, model_fingerprint):
            pmeta = self.index.get_in(namespace, parent)
            if pmeta is None or pmeta.model_fingerprint != model_fingerprint or not pmeta.full:
                raise FailedPrecondition(f"parent block {brief(parent)} is not a stored full block")
        shape = layout.block_shape(bt)
        done: list[BlockMeta] = []
        for i, (key, tokens) in enumerate(blocks):
            if len(tokens) != 4 * bt:
                raise InvalidArgument(f"block {i}: {len(tokens) // 4} tokens, a full block has {bt}")
            try:
                await self._store(namespace, model_fingerprint, parent, pmeta, key, tokens, bt, bt, layout.dtype,
                                  shape, payload_checksum, payload, index=i)
            except ResourceExhausted:
                break  # the rest of the chain would have no parent
            parent, pmeta = key, self.index.get_in(namespace, key)
            if pmeta is None:
                break  # stored and already gone (it made room for nothing else): the chain ends here
            done.append(pmeta)
        return done

    async def _store(self, namespace: str, model_fingerprint: bytes, parent: bytes, pmeta: BlockMeta | None,
                     key: bytes, tokens: bytes, num_tokens: int, block_tokens: int, dtype: DType,
                     shape: tuple[int, ...], payload_checksum: int, payload: Payload, *, pin: bool = False,
                     index: int = 0, sample: Sample | None = None, pin_share: PinShare | None = None) -> PutOutcome:
        """Dedupe and store one block whose header and payload were checked (put) or are the caller's own
        (put_chain): placed, then published in the index; `sample`, the raw elements a lossy encoding was
        sampled from, is measured once stored (engram/store/quality.py)."""
        if self.flusher is not None and self.write_policy == WritePolicy.WRITE_BACK:
            await self.flusher.admit(len(payload))  # the loss window's byte bound: wait for the disk
        while True:
            while (waiting := self._pending.get(key)) is not None:
                done = asyncio.Event()  # the same block is being stored by another put: dedupe against it
                waiting.append(done)
                await done.wait()
            existing = self.index.get_in(namespace, key)
            if existing is None:
                break
            if existing.tokens != tokens:
                raise FailedPrecondition(f"block {index}: key {key.hex()} is stored with other tokens (hash collision)")
            self.placement.use(existing)
            try:  # this put's bytes are dropped on the strength of the stored copy: it must verify
                verified = await self.verify_stored(existing, during="a put of it (deduplicated)")
            except DataLoss:
                continue  # no copy of it verified and it was dropped: this put stores its own bytes anew
            if self.index.get_in(namespace, key) is not existing:
                continue  # it left while its NVMe copy was read
            if pin:
                if pin_share is not None:
                    pin_share.check(self.index, pin_share.growth(self.index, [existing]), f"block {index}")
                self.add_pin(existing, share=pin_share)
            ok = True
            if self.write_policy == WritePolicy.WRITE_THROUGH:  # acknowledged again: durable again, too
                try:
                    ok = await durable.make_durable_again(self, existing, payload, payload_checksum, index=index,
                                                          verified=verified)
                except DataLoss:
                    continue  # damaged since it was verified, and dropped: this put stores its own bytes anew
            self.counters.blocks_deduplicated += 1
            self.counters.of(namespace).blocks_deduplicated += 1
            return _outcome(key, False, ok)

        self._check_parent_stayed(namespace, parent, pmeta, index)  # the awaits above let it be evicted
        meta = BlockMeta(
            key=key, parent=parent, namespace=namespace, model_fingerprint=model_fingerprint, tokens=tokens,
            num_tokens=num_tokens, dtype=dtype, shape=shape, nbytes=len(payload),
            checksum=payload_checksum, locations=[], full=num_tokens == block_tokens,
            pins=1 if pin else 0, operator_pins=1 if pin and pin_share is None else 0,
            pin_owners={pin_share.tenant: 1} if pin and pin_share is not None else None,
        )
        if pin_share is not None and pin:  # here, before its bytes are written; and as it is published, exactly
            pin_share.check(self.index, pin_share.growth(self.index, [meta]), f"block {index}")
        self.placement.model.arrive(meta)
        self._charge_quota(namespace, len(payload), index)
        waiters: list[asyncio.Event] = []
        self._pending[key] = waiters
        # Until the block is indexed its parent is a leaf, which making room could delete, orphaning the new
        # block: count the coming child now (the parent may still be demoted: it stays reachable).
        if pmeta is not None:
            pmeta.children += 1
        placement = self.placement
        ok = True
        try:
            await placement.place(meta, 0, payload)
            if self.write_policy == WritePolicy.WRITE_THROUGH:
                ok = await durable.make_durable(self, meta, payload, index=index)  # NotDurable: not acknowledged
            # Making room may have demoted the parent and found its copy damaged (dropped): no orphan is published.
            self._check_parent_stayed(namespace, parent, pmeta, index)
            if pin_share is not None and pin:  # other pins may have come while the bytes were written
                pin_share.check(self.index, pin_share.growth(self.index, [meta]), f"block {index}")
            self.index.add(meta)  # published only now that the bytes are in their tiers
            placement.compete(meta)
        except BaseException:
            for name in list(meta.locations):
                await placement.drop_copy(meta, name)
            raise
        finally:
            if pmeta is not None:
                pmeta.children -= 1
                if pmeta.children == 0:  # the put failed: the parent is a leaf again, and a victim
                    for name in pmeta.locations:
                        placement.victims[name].leaf_again(pmeta)
            del self._pending[key]
            self._quota_pending[namespace] -= len(payload)
            for w in waiters:
                w.set()
        self.counters.blocks_put += 1
        self.counters.of(namespace).blocks_put += 1
        if sample is not None:  # measured off the loop; this put does not wait (engram/store/quality.py)
            self.quality.measure_later(sample, payload, dtype, shape,
                                       meta.locations[0] if meta.locations else placement.tiers[0].name)
        if self.flusher is not None and not durable.is_durable(placement, meta):
            self.flusher.note(meta, now=not ok)  # write-back's window; or write-through degraded: at once
        if meta.full and self.index.has_partial_children(namespace, parent):
            await self._drop_superseded_partials(meta)
        return _outcome(key, True, ok)

    def _check_parent_stayed(self, namespace: str, parent: bytes, pmeta: BlockMeta | None, index: int) -> None:
        """The parent checked before a put's awaits is still the stored one: a child published under a parent
        that left meanwhile (evicted while the put waited for the write-back window or another put of its key,
        or dropped as damaged when making room demoted it) is an orphan no Lookup reaches and a restart drops."""
        if pmeta is not None and self.index.get_in(namespace, parent) is not pmeta:
            raise FailedPrecondition(f"block {index}: parent block {brief(parent)} left the store while this put "
                                     "waited (evicted, or dropped as damaged); Lookup again and put the chain from "
                                     "its first missing block")

    def _charge_quota(self, namespace: str, nbytes: int, index: int) -> None:
        """Count a new block against its namespace's quota (physical bytes: a deduplicated block is free)."""
        self._check_quota(namespace, nbytes, index)
        self._quota_pending[namespace] = self._quota_pending.get(namespace, 0) + nbytes

    async def _stored_form(self, namespace: str, spec: ModelSpec, header: BlockHeader, payload: Payload, index: int
                           ) -> tuple[BlockHeader, Payload, Sample | None]:
        """The block as the model stores it: raw elements are encoded here when the model's codec is a
        quantizing one (or kept lossless, a v1 block of the raw codec, while the fallback holds for its layer
        kinds; and sampled for the error telemetry); a block the worker already encoded must be in the
        model's codec and verify. A stream layout's v2 block: each stream raw (encoded here) or in its codec
        (verified); not sampled yet."""
        where = f"block {index}"
        codec = spec.stored_codec
        if stored.is_streams(codec):
            blob, blob_checksum = await in_thread(_streams_stored, payload, spec.streams, tuple(header.shape),
                                                  self.codec_backend, where)
            if blob_checksum is None:
                return header, payload, None
            return dataclasses.replace(header, payload_nbytes=len(blob), checksum=blob_checksum), blob, None
        quality = self.quality
        if header.codec == codec:  # raw models, and blocks a worker encoded (no raw elements here to measure)
            if len(payload) < CHECKSUM_OFF_LOOP_BYTES or stored.is_raw(codec):
                stored.check_encoded(payload, codec, header.dtype, tuple(header.shape), where)
            else:  # its body's hash and scales: in a thread a cancelled put waits for (the data channel's buffer)
                await in_thread(stored.check_encoded, payload, codec, header.dtype, tuple(header.shape), where)
            sample = None
            if stored.is_raw(codec) and quality.sample(len(payload)):  # stored as sent: counted with error 0
                sample = Sample(None, stored.RAW, persisted_kinds(spec.layout), codec, namespace)
            return header, payload, sample
        if not stored.is_raw(header.codec):
            raise InvalidArgument(f"{where}: this model stores {codec} blocks; send raw elements (the daemon "
                                  f"encodes them) or {codec} blocks, not {header.codec}")
        sampled = quality.sample(len(payload))
        kinds = persisted_kinds(spec.layout) if sampled or quality.fallbacks else ()  # (most puts need neither)
        fallback = quality.lossless(namespace, codec, kinds)
        kv, encoded, encoded_checksum = await in_thread(_encoded, payload, header.dtype, tuple(header.shape), codec,
                                                        fallback is not None, self.codec_backend)
        sample = Sample(kv, codec, kinds, codec, namespace) if sampled else None
        if fallback is not None:  # kept bit-exact: measured, when sampled, under the codec it is in (raw)
            fallback.blocks += 1
            if sample is not None:
                sample = dataclasses.replace(sample, codec=stored.RAW)
        header = dataclasses.replace(header, codec=codec, payload_nbytes=len(encoded), checksum=encoded_checksum)
        return header, encoded, sample

    async def after_put(self, metas: Sequence[BlockMeta], not_durable: set[bytes]) -> None:
        """What follows publishing blocks that were written into a pool in place (engram/store/inplace.py, which
        made them durable first under write-through; `not_durable`: the keys acknowledged without a durable
        copy): the flusher's note of what lacks one, and the partial tails they supersede go."""
        placement = self.placement
        for meta in metas:
            if self.flusher is not None and not durable.is_durable(placement, meta):
                self.flusher.note(meta, now=meta.key in not_durable)
            if meta.full:
                await self._drop_superseded_partials(meta)
        if self.flusher is not None and self.write_policy == WritePolicy.WRITE_BACK:
            await self.flusher.admit(0)  # in-place puts are held back after the fact: one reservation at most

    async def _drop_superseded_partials(self, full: BlockMeta) -> None:
        """A full block makes the partial tails under the same parent that it extends redundant."""
        for cand in self.index.partial_children(full.namespace, full.parent):
            if cand.evictable and full.tokens.startswith(cand.tokens):
                await self.placement.delete_block(cand)

    # ---- reads ---------------------------------------------------------------------------------

    def acquire(self, metas: Sequence[BlockMeta]) -> None:
        """Lease blocks for reading: a leased block is not evicted until `release`."""
        now = CLOCK.now
        for meta in metas:
            meta.leases += 1
            meta.tick = now  # its age restarts; no comeback is counted (the Lookup before it counted one)
        self.placement.busy += len(metas)

    def release(self, metas: Sequence[BlockMeta]) -> None:
        if not metas:
            return  # nothing freed: the victim searches keep what they found (a replay's miss, with or without a
            # `reading` of no blocks, must decide alike)
        for meta in metas:
            meta.leases -= 1
            if meta.leases < 0:
                raise AssertionError(f"block {meta.key.hex()} released more often than acquired")
        self.placement.busy -= len(metas)
        self.placement.notify_freed()

    @contextlib.contextmanager
    def reading(self, metas: Sequence[BlockMeta]) -> Iterator[Sequence[BlockMeta]]:
        """Hold read leases on blocks for the duration of a `with` (a stream being sent)."""
        self.acquire(metas)
        try:
            yield metas
        finally:
            self.release(metas)

    def served(self, meta: BlockMeta, tier_name: str) -> None:
        """Count a block served from `tier_name`, whichever path served it (bytes, a zero-copy descriptor, a
        Resume, a peer): a hit there, a miss in every faster tier, and the block's own hit count."""
        rank = self.placement.rank[tier_name]
        c = self.counters
        c.tiers[tier_name].hits += 1
        c.tiers[tier_name].served_bytes += meta.nbytes
        for upper in self.placement.tiers[:rank]:
            c.tiers[upper.name].misses += 1
        meta.hits += 1
        c.blocks_served += 1
        c.bytes_served += meta.nbytes
        own = c.of(meta.namespace)
        own.blocks_served += 1
        own.bytes_served += meta.nbytes

    def served_all(self, metas: Sequence[BlockMeta], tier_name: str, namespace: str) -> None:
        """`served` of many blocks of one namespace from one tier (a slice of GetPrefix's descriptors), counted
        at once: per block, `served` was a third of the answer's Python."""
        n, nbytes = len(metas), 0
        for meta in metas:
            meta.hits += 1
            nbytes += meta.nbytes
        c = self.counters
        c.tiers[tier_name].hits += n
        c.tiers[tier_name].served_bytes += nbytes
        for upper in self.placement.tiers[: self.placement.rank[tier_name]]:
            c.tiers[upper.name].misses += n
        c.blocks_served += n
        c.bytes_served += nbytes
        own = c.of(namespace)
        own.blocks_served += n
        own.bytes_served += nbytes

    async def read(self, meta: BlockMeta, *, promote: bool = True, verify: bool = True) -> bytes | memoryview:
        """The block's payload from its fastest verified copy, the caller's own (bytes, or a view of a copy made
        out of a pool slot); a corrupt or unreadable copy is dropped and the next tried. A hit below the top tier
        is copied up (promotion) unless promote is False. verify=False skips the checksum: only for payloads the
        caller wrote itself (the trace replayer's)."""
        payload, name = await self._read_verified(meta, verify=verify)
        await self._served_from(meta, name, payload, promote, owned=True)
        return payload

    async def read_view(self, meta: BlockMeta, *, promote: bool = True, verify: bool = True) -> bytes | memoryview:
        """As `read`, but a copy in a host pool comes as a view of its slot, valid only while the block is
        held (`reading`): the data channel writes it to the socket from there, without a copy."""
        payload, name = await self._read_verified(meta, view=True, verify=verify)
        await self._served_from(meta, name, payload, promote)
        return payload

    async def read_views(self, metas: Sequence[BlockMeta], *, promote: bool = True, verify: bool = True
                         ) -> list[bytes | memoryview]:
        """`read_view` of every block, as one call: a block whose copy in the top tier answers without an
        await (a host pool's slot, a private DRAM tier's bytes) and verifies is served in the loop, counted
        once for the batch; any other (a copy below the top tier, which may be promoted, or one that fails
        its checksum) goes through `read_view`. The blocks must be held (`reading`): a large copy is hashed in a
        worker thread (checksum_off_loop), its slot kept by the hold."""
        out: list[bytes | memoryview] = []
        placement = self.placement
        top = placement.tiers[0]
        now: Callable[[bytes], bytes | memoryview | None] | None = (
            top.view if isinstance(top, PoolTier) else top.read_now if isinstance(top, DramTier) else None)
        top_name = top.name
        n_top = bytes_top = 0
        for meta in metas:
            locations = meta.locations
            payload: bytes | memoryview | None = None
            if now is not None and locations and locations[0] == top_name:
                payload = now(meta.key)
                if payload is not None and verify and await checksum_off_loop(payload) != meta.checksum:
                    payload = None  # read_view drops the copy, counts it and tries the next
            if payload is None:
                out.append(await self.read_view(meta, promote=promote, verify=verify))
                continue
            n_top += 1
            bytes_top += meta.nbytes
            meta.hits += 1
            own = self.counters.of(meta.namespace)
            own.blocks_served += 1
            own.bytes_served += meta.nbytes
            out.append(payload)
        c = self.counters
        c.tiers[top_name].hits += n_top  # `served`, once for the batch: the top tier misses nothing
        c.tiers[top_name].served_bytes += bytes_top
        c.blocks_served += n_top
        c.bytes_served += bytes_top
        return out

    async def _served_from(self, meta: BlockMeta, name: str, payload: bytes | memoryview, promote: bool, *,
                           owned: bool = False) -> None:
        """Count the hit, and copy a block served from below the top tier up. `owned`: the payload is the
        caller's (not a view of a slot, valid only while the block is held), kept as it is by the promotion."""
        self.served(meta, name)
        placement = self.placement
        top = placement.tiers[0].name
        if promote and placement.rank[name] > 0 and not meta.moving and top not in meta.locations:
            await placement.promote(meta, payload if owned or not isinstance(payload, memoryview) else bytes(payload))

    async def copy_up(self, metas: Sequence[BlockMeta], tier_name: str) -> int:
        """Copy blocks that tier `tier_name` lacks into it from where they lie, as one batch: every block is
        read (concurrently, verified) and placed without waiting for room (what finds none stays where it
        is); a copy joins a block's locations once written. Returns how many landed. The hit path uses it
        to bring NVMe blocks into the shared DRAM pool before describing them."""
        placement = self.placement
        rank = placement.rank[tier_name]
        todo = [m for m in metas if tier_name not in m.locations and m.locations and not m.moving]
        for meta in todo:  # marked before the first await: gather starts its tasks later, and a concurrent
            meta.moving = True  # GetPrefix that saw them not moving would write the same key into the tier
            placement.busy += 1

        async def one(meta: BlockMeta) -> int:
            try:
                payload, source = await self._read_verified(meta)
                await placement.place(meta, rank, payload, wait=False)
            except (ResourceExhausted, DataLoss):
                return 0
            finally:
                meta.moving = False
                placement.busy -= 1
                placement.notify_freed()
            if tier_name not in meta.locations:  # the block left while room was made: nothing was written (place)
                return 0
            if placement.rank[source] > rank:  # up from a slower tier (NVMe): a promotion into tier_name
                tc = self.counters.tiers[tier_name]
                tc.promotions += 1
                tc.promoted_bytes += meta.nbytes
            else:  # down from a faster one (HBM into the shared DRAM pool): a copy out of it, counted there
                tc = self.counters.tiers[source]
                tc.demotions += 1
                tc.demoted_bytes += meta.nbytes
            return 1

        return sum(await asyncio.gather(*(one(m) for m in todo)))

    async def verify_stored(self, meta: BlockMeta, *, during: str) -> str:
        """Check that a stored block still has a copy that verifies, before a put drops its caller's bytes on the
        strength of it (deduplicated against it, or skipped by an in-place reservation). The put is acknowledged
        as stored: a block whose only copy was damaged (a byte flipped in the pool, an NVMe file corrupt or gone)
        was acknowledged stored nowhere, its hits failed, and each put of it again was deduplicated away. The
        fastest copy is read and verified as a read does (`_read_verified`: one that fails is dropped, counted
        and logged, and the next tried), under a lease (not evicted while an NVMe copy is read) that leaves its
        age as it is. A memory copy costs one xxh3 over its bytes, in place, as a demotion's check (an HBM copy
        is copied to the host first, as a demotion copies it). A block held on NVMe alone is read back: nothing
        short of its bytes says a file is sound (the tier's record and the caller's checksum are what the file
        should hold, not what it does; a stat finds a file missing or cut short, not a byte flipped), and such a
        dedupe is rare: a client's put sends only the blocks after its Lookup's cached prefix, so a put finds a
        block stored when two puts race (the block then just stored, in memory) or one sends every block (pin,
        skip_cached=False); the read is a hit's, in the tier's threads, off the loop (benchmarks/RESULTS.md,
        put_cost: a deduplicated put). DataLoss when no copy verified: the block was dropped, with the blocks
        that extend it, and the caller stores its own bytes. Returns the tier whose copy verified."""
        meta.leases += 1  # `acquire` without restarting its age: the put counted its use, a reservation counts none
        self.placement.busy += 1
        try:
            return (await self._read_verified(meta, view=True, during=during))[1]
        finally:
            self.release([meta])

    async def _copied_under_lease(self, meta: BlockMeta, in_place: memoryview) -> bytes | memoryview:
        """copy_off_loop of a block's slot, the block leased meanwhile (its age left as it is, as verify_stored's
        lease): not evicted, its slot not given to another block, while a worker thread copies out of it."""
        meta.leases += 1
        self.placement.busy += 1
        try:
            return await copy_off_loop(in_place)
        finally:
            self.release([meta])

    async def _read_verified(self, meta: BlockMeta, *, view: bool = False, verify: bool = True,
                             during: str = "a read", only: str | None = None, held: bool = False
                             ) -> tuple[bytes | memoryview, str]:
        """The payload of the block's fastest copy that reads and verifies, and that tier's name; copies
        that fail are dropped (counted, logged as dropped on `during`); with none left the block is unindexed
        (with the blocks that extend it) and DataLoss raised. `only`: that tier's copy alone is tried (DataLoss
        when it fails or is not there; the others are kept). Without `view`, a copy in a host pool is copied out
        of its slot (a large one in a worker thread: copy_off_loop) under a lease taken for the copy, unless the
        caller holds the block already (`held`: moving, or leased): the pool's own read, a copy into bytes, held
        the event loop (and the GIL) for the whole copy."""
        placement = self.placement
        reasons = []
        tried: set[str] = set()
        # The copies as they are now, at each step: one may arrive while another is read (a concurrent reader's
        # promotion), and a block is unindexed only when no copy is left untried.
        while (name := next((n for n in meta.locations if n not in tried and only in (None, n)), None)) is not None:
            tried.add(name)
            try:
                tier = placement.tier(name)
                in_place = tier.view(meta.key) if isinstance(tier, PoolTier) else None
                if in_place is not None and not view:
                    payload: bytes | memoryview = await (copy_off_loop(in_place) if held
                                                         else self._copied_under_lease(meta, in_place))
                else:
                    payload = in_place if in_place is not None else await tier.read(meta.key)
                if verify and await checksum_off_loop(payload) != meta.checksum:  # a view: the block is held
                    raise DataLoss(f"block {meta.key.hex()} failed its checksum in tier {name}")
            except NotFound as exc:
                # The index lists a copy its tier does not hold (a check forgot a broken file before the index
                # dropped it): lost, as a file gone from the disk is (DataLoss), not a miss the client is told of
                # in a tier's words (NOT_FOUND); it reached clients so, and the index kept the copy
                lost = DataLoss(f"{exc}, though the index listed a copy there")
                reasons.append(str(lost))
                await self._copy_failed(meta, name, lost)
                self.note_dropped(meta, name, str(lost), during)
                continue
            except StaleRecord as exc:
                if self.adopt(meta, name, exc.found):
                    return exc.payload, name  # verified against its file's header, now the index's checksum too
                reasons.append(str(exc))
                await self._copy_failed(meta, name, exc)
                self.note_dropped(meta, name, str(exc), during)
                continue
            except (DataLoss, Unavailable, OSError) as exc:
                reasons.append(str(exc))
                await self._copy_failed(meta, name, exc)
                self.note_dropped(meta, name, str(exc), during)
                continue
            return payload, name
        if not meta.locations:
            await recovery.drop_lost(self, meta)  # and what extends it: no lookup could reach those again
        elif only is not None:
            raise DataLoss(f"block {meta.key.hex()}: its {only} copy is missing or failed ({'; '.join(reasons)}); "
                           "that copy was dropped, the others kept")
        raise DataLoss(f"block {meta.key.hex()}: no tier holds a valid copy any more ({'; '.join(reasons)}); "
                       "it was dropped")

    def adopt(self, meta: BlockMeta, tier_name: str, found: BlockRecord) -> bool:
        """Re-index a block under its NVMe file's own checksum after a read (or the start's check of trusted
        files) found the file sound, naming the same block (key, parent, model, namespace, tokens, shape,
        size), with other bytes than the journal's record said (StaleRecord: an earlier build wrote the block
        again under its key, after the record). Same key, same tokens under the same parent: the file's bytes
        are another prefill of the same prefix, which that build acknowledged, as a start without the journal
        would index them. Only when that file is the block's one copy (memory holds none with the record's
        bytes) and the index's checksum is the record's; False otherwise (the caller drops the copy)."""
        if self.index.get(meta.key) is not meta or found.nbytes != meta.nbytes:
            return False
        if meta.checksum == found.checksum:
            return True  # a concurrent read adopted it
        adopt = getattr(self.placement.tier(tier_name), "adopt", None)
        if adopt is None or meta.locations != [tier_name] or not adopt(meta.key, found, meta.checksum):
            return False
        log.warning("block %s: its %s file holds it under checksum %016x, the index journal's record %016x: the "
                    "record was stale (an earlier Engram wrote the block again under its key); re-indexed from the "
                    "file, whose bytes verify against its own header", meta.key.hex(), tier_name, found.checksum,
                    meta.checksum)
        meta.checksum = found.checksum
        self.index.changed(meta)
        return True

    def note_dropped(self, meta: BlockMeta, tier_name: str, why: str, during: str) -> None:
        """Log a copy dropped as damaged or unreadable: one WARNING each, with the key, tier and why; a burst
        beyond `drop_log` is counted and named by the next line let through."""
        held = self.drop_log.take()
        if held is None:
            return
        log.warning("block %s: its %s copy was dropped on %s: %s%s%s", meta.key.hex(), tier_name, during, why,
                    "" if meta.locations else "; no copy was left: the block left the store, with the blocks that "
                    "extend it", f" ({held} more copies dropped before this one, not logged)" if held else "")

    async def _copy_failed(self, meta: BlockMeta, name: str, exc: Exception) -> None:
        """A copy that failed its checksum (DataLoss) or its read: counted in its tier, and dropped."""
        tc = self.counters.tiers[name]
        if isinstance(exc, DataLoss):
            tc.corrupt_blocks += 1
            self.counters.corrupt_blocks += 1
        else:
            tc.io_errors += 1
        await self.drop_damaged_copy(meta, name)

    async def damaged_in_a_move(self, meta: BlockMeta, name: str, problem: DataLoss | None = None,
                                move: str = "a demotion") -> None:
        """A copy that a move found damaged or missing from its tier (`problem`; None: it failed its checksum),
        instead of copying it (a demotion: Placement.damaged; a batched copy between pools: engram/transfer.py):
        dropped and counted as a read drops it, the block with it (and what extends it) when no copy is left. No
        caller hears of it: the log says so."""
        if problem is None:
            problem = DataLoss(f"block {meta.key.hex()} failed its checksum in tier {name}")
        await self._copy_failed(meta, name, problem)
        if not meta.locations:
            await recovery.drop_lost(self, meta)
        self.note_dropped(meta, name, f"{problem} (not copied)", move)

    async def prefetch(self, metas: Iterable[BlockMeta]) -> int:
        """Copy blocks held below the top tier up into it before they are asked for (a session due back soon,
        its blocks head first), as far as half the top tier takes the chain, without waiting for room. Nothing
        is served or counted as a hit; a copy that fails its checksum is dropped as a read would. Returns the
        blocks copied up (also StoreCounters.blocks_prefetched and the tier's promotions)."""
        placement = self.placement
        top = placement.tiers[0]
        budget = top.capacity_bytes // 2
        copied = 0
        for meta in metas:
            budget -= meta.nbytes
            if budget < 0:
                break
            if (not meta.locations or meta.locations[0] == top.name or meta.moving
                    or self.index.get(meta.key) is not meta):
                continue
            meta.leases += 1  # not evicted while it is read
            placement.busy += 1
            try:
                payload, _ = await self._read_verified(meta)
                if meta.locations and top.name not in meta.locations and not meta.moving:
                    await placement.promote(meta, payload)
                    if top.name in meta.locations:
                        copied += 1
                        meta.tick = CLOCK.now  # as a lease does: its age restarts (no comeback counted), or
                        # least-recently-used order would take it straight back down
            except DataLoss:
                pass  # no valid copy was left: unindexed, as a Get would have (not `continue`: mypyc has none here)
            finally:
                self.release([meta])
        self.counters.blocks_prefetched += copied
        return copied

    # ---- pins, references, removal -------------------------------------------------------------

    def pin(self, namespace: str, model_fingerprint: bytes, keys: Sequence[bytes], *, unpin: bool = False,
            share: PinShare | None = None) -> int:
        """Pin (or unpin) blocks; returns how many changed. Pins count, so two pinners need two unpins. `share`:
        the caller's (a tenant's, engram/store/pins.py), whose pins it counts and that pins passing it are refused
        against, none of them taken; None for an admin or with tenancy off, whose pins are the operator's, outside
        every share. A tenant's pin is its own (BlockMeta.pin_owners): its unpin lifts its own, never the operator's
        nor another tenant's in a namespace they share (any tenant of it lifted any other's, an audit, session 48),
        and a pin of no recorded owner (pins.restore) as before; the operator's lifts its own first, then one of no
        recorded owner, then any tenant's (an admin acts on the whole daemon)."""
        metas = self.find(namespace, model_fingerprint, keys)
        if share is not None and not unpin:
            share.check(self.index, share.growth(self.index, metas), f"pinning {len(metas)} blocks")
        changed = 0
        for meta in metas:
            if unpin:
                if not meta.pins:
                    continue
                if share is None and meta.operator_pins:
                    self.index.set_pins(meta, meta.pins - 1, meta.operator_pins - 1)
                else:
                    owner = self._pin_to_lift(meta, share)
                    if owner is None:
                        continue  # the operator's or another tenant's pins hold it: not this tenant's to lift
                    self.index.set_pins(meta, meta.pins - 1, owner=owner)
                changed += 1
                self.placement.reordered()
            else:
                self.add_pin(meta, share=share)
                changed += 1
        return changed

    @staticmethod
    def _pin_to_lift(meta: BlockMeta, share: PinShare | None) -> str | None:
        """Whose tenant pin an unpin lifts: the caller's own (a tenant's `share`), else one of no recorded owner;
        an admin's (None), any tenant's once those are gone. None: no pin the caller may lift."""
        if share is not None and meta.owner_pins(share.tenant):
            return share.tenant
        if meta.owner_pins(""):
            return ""
        if share is None and meta.pin_owners:
            return min(meta.pin_owners)
        return None

    def add_pin(self, meta: BlockMeta, *, share: PinShare | None) -> None:
        """One more pin on a block: the tenant's whose `share` it is (checked by the caller), or the operator's."""
        if share is None:
            self.index.set_pins(meta, meta.pins + 1, meta.operator_pins + 1)
        else:
            self.index.set_pins(meta, meta.pins + 1, owner=share.tenant)

    def lift_pins(self, meta: BlockMeta) -> None:
        """Drop every pin of a block about to be removed (an evict that overrides pins, a lost block's chain)."""
        self.index.set_pins(meta, 0, 0)

    def reference(self, metas: Sequence[BlockMeta], delta: int, holder: Expected | None = None, owner: str = ""
                  ) -> None:
        """Add (+1) or drop (-1) one session's reference to blocks; eviction prefers unreferenced blocks, then
        those one session holds (engram/eviction.py: read at each victim search). `holder`: the session's
        Expected (when its client said it is back): a block taken points at it, a block dropped forgets it.
        `owner`: the session's tenant ("": an admin's, or tenancy off), whose own figures follow (ChainIndex.add_refs).
        A block whose count cannot change (dropped more often than taken: a bookkeeping error) does not stop the
        others: every other block changes once, then the first such error is raised. So a caller that goes on past
        a failed call (a cut close letting go of the rest) never changes a block twice, nor leaves one unchanged."""
        add_refs = self.index.add_refs
        failed: AssertionError | None = None
        for meta in metas:
            try:
                add_refs(meta, delta, owner)
            except AssertionError as exc:
                failed = failed or exc
                continue
            if delta > 0:
                meta.holder = holder
            elif meta.holder is holder:
                meta.holder = None
        if metas:
            self.placement.reordered()
        if failed is not None:
            raise failed

    async def remove(self, meta: BlockMeta) -> None:
        """Delete a block on request (engram evict). Only a leaf that no reader or move holds: the caller
        removes descendants first (prefix closure) and lifts pins it was told to override."""
        if meta.children or not meta.evictable:
            raise FailedPrecondition(f"block {meta.key.hex()} has children, is pinned, or is being read or moved")
        try:
            await self.placement.delete_block(meta)
        finally:  # out of the index as the call began: counted even when the caller went before its copies did
            self.counters.blocks_evicted_on_request += 1

    # ---- moves that others perform (engram/transfer.py): the two-phase protocol ---------------------

    async def begin_copy(self, meta: BlockMeta, tier_name: str) -> int:
        return await self.placement.begin_copy(meta, tier_name)

    def begin_copy_now(self, meta: BlockMeta, tier_name: str) -> int | None:
        return self.placement.begin_copy_now(meta, tier_name)

    def begin_copies_now(self, metas: Sequence[BlockMeta], tier_name: str) -> list[int | None]:
        return self.placement.begin_copies_now(metas, tier_name)

    def end_copy(self, meta: BlockMeta, tier_name: str, *, ok: bool) -> None:
        self.placement.end_copy(meta, tier_name, ok=ok)

    def end_copies(self, metas: Sequence[BlockMeta], tier_name: str, oks: Sequence[bool]) -> None:
        self.placement.end_copies(metas, tier_name, oks)

    async def drop_copy(self, meta: BlockMeta, tier_name: str) -> None:
        await self.placement.drop_spare_copy(meta, tier_name)

    async def drop_damaged_copy(self, meta: BlockMeta, tier_name: str, report: recovery.StoreReport | None = None
                                ) -> None:
        """Drop a copy found damaged or unreadable (a read, a demotion, `check --fix`, the start's check of
        journal-trusted files all drop it here). The block's last copy takes the block with it (and what extends
        it: `recovery.drop_lost`, findings into `report`), out of the index as the tier's delete begins, with no
        turn of the loop between: a Lookup meanwhile (an NVMe unlink) found it indexed with no copy and failed
        INTERNAL, and a put of its key between the two would have its new copy deleted. A block that loses its
        durable (NVMe) copy so while memory holds
        one would stay acknowledged and indexed in memory alone, nothing pending, lost at a crash: it is written
        to NVMe again from its fastest copy that verifies (the flusher's copy). Under write-through before this
        returns (the policy promises acknowledged = durable; a write that fails leaves it pending, due at once);
        under write-back it is pending again, as a block just put. Evictions and `keep_only_in` drop sound
        copies on purpose, not through here."""
        placement, flusher = self.placement, self.flusher
        below: list[BlockMeta] = []
        try:
            await placement.drop_copy(meta, tier_name, last=lambda: below.extend(recovery.forget_lost(self, meta)))
        finally:
            if below:  # even when the caller went during the delete: they would stay indexed under a lost parent
                await to_its_end(asyncio.ensure_future(recovery.drop_below(self, below, report)))
        d = durable.durable_tier(placement)
        if (flusher is None or d is None or placement.tiers[d].name != tier_name or not meta.locations
                or self.index.get(meta.key) is not meta):
            return
        what = f"block {meta.key.hex()}: its {tier_name} copy was damaged or unreadable"
        through = self.write_policy == WritePolicy.WRITE_THROUGH
        if through and await flusher.flush_now(meta):
            log.warning("%s; written again from memory", what)
            return
        if self.index.get(meta.key) is not meta:
            return  # no copy in memory verified either: the block was dropped, as a read drops it
        flusher.note(meta, now=through)
        log.warning("%s; held in %s alone until it is written again (pending)", what, ", ".join(meta.locations))

    async def keep_only_in(self, meta: BlockMeta, tier_name: str) -> None:
        """Leave a block's one copy in `tier_name`, copying it there first: how `engram verify-isolation`
        (engram/isolation_rig.py) puts a block in the tier it probes. Not for serving paths: it ignores
        the write policy, and reads the copy without counting a hit. A copy that fails its checksum is dropped
        as a read drops it, never copied; DataLoss when none verifies (the block was dropped)."""
        placement = self.placement
        if tier_name not in meta.locations:
            meta.moving = True  # not a victim (nor removed) while it is read and copied
            try:
                # its fastest copy that verifies (DataLoss: none did, the block is gone), as the flusher copies
                payload, _ = await self._read_verified(meta)
                await placement.place(meta, placement.rank[tier_name], payload)
            finally:
                meta.moving = False
        for name in list(meta.locations):
            if name != tier_name:
                await placement.drop_spare_copy(meta, name)

    # ---- recovery and check --------------------------------------------------------------------

    async def recover(self, pin_shares: SharesOf | None = None) -> recovery.StoreReport:
        """Rebuild the index from the tiers that outlive the process (engram/store/recovery.py), and pin the
        blocks that come back as they were pinned, within `pin_shares` (store/pins.py `restore`)."""
        return await recovery.recover(self, pin_shares)

    async def check(self, *, fix: bool) -> recovery.StoreReport:
        """Verify every stored copy (DRAM payloads, NVMe files); with fix, drop what is broken."""
        return await recovery.check(self, fix=fix)

    # ---- figures -------------------------------------------------------------------------------

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Every tier's figures (its blocks' tokens and pins as the index keeps them: no walk over blocks)."""
        return tier_stats(self.placement, self.index.tier_tallies())

    def own_tier_stats(self, namespaces: Sequence[str], tenant: str) -> tuple[TierStats, ...]:
        """Every tier as `tenant`, of `namespaces`, sees it (counters.own_tier_stats): its copies, not the tier's,
        and of them those pinned by pins it may lift (`ChainIndex.pinned_tiers`). A namespace other tenants share
        counts each block once, in its home tier (the slowest holding a copy, `ChainIndex.home_tallies`): the
        copies above it are made by reads, the other tenants' too, and the tenant read from its DRAM figures when
        another's Get copied a block of theirs up from NVMe (session 50's loose ends)."""
        index, shared = self.index, self.namespaces.shared
        alone = [ns for ns in namespaces if not shared(ns)]
        if len(alone) == len(namespaces):
            return own_tier_stats(self.placement, index.tier_tallies(namespaces), index.pinned_tiers(namespaces, tenant))
        others = [ns for ns in namespaces if shared(ns)]
        copies = index.tier_tallies(alone)  # (copies of the index's tallies: added to here)
        for name, t in index.home_tallies(others).items():
            copies.setdefault(name, Tally()).add(t)
        pinned = index.pinned_tiers(alone, tenant)
        for name, n in index.pinned_tiers(others, tenant, homes=True).items():
            pinned[name] = pinned.get(name, 0) + n
        return own_tier_stats(self.placement, copies, pinned)

    def model_usage(self, namespaces: Sequence[str] | None = None) -> list[ModelUsage]:
        """Blocks, bytes and tokens per registered model: of every namespace, or of `namespaces` only."""
        held = self.index.model_tallies(namespaces)
        out = []
        for spec in self.registry:
            t = held.get(spec.fingerprint)
            blocks, nbytes, tokens = (0, 0, 0) if t is None else (t.blocks, t.nbytes, t.tokens)
            out.append(ModelUsage(spec.fingerprint, spec.name, spec.codec, blocks, nbytes, tokens,
                                  tokens * spec.layout.bytes_per_token()))
        return out

    def stored_in(self, namespace: str) -> Tally:
        """A namespace's blocks, stored bytes, tokens and pinned blocks (`engram ls`)."""
        return self.index.namespace_tally(namespace)

    def namespace_usage(self, namespace: str, owner: str | None = None) -> NamespaceUsage:
        """The namespace's blocks and bytes; its logical bytes and referenced blocks of every session's references,
        or (`owner`, a tenant's view) of that tenant's own sessions alone."""
        index = self.index
        return NamespaceUsage(index.block_count(namespace), index.physical_bytes(namespace),
                              index.logical_bytes(namespace, owner), index.referenced_blocks(namespace, owner))

    def decode(self, payload: bytes | memoryview, meta: BlockMeta, *, device: torch.device | str = "cpu"
               ) -> torch.Tensor:
        """A stored payload of `meta` (a K/V layout's block) as its KV tensor, decoded with the daemon's codec
        backend."""
        codec = self.spec(meta.model_fingerprint).stored_codec
        return stored.decode(payload, codec, meta.dtype, meta.shape, backend=self.codec_backend, device=device,
                             where=f"stored block {meta.key.hex()}")

    def write_back_pending(self) -> Pending:
        """Blocks held only in volatile tiers (DRAM, HBM) while an NVMe tier exists: what a crash would lose."""
        return Pending(0, 0, 0.0) if self.flusher is None else self.flusher.pending()

    async def flush(self, deadline_s: float) -> FlushResult:
        """Copy every block held only in volatile tiers to NVMe (shutdown), within `deadline_s`."""
        if self.flusher is None:
            return FlushResult(0, 0, 0, 0.0)
        return await self.flusher.flush_all(deadline_s)

    def as_raw(self, payload: bytes | memoryview, meta: BlockMeta) -> bytes | memoryview:
        """A stored payload as a raw put would send it (Get with decode: the daemon decodes); a K/V layout's as a
        view of the decoded elements (stored.as_raw)."""
        codec = self.spec(meta.model_fingerprint).stored_codec
        return stored.as_raw(payload, codec, meta.dtype, meta.shape, backend=self.codec_backend,
                             where=f"stored block {meta.key.hex()}")

    async def close(self) -> None:
        await self.quality.close()
        if self.flusher is not None:
            await self.flusher.close()
        for task in self.background:
            task.cancel()
        for task in self.background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for tier in self.tiers:
            await tier.close()

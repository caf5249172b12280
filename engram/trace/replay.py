"""Replay a trace against three policies and count prefix-contiguous hits: a request hits its first k blocks
if all of them are cached (KV is causal, so a block after a gap is useless). After its lookup each request
reads its hit blocks and stores its missing ones. Ids are first made global (formats.prefix_ids: one id per
distinct prefix, hash scopes applied), so every policy sees the same blocks.

- engram: the real BlockStore, ChainIndex, eviction (TierVictims, ReturnModel) and Placement, with sessions holding references as the
  daemon's do. Its tiers are sized in bytes (`TierSpec`: hbm, dram, nvme; a capacity in blocks is one DRAM
  tier of that many blocks) and hold blocks of the trace's own size: a raw layout whose block weighs
  `block_bytes` (rounded up to 64 bytes). Each request is a lookup, a read of every hit block under read
  leases (served from its fastest tier, promoted to the top tier on a hit below it, as a daemon's Get does;
  a hit in a host pool, the HBM stand-in, is read in place as the same-host zero-copy Get reads it), and a
  put of the missing blocks; bytes served, written, promoted and demoted per tier are the store's own
  counters (store.counters.tiers), not misses times a block size. Tiers: DRAM is the store's private DRAM
  tier (DramTier, which keeps every block's bytes object: all blocks share one, so 16 GiB of blocks costs no
  memory); HBM is the real HBM pool tier over a CPU tensor (engram/tiers/hbm.py's CPU path: it allocates and
  copies its capacity for real); NVMe is a DRAM-like stand-in named "nvme" by default (real files cost a
  file write per demotion: minutes per million), or the real NvmeTier in a temporary directory
  (`nvme_files`, no fsync). The replay has no background flusher: trace time is not wall time, so blocks
  reach NVMe only by demotion. Nothing of the policy is re-implemented here.
  Fast path (the default): keys are hashed once per distinct block for the whole replay (the ids stand for
  prefixes), lookups go by key (BlockStore.lookup_keys), puts through BlockStore.put_chain (the same
  dedupe, placement and publishing as put, without re-checking blocks the replayer made; the blocks it
  stored and the lookup's are what the session holds) and a request's hits are read in one call, unverified
  (read_views(verify=False)). `fast=False` goes through the daemon's verbs instead (lookup
  by tokens, put per block, verified reads, SessionManager.hold); tests/test_trace.py checks both give the
  same counts.
- lru: plain LRU over block ids (what most caches do).
- belady: evict the block whose next use is furthest (offline, knows the future), and among blocks next
  used at the same time (by the same request) the deepest first. That is the optimum for prefix-contiguous
  hits too: a chained id stands for its whole prefix, so a block's ancestors are next used no later than it
  is; evicting furthest-then-deepest therefore never drops an ancestor while a descendant stays, the cache
  stays prefix-closed, every cached block it meets is a contiguous hit, and it gets Belady's plain-hit count,
  which bounds any policy's contiguous hits. (Breaking ties the other way, by id, dropped the chain's start
  and lost the hits of everything behind it.) tests/test_trace.py checks it against a brute force.
lru and belady count capacity in blocks: with tiers, the tiers' total bytes over the block size.
`bytes_moved` (every policy): missed blocks times `block_bytes`, what the misses cost to recompute or fetch.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import gc
import heapq
import multiprocessing
import operator
import queue as queue_module
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram import limits
from engram.api import EvictionStats, SessionMode
from engram.block import BlockHeader, checksum
from engram.collector import CollectorSchedule
from engram.errors import InvalidArgument, ResourceExhausted
from engram.eviction import stats as eviction_stats
from engram.keys import block_key_of_bytes
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.replay.runtime import ReplayRuntime
from engram.sessions import Session, SessionManager
from engram.store import BlockStore
from engram.tiers.base import Tier
from engram.tiers.dram import DramTier
from engram.tiers.hbm import hbm_tier
from engram.tiers.nvme import NvmeTier
from engram.tiers.pool import auto_page_bytes
from engram.trace.formats import Request, prefix_ids

_BT = 16  # tokens per simulated block: block d of the trace carries d in each of its tokens
_NS = "trace"
_PROGRESS_EVERY = 1024  # requests between progress callbacks (a rich bar costs microseconds per update)
TIER_NAMES = ("hbm", "dram", "nvme")

Progress = Callable[[int], None]
_locations = operator.attrgetter("locations")  # (a genexpr per request cost 2% of a replay)


@dataclass(frozen=True)
class TierSpec:
    name: str  # hbm, dram or nvme
    capacity_bytes: int


@dataclass(frozen=True)
class TierResult:
    """One tier's figures after an engram run, from the store's counters."""

    name: str
    capacity_bytes: int
    hits: int  # blocks served from this tier
    served_bytes: int
    written_bytes: int  # copies written into it: puts (top tier), demotions into it, promotions into it
    promoted_bytes: int  # copied up into it on a hit below it
    demoted_bytes: int  # copied down out of it to make room
    evictions: int  # blocks that left it to make room (demoted, or deleted from the last tier)
    blocks: int  # blocks it holds at the end


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    capacity_blocks: int
    requested_blocks: int
    hit_blocks: int
    bytes_moved: int  # missed blocks x block_bytes
    seconds: float = 0.0  # the run's wall time
    tiers: tuple[TierResult, ...] = ()  # engram only
    config: str = ""  # the tiers by bytes ("hbm 2GiB + dram 16GiB"); "": one DRAM tier of capacity_blocks
    eviction: EvictionStats | None = None  # engram only: what the eviction order learned by the end of the run

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / max(1, self.requested_blocks)

    @property
    def accesses_per_s(self) -> float:
        return self.requested_blocks / self.seconds if self.seconds else 0.0


# The heaviest block a layout_for layout stands in for: its heads and head size at the daemon's own bounds.
MAX_BLOCK_BYTES = 2 * _BT * DType.BF16.itemsize * limits.MAX_KV_HEADS * limits.MAX_HEAD_DIM  # 256 MiB


def layout_for(block_bytes: int) -> KVLayout:
    """A raw BF16 layout of _BT-token blocks weighing at least `block_bytes` (in steps of 64 bytes). A weight
    past MAX_BLOCK_BYTES is refused by name: it failed as the layout's "num_kv_heads", a field no caller gave."""
    if not 0 < block_bytes <= MAX_BLOCK_BYTES:
        raise InvalidArgument(f"block_bytes must be in [1, {MAX_BLOCK_BYTES:,}] (256 MiB: the replay's largest "
                              f"block), got {block_bytes:,}")
    unit = 2 * _BT * DType.BF16.itemsize
    n = max(1, -(-block_bytes // unit))
    heads = -(-n // limits.MAX_HEAD_DIM)
    return KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=heads, head_dim=-(-n // heads),
                    dtype=DType.BF16, block_tokens=_BT)


def _blocks_held(t: TierSpec, nbytes: int) -> int:
    """Blocks of nbytes a tier of the replay holds (what LRU and the optimum get): the HBM pool gives each block
    whole pages, so it holds fewer than its bytes divided by the block's."""
    if t.name == "hbm":
        page = auto_page_bytes(t.capacity_bytes)
        return (-(-t.capacity_bytes // page)) // (-(-nbytes // page))
    return t.capacity_bytes // nbytes


def _tiers(specs: Sequence[TierSpec], nvme_dir: Path | None) -> list[Tier]:
    order = {n: i for i, n in enumerate(TIER_NAMES)}
    names = [t.name for t in specs]
    if set(names) - set(TIER_NAMES) or len(set(names)) != len(names) or not names:
        raise InvalidArgument(f"tiers are some of {', '.join(TIER_NAMES)}, each once; got {names}")
    out: list[Tier] = []
    for t in sorted(specs, key=lambda t: order[t.name]):  # each holds a block at least: replay_all checked
        if t.name == "hbm":
            try:  # the replay's HBM is host memory: a size the host cannot give is the caller's bad input
                out.append(hbm_tier(t.capacity_bytes, device="cpu"))
            except (RuntimeError, MemoryError) as exc:
                raise InvalidArgument(f"an HBM tier of {t.capacity_bytes} bytes cannot be allocated here (the replay "
                                      f"holds it in host memory): {str(exc).splitlines()[0]}") from None
        elif t.name == "dram":
            out.append(DramTier(t.capacity_bytes))
        elif nvme_dir is not None:
            out.append(NvmeTier(nvme_dir, t.capacity_bytes, fsync=False, journal=False))
        else:
            out.append(DramTier(t.capacity_bytes, name="nvme"))  # its place, capacity and accounting; no files
    return out


class _Run:
    """One engram run: a store of the given tiers, the model, sessions."""

    def __init__(self, tiers: Sequence[TierSpec], layout: KVLayout, nvme_dir: Path | None,
                 prefetch_lead_ms: float = 0.0) -> None:
        self.store = BlockStore(_tiers(tiers, nvme_dir), ModelRegistry(default_codec="raw"))
        self.store.flusher = None  # trace time is not wall time: blocks reach NVMe by demotion only
        # Nothing runs beside the replay that could free a leased block: waiting for room would only stall (a
        # demotion into a tier whose blocks the current read holds fails at once, as it would after the wait).
        self.store.wait_for_room_s = 0.0
        self.layout = layout
        self.fp = self.store.registry.register(ModelSpec(name="trace", weights_id="trace", layout=layout,
                                                         codec="raw"))
        self.sessions = SessionManager(self.store, ReplayRuntime([]), max_sessions_per_namespace=1 << 30,
                                       prefetch_lead_ms=prefetch_lead_ms if len(tiers) > 1 else 0.0)
        self.now_ms = 0.0  # trace time: what sessions' hints are due by (ReturnModel.clock_ms)
        self.store.placement.model.clock_ms = lambda: self.now_ms
        self.live: dict[str, Session] = {}
        self.payload = bytes(layout.block_nbytes(_BT))
        self.checksum = checksum(self.payload)
        # The daemon's garbage-collector schedule (engram/collector.py), stepped after each request: every second
        # the young generations are collected and what survived is frozen, so collections do not walk the whole
        # index again and again (with CPython's default thresholds they took 5-8% of a compiled replay at 1,000
        # blocks, 3-3.5% frozen). replay_all unfreezes after the run; it turns CPython's own collections off
        # during the run, so these are the only ones.
        self.collector = CollectorSchedule()

    def session(self, r: Request, tokens: np.ndarray | None) -> Session | None:
        """The request's session (opened on its first request), or None."""
        if not r.session:
            return None
        s = self.live.get(r.session)
        if s is None:
            s = self.live[r.session] = self.sessions.open(_NS, self.fp, SessionMode.PERSIST, session_id=r.session,
                                                          tokens=tokens)
            s.parent = r.parent  # a sub-agent, as a fork is: its parent's blocks keep the parent's hint after it
            s.parent_key = (_NS, "", r.parent) if r.parent else None
        return s

    def hint(self, s: Session, r: Request, hints: bool) -> None:
        """What the request's client said of its session's next request (expect_back_ms), if hints are used."""
        if hints:
            self.sessions.expect_back(s, r.back_ms)

    def closed(self, r: Request) -> None:
        if r.session and r.close:
            self.sessions.close(_NS, r.session)
            del self.live[r.session]

    async def finish(self, hits: int, specs: Sequence[TierSpec], progress: Progress | None, requests: int
                     ) -> tuple[int, tuple[TierResult, ...], EvictionStats]:
        """The run's hits, per-tier figures and what its eviction order learned; the store closed."""
        if progress:
            progress(requests % _PROGRESS_EVERY)
        out = self.result(specs), eviction_stats(self.store.placement.model)
        await self.store.close()
        return hits, *out

    def result(self, specs: Sequence[TierSpec]) -> tuple[TierResult, ...]:
        cap = {t.name: t.capacity_bytes for t in specs}
        out = []
        for tier in self.store.tiers:
            c = self.store.counters.tiers[tier.name]
            out.append(TierResult(tier.name, cap[tier.name], c.hits, c.served_bytes, c.written_bytes,
                                  c.promoted_bytes, c.demoted_bytes, c.evictions, len(tier)))
        return tuple(out)


def _token_bytes(d: int) -> bytes:
    return (d % (2**31 - 1)).to_bytes(4, "little") * _BT


Blocks = tuple[list[bytes], list[tuple[bytes, bytes]]]  # every dense id's key, and its (key, tokens) for put_chain


def _blocks(parent_of: Sequence[int], root: bytes) -> Blocks:
    """The store key of every dense block id (formats.prefix_ids; parents come first), each hashed once, and
    each block as put_chain takes it (key, tokens), made once for the whole replay, not at every miss."""
    keys: list[bytes] = []
    items: list[tuple[bytes, bytes]] = []
    for d, p in enumerate(parent_of):
        tokens = _token_bytes(d)
        key = block_key_of_bytes(keys[p] if p >= 0 else root, tokens)
        keys.append(key)
        items.append((key, tokens))
    return keys, items


async def _engram_fast(trace: Sequence[Request], parent_of: Sequence[int], tiers: Sequence[TierSpec],
                       layout: KVLayout, nvme_dir: Path | None, progress: Progress | None,
                       key_cache: dict[bytes, Blocks], hints: bool = True, prefetch_lead_ms: float = 0.0
                       ) -> tuple[int, tuple[TierResult, ...], EvictionStats]:
    run = _Run(tiers, layout, nvme_dir, prefetch_lead_ms)
    prefetch = run.sessions.prefetch_due if run.sessions.prefetch_lead_ms else None
    store, fp = run.store, run.fp
    root = store.root(_NS, fp)
    cached = key_cache.get(root)
    if cached is None:
        cached = key_cache[root] = _blocks(parent_of, root)
    keys, items = cached
    lookup, put_chain, read_views, reading = store.lookup_keys, store.put_chain, store.read_views, store.reading
    match_keys, hold = store.index.match_keys, run.sessions.hold_blocks
    payload, ck = run.payload, run.checksum
    hits = 0
    for n, r in enumerate(trace, 1):
        run.now_ms = r.timestamp
        if prefetch is not None:
            await prefetch()  # hinted sessions due back by now (trace time) have their blocks copied up
        ids = r.hash_ids
        ks = [keys[d] for d in ids]
        blocks = lookup(_NS, fp, ks).blocks
        have = len(blocks)
        hits += have
        if have:
            with reading(blocks):
                await read_views(blocks, verify=False)
        chain = blocks
        if have < len(ks):
            chain = blocks + tuple(await put_chain(_NS, fp, blocks[-1].key if have else root,
                                                   [items[d] for d in ids[have:]],
                                                   payload, ck))
        s = run.session(r, None)
        if s is not None:
            # The session's tokens are not kept (nothing in a replay reads them): its references are what counts.
            # Its stored prefix is what the lookup found and the put stored, unless a block of it went meanwhile
            # (a deleted block's locations are emptied): then it is looked up again.
            hold(s, chain if all(map(_locations, chain)) else match_keys(_NS, fp, ks).blocks)
            run.hint(s, r, hints)
            run.closed(r)
        if progress and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
        run.collector.step_if_due()
    return await run.finish(hits, tiers, progress, len(trace))


async def _engram_verbs(trace: Sequence[Request], tiers: Sequence[TierSpec], layout: KVLayout,
                        nvme_dir: Path | None, progress: Progress | None, hints: bool = True,
                        prefetch_lead_ms: float = 0.0) -> tuple[int, tuple[TierResult, ...], EvictionStats]:
    """The engram run through the daemon's own verbs: lookup by tokens, put per block, verified reads."""
    run = _Run(tiers, layout, nvme_dir, prefetch_lead_ms)
    store, fp, payload = run.store, run.fp, run.payload
    hits = 0
    for n, r in enumerate(trace, 1):
        run.now_ms = r.timestamp
        if run.sessions.prefetch_lead_ms:
            await run.sessions.prefetch_due()
        toks = np.repeat(np.asarray(r.hash_ids, dtype=np.int64) % (2**31 - 1), _BT).astype(np.int32)
        match = store.lookup(_NS, fp, toks)
        have = match.matched_tokens // _BT
        hits += have
        with store.reading(match.blocks):
            for meta in match.blocks:
                await store.read(meta)
        parent = match.blocks[have - 1].key if have else store.root(_NS, fp)
        for i in range(have, len(r.hash_ids)):
            header = BlockHeader(toks[i * _BT:(i + 1) * _BT], layout.dtype, layout.block_shape(_BT), len(payload),
                                 run.checksum)
            try:
                parent = (await store.put(_NS, fp, parent, header, payload, index=i)).key
            except ResourceExhausted:
                break  # the request alone outgrows the tier: its tail is not cached
        s = run.session(r, toks)
        if s is not None:
            run.sessions.set_tokens(s, toks)
            run.sessions.hold(s)
            run.hint(s, r, hints)
            run.closed(r)
        if progress and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
        run.collector.step_if_due()
    return await run.finish(hits, tiers, progress, len(trace))


def _lru(trace: Sequence[Request], capacity: int, progress: Progress | None) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for n, r in enumerate(trace, 1):
        for h in r.hash_ids:
            if h not in cache:
                break
            hits += 1
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
        if progress and n % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress:
        progress(len(trace) % _PROGRESS_EVERY)
    return hits


def _belady(trace: Sequence[Request], capacity: int, progress: Progress | None) -> int:
    """The offline optimum for prefix-contiguous hits: the block next used furthest away goes first, and among
    blocks next used by the same request the deepest first. Memory is O(accesses) machine words for the next uses
    (a flat array, not a list per request) plus O(cached blocks) for the cache and its heap: stale heap entries are
    dropped whenever they outnumber the live ones, so a trace of millions of accesses stays within a few
    hundred MB (a heap of every push took 0.7 GB on a 5.9M-access trace)."""
    n = len(trace)
    starts = [0]
    for r in trace:
        starts.append(starts[-1] + len(r.hash_ids))
    never = n + 1
    uses = array.array("q", bytes(8 * starts[-1]))  # the next request using each access's block, after this one
    nxt: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        ids, at = trace[i].hash_ids, starts[i]
        for k, h in enumerate(ids):
            uses[at + k] = nxt.get(h, never)
        for h in ids:
            nxt[h] = i
    del nxt
    # A heap entry is one int ordering as the tuple (-next use, -depth, block) would: furthest first, then
    # deepest, then the smaller id. Blocks are dense ids (prefix_ids), so the fields pack into one int.
    id_bits = max((max(r.hash_ids, default=0) for r in trace), default=0).bit_length()
    deepest = max((len(r.hash_ids) for r in trace), default=0)
    when_shift = id_bits + deepest.bit_length()
    mask = (1 << id_bits) - 1
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[int] = []  # lazy: an entry whose next use is no longer its block's is stale
    hits = 0
    for i, r in enumerate(trace):
        ids = r.hash_ids
        for h in ids:
            if h not in cache:
                break
            hits += 1
        at = starts[i]
        for depth, h in enumerate(ids):
            when = uses[at + depth]
            cache[h] = when
            heapq.heappush(heap, (never - when) << when_shift | (deepest - depth) << id_bits | h)
        while len(cache) > capacity:
            e = heapq.heappop(heap)
            h = e & mask
            if cache.get(h) == never - (e >> when_shift):
                del cache[h]
        if len(heap) > 2 * len(cache) + 1024:  # mostly stale: keep the live entries only (the same pops follow)
            heap = [e for e in heap if cache.get(e & mask) == never - (e >> when_shift)]
            heapq.heapify(heap)
        if progress and (i + 1) % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    if progress:
        progress(len(trace) % _PROGRESS_EVERY)
    return hits


POLICIES = ("engram", "lru", "belady")


def replay_all(trace: Sequence[Request], capacities: Sequence[int] = (), block_bytes: int = 512 * 890,
               progress: Progress | None = None, policies: Sequence[str] = POLICIES,
               on_run: Callable[[str, str], None] | None = None, *, tiers: Sequence[TierSpec] | None = None,
               nvme_files: bool = False, fast: bool = True, hints: bool = True, jobs: int = 1,
               prefetch_lead_ms: float = 1000.0) -> list[PolicyResult]:
    """Each of `policies` at every capacity in blocks (one DRAM tier of that many blocks for engram), then
    once more with `tiers` (capacities in bytes) if given; requests in trace order (sort by timestamp first:
    formats.in_time_order). block_bytes: one block's weight, by default 512 tokens of an FP4 global KV.
    `on_run(policy, label)` is called as each run starts; `progress(requests)` as requests are replayed.
    nvme_files: the NVMe tier is the real NvmeTier in a temporary directory; fast=False: engram through the
    daemon's verbs (slower, same counts); hints=False: the engram run ignores the trace's back_ms hints;
    prefetch_lead_ms: a hinted session's blocks below the top tier are copied up this long (trace time) before
    it is due, as the daemon's tiers.prefetch_lead_ms (0: never; a one-tier run has nothing to copy up).
    jobs: runs at once, each in a forked process of its own (the same figures: a run shares nothing with
    another; its seconds are its own, slower if the runs outnumber the cores); on_run is then called once,
    as they start."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    layout = layout_for(block_bytes)
    nbytes = layout.block_nbytes(_BT)
    configs: list[tuple[str, int, list[TierSpec]]] = [
        (f"{c} blocks", c, [TierSpec("dram", c * nbytes)]) for c in capacities]
    small = [t for t in tiers or () if t.capacity_bytes < nbytes]
    if small:
        raise InvalidArgument(f"the {small[0].name} tier's {fmt_bytes(small[0].capacity_bytes)} hold no block of "
                              f"{nbytes:,} bytes: give each tier at least one block")
    if tiers:
        tiers = sorted(tiers, key=lambda t: TIER_NAMES.index(t.name) if t.name in TIER_NAMES else -1)  # fastest first
        label = " + ".join(f"{t.name} {fmt_bytes(t.capacity_bytes)}" for t in tiers)
        configs.append((label, sum(_blocks_held(t, nbytes) for t in tiers), list(tiers)))
    dense, parent_of = prefix_ids(trace)
    requested = sum(len(r.hash_ids) for r in dense)
    key_cache: dict[bytes, Blocks] = {}

    def engram(specs: list[TierSpec], progress: Progress | None) -> tuple[int, tuple[TierResult, ...], EvictionStats]:
        # One torch thread for the HBM stand-in's copies of single blocks: with more, OpenMP's threads spin at
        # every copy, and on a busy 2-core machine a 57 KB copy took a millisecond instead of microseconds.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        # No automatic collections during the run: its collector schedule (_Run.collector) collects the young
        # generations every second, so cyclic garbage stays bounded by a second's worth, and the collections
        # CPython would run every 700 allocations besides (2.6% of a compiled run, each miss allocating a dozen
        # objects) are not run. No decision depends on when garbage is collected.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with tempfile.TemporaryDirectory(prefix="engram-trace-") as tmp:
                nvme = Path(tmp) if nvme_files else None
                if fast:
                    return asyncio.run(_engram_fast(dense, parent_of, specs, layout, nvme, progress, key_cache, hints,
                                                    prefetch_lead_ms))
                return asyncio.run(_engram_verbs(dense, specs, layout, nvme, progress, hints, prefetch_lead_ms))
        finally:
            torch.set_num_threads(threads)
            if collecting:
                gc.enable()
            if not _IN_WORKER:  # what the run's collector froze is the collector's again (a forked worker
                gc.unfreeze()  # keeps what it inherited frozen: _in_processes says why)

    runs = [(label, cap, specs, name) for label, cap, specs in configs for name in policies]

    def one(i: int, progress: Progress | None) -> PolicyResult:
        label, cap, specs, name = runs[i]
        t0 = time.perf_counter()
        detail: tuple[TierResult, ...] = ()
        learned = None
        if name == "engram":
            hit, detail, learned = engram(specs, progress)
        elif name == "lru":
            hit = _lru(dense, cap, progress)
        else:
            hit = _belady(dense, cap, progress)
        return PolicyResult(name, cap, requested, hit, (requested - hit) * block_bytes, time.perf_counter() - t0,
                            detail, "" if label.endswith(" blocks") else label, learned)

    if jobs > 1 and len(runs) > 1:
        if on_run:
            on_run(f"{len(runs)} runs", f"{min(jobs, len(runs))} at a time")
        return _in_processes(one, len(runs), jobs, progress)
    out = []
    for i, (label, _, _, name) in enumerate(runs):
        if on_run:
            on_run(name, label)
        out.append(one(i, progress))
    return out


_FORKED: tuple[Callable[[int, Progress | None], PolicyResult], Any] | None = None  # what a forked worker runs
_IN_WORKER = False  # this process is one of _in_processes' forked workers


def _worker_started() -> None:
    global _IN_WORKER
    _IN_WORKER = True


def _forked_run(i: int) -> PolicyResult:
    assert _FORKED is not None
    run, queue = _FORKED
    return run(i, queue.put)


def _in_processes(run: Callable[[int, Progress | None], PolicyResult], n: int, jobs: int,
                  progress: Progress | None) -> list[PolicyResult]:
    """run(0) .. run(n - 1), `jobs` at a time in forked processes (each inherits the trace: nothing is pickled
    but the results); their progress comes back through a queue.

    Everything the parent holds is frozen (`gc.freeze`) before the fork, and a worker never unfreezes it: a
    worker's collector then walks only what the worker made. Forking copies one thread of a process that may run
    others (gRPC's, in a process that served or called before; OpenMP's), whose objects may be mid-change in the
    copy: in a test run, after tests that ran gRPC servers, a worker crashed in its collector (a segmentation
    fault while collecting in `_belady`; gRPC logged that it skipped its fork handlers), and twice one hung.
    Not walking them also keeps the trace's pages shared with the parent instead of copied into every worker
    (the collector writes to each object it visits), as the gc module's documentation advises for fork."""
    global _FORKED
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    _FORKED = (run, queue)
    gc.freeze()
    try:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, n), mp_context=ctx,
                                                    initializer=_worker_started) as pool:
            futures = [pool.submit(_forked_run, i) for i in range(n)]
            while True:
                finished = all(f.done() for f in futures)
                try:
                    while True:
                        done = queue.get(timeout=0.2)
                        if progress:
                            progress(done)
                except queue_module.Empty:
                    pass
                if finished:
                    break
            return [f.result() for f in futures]
    finally:
        _FORKED = None
        gc.unfreeze()


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"

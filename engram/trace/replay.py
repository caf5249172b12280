"""Replay a trace against three policies at the same capacity (in blocks) and count prefix-contiguous
hits: a request hits its first k blocks if all of them are cached (KV is causal, so a block after a gap is
useless). After its lookup each request stores its missing blocks.

- engram: the real BlockStore, ChainIndex and LeafLRU (one DRAM tier sized to the capacity, blocks of a
  tiny layout, payloads of 256 bytes), with sessions holding references as the daemon's do. Nothing of
  the policy is re-implemented here.
- lru: plain LRU over block ids (what most caches do).
- belady: evict the block whose next use is furthest (offline, knows the future), and among blocks next
  used at the same time (by the same request) the deepest first. That is the optimum for prefix-contiguous
  hits too: a chained id stands for its whole prefix, so a block's ancestors are next used no later than it
  is; evicting furthest-then-deepest therefore never drops an ancestor while a descendant stays, the cache
  stays prefix-closed, every cached block it meets is a contiguous hit, and it gets Belady's plain-hit count,
  which bounds any policy's contiguous hits. (Breaking ties the other way, by id, dropped the chain's start
  and lost the hits of everything behind it.) tests/test_trace.py checks it against a brute force.
Bytes moved: missed blocks times `block_bytes` (what the blocks would weigh in the real model).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engram.api import SessionMode
from engram.block import BlockHeader, checksum
from engram.errors import ResourceExhausted
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.replay.runtime import ReplayRuntime
from engram.sessions import Session, SessionManager
from engram.store import BlockStore
from engram.tiers.dram import DramTier
from engram.trace.formats import Request

_BT = 16  # tokens per simulated block: block i of a request carries its hash id
_LAYOUT = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=4, dtype=DType.FP32,
                   block_tokens=_BT)
_SPEC = ModelSpec(name="trace", weights_id="trace", layout=_LAYOUT, codec="raw")
_NS = "trace"

Progress = Callable[[int], None]


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    capacity_blocks: int
    requested_blocks: int
    hit_blocks: int
    bytes_moved: int
    seconds: float = 0.0  # the run's wall time

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / max(1, self.requested_blocks)


def _tokens(ids: Sequence[int]) -> np.ndarray:
    return np.repeat(np.asarray(ids, dtype=np.int64) % (2**31 - 1), _BT).astype(np.int32)


async def _engram(trace: Sequence[Request], capacity: int, progress: Progress | None) -> int:
    payload = bytes(_LAYOUT.block_nbytes(_BT))
    store = BlockStore([DramTier(capacity * len(payload))], ModelRegistry(default_codec="raw"))
    fp = store.registry.register(_SPEC)
    sessions = SessionManager(store, ReplayRuntime([]))
    live: dict[str, Session] = {}
    hits = 0
    for r in trace:
        toks = _tokens(r.hash_ids)
        match = store.lookup(_NS, fp, toks)
        have = match.matched_tokens // _BT
        hits += have
        parent = match.blocks[have - 1].key if have else store.root(_NS, fp)
        for i in range(have, len(r.hash_ids)):
            header = BlockHeader(toks[i * _BT:(i + 1) * _BT], DType.FP32, _LAYOUT.block_shape(_BT), len(payload),
                                 checksum(payload))
            try:
                parent = (await store.put(_NS, fp, parent, header, payload, index=i)).key
            except ResourceExhausted:
                break  # the request alone outgrows the tier: its tail is not cached
        if r.session:
            s = live.get(r.session)
            if s is None:
                s = live[r.session] = sessions.open(_NS, fp, SessionMode.PERSIST, session_id=r.session, tokens=toks)
            else:
                s.tokens = toks
                sessions.hold(s)
            if r.close:
                sessions.close(_NS, r.session)
                del live[r.session]
        if progress:
            progress(1)
    return hits


def _lru(trace: Sequence[Request], capacity: int, progress: Progress | None) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in trace:
        for h in r.hash_ids:
            if h not in cache:
                break
            hits += 1
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
        if progress:
            progress(1)
    return hits


def _belady(trace: Sequence[Request], capacity: int, progress: Progress | None) -> int:
    uses: list[list[int]] = [[] for _ in trace]  # next use of each request's blocks, after that request
    nxt: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        uses[i] = [nxt.get(h, len(trace) + 1) for h in trace[i].hash_ids]
        for h in trace[i].hash_ids:
            nxt[h] = i
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazy: furthest first, then deepest
    hits = 0
    for i, r in enumerate(trace):
        for h in r.hash_ids:
            if h not in cache:
                break
            hits += 1
        for depth, (h, when) in enumerate(zip(r.hash_ids, uses[i], strict=True)):
            cache[h] = when
            heapq.heappush(heap, (-when, -depth, h))
        while len(cache) > capacity:
            when, _, h = heapq.heappop(heap)
            if cache.get(h) == -when:
                del cache[h]
        if progress:
            progress(1)
    return hits


POLICIES = ("engram", "lru", "belady")


def replay_all(trace: Sequence[Request], capacities: Sequence[int], block_bytes: int = 512 * 890,
               progress: Progress | None = None, policies: Sequence[str] = POLICIES,
               on_run: Callable[[str, int], None] | None = None) -> list[PolicyResult]:
    """Each of `policies` at every capacity (blocks), in trace order (sort by timestamp first:
    formats.in_time_order). block_bytes defaults to 512 tokens of an FP4 global KV. `on_run(policy,
    capacity)` is called as each run starts."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    runs: dict[str, Callable[[int], int]] = {
        "engram": lambda c: asyncio.run(_engram(trace, c, progress)),
        "lru": lambda c: _lru(trace, c, progress),
        "belady": lambda c: _belady(trace, c, progress),
    }
    requested = sum(len(r.hash_ids) for r in trace)
    out = []
    for cap in capacities:
        for name in policies:
            if on_run:
                on_run(name, cap)
            t0 = time.perf_counter()
            hit = runs[name](cap)
            out.append(PolicyResult(name, cap, requested, hit, (requested - hit) * block_bytes,
                                    time.perf_counter() - t0))
    return out

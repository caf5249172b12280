"""Which block a full tier gives up. Blocks no live session references go first, then those one session
holds, then those several hold; within that, one of two orders picks: least recently used first, or the
lowest *hit density* first (the hits a block may still earn per unit of cache time it would take up,
learned from when blocks come back); once clients say when their sessions are back, a third: the block whose
session is due back last first. Which order picks is learned too (LeCaR): an order whose victims come back
soon after they went loses weight. Where eviction deletes (the last tier, or any tier with nowhere to
demote to) only leaves go.

Why held classes: a session about to resume keeps its prefix, while blocks nobody holds (a finished agent's
history) go first; a shared root serves every session below it, a private tail only its own. They are still
victims when nothing else is left, so sessions cannot wedge a tier.

Why leaves: deleting only blocks with no children in the index makes a chain lose its tail before its head,
so every stored block stays reachable from the root (prefix closure). Demoting keeps a block reachable, so
demotion may take any block.

Why not LRU alone: LRU bets that the longest-idle block is the least likely to come back. Chats break that
bet: a conversation comes back after its user reads and types (in the public Mooncake conversation trace,
never within 30 s and half of the time after 2 minutes), and most prompts' tails never. When the cache
cannot hold that much traffic, LRU evicts each conversation just before it returns. The hit density ranks
by what the store has seen instead (LHD: Beckmann, Chen and Cidon, NSDI '18), with two changes for this
cache:
- Comebacks past eviction are seen too: a deleted block is remembered as a ghost (key, last use, class),
  and a put of it later counts as a comeback at its true age. LHD learns only from what it keeps, so a cache
  that evicts everything younger than the typical think time never learns that blocks come back after it.
- The horizon is chosen per block: density(class, age a) = max over T > a of (comebacks in (a, T]) /
  (cache time in (a, T]), where each block still waiting at age a occupies the cache until it comes back or
  until T: the best rate keeping it can still earn. Blocks unused for HORIZON x (stored blocks) uses count
  as gone.
Why not the density alone: where recency is right (agent sessions that come back after a tool call, and
whose liveness the held classes already tell), the density's estimates over pooled classes measured worse
than LRU; the LeCaR weights (Vietri et al., HotStorage '18) let each workload keep the order that works for
it (benchmarks/RESULTS.md trace_policy).

Why a hint order: what decides an agent's hits is which session comes back next, and its client knows
(the tool it called and how long that tool usually takes, or that its user is next), while the store only
sees ages. A client may say so with each turn (AppendSession expect_back_ms; `SessionManager.expect_back`):
a block points at the hint of the last session that took a reference to it (BlockMeta.holder), and the
third order gives up, within the lowest held class, the block whose session is due back last; a block with
no hint, or whose session is late by HINT_LAPSE x its wait (a crashed agent's), goes before any with one.
This is Continuum's tool-call-aware retention and KVFlow's steps-to-execution order, with the wait told by
the client rather than predicted here. The order takes a third of the picks once a client sends a hint, and
the LeCaR regrets move its weight like the others' (bad hints lose it); without hints nothing changes.

What is learned (`ReturnModel`, one per store, shared by its tiers):
- classes: held class (0, 1, 2) x reuse (0, 1, 2, 3 or more comebacks so far; a ghost carries its count).
- age: the store's clock counts block uses (each block a lookup finds, a put stores or finds stored); a
  block's age is the clock's advance since its last use; ages go in buckets, four per octave.
- a use at age a counts a comeback in the class the block had at its last use; a lease (a Get after the
  Lookup that found the block) refreshes its age without counting one.
- every (stored blocks) uses the densities are recomputed and older counts halved (workloads drift); stored
  blocks idle past the horizon are counted gone then (a sample of SWEEP_MAX of them in a larger store).
- a ghost that comes back costs the order(s) that chose it weight, the more the sooner it came back.
Until MIN_EVIDENCE comebacks and gones are seen (a small or new store) the order is plain least recently
used, exactly.

Per tier (`TierVictims`): every block with a copy in the tier, and apart the leaves, in arrays sampled
SAMPLE at a time (as LHD and Redis do; up to 2 x SAMPLE candidates all are compared); entries of blocks that
left the tier or gained a child are dropped as they are met (a block is added back when it becomes a leaf
again). Pinned, leased or moving blocks are passed over. Costs: a use O(1), a victim O(SAMPLE), memory
O(blocks + ghosts), a recomputation O(blocks) every (stored blocks) uses.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from engram.api import EvictionStats
from engram.index import BlockMeta

SAMPLE = 16  # candidates compared per victim in a tier with more than twice as many
KEEP_DIVISOR = 8  # a cold search keeps its sample's best 1/8 for the next searches
HORIZON = 16.0  # unused for HORIZON x stored blocks uses: gone
MIN_EVIDENCE = 256  # comebacks and gones seen before densities replace least-recently-used order
HINT_LAPSE = 3.0  # a hint no longer counts once its session is late by 3 x the wait it said (at least 3 s)
LEARNING_RATE = 0.45  # LeCaR's: how much weight an order loses per victim that came back at once
GHOSTS_MAX = 1 << 20  # entries of each ghost table at most (about 200 bytes each)
GHOSTS_PER_BLOCK = 4  # ghosts within the horizon: 4 per stored block, plus 1024
SWEEP_MAX = 1 << 17  # stored blocks a recomputation checks for idleness (all of them up to this many)
_REUSE = 4  # reuse classes: 0, 1, 2, 3+ comebacks
CLASSES = 3 * _REUSE
_NB = 160  # age buckets: ages 0-7 exact, then four per octave


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0


CLOCK = _Clock()  # one clock for every store and tier, so a block keeps its age when it moves


class Expected:
    """When a session's client said it will be back: `due`, in ms on its store's `ReturnModel.clock_ms`, after
    a wait of `wait` ms; due 0: nothing said. Blocks point at the Expected of the last session that took a
    reference to them (BlockMeta.holder), so a session's new hint reaches all its blocks at once."""

    __slots__ = ("due", "wait")

    def __init__(self) -> None:
        self.due = 0.0
        self.wait = 0.0


def tick(meta: BlockMeta) -> None:
    """Restart a block's age (a recovered block, or a test's use) without counting a comeback."""
    CLOCK.now += 1
    meta.tick = CLOCK.now


def age_bucket(age: int) -> int:
    if age < 8:
        return max(age, 0)
    bl = age.bit_length()
    return min(4 * (bl - 2) + ((age >> (bl - 3)) & 3), _NB - 1)


def _bucket_ages() -> np.ndarray:
    """A representative age (the middle) of every bucket."""
    out = np.zeros(_NB)
    for b in range(_NB):
        if b < 8:
            out[b] = b
            continue
        bl, sub = b // 4 + 2, b % 4
        lo = (4 + sub) << (bl - 3)
        out[b] = lo + (1 << (bl - 3)) / 2
    return out


_AGES = _bucket_ages()


class ReturnModel:
    """Comebacks and gones per class and age bucket, and from them each class's hit density by age."""

    def __init__(self, stored: Callable[[], Iterable[BlockMeta]], count: Callable[[], int], *,
                 horizon: float = HORIZON, min_evidence: int = MIN_EVIDENCE) -> None:
        self._stored = stored  # every indexed block: idle ones past the horizon count as gone
        self._count = count  # how many blocks are stored
        self.horizon = horizon
        self.min_evidence = min_evidence
        self.hits = [[0.0] * _NB for _ in range(CLASSES)]
        self.gone = [[0.0] * _NB for _ in range(CLASSES)]
        self.density: list[list[float]] | None = None  # None: not enough evidence yet, LRU order
        # key -> (tick, class, uses, the orders that chose it, the clock when it went)
        self.ghosts: OrderedDict[bytes, tuple[int, int, int, int, int]] = OrderedDict()
        self.weights = [0.5, 0.5, 0.0]  # recency, density, hint: how often each order picks the victim (LeCaR)
        self.clock_ms: Callable[[], float] = _monotonic_ms  # what hints' due times are read against
        self.hinted = False  # a client has said when a session comes back: the hint order takes part from then
        self.past: OrderedDict[bytes, int] = OrderedDict()  # ghosts past the horizon: key -> uses, for the class
        self.evidence = 0
        self._since = 0
        self._limit = self._g = 1024
        self.recomputed = 0
        self._rng = random.Random(0)

    # ---- what the store reports -----------------------------------------------------------------

    def use(self, meta: BlockMeta) -> None:
        """A request used a stored block (a put found it stored; a lookup's chain goes through `use_all`)."""
        self.use_all((meta,))

    def use_all(self, metas: Sequence[BlockMeta]) -> None:
        """`use` of each block in turn (a lookup's chain), in one loop: the densities are recomputed after
        the chain if it crossed the period."""
        hits = self.hits
        g = self._g
        now = CLOCK.now
        seen = gone = 0
        top = _REUSE - 1
        for meta in metas:
            now += 1
            if meta.tick:
                cls = meta.cls
                if cls >= 0:
                    age = now - meta.tick
                    if age > g:
                        self.gone[cls][age_bucket(g)] += 1
                        gone += 1
                    else:
                        if age < 8:
                            b = age
                        else:
                            bl = age.bit_length()
                            b = 4 * (bl - 2) + ((age >> (bl - 3)) & 3)  # age_bucket, inlined: age <= g
                        hits[cls][b] += 1
                        seen += 1
                meta.uses += 1
            meta.tick = now
            refs, uses = meta.refs, meta.uses
            meta.cls = (refs if refs < 2 else 2) * _REUSE + (uses if uses < top else top)
            meta.chosen = 0
        CLOCK.now = now
        self.evidence += seen + gone
        self._since += len(metas)
        if self._since >= self._limit:
            self.recompute()

    def arrive(self, meta: BlockMeta) -> None:
        """A new block was put: a comeback if the store deleted it before (a ghost), else its first use. (The
        comeback's count and the block's class inlined: every put of a new block comes here.)"""
        now = CLOCK.now = CLOCK.now + 1
        ghost = self.ghosts.pop(meta.key, None)
        if ghost is not None:
            last, cls, uses, chosen, went = ghost
            if cls >= 0:  # (_came_back; below 0: counted gone already, it starts afresh)
                age = now - last
                if age > self._g:
                    self._gone(cls)
                else:
                    self.hits[cls][age_bucket(age)] += 1
                    self.evidence += 1
            meta.uses = uses + 1
            if chosen:
                self._regret(chosen, now - went)
        else:
            past = self.past.pop(meta.key, -1)
            if past >= 0:  # back after the horizon: counted gone then, but a reuser all the same
                meta.uses = past + 1
        meta.tick = now
        refs, uses, top = meta.refs, meta.uses, _REUSE - 1
        meta.cls = (refs if refs < 2 else 2) * _REUSE + (uses if uses < top else top)  # held class, then reuse
        self._since += 1
        if self._since >= self._limit:
            self.recompute()

    def forget(self, meta: BlockMeta) -> None:
        """The store deleted the block: remember it, so a put of it later counts as a comeback."""
        if meta.cls < 0:  # already counted gone
            self._remember(meta.key, meta.uses)
            return
        self.ghosts[meta.key] = (meta.tick, meta.cls, meta.uses, meta.chosen, CLOCK.now)
        self.ghosts.move_to_end(meta.key)
        most = GHOSTS_PER_BLOCK * self._count() + 1024  # (the store's count, once: the loop changes it not)
        while len(self.ghosts) > (most if most < GHOSTS_MAX else GHOSTS_MAX):
            key, (_, cls, uses, _, _) = self.ghosts.popitem(last=False)
            self._gone(cls)
            self._remember(key, uses)

    def _remember(self, key: bytes, uses: int) -> None:
        self.past[key] = uses
        self.past.move_to_end(key)
        most = min(GHOSTS_MAX, max(65536, 8 * self._count()))
        while len(self.past) > most:
            self.past.popitem(last=False)

    # ---- learning -------------------------------------------------------------------------------

    def _regret(self, chosen: int, since: int) -> None:
        """A block an order chose came back `since` uses after it went: that order loses weight, the more
        the sooner (LeCaR: Vietri et al., HotStorage '18)."""
        n = max(16, self._count())
        r = 0.005 ** (since / n)
        w = self.weights
        orders = 3 if self.hinted else 2  # (loops over range(orders), a sum as a loop: compiled, no objects made)
        for e in range(orders):
            if chosen & (1 << e):
                w[e] *= math.exp(-LEARNING_RATE * r)
        total = 0.0
        for e in range(orders):
            total += w[e]
        for e in range(orders):  # min(0.99, max(0.01, w[e] / total)), without the generic min and max
            v = w[e] / total
            v = v if v > 0.01 else 0.01
            w[e] = v if v < 0.99 else 0.99

    def hint_seen(self) -> None:
        """A client said when a session comes back: from now on the hint order draws a share of the victims
        (a third of them to begin with; the regrets move it like the others')."""
        if not self.hinted:
            self.hinted = True
            w = self.weights
            w[0], w[1], w[2] = w[0] * 2 / 3, w[1] * 2 / 3, 1 / 3

    def _gone(self, cls: int) -> None:
        self.gone[cls][age_bucket(self._g)] += 1
        self.evidence += 1

    def recompute(self) -> None:
        """Count blocks idle past the horizon as gone, recompute every class's densities, halve the counts."""
        n = self._count()
        self._g = max(1024, int(self.horizon * n))
        self._limit = max(1024, n)
        self._since = 0
        now = CLOCK.now
        stored: Iterable[BlockMeta] = self._stored()
        if n > SWEEP_MAX:  # a large store: a sample, so a recomputation stays tens of milliseconds on the loop
            stored = self._rng.sample(list(stored), SWEEP_MAX)
        for meta in stored:
            if meta.cls >= 0 and now - meta.tick > self._g:
                self._gone(meta.cls)
                meta.cls = -1
        while self.ghosts:
            key, (last, cls, _, _, _) = next(iter(self.ghosts.items()))
            if now - last <= self._g:
                break
            _, _, uses, _, _ = self.ghosts.pop(key)
            self._gone(cls)
            self._remember(key, uses)
        if self.evidence >= self.min_evidence:
            self.density = densities(np.array(self.hits, dtype=np.float64), np.array(self.gone, dtype=np.float64)
                                     ).tolist()  # (the dtype named: not discovered element by element)
        self.hits = [[h / 2 for h in row] for row in self.hits]
        self.gone = [[g / 2 for g in row] for row in self.gone]
        self.recomputed += 1


def stats(model: ReturnModel) -> EvictionStats:
    return EvictionStats(learned=model.density is not None, recency_weight=model.weights[RECENCY],
                         hint_weight=model.weights[HINT],
                         comebacks=model.evidence, ghosts=len(model.ghosts) + len(model.past),
                         recomputations=model.recomputed)


def densities(hits: np.ndarray, gone: np.ndarray) -> np.ndarray:
    """density[c, a] = max over T > a of hits in (a, T] / cache time in (a, T], where a block that comes
    back at age x (or is gone at x) occupies min(x, T) - a. Arrays are (classes, buckets); buckets past the
    last one with any count get 0 and are left out of the O(buckets^2) work."""
    used = np.flatnonzero((hits + gone).sum(axis=0))
    out = np.zeros(hits.shape)
    if not len(used):
        return out
    nb = int(used[-1]) + 1
    hits, gone = hits[:, :nb], gone[:, :nb]
    n = hits + gone
    ages = _AGES[:nb]
    cum_h = np.cumsum(hits, axis=1)  # (C, B): comebacks at buckets <= k
    cum_n = np.cumsum(n, axis=1)
    cum_rn = np.cumsum(n * ages, axis=1)
    total_n = cum_n[:, -1:]
    # [c, a, T]
    h = cum_h[:, None, :] - cum_h[:, :, None]
    occ = ((cum_rn[:, None, :] - cum_rn[:, :, None])
           - ages[None, :, None] * (cum_n[:, None, :] - cum_n[:, :, None])
           + (ages[None, None, :] - ages[None, :, None]) * (total_n[:, :, None] - cum_n[:, None, :]))
    later = np.triu(np.ones((nb, nb), dtype=bool), k=1)[None]
    ok = later & (occ > 0)
    rate = np.where(ok, h / np.where(ok, occ, 1.0), 0.0)
    out[:, :nb] = rate.max(axis=2)
    return out


def _first(entry: tuple) -> tuple:
    return entry[0]


class _Members:
    """An array of blocks with O(1) add, remove and uniform sampling."""

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[BlockMeta] = []
        self.pos: dict[int, int] = {}  # id(meta) -> index; the array keeps the object alive, so ids stay unique

    def __len__(self) -> int:
        return len(self.items)

    def add(self, meta: BlockMeta) -> None:
        items = self.items
        n = len(items)
        if self.pos.setdefault(id(meta), n) == n:  # one probe (a member's place is below n): not a member yet
            items.append(meta)

    def remove_at(self, i: int) -> None:
        meta = self.items[i]
        last = self.items.pop()
        del self.pos[id(meta)]
        if last is not meta:
            self.items[i] = last
            self.pos[id(last)] = i

    def reset(self, metas: Iterable[BlockMeta]) -> None:
        self.items = []
        self.pos = {}
        for m in metas:
            self.add(m)


RECENCY, DENSITY, HINT = 0, 1, 2  # the orders a victim is chosen by


class TierVictims:
    """One tier's eviction candidates (every block it holds, and its leaves), and the victim search."""

    def __init__(self, tier_name: str, lookup: Callable[[bytes], BlockMeta | None],
                 model: ReturnModel | None = None, *, sample: int = SAMPLE, seed: int = 0) -> None:
        self.tier_name = tier_name
        self.lookup = lookup
        self.model = model
        self.sample = sample
        self.keep = max(1, sample // KEEP_DIVISOR)
        self._all = _Members()
        self._leaves = _Members()
        self._rng = random.Random(seed)
        self._live = 0  # blocks found valid at the last compaction
        # While the model is cold: the best candidates of the last search by recency, best last: (negated
        # rank key, block, its tick then); for the leaves or for every block (`_queued_leaf_only`).
        self._queue: list[tuple[tuple, BlockMeta, int]] = []
        self._queued_leaf_only = False
        self._epoch = -1  # the model's recomputations when the queue was filled: warm since, it is dropped

    def __len__(self) -> int:
        return len(self._all)

    def add(self, meta: BlockMeta, *, fill: bool = False) -> None:
        """A copy of the block arrived in this tier (it competes once a sample draws it). While the model is cold
        and a search kept candidates, it joins them if it ranks among them: kept candidates taken without it
        could put a block a session holds before it, one no session holds (the order says unheld first)."""
        self._all.add(meta)
        if not meta.children:
            self._leaves.add(meta)
        if self._queue and (not self._queued_leaf_only or not meta.children):
            self._offer(meta, fill=fill)  # unless filling, only if it ranks ahead of a kept one
        if len(self._all) > 2 * self._live + 1024:
            self._compact()

    def _offer(self, meta: BlockMeta, *, fill: bool) -> None:
        """Rank a block among the kept candidates: in if it beats the worst of them (or, with fill, while
        fewer than `keep` are kept)."""
        queue = self._queue
        entry = self._entry(meta)
        if (fill and len(queue) < self.keep) or entry[0] > queue[0][0]:
            bisect.insort(queue, entry, key=_first)
            if len(queue) > self.keep:
                del queue[0]

    def leaf_again(self, meta: BlockMeta) -> None:
        """The block's last child left the index: a candidate where eviction deletes. While the model is cold
        it joins the kept candidates at once (`add`), since it is least recently used order's next victim (as
        old as the child that went); once warm, it waits until a sample draws it: trimming the tails of several
        chains rather than eating one chain whole measured better."""
        self.add(meta, fill=self._queued_leaf_only)

    def forget_queue(self) -> None:
        """Blocks may have become evictable (a lease or pin ended, a move landed) or changed class (a session
        took or dropped a reference): what the last search kept no longer reflects the order."""
        self._queue.clear()

    def _valid(self, meta: BlockMeta, leaf_only: bool) -> bool:
        return (self.tier_name in meta.locations and self.lookup(meta.key) is meta
                and not (leaf_only and meta.children))

    def victim(self, *, leaf_only: bool, max_held: int | None = None) -> BlockMeta | None:
        """The evictable block (a leaf, with leaf_only) that one of two orders puts first, among all
        candidates or a sample of them; None if every candidate is pinned, leased or moving. Both orders
        take blocks no live session holds first, then those one holds, then those several hold. Within that,
        the recency order takes the least recently used; the density order the lowest hit density. While
        the model is cold the recency order decides; once it is warm, each search draws the order by the
        model's weights (LeCaR), which move toward the order whose victims come back less; once a client
        has sent a hint, a third order draws too: the block whose session is due back last (`_hint_best`).
        `max_held`: give up (None) after passing that many held blocks (a promotion would rather skip than
        search a tier its reader's leases fill). While the model is cold a search's next best
        `sample // KEEP_DIVISOR` are kept for the next searches (as Redis's eviction pool), each taken only if
        it is still a candidate and unused since, and ranked again as it is taken; once warm every search
        samples afresh (kept candidates ranked stale measured worse)."""
        model = self.model
        warm = model is not None and model.density is not None
        order = RECENCY
        if model is not None and warm:
            u, w = self._rng.random(), model.weights
            order = RECENCY if u < w[RECENCY] else DENSITY if u < w[RECENCY] + w[DENSITY] or not model.hinted else HINT
        epoch = model.recomputed if model is not None else -1
        if not warm and self._queued_leaf_only == leaf_only and self._epoch == epoch:
            found = self._from_queue(leaf_only)
            if found is not None:
                found.chosen = 1 << RECENCY
                return found
        if self._queue:
            self._queue.clear()
        self._queued_leaf_only = leaf_only
        self._epoch = epoch
        candidates = self._candidates(leaf_only, max_held)
        if not candidates:
            return None
        now = CLOCK.now
        if not warm:
            entries = sorted(self._entry(m) for m in candidates)
            victim = entries.pop()[1]
            self._queue[:] = entries[-self.keep:] if self.keep > 1 else []
            return victim
        assert model is not None  # warm
        by_recency, by_density = self._both_best(candidates, now)
        hinted = model.hinted
        by_hint = self._hint_best(candidates, model.clock_ms()) if hinted else by_recency
        victim = by_density if order == DENSITY else by_hint if order == HINT else by_recency
        victim.chosen = ((victim is by_recency) << RECENCY | (victim is by_density) << DENSITY
                         | (hinted and victim is by_hint) << HINT)
        return victim

    def _from_queue(self, leaf_only: bool) -> BlockMeta | None:
        queue = self._queue
        while queue:
            key, meta, at = queue.pop()
            if meta.tick != at or not meta.evictable or not self._valid(meta, leaf_only):
                continue
            fresh = self._entry(meta)  # its class may have changed since it was ranked
            if fresh[0] == key or not queue or fresh[0] >= queue[-1][0]:
                return meta
            bisect.insort(queue, fresh, key=_first)
        return None

    def pinned_to_demote(self) -> BlockMeta | None:
        """When every candidate is pinned, leased or moving: the least recently used pinned block that is neither
        leased nor moving (of a sample, or of all when the sample meets none), for a tier that can demote. A pin
        keeps a block stored, not in this tier: a tenant that pinned its blocks until DRAM was full failed every
        other tenant's puts while NVMe had room."""
        items = self._all.items
        rand, n = self._rng.random, len(items)
        drawn = [items[int(rand() * n)] for _ in range(min(n, 8 * self.sample))] if n > 2 * self.sample else items
        for pool in (drawn, items):
            found = [m for m in pool if m.pins and not m.leases and not m.moving and self._valid(m, False)]
            if found:
                return min(found, key=lambda m: m.tick)
        return None

    def _candidates(self, leaf_only: bool, max_held: int | None) -> list[BlockMeta]:
        """Every evictable candidate when there are at most 2 x sample, else a sample of `sample` of them;
        entries no longer candidates are dropped on the way."""
        members = self._leaves if leaf_only else self._all
        items = members.items
        found: list[BlockMeta] = []
        if len(items) <= 2 * self.sample:
            name, lookup = self.tier_name, self.lookup
            i = 0
            while i < len(items):
                meta = items[i]
                if (leaf_only and meta.children) or name not in meta.locations or lookup(meta.key) is not meta:
                    members.remove_at(i)
                    continue
                i += 1
                if not (meta.pins or meta.leases or meta.moving):  # evictable, inlined: this runs per eviction
                    found.append(meta)
            return found
        held = draws = 0
        rand = self._rng.random
        name, lookup = self.tier_name, self.lookup
        n = len(items)
        want, most = self.sample, 8 * self.sample
        while n and want and draws < most:
            draws += 1
            i = int(rand() * n)
            meta = items[i]
            if (leaf_only and meta.children) or name not in meta.locations or lookup(meta.key) is not meta:
                members.remove_at(i)
                n -= 1
                continue
            if not (meta.pins or meta.leases or meta.moving):
                found.append(meta)
                want -= 1
                continue
            held += 1
            if max_held is not None and held >= max_held and not found:
                return []
        if found or not items or (max_held is not None and held >= max_held):
            return found
        held = 0  # the sample met only held blocks: look at every candidate
        for meta in list(items):
            if not self._valid(meta, leaf_only):
                members.remove_at(members.pos[id(meta)])
            elif meta.evictable:
                found.append(meta)
            else:
                held += 1
                if max_held is not None and held >= max_held and not found:
                    return []
        return found

    def _both_best(self, candidates: list[BlockMeta], now: int) -> tuple[BlockMeta, BlockMeta]:
        """The first candidate by recency and by density (`_entry`'s orders, in one pass: this runs for
        every eviction)."""
        assert self.model is not None and self.model.density is not None
        density = self.model.density
        reuse_top = _REUSE - 1
        top = _NB - 1
        best_r = best_d = candidates[0]
        r_refs, r_tick = 3, 0  # the recency order's best so far: (held class, tick)
        d_refs, d_dens, d_tick = 3, 0.0, 0  # the density order's: (held class, density, tick)
        for m in candidates:
            refs = m.refs if m.refs < 2 else 2
            t = m.tick
            if refs < r_refs or (refs == r_refs and t < r_tick):
                r_refs, r_tick, best_r = refs, t, m
            if refs > d_refs:
                continue  # a higher held class never beats the density order's best
            age = now - t
            if age < 8:
                b = age if age > 0 else 0
            else:
                bl = age.bit_length()
                b = 4 * (bl - 2) + ((age >> (bl - 3)) & 3)
                if b > top:
                    b = top
            u = m.uses if m.uses < reuse_top else reuse_top
            d = density[refs * _REUSE + u][b]
            if refs < d_refs or d < d_dens or (d == d_dens and t < d_tick):
                d_refs, d_dens, d_tick, best_d = refs, d, t, m
        return best_r, best_d

    @staticmethod
    def _hint_best(candidates: list[BlockMeta], now_ms: float) -> BlockMeta:
        """The hint order's first: held class first, as the others; within it, the block whose session said
        it comes back last; a block with no live hint (none said, or its session late by HINT_LAPSE x its
        wait, at least HINT_LAPSE seconds) before any that has one, the least recently used of those first."""
        best = candidates[0]
        b_refs, b_due, b_tick = 3, -1.0, 0
        for m in candidates:
            refs = m.refs if m.refs < 2 else 2
            if refs > b_refs:
                continue
            h = m.holder
            due = math.inf
            if h is not None and h.due and now_ms <= h.due + HINT_LAPSE * max(h.wait, 1000.0):
                due = h.due
            if refs < b_refs or due > b_due or (due == b_due and m.tick < b_tick):
                b_refs, b_due, b_tick, best = refs, due, m.tick, m
        return best

    @staticmethod
    def _entry(m: BlockMeta) -> tuple[tuple, BlockMeta, int]:
        """(negated rank key, block, tick) by recency: held class, then the older; the largest negated key
        goes first. Ties (a lease gives every block of a chain the same tick) go by key, so a replay decides
        the same way every time."""
        return (-min(m.refs, 2), -m.tick, m.key), m, m.tick

    def rebuild(self, metas: Iterable[BlockMeta]) -> None:
        """Every block of `metas` with a copy in this tier (after recovery, or when the tier leaves
        leaf-only mode and inner blocks dropped from the leaves may be leaves again)."""
        mine = [m for m in metas if self.tier_name in m.locations]
        self._all.reset(mine)
        self._leaves.reset(m for m in mine if not m.children)
        self._live = len(mine)

    def _compact(self) -> None:
        self._all.reset(m for m in self._all.items if self._valid(m, False))
        self._leaves.reset(m for m in self._leaves.items if self._valid(m, True))
        self._live = len(self._all)

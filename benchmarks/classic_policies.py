"""Classic online eviction policies from the literature, as block-level simulators scored the way the replayer
scores (a request's leading cached blocks hit; then every block of the request is accessed in order, root first),
so the store's learned order can be set against them on the same traces (benchmarks/trace_bounds.py prints them
beside LRU, the oracle orders and the optimum):
- LIRS (Jiang and Zhang, SIGMETRICS '02): blocks whose last reuse distance was short (LIR) hold all but a small
  share of the cache; the rest (HIR) pass through a small FIFO. Keeps a stable subset when a loop outgrows the
  cache, which LRU cycles through.
- ARC (Megiddo and Modha, FAST '03): recency and frequency lists with ghosts of each; the split between them adapts
  to which ghost list is hit.
- S3-FIFO (Yang et al., SOSP '23): new blocks enter a small FIFO; those used again there move to the main FIFO,
  the rest leave a ghost; a ghost hit enters the main FIFO directly; the main FIFO gives a used block another pass.
Each simulator holds exactly `capacity` blocks at most and admits every block it is asked for (a put is stored).
Plain Python on dense ids (engram.trace.formats.prefix_ids); not the store's code."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

from engram.trace.formats import Request


class OnlinePolicy(Protocol):
    def __contains__(self, block: object) -> bool: ...

    def access(self, block: int) -> None:
        """The block was used: a hit if cached, else it is admitted (evicting as needed)."""

    def __len__(self) -> int: ...


class Lirs:
    """LIRS with `hir_share` of the capacity for resident HIR blocks (the paper's 1%); the stack's non-resident
    entries are bounded at `ghosts` x capacity (the oldest to become non-resident dropped first)."""

    def __init__(self, capacity: int, hir_share: float = 0.01, ghosts: float = 10.0) -> None:
        self.capacity = capacity
        self.lir_capacity = capacity - max(1, int(capacity * hir_share))  # at least one resident HIR block
        self.stack: OrderedDict[int, bool] = OrderedDict()  # block -> is LIR; last = most recent
        self.queue: OrderedDict[int, None] = OrderedDict()  # resident HIR blocks; first = next victim
        self.resident: set[int] = set()
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # non-resident HIR blocks still in the stack
        self.max_ghosts = max(1, int(ghosts * capacity))
        self.lir = 0

    def __contains__(self, block: object) -> bool:
        return block in self.resident

    def __len__(self) -> int:
        return len(self.resident)

    def _prune(self) -> None:
        """The stack's bottom is always a LIR block: drop HIR entries below the lowest one."""
        while self.stack:
            block, is_lir = next(iter(self.stack.items()))
            if is_lir:
                return
            del self.stack[block]
            self.ghosts.pop(block, None)

    def _demote_bottom(self) -> None:
        self._prune()
        block, _ = self.stack.popitem(last=False)
        self.lir -= 1
        self.queue[block] = None
        self._prune()

    def _make_lir(self, block: int) -> None:
        self.stack[block] = True
        self.stack.move_to_end(block)
        self.lir += 1
        if self.lir > self.lir_capacity:
            self._demote_bottom()

    def access(self, block: int) -> None:
        if block in self.resident:
            if self.stack.get(block) is True:  # a LIR block: to the top
                self.stack.move_to_end(block)
                self._prune()
            elif block in self.stack:  # a HIR block reused within the LIR set's span: becomes LIR
                del self.queue[block]
                self._make_lir(block)
            else:  # a HIR block whose last use fell off the stack: stays HIR
                self.stack[block] = False
                self.queue.move_to_end(block)
            return
        if self.lir < self.lir_capacity and len(self.resident) < self.capacity:  # filling: every block is LIR
            self.resident.add(block)
            self.ghosts.pop(block, None)
            self._make_lir(block)
            return
        if len(self.resident) >= self.capacity:
            victim, _ = self.queue.popitem(last=False)
            self.resident.discard(victim)
            if victim in self.stack:
                self.ghosts[victim] = None
                if len(self.ghosts) > self.max_ghosts:
                    old, _ = self.ghosts.popitem(last=False)
                    del self.stack[old]
        self.resident.add(block)
        if block in self.stack:  # a ghost: reused within the LIR set's span
            del self.ghosts[block]
            self._make_lir(block)
        else:
            self.stack[block] = False
            self.queue[block] = None


class Arc:
    """ARC as published: T1 (seen once lately) and T2 (seen at least twice), ghosts B1 and B2, target size p of T1."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: object) -> bool:
        return block in self.t1 or block in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (not self.t2 or len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        else:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None

    def access(self, block: int) -> None:
        if block in self.t1:
            del self.t1[block]
            self.t2[block] = None
        elif block in self.t2:
            self.t2.move_to_end(block)
        elif block in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1))
            self._replace(False)
            del self.b1[block]
            self.t2[block] = None
        elif block in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            self._replace(True)
            del self.b2[block]
            self.t2[block] = None
        else:
            if len(self.t1) + len(self.b1) == self.c:
                if len(self.t1) < self.c:
                    self.b1.popitem(last=False)
                    self._replace(False)
                else:
                    self.t1.popitem(last=False)
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= self.c:
                if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) == 2 * self.c:
                    self.b2.popitem(last=False)
                self._replace(False)
            self.t1[block] = None


class S3Fifo:
    """S3-FIFO: a small FIFO of `small_share` of the capacity (the paper's 10%), a main FIFO, a ghost FIFO as
    long as the main one, a use count capped at 3. A block used again while in the small FIFO moves to the main
    one when it reaches the tail (the paper's text: accessed at least once there)."""

    def __init__(self, capacity: int, small_share: float = 0.1) -> None:
        self.small_capacity = max(1, int(capacity * small_share))
        self.main_capacity = max(1, capacity - self.small_capacity)
        self.capacity = capacity
        self.small: deque[int] = deque()  # appendleft = newest; pop = oldest
        self.main: deque[int] = deque()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}  # resident blocks' use counts

    def __contains__(self, block: object) -> bool:
        return block in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def _evict_small(self) -> None:
        while self.small:
            block = self.small.pop()
            if self.freq[block] >= 1:
                self.freq[block] = 0
                self.main.appendleft(block)
                if len(self.main) > self.main_capacity:
                    self._evict_main()
            else:
                del self.freq[block]
                self.ghost[block] = None
                if len(self.ghost) > self.main_capacity:
                    self.ghost.popitem(last=False)
                return

    def _evict_main(self) -> None:
        while self.main:
            block = self.main.pop()
            if self.freq[block] > 0:
                self.freq[block] -= 1
                self.main.appendleft(block)
            else:
                del self.freq[block]
                return

    def access(self, block: int) -> None:
        if block in self.freq:
            self.freq[block] = min(self.freq[block] + 1, 3)
            return
        while len(self.freq) >= self.capacity:
            if len(self.small) >= self.small_capacity or not self.main:
                self._evict_small()
            else:
                self._evict_main()
        self.freq[block] = 0
        if block in self.ghost:
            del self.ghost[block]
            self.main.appendleft(block)
        else:
            self.small.appendleft(block)


POLICIES: dict[str, Callable[[int], OnlinePolicy]] = {"lirs": Lirs, "arc": Arc, "s3fifo": S3Fifo}


def replay(trace: Sequence[Request], policy: OnlinePolicy) -> int:
    """Hit blocks: each request's leading blocks the policy holds when it arrives; then all its blocks are used."""
    hits = 0
    for r in trace:
        for h in r.hash_ids:
            if h not in policy:
                break
            hits += 1
        for h in r.hash_ids:
            policy.access(h)
    return hits

"""What could an online eviction policy reach on a trace? Block-level simulators (prefix-contiguous hits, as the
replayer scores them) of least recently used order, of the offline optimum, and of orders that are told, by
an oracle, part of what the optimum knows:
- flag: whether a block is ever used again (not when); blocks never used again go first, then LRU.
- flag_mru: the same, then the most recently used of the reused blocks first (keeps a stable subset when the
  reused blocks outgrow the cache, which LRU cycles through).
- flag_depth: the same, then the deepest block first.
If an order that knows which blocks come back still falls short of a target, no online policy that only
predicts reuse (admission, frequency, reuse classes) meets it: what is missing is *when* blocks come back.
Beside them, the classic online policies of benchmarks/classic_policies.py (LIRS, ARC, S3-FIFO) on the same
trace and scoring, so the store's order can be set against the literature's. Also prints the optimum's hits by
return age (how long after its last use a hit block came back) and, for predicting reuse online, how often the
blocks a request adds are used again by what the store can see of the request (a continuing conversation or a
first turn, its last block).
Run: .venv/bin/python benchmarks/trace_bounds.py TRACE.jsonl [--capacity 1000,10000]"""

from __future__ import annotations

import argparse
import heapq
from collections import Counter
from collections.abc import Callable, Sequence

from engram.errors import EngramError
from engram.trace import in_time_order, read_trace
from engram.trace.formats import Request, prefix_ids

try:
    from benchmarks.classic_policies import POLICIES, replay
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from classic_policies import POLICIES, replay  # type: ignore[no-redef]

NEVER = 1 << 62
# (request index, depth in its chain, the block's next use (NEVER: none), a sequence number) -> rank; highest first
Rank = Callable[[int, int, int, int], tuple[int, ...]]

ORDERS: dict[str, Rank] = {
    "lru": lambda i, d, nxt, seq: (-seq,),
    "flag": lambda i, d, nxt, seq: (nxt == NEVER, -seq),
    "flag_mru": lambda i, d, nxt, seq: (nxt == NEVER, seq),
    "flag_depth": lambda i, d, nxt, seq: (nxt == NEVER, d, -seq),
    "belady": lambda i, d, nxt, seq: (nxt, d),  # furthest next use first; among equals the deepest
}


def next_uses(trace: Sequence[Request]) -> list[list[int]]:
    """For each request, each of its blocks' next use (a later request's index), NEVER if none."""
    out: list[list[int]] = [[] for _ in trace]
    nxt: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        out[i] = [nxt.get(h, NEVER) for h in trace[i].hash_ids]
        for h in trace[i].hash_ids:
            nxt[h] = i
    return out


def simulate(trace: Sequence[Request], capacity: int, rank: Rank, uses: list[list[int]] | None = None
             ) -> tuple[int, list[float]]:
    """Hit blocks (a request's leading blocks found cached) and each hit's return age in ms."""
    uses = uses if uses is not None else next_uses(trace)
    cache: dict[int, tuple[int, ...]] = {}
    heap: list[tuple[tuple[int, ...], int]] = []  # (negated rank, block): lazy, stale entries skipped
    last: dict[int, float] = {}
    hits, ages, seq = 0, [], 0
    for i, r in enumerate(trace):
        for h in r.hash_ids:
            if h not in cache:
                break
            hits += 1
            ages.append(r.timestamp - last[h])
        for d, (h, nxt) in enumerate(zip(r.hash_ids, uses[i], strict=True)):
            seq += 1
            key = tuple(-x for x in rank(i, d, nxt, seq))
            cache[h] = key
            last[h] = r.timestamp
            heapq.heappush(heap, (key, h))
        while len(cache) > capacity:
            key, h = heapq.heappop(heap)
            if cache.get(h) == key:
                del cache[h]
    return hits, ages


def reuse_by_feature(trace: Sequence[Request]) -> dict[str, tuple[int, int]]:
    """(blocks, of them used again) per what the store sees of the request that added them: a request that
    matched more than its first block (a conversation going on), or at most that one (a first turn); its last
    block apart (partial in Mooncake traces)."""
    count = Counter(h for r in trace for h in r.hash_ids)
    known: set[int] = set()
    out: dict[str, list[int]] = {}
    for r in trace:
        matched = 0
        for h in r.hash_ids:
            if h not in known:
                break
            matched += 1
        new = r.hash_ids[matched:]
        known.update(new)
        for n, h in enumerate(new):
            kind = "last block" if n == len(new) - 1 else "continuing" if matched > 1 else "first turn"
            row = out.setdefault(kind, [0, 0])
            row[0] += 1
            row[1] += count[h] > 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _quantile(ordered: list[float], p: float) -> float:
    """The p-quantile of sorted ms, in seconds."""
    return ordered[int(p * (len(ordered) - 1))] / 1000 if ordered else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="1000,10000")
    args = ap.parse_args()
    try:
        trace, moved = in_time_order(read_trace(args.trace))
        caps = [int(c) for c in args.capacity.split(",")]
    except (OSError, ValueError, EngramError) as exc:
        raise SystemExit(f"trace_bounds: {exc}") from None
    if not trace or min(caps) < 1:
        raise SystemExit(f"trace_bounds: {args.trace} holds no requests" if not trace
                         else "trace_bounds: --capacity takes positive block counts")
    trace = prefix_ids(trace)[0]  # ids stand for whole prefixes, in their hash scopes, as the replayer counts them
    accesses = sum(len(r.hash_ids) for r in trace)
    if not accesses:
        raise SystemExit(f"trace_bounds: {args.trace}'s requests name no blocks: nothing to count hits of")
    seconds = max(1e-3, (trace[-1].timestamp - trace[0].timestamp) / 1000)
    rate = accesses / seconds
    print(f"{args.trace}: {len(trace):,} requests ({moved} out of time order, sorted), {accesses:,} block accesses, "
          f"{len({h for r in trace for h in r.hash_ids}):,} distinct blocks over {seconds:,.0f} s "
          f"({rate:,.1f} blocks/s)")
    uses = next_uses(trace)
    for cap in caps:
        print(f"\ncapacity {cap:,} blocks ({cap / rate:,.1f} s of traffic)")
        print("| order | hit ratio | hit blocks | return age of hits p50 / p90 s |")
        print("|---|---:|---:|---|")
        ages: list[float] = []
        for name, rank in ORDERS.items():
            hits, ages = simulate(trace, cap, rank, uses)
            ages.sort()
            print(f"| {name} | {100 * hits / accesses:.2f}% | {hits:,} | {_quantile(ages, 0.5):.0f} / "
                  f"{_quantile(ages, 0.9):.0f} |")
        for name, make in POLICIES.items():
            hits = replay(trace, make(cap))
            print(f"| {name} (online) | {100 * hits / accesses:.2f}% | {hits:,} | - |")
        within = " / ".join(f"{100 * sum(a <= s * 1000 for a in ages) / accesses:.2f}%" for s in (10, 30, 60, 120, 300))
        print(f"the optimum's hits that came back within 10 / 30 / 60 / 120 / 300 s, of all accesses: {within}")
    print("\n| blocks a request adds | blocks | used again |")
    print("|---|---:|---:|")
    for kind, (n, again) in sorted(reuse_by_feature(trace).items()):
        print(f"| {kind} | {n:,} | {100 * again / max(1, n):.1f}% |")


if __name__ == "__main__":
    main()

"""Lookups per second through ChainIndex.match behind a prefix with many children (a shared system prompt
that thousands of conversations extend: 7,373 children of the first block in a real conversation trace).
Each query matches the shared first block, then diverges inside one child at token 200 of 512; every child
opens with the same 16 template tokens. Reports lookups/s and the index's own work count per lookup, with 1
child and with N children. With --replay: the trace replayer's engram policy (the real store) on a trace of
8,000 requests behind one shared first block with 7,000 continuations, as in a conversation trace.
Run: .venv/bin/python benchmarks/index_fanout.py [--children 7000] [--replay] [--json]"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time

import numpy as np

from engram.index import BlockMeta, ChainIndex
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.layout import DType
from engram.trace import Request, replay_all

BT = 512
FP = b"fanout-model-fp0"


def _meta(parent: bytes, tokens: np.ndarray) -> BlockMeta:
    return BlockMeta(key=block_key(parent, tokens), parent=parent, namespace="ns", model_fingerprint=FP,
                     tokens=tokens_to_bytes(tokens), num_tokens=len(tokens), dtype=DType.BF16,
                     shape=(1, 2, len(tokens), 1, 1), nbytes=0, checksum=0, locations=["dram"],
                     full=len(tokens) == BT)


def measure(children: int, lookups: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    index = ChainIndex()
    first = rng.integers(0, 32_000, BT, dtype=np.int32)
    b0 = _meta(root_key("ns", FP), first)
    index.add(b0)
    bodies = []
    for _ in range(children):
        body = rng.integers(0, 32_000, BT, dtype=np.int32)
        body[:16] = np.arange(100, 116)
        index.add(_meta(b0.key, body))
        bodies.append(body)
    queries = []
    for i in range(256):
        q = np.concatenate([first, bodies[i % children]]).astype(np.int32)
        q[BT + 200] = 40_000  # diverges inside the child: the key walk stops after b0
        queries.append(q)
    index.match("ns", FP, queries[0], BT)
    before = index.probes
    t0 = time.perf_counter()
    for i in range(lookups):
        m = index.match("ns", FP, queries[i % len(queries)], BT)
    dt = time.perf_counter() - t0
    assert m.matched_tokens == BT + 200
    return {"children": children, "lookups_per_s": lookups / dt, "work_per_lookup": (index.probes - before) / lookups}


def replay(children: int) -> dict[str, float]:
    rng = random.Random(0)
    trace = [Request(t, (0, 1 + t % children, *(100_000 + 10 * (t % children) + k for k in range(rng.randint(1, 3)))))
             for t in range(8000)]
    t0 = time.perf_counter()
    r = replay_all(trace, [4096], policies=("engram",))[0]
    dt = time.perf_counter() - t0
    return {"requests": len(trace), "accesses": r.requested_blocks, "seconds": dt,
            "accesses_per_s": r.requested_blocks / dt, "hit_ratio": r.hit_ratio}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=7000)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.replay:
        r = replay(args.children)
        print(json.dumps(r) if args.json else f"{r['requests']} requests, {r['accesses']} block accesses: "
              f"{r['seconds']:.2f} s, {r['accesses_per_s']:,.0f} accesses/s, hit ratio {r['hit_ratio']:.4f}")
        return
    rows = [measure(1, args.lookups), measure(args.children, args.lookups)]
    if args.json:
        print(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.processor() or
                          platform.machine(), "rows": rows}, indent=2))
        return
    for r in rows:
        print(f"{r['children']:>7} children: {r['lookups_per_s']:>10,.0f} lookups/s, "
              f"{r['work_per_lookup']:.0f} steps per lookup")


if __name__ == "__main__":
    main()

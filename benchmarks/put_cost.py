"""Microseconds per block of the store's put path (BlockStore.put_chain, the trace replayer's put), into a tier
with room and into a full one (each put then makes room first: victim search, delete, ghost), without sessions,
the garbage collector off. What a miss costs in a replay, in its parts; run it against a compiled build
(PYTHONPATH at a directory holding only its package) and the dev install to compare (engram/compiled.py).
Run: .venv/bin/python benchmarks/put_cost.py [--blocks 100000] [--full 10000]"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

from engram import compiled
from engram.block import checksum
from engram.keys import block_key_of_bytes
from engram.layout import ModelSpec
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import DramTier
from engram.trace.replay import layout_for

CHAIN = 100  # blocks per put_chain call, as a request's missing tail


async def per_block(capacity_blocks: int, blocks: int) -> float:
    layout = layout_for(64 * 890)
    bt = layout.block_tokens
    nbytes = layout.block_nbytes(bt)
    store = BlockStore([DramTier(capacity_blocks * nbytes)], ModelRegistry(default_codec="raw"))
    store.flusher = None
    fp = store.registry.register(ModelSpec(name="bench", weights_id="bench", layout=layout, codec="raw"))
    root = store.root("bench", fp)
    payload = bytes(nbytes)
    chains = []
    for c in range(blocks // CHAIN):
        parent, chain = root, []
        for j in range(CHAIN):
            tokens = (c * CHAIN + j).to_bytes(4, "little") * bt
            parent = block_key_of_bytes(parent, tokens)
            chain.append((parent, tokens))
        chains.append(chain)
    ck = checksum(payload)
    t0 = time.perf_counter()
    for chain in chains:
        await store.put_chain("bench", fp, root, chain, payload, ck)
    return (time.perf_counter() - t0) / (len(chains) * CHAIN) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks put")
    ap.add_argument("--full", type=int, default=10_000, help="the full tier's capacity in blocks")
    args = ap.parse_args()
    gc.disable()
    print(f"the store's modules: {compiled.summary()}")
    print(f"a put with room:         {asyncio.run(per_block(args.blocks * 2, args.blocks)):.2f} us per block")
    print(f"a put into a full tier:  {asyncio.run(per_block(args.full, args.blocks)):.2f} us per block "
          f"({args.full} blocks)")


if __name__ == "__main__":
    main()

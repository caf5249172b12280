"""Microseconds per block of the store's put path (BlockStore.put_chain, the trace replayer's put), into a tier
with room and into a full one (each put then makes room first: victim search, delete, ghost), without sessions,
the garbage collector off. What a miss costs in a replay, in its parts; run it against a compiled build
(PYTHONPATH at a directory holding only its package) and the dev install to compare (engram/compiled.py).
With --dedupe, what a put of a block already stored costs instead (the chains put again: every block deduplicated,
its stored copy verified first, BlockStore.verify_stored), the copy in DRAM or on NVMe alone, for blocks of
--block-bytes.
Run: .venv/bin/python benchmarks/put_cost.py [--blocks 100000] [--full 10000]
     .venv/bin/python benchmarks/put_cost.py --dedupe [--blocks 20000] [--block-bytes 56960] [--nvme-dir DIR]"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Awaitable, Callable

from engram import compiled
from engram.block import checksum
from engram.keys import block_key_of_bytes
from engram.layout import KVLayout, ModelSpec
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import DramTier
from engram.trace.replay import layout_for

CHAIN = 100  # blocks per put_chain call, as a request's missing tail


async def per_block(capacity_blocks: int, blocks: int) -> float:
    layout = layout_for(64 * 890)
    nbytes = layout.block_nbytes(layout.block_tokens)
    store = BlockStore([DramTier(capacity_blocks * nbytes)], ModelRegistry(default_codec="raw"))
    store.flusher = None
    chains, put = _chains(store, layout, blocks)
    return await put(chains)


def _chains(store: BlockStore, layout: KVLayout, blocks: int
            ) -> tuple[list[list[tuple[bytes, bytes]]], Callable[[list[list[tuple[bytes, bytes]]]], Awaitable[float]]]:
    """`blocks` blocks of the bench model in chains of CHAIN, and a put of chains timing it (us per block)."""
    bt = layout.block_tokens
    fp = store.registry.register(ModelSpec(name="bench", weights_id="bench", layout=layout, codec="raw"))
    root = store.root("bench", fp)
    payload = bytes(layout.block_nbytes(bt))
    chains = []
    for c in range(blocks // CHAIN):
        parent, chain = root, []
        for j in range(CHAIN):
            tokens = (c * CHAIN + j).to_bytes(4, "little") * bt
            parent = block_key_of_bytes(parent, tokens)
            chain.append((parent, tokens))
        chains.append(chain)
    ck = checksum(payload)

    async def put(todo: list[list[tuple[bytes, bytes]]]) -> float:
        t0 = time.perf_counter()
        for chain in todo:
            await store.put_chain("bench", fp, root, chain, payload, ck)
        return (time.perf_counter() - t0) / (len(todo) * CHAIN) * 1e6

    return chains, put


async def dedupe_per_block(blocks: int, block_bytes: int, nvme_dir: str | None) -> float:
    """A put of blocks stored already: put once, then (with nvme_dir) moved to NVMe alone, then put again, timed."""
    from engram.config import load_config
    from engram.server.app import build_store

    layout = layout_for(block_bytes)
    nbytes = layout.block_nbytes(layout.block_tokens)
    over: dict[str, object] = {"tiers.dram.pool": "private", "tiers.dram.capacity": 2 * blocks * nbytes}
    if nvme_dir is not None:
        over.update({"tiers.nvme.path": nvme_dir, "tiers.nvme.capacity": 2 * blocks * nbytes,
                     "tiers.nvme.fsync": False})
    store = await build_store(load_config(env={}, overrides=over))
    if store.flusher is not None:
        await store.flusher.close()
    store.flusher = None
    try:
        chains, put = _chains(store, layout, blocks)
        await put(chains)
        if nvme_dir is not None:
            for meta in list(store.index):
                await store.keep_only_in(meta, "nvme")
        before = store.counters.blocks_deduplicated
        us = await put(chains)
        assert store.counters.blocks_deduplicated - before == len(chains) * CHAIN, "not every put deduplicated"
        return us
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks put")
    ap.add_argument("--full", type=int, default=10_000, help="the full tier's capacity in blocks")
    ap.add_argument("--dedupe", action="store_true", help="time puts of blocks stored already instead")
    ap.add_argument("--block-bytes", type=int, default=64 * 890, help="--dedupe: a block's bytes")
    ap.add_argument("--nvme-dir", help="--dedupe: where the NVMe tier goes (default: a temporary directory)")
    args = ap.parse_args()
    gc.disable()
    print(f"the store's modules: {compiled.summary()}")
    if args.dedupe:
        print(f"a deduplicated put, its copy in DRAM:       "
              f"{asyncio.run(dedupe_per_block(args.blocks, args.block_bytes, None)):.2f} us per block "
              f"({args.block_bytes} bytes)")
        with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme:
            print(f"a deduplicated put, its copy on NVMe alone: "
                  f"{asyncio.run(dedupe_per_block(args.blocks, args.block_bytes, nvme)):.2f} us per block")
        return
    print(f"a put with room:         {asyncio.run(per_block(args.blocks * 2, args.blocks)):.2f} us per block")
    print(f"a put into a full tier:  {asyncio.run(per_block(args.full, args.blocks)):.2f} us per block "
          f"({args.full} blocks)")


if __name__ == "__main__":
    main()

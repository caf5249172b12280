"""What one Stats call and one /metrics scrape cost against the number of stored blocks: each runs on the daemon's
event loop, so its time is a stall of every request in flight (a hit waits for it), and `engram stats`, `engram
top`, the client's check()/evict()/forget_model() and Prometheus call them again and again.

An in-process daemon (start_server over a store of one private DRAM tier, /metrics on), seeded through the store's own put (`put_chain`, the
trace replayer's: the same placement and index as a Put, without gRPC) with BLOCKS small blocks (512 B: 16 tokens
of one global layer, one head of 8) in 64-block chains over 4 namespaces and 2 models; a chain in 16 pinned at its
first block and one in 4 referenced as a session holds its prefix (`BlockStore.reference`). Then each piece of an
admin's Stats (the tiers' figures, models, namespaces, the whole reply as the service builds it, the RPC over the
unix socket) and of a tenant's (one namespace: its tiers' copies, its models, the reply), and a GET /metrics, are
timed: the median of a few runs, in ms.

Runs against whatever `engram` is importable, so the same command times another tree with PYTHONPATH set.

    .venv/bin/python -m benchmarks.stats_cost [--blocks 100000,1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import machine
from engram.config import load_config
from engram.control import ControlClient
from engram.keys import chain_keys, root_key
from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.server import auth, start_server
from engram.store import BlockStore
from engram.tenancy import OPEN
from engram.tiers.dram import DramTier

CHAIN = 64
NAMESPACES = ("a", "b", "c", "d")
MODELS = (ModelSpec("stats-a", "w", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=8,
                                             block_tokens=16), codec="raw"),
          ModelSpec("stats-b", "w", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=8,
                                             block_tokens=16), codec="raw"))


async def seed(srv: Any, blocks: int) -> None:
    store = srv.store
    fps = [store.registry.register(m) for m in MODELS]
    bt = MODELS[0].layout.block_tokens
    payload = bytes(MODELS[0].layout.block_nbytes(bt))
    from engram.block import checksum

    ck = checksum(payload)
    rng = np.random.default_rng(0)
    for c in range(blocks // CHAIN):
        ns, fp = NAMESPACES[c % len(NAMESPACES)], fps[(c // len(NAMESPACES)) % len(fps)]
        toks = rng.integers(0, 1 << 20, CHAIN * bt, dtype=np.int32)
        chain = [(key, toks[s:e].astype("<i4").tobytes()) for key, s, e in chain_keys(ns, fp, toks, bt)]
        metas = await store.put_chain(ns, fp, root_key(ns, fp), chain, payload, ck)
        assert len(metas) == CHAIN, "the DRAM tier is too small for the blocks asked for"
        if c % 16 == 0:
            store.pin(ns, fp, [metas[0].key])
        if c % 4 == 1:
            store.reference(metas, +1)


async def timed(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = fn()
        if isinstance(got, Awaitable):
            await got
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


async def run(blocks: int, repeat: int) -> dict[str, float]:
    nbytes = MODELS[0].layout.block_nbytes(16)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(env={}, overrides={
            "server.port": 0, "server.unix_socket": str(Path(tmp) / "engram.sock"), "server.metrics_port": -1})
        # the private DRAM tier (the trace replayer's): the shared pool's pages are capacity / 64Ki, 8 KiB a block
        # at this size, and would hold about 128k of them
        store = BlockStore([DramTier(blocks * nbytes * 2)], ModelRegistry(default_codec="raw"))
        srv = await start_server(cfg, store)
        try:
            await seed(srv, blocks)
            store, service, sessions = srv.store, srv.service, srv.sessions
            assert len(store.index) == blocks // CHAIN * CHAIN
            every = sorted({*store.namespaces_in_use(), *(s.namespace for s in sessions.sessions())})
            auth._principal.set(OPEN)  # the tenant's figures called as a guarded RPC would (tenancy off: OPEN)
            url = f"http://127.0.0.1:{srv.metrics.port}/metrics"

            def scrape() -> int:
                with urllib.request.urlopen(url) as r:
                    return len(r.read())

            async with ControlClient(srv.address, timeout_s=600) as client:
                return {
                    "admin: namespaces_in_use": await timed(store.namespaces_in_use, repeat),
                    "admin: tier_stats": await timed(store.tier_stats, repeat),
                    "admin: model_usage": await timed(store.model_usage, repeat),
                    "admin: namespace_usage x4": await timed(lambda: [store.namespace_usage(ns) for ns in every],
                                                             repeat),
                    "admin: service.stats": await timed(lambda: service.stats(every), repeat),
                    "admin: Stats RPC": await timed(client.stats, repeat),
                    "tenant: own_tier_stats": await timed(lambda: store.own_tier_stats(["a"]), repeat),
                    "tenant: model_usage": await timed(lambda: store.model_usage(["a"]), repeat),
                    "tenant: service.tenant_stats": await timed(lambda: service.tenant_stats(["a"], ["a"]), repeat),
                    "GET /metrics": await timed(lambda: asyncio.to_thread(scrape), repeat),
                }
        finally:
            await srv.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="100000,1000000")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    counts = [int(b) for b in args.blocks.split(",")]
    results = {n: asyncio.run(run(n, args.repeat)) for n in counts}
    print(f"# stats_cost {datetime.date.today()} on {machine()}; median of {args.repeat}, ms")
    print("| piece | " + " | ".join(f"{n:,} blocks" for n in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    for piece in results[counts[0]]:
        print(f"| {piece} | " + " | ".join(str(results[n][piece]) for n in counts) + " |")


if __name__ == "__main__":
    main()

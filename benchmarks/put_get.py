"""Put and Get throughput and latency through a real Engram daemon, against a real redis-server.

For each block size (1 MiB, 16 MiB), client count (1, 8) and transport (TCP, unix socket): C asyncio
clients each put N blocks (one Put RPC per block) and then get them back (one Get RPC per block, the
client rebuilding a torch tensor and verifying the checksum); the same payloads go through redis-py
SET/GET on the same transport. Figures: GB/s (payload bytes / wall time) and per-operation p50/p99.
The clients take the bytes path (zero_copy=False), as a worker on another host does: on the daemon's host a
put is written in place and a get copied out of the mapped pool (benchmarks/hit_path.py measures those).

    .venv/bin/python benchmarks/put_get.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from benchmarks._harness import cells, engram_daemon, machine, percentiles, redis_server
from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

MiB = 2**20


@dataclass
class Row:
    system: str
    transport: str
    block_mib: int
    clients: int
    op: str
    gbps: float
    p50_ms: float
    p99_ms: float
    ops: int


def layout_for(block_mib: int) -> KVLayout:
    # 256 tokens x 8 kv heads x 128 head dim x bf16 x (K, V) = 1 MiB per global layer.
    return KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * block_mib, num_kv_heads=8, head_dim=128,
                    dtype=DType.BF16, block_tokens=256)


def payloads(block_mib: int, clients: int, per_client: int) -> list[list[tuple[np.ndarray, torch.Tensor]]]:
    layout = layout_for(block_mib)
    gen = torch.Generator().manual_seed(block_mib * 100 + clients)
    out = []
    for c in range(clients):
        blocks = []
        for i in range(per_client):
            toks = np.full(256, c * 10_000 + i, dtype=np.int32)  # distinct root blocks: no dedupe
            blocks.append((toks, torch.randn(layout.block_shape(256), generator=gen).to(torch.bfloat16)))
        out.append(blocks)
    return out


async def bench_engram(address: str, transport: str, block_mib: int, clients: int, per_client: int) -> list[Row]:
    spec = ModelSpec(f"bench-{block_mib}", "w", layout_for(block_mib))
    data = payloads(block_mib, clients, per_client)
    conns = [EngramClient(address, namespace="bench", chunk_bytes=32 * MiB, max_message_bytes=64 * MiB,
                          zero_copy=False) for _ in range(clients)]
    fps = [await c.register_model(spec) for c in conns]
    put_lat: list[float] = []
    get_lat: list[float] = []
    keys: list[list[bytes]] = [[] for _ in range(clients)]

    async def putter(i: int) -> None:
        for toks, kv in data[i]:
            t0 = time.perf_counter()
            resp = await conns[i].put_blocks(fps[i], [(toks, kv)])
            put_lat.append(time.perf_counter() - t0)
            keys[i].append(resp.keys[0])

    async def getter(i: int) -> None:
        for (_, kv), key in zip(data[i], keys[i], strict=True):
            t0 = time.perf_counter()
            (got,) = await conns[i].get(fps[i], [key])
            get_lat.append(time.perf_counter() - t0)
            assert got.shape == kv.shape

    total = clients * per_client * block_mib * MiB
    t0 = time.perf_counter()
    await asyncio.gather(*(putter(i) for i in range(clients)))
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(getter(i) for i in range(clients)))
    get_s = time.perf_counter() - t0
    for c in conns:
        await c.close()
    n = clients * per_client
    return [Row("engram", transport, block_mib, clients, "put", total / put_s / 1e9, *percentiles(put_lat), n),
            Row("engram", transport, block_mib, clients, "get", total / get_s / 1e9, *percentiles(get_lat), n)]


async def bench_redis(kwargs: dict[str, object], transport: str, block_mib: int, clients: int,
                      per_client: int) -> list[Row]:
    import redis.asyncio as aioredis

    data = payloads(block_mib, clients, per_client)
    blobs = [[kv.view(torch.uint8).numpy().tobytes() for _, kv in blocks] for blocks in data]
    conns = [aioredis.Redis(**kwargs) for _ in range(clients)]  # type: ignore[arg-type]
    put_lat: list[float] = []
    get_lat: list[float] = []

    async def putter(i: int) -> None:
        for j, blob in enumerate(blobs[i]):
            t0 = time.perf_counter()
            await conns[i].set(f"b:{i}:{j}", blob)
            put_lat.append(time.perf_counter() - t0)

    async def getter(i: int) -> None:
        for j, blob in enumerate(blobs[i]):
            t0 = time.perf_counter()
            got = await conns[i].get(f"b:{i}:{j}")
            get_lat.append(time.perf_counter() - t0)
            assert got is not None and len(got) == len(blob)

    total = clients * per_client * block_mib * MiB
    t0 = time.perf_counter()
    await asyncio.gather(*(putter(i) for i in range(clients)))
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(getter(i) for i in range(clients)))
    get_s = time.perf_counter() - t0
    await conns[0].flushall()
    for c in conns:
        await c.aclose()
    n = clients * per_client
    return [Row("redis", transport, block_mib, clients, "put", total / put_s / 1e9, *percentiles(put_lat), n),
            Row("redis", transport, block_mib, clients, "get", total / get_s / 1e9, *percentiles(get_lat), n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer blocks per client (a smoke run)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows: list[Row] = []
    # Bytes per (size, clients) cell: ~256 MiB for 1 MiB blocks, ~1 GiB for 16 MiB blocks.
    plan = [(1, 1, 256), (1, 8, 32), (16, 1, 64), (16, 8, 8)]
    if args.quick:
        plan = [(1, 1, 16), (1, 8, 2), (16, 1, 4), (16, 8, 1)]
    with cells(4 * len(plan), "put_get") as done:
        for transport in ("tcp", "unix"):
            with engram_daemon(transport) as address:
                for block_mib, clients, per_client in plan:
                    rows += asyncio.run(bench_engram(address, transport, block_mib, clients, per_client))
                    done(f"engram {transport} {block_mib} MiB x{clients}")
            with redis_server(transport) as kwargs:
                for block_mib, clients, per_client in plan:
                    rows += asyncio.run(bench_redis(kwargs, transport, block_mib, clients, per_client))
                    done(f"redis {transport} {block_mib} MiB x{clients}")
    print(f"# put_get: {datetime.date.today()} on {machine()}\n")
    print("| system | transport | block | clients | op | GB/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.op, r.block_mib, r.clients, r.transport, r.system)):
        print(f"| {r.system} | {r.transport} | {r.block_mib} MiB | {r.clients} | {r.op} | {r.gbps:.2f} | "
              f"{r.p50_ms:.2f} | {r.p99_ms:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)


if __name__ == "__main__":
    main()

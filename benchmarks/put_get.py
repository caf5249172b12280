"""Put and Get through a real Engram daemon's bytes path, against redis-server and (given its venv) LMCache 0.5.6,
the same payloads in the same run. Every client connects (one untimed call) before the clock starts.

Engram's clients take the bytes path (zero_copy=False), as a worker on another host does: the data channel when
the daemon has one (the default), or gRPC streams (`--grpc`). Cells:
- `engram-raw`: the model stores raw KV; `engram-nvfp4`: the client encodes NVFP4 on the CPU (its fastest CPU
  backend) and decodes what it gets; GB/s counts the raw KV bytes the caller put or got back, so encoding
  shows as time. `redis`: redis-py SET/GET of the same raw bytes against a local redis-server.
- block size (1, 16 MiB) x clients (1, 8 asyncio clients, one connection each) x transport (TCP on loopback,
  unix socket); every client puts its blocks one Put per block, then gets them back one Get per block
  (the client rebuilding the tensor and verifying the checksum); raw hits are compared with what was put after
  the clock stops (got again: a comparison on the clients' shared loop put its time on the other clients' ops).
- LMCache's own cases (`--lmcache-python VENV/bin/python`): its MP server with the L1 DRAM tier, driven by its
  own bench client (../shared/peers/lmcache/bench.py, chunks of 256 tokens, one at a time); Engram runs the
  same chunk shapes one at a time, each hit written into a KV tensor allocated once (load_prefix_into), as
  LMCache's retrieve writes into its registered KV cache: on the bytes path over the unix socket, and on the
  same-host path (`transport=shm`: puts written into the shared pool in place, hits copied out of it), which
  is what LMCache's MP mode does (its client and server share memory).
GB/s = payload bytes / wall time (LMCache's rows: bytes / sum of latencies, one op at a time, so the same);
p50/p99 per operation.

    .venv/bin/python -m benchmarks.put_get [--quick] [--json rows.jsonl] [--lmcache-python /path/venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks._harness import (
    cells,
    engram_daemon,
    give_back_freed_memory,
    machine,
    percentiles,
    redis_server,
    write_rows,
)
from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

MiB = 2**20
REPO = Path(__file__).resolve().parent.parent
LMCACHE_BENCH = REPO.parent / "shared" / "peers" / "lmcache" / "bench.py"
# LMCache's bench cases: 256-token chunks of (layers, kv heads, head dim) in bf16
LMCACHE_CASES = {"1MiB": (8, 1, 128), "32MiB": (32, 8, 128)}


@dataclass
class Row:
    system: str
    transport: str
    block_mib: float
    clients: int
    op: str
    gbs: float
    p50_ms: float
    p99_ms: float
    ops: int


def layout_for(layers: int, heads: int = 8, head_dim: int = 128) -> KVLayout:
    # 256 tokens x 8 kv heads x 128 head dim x bf16 x (K, V) = 1 MiB per global layer.
    return KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * layers, num_kv_heads=heads, head_dim=head_dim,
                    dtype=DType.BF16, block_tokens=256)


def payloads(layout: KVLayout, clients: int, per_client: int, seed: int) -> list[list[tuple[np.ndarray, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(clients):
        blocks = []
        for i in range(per_client):
            toks = np.full(256, seed * 10_000 + c * 1_000 + i, dtype=np.int32)  # distinct roots: no dedupe
            blocks.append((toks, torch.randn(layout.block_shape(256), generator=gen).to(torch.bfloat16)))
        out.append(blocks)
    return out


async def bench_engram(address: str, transport: str, layout: KVLayout, clients: int, per_client: int, *,
                       codec: str, data_channel: bool = True, zero_copy: bool = False, into: bool = False
                       ) -> list[Row]:
    """into: each hit is written into a KV tensor the client allocated once (load_prefix_into, the worker's own
    KV memory, as LMCache's retrieve writes into its registered KV cache); else get() returns new tensors."""
    system = f"engram-{codec}" + ("-into" if into else "")  # -into: hits written into a tensor allocated once
    give_back_freed_memory()  # what earlier cells freed: given back now, not inside one of this cell's timed ops
    spec = ModelSpec(f"bench-{len(layout.layers)}-{layout.num_kv_heads}-{codec}", "w", layout, codec=codec)
    data = payloads(layout, clients, per_client, seed=len(layout.layers) * 100 + clients)
    nbytes = layout.block_nbytes(256)
    conns = [EngramClient(address, namespace=f"bench-{transport}", chunk_bytes=32 * MiB, max_message_bytes=64 * MiB,
                          zero_copy=zero_copy, data_channel=data_channel) for _ in range(clients)]
    fps = [await c.register_model(spec) for c in conns]
    for i, (c, fp) in enumerate(zip(conns, fps, strict=True)):  # connected before the clock starts, as
        await c.get(fp, [])  # redis-py's PING below; a same-host client also maps the pool (one block put and hit)
        if zero_copy:
            toks = np.full(256, 9_999 - i, dtype=np.int32)
            await c.put(fp, toks, data[i][0][1], skip_cached=False)
            await c.load_prefix_into(fp, toks, torch.empty(layout.block_shape(256), dtype=torch.bfloat16))
    put_lat: list[float] = []
    get_lat: list[float] = []
    keys: list[list[bytes]] = [[] for _ in range(clients)]

    async def putter(i: int) -> None:
        for toks, kv in data[i]:
            t0 = time.perf_counter()
            if zero_copy:  # the same-host path: encoded here, written into a reserved pool slot
                resp = await conns[i].put(fps[i], toks, kv, encode=codec != "raw", skip_cached=False)
            else:  # one Put of one block, as a Redis SET
                resp = await conns[i].put_blocks(fps[i], [(toks, kv)], codec=codec)
            put_lat.append(time.perf_counter() - t0)
            keys[i].append(resp.keys[0])

    wrong: list[int] = []

    async def get_one(i: int, toks: np.ndarray, key: bytes, dest: torch.Tensor | None) -> torch.Tensor:
        if dest is None:
            (got,) = await conns[i].get(fps[i], [key])
            return got
        res = await conns[i].load_prefix_into(fps[i], toks, dest)
        assert res.loaded_tokens == 256
        return dest

    async def getter(i: int) -> None:
        dest = torch.empty(layout.block_shape(256), dtype=torch.bfloat16) if into else None
        for (toks, _), key in zip(data[i], keys[i], strict=True):
            t0 = time.perf_counter()
            await get_one(i, toks, key, dest)
            get_lat.append(time.perf_counter() - t0)

    async def checker(i: int) -> None:
        """Each hit checked against what was put, after the timed gets, one client at a time (redis-py's GET is
        checked by length only): every block when it is small, a sample of big ones. Checked as each get
        returned, one client's comparison (a torch op on the clients' shared event loop) landed on the other
        clients' clocks: session 49's stall probe saw 41-50 ms steps in the 1 MiB x 8 cells' p99s."""
        dest = torch.empty(layout.block_shape(256), dtype=torch.bfloat16) if into else None
        for j, ((toks, kv), key) in enumerate(zip(data[i], keys[i], strict=True)):
            sampled = codec == "raw" and (j % 8 == 0 or nbytes <= MiB)
            if sampled and not torch.equal(await get_one(i, toks, key, dest), kv):
                wrong.append(j)

    total = clients * per_client * nbytes
    t0 = time.perf_counter()
    await asyncio.gather(*(putter(i) for i in range(clients)))
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(getter(i) for i in range(clients)))
    get_s = time.perf_counter() - t0
    for i in range(clients):
        await checker(i)
    assert not wrong, f"blocks {wrong} came back different"
    for c in conns:
        await c.close()
    n = clients * per_client
    mib = round(nbytes / MiB, 2)
    return [Row(system, transport, mib, clients, "put", total / put_s / 1e9, *percentiles(put_lat), n),
            Row(system, transport, mib, clients, "get", total / get_s / 1e9, *percentiles(get_lat), n)]


async def bench_redis(kwargs: dict[str, object], transport: str, layout: KVLayout, clients: int,
                      per_client: int) -> list[Row]:
    import redis.asyncio as aioredis

    give_back_freed_memory()  # as bench_engram: before this cell's payloads are made
    data = payloads(layout, clients, per_client, seed=len(layout.layers) * 100 + clients)
    blobs = [[kv.view(torch.uint8).numpy().tobytes() for _, kv in blocks] for blocks in data]
    conns = [aioredis.Redis(**kwargs) for _ in range(clients)]  # type: ignore[arg-type]
    for c in conns:
        await c.ping()
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

    nbytes = layout.block_nbytes(256)
    total = clients * per_client * nbytes
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
    mib = round(nbytes / MiB, 2)
    return [Row("redis", transport, mib, clients, "put", total / put_s / 1e9, *percentiles(put_lat), n),
            Row("redis", transport, mib, clients, "get", total / get_s / 1e9, *percentiles(get_lat), n)]


def bench_lmcache(python: str, n: int) -> list[Row]:
    """LMCache's own MP bench (its server, its client), L1 DRAM only; its store/retrieve rows as ours."""
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-") as tmp:
        out = Path(tmp) / "lmcache.json"
        subprocess.run([python, str(LMCACHE_BENCH), "--n", str(n), "--backends", "mp-l1", "--cases",
                        ",".join(LMCACHE_CASES), "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        report = json.loads(out.read_text())
    rows = []
    for res in report["results"]:
        if res["error"]:
            raise SystemExit(f"LMCache {res['backend']} {res['case']} failed: {res['error']}")
        for r in res["rows"]:
            if r["op"] in ("store", "retrieve"):
                rows.append(Row("lmcache", "shm", round(res["chunk_bytes"] / MiB, 2), 1,
                                "put" if r["op"] == "store" else "get", r["gbps"], r["p50_ms"], r["p99_ms"], r["n"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer blocks per client (a smoke run)")
    ap.add_argument("--grpc", action="store_true", help="Engram over gRPC streams instead of its data channel")
    ap.add_argument("--json", help="write the rows here, one JSON object per line")
    ap.add_argument("--lmcache-python", help="the python of a venv made by ../shared/peers/lmcache/install.sh")
    args = ap.parse_args()
    # As a serving process would once loaded (the daemon does it too): start-up's objects (torch's ~170k) out of
    # the collector's sight, so full collections do not stall the clients, redis-py's as much as Engram's.
    gc.freeze()
    rows: list[Row] = []
    # (block MiB, clients, blocks per client): ~256 MiB per 1 MiB cell, ~1 GiB per 16 MiB cell (nvfp4: a quarter)
    plan = [(1, 1, 256), (1, 8, 32), (16, 1, 64), (16, 8, 8)]
    lm_n = 32
    if args.quick:
        plan, lm_n = [(1, 1, 16), (1, 8, 2), (16, 1, 4), (16, 8, 1)], 8
    codecs = ("raw", "nvfp4")
    n_cells = 2 * len(plan) * (len(codecs) + 1) + (2 * len(LMCACHE_CASES) + 1 if args.lmcache_python else 0)
    with cells(n_cells, "put_get") as done:
        for transport in ("tcp", "unix"):
            with engram_daemon(transport, dram="4GiB") as address:
                for codec in codecs:
                    for block_mib, clients, per_client in plan:
                        per = per_client if codec == "raw" else max(1, per_client // 4)
                        rows += asyncio.run(bench_engram(address, transport, layout_for(block_mib), clients, per,
                                                         codec=codec, data_channel=not args.grpc))
                        done(f"engram {codec} {transport} {block_mib} MiB x{clients}")
            with redis_server(transport) as kwargs:
                for block_mib, clients, per_client in plan:
                    rows += asyncio.run(bench_redis(kwargs, transport, layout_for(block_mib), clients, per_client))
                    done(f"redis {transport} {block_mib} MiB x{clients}")
        if args.lmcache_python:
            rows += bench_lmcache(args.lmcache_python, lm_n)
            done("lmcache mp-l1")
            with engram_daemon("unix", dram="4GiB") as address:
                for case, (layers, heads, dim) in LMCACHE_CASES.items():
                    for transport, zero_copy in (("unix", False), ("shm", True)):
                        rows += asyncio.run(bench_engram(address, transport, layout_for(layers, heads, dim), 1, lm_n,
                                                         codec="raw", data_channel=not args.grpc,
                                                         zero_copy=zero_copy, into=True))
                        done(f"engram {case} {transport}")
    print(f"# put_get: {datetime.date.today()} on {machine()}; Engram over "
          f"{'gRPC streams' if args.grpc else 'its data channel'}\n")
    print("| op | block | clients | transport | system | GB/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.op, r.block_mib, r.clients, r.transport, r.system)):
        print(f"| {r.op} | {r.block_mib:g} MiB | {r.clients} | {r.transport} | {r.system} | {r.gbs:.2f} | "
              f"{r.p50_ms:.2f} | {r.p99_ms:.2f} |")
    if args.json:
        write_rows(args.json, [asdict(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())

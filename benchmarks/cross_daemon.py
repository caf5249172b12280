"""Cross-daemon hit latency: Lookup + Get of a 4-block prefix through daemon B when only daemon A holds it
(B finds it in the Redis cluster index, fetches it from A over gRPC, verifies and stores it), against a
local hit (the same prefix through A). Two daemons in this process (grpc.aio) on loopback, a real
redis-server subprocess. Run: .venv/bin/python -m benchmarks.cross_daemon [--samples 200] [--json]"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import time

import numpy as np

from benchmarks._harness import free_port, machine, percentiles
from engram.client import EngramClient
from engram.config import load_config
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import start_server
from engram.workload import synthetic_kv

LAYOUT = KVLayout(layers=(LayerSpec(LayerKind.SLIDING, 128), LayerSpec(LayerKind.GLOBAL)) * 4, num_kv_heads=8,
                  head_dim=64, dtype=DType.BF16, block_tokens=256)  # 2 MiB raw per block (4 global layers)
SPEC = ModelSpec("bench", "bench-0", LAYOUT, codec="raw")


async def main(samples: int) -> dict[str, object]:
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    daemons = [await start_server(load_config(env={}, overrides={
        "server.port": 0, "cluster.redis_url": f"redis://127.0.0.1:{port}/0", "cluster.node_id": n,
        "cluster.heartbeat_s": 0.5, "cluster.ttl_s": 5.0, "cluster.secret": "bench-secret",
        "tiers.dram.capacity": "512MiB"})) for n in ("a", "b")]
    try:
        async with EngramClient(daemons[0].address, namespace="ns") as a, \
                EngramClient(daemons[1].address, namespace="ns") as b:
            fp = await a.register_model(SPEC)
            await b.register_model(SPEC)
            while (await b.stats()).cluster.state != "ok" or (await a.stats()).cluster.state != "ok":
                await asyncio.sleep(0.05)
            local, remote = [], []
            rng = np.random.default_rng(0)
            for _ in range(samples):
                toks = rng.integers(0, 32000, 4 * 256, dtype=np.int32)
                await a.put(fp, toks, synthetic_kv(LAYOUT, "ns", fp, toks))
                await asyncio.sleep(0.02)  # let A publish (outside the timed region)
                t0 = time.perf_counter()
                n, _ = await a.get_prefix(fp, toks)
                local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                m, _ = await b.get_prefix(fp, toks)
                remote.append(time.perf_counter() - t0)
                assert n == m == len(toks), (n, m)
    finally:
        for d in daemons:
            await d.stop(0)
        redis.kill()
        redis.wait()
    lp50, lp99 = percentiles(local)
    rp50, rp99 = percentiles(remote)
    return {"samples": samples, "block_bytes": LAYOUT.block_nbytes(256), "blocks": 4,
            "local_p50_ms": lp50, "local_p99_ms": lp99, "cross_p50_ms": rp50, "cross_p99_ms": rp99,
            "machine": machine(), "date": datetime.date.today().isoformat()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(main(args.samples))
    print(json.dumps(out, indent=2) if args.json else
          f"local hit p50 {out['local_p50_ms']:.2f} ms p99 {out['local_p99_ms']:.2f} ms; cross-daemon hit p50 "
          f"{out['cross_p50_ms']:.2f} ms p99 {out['cross_p99_ms']:.2f} ms ({out['blocks']} blocks of "
          f"{out['block_bytes']} B)")

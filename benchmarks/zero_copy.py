"""Zero-copy Get against gRPC-bytes Get on the same host, through a real `engram serve` subprocess.

A raw-codec model with 1 MiB blocks; N blocks are put once, then fetched in Gets of B blocks, R rounds,
alternating the two paths: zero-copy (descriptors into the shared DRAM segment, the client copies each
block out of its mapping, checks generations and checksum, releases the lease) and bytes (the payload
streamed over the socket, checksum checked). Both build the same torch tensors on the CPU.
Figures: payload GB/s over the timed rounds, and per-Get p50/p99 latency.

    .venv/bin/python -m benchmarks.zero_copy [--blocks 64] [--batch 16] [--rounds 20] [--transport unix tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import time

import numpy as np
import torch

from benchmarks._harness import engram_daemon, machine, percentiles
from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

MiB = 2**20


def spec() -> ModelSpec:
    # 256 tokens x 8 kv heads x 128 head dim x bf16 x (K, V) = 1 MiB per block.
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=256)
    return ModelSpec(name="bench-1mib", weights_id="zero-copy", layout=layout, codec="raw")


async def run(address: str, blocks: int, batch: int, rounds: int) -> dict[str, tuple[float, float, float]]:
    sp = spec()
    async with EngramClient(address, namespace="bench", chunk_bytes=32 * MiB, max_message_bytes=64 * MiB) as c:
        fp = await c.register_model(sp)
        gen = torch.Generator().manual_seed(0)
        keys = []
        for i in range(blocks):
            toks = np.full(256, i, dtype=np.int32)  # distinct roots: no dedupe
            kv = torch.randn(sp.layout.block_shape(256), generator=gen).to(torch.bfloat16)
            keys += (await c.put(fp, toks, kv)).keys
        batches = [keys[i : i + batch] for i in range(0, len(keys), batch)]
        ref = await c.get(fp, batches[0], zero_copy=False)
        got = await c.get(fp, batches[0], zero_copy=True)
        if not all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)):
            raise SystemExit("zero-copy and bytes Gets returned different tensors")
        samples: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for zc in (True, False):
                for b in batches:
                    t0 = time.perf_counter()
                    await c.get(fp, b, zero_copy=zc)
                    samples[zc].append(time.perf_counter() - t0)
        out = {}
        for zc, name in ((True, "zero-copy"), (False, "bytes")):
            total = sum(samples[zc])
            p50, p99 = percentiles(samples[zc])
            out[name] = (len(samples[zc]) * batch * MiB / total / 1e9, p50, p99)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--transport", nargs="+", default=["unix", "tcp"], choices=["unix", "tcp"])
    args = ap.parse_args()
    print(f"zero_copy: {args.blocks} x 1 MiB blocks, Gets of {args.batch}, {args.rounds} rounds; "
          f"{datetime.date.today()}; {machine()}; torch {torch.__version__}\n")
    print("| transport | path | GB/s | Get p50 ms | Get p99 ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for transport in args.transport:
        with engram_daemon(transport, dram=f"{args.blocks * 2 + 64}MiB") as address:
            res = asyncio.run(run(address, args.blocks, args.batch, args.rounds))
        base = res["bytes"][0]
        for name, (gbps, p50, p99) in res.items():
            print(f"| {transport} | {name} | {gbps:.2f} | {p50:.1f} | {p99:.1f} | {gbps / base:.1f}x |")


if __name__ == "__main__":
    main()

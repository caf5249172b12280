"""The worker process of test_gpu_data_path.py (run as a script, not collected): connects to a daemon on
this host, puts blocks as Put messages (they land in the daemon's top tier, its HBM pool, and the rest are
demoted to its pinned DRAM pool; an in-place put would write them into the DRAM pool directly),
then gets them three ways: bytes, zero-copy to the CPU (the pinned pool, mapped), and zero-copy to the GPU
(CUDA IPC for HBM blocks, the pool for DRAM blocks). Prints one JSON line: whether all agree bit for bit,
and how many blocks came through each path."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import numpy as np
import torch

from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

# 16 tokens x 2 global layers x 8 kv heads x 128 head dim x bf16 x (K, V) = 128 KiB per block.
LAYOUT = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                  block_tokens=16)
SPEC = ModelSpec(name="gpu-worker", weights_id="seed-0", layout=LAYOUT, codec="raw")


async def count_paths(address: str, fp: bytes, keys: list[bytes]) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.EngramStub(ch)
        req = pb.GetRequest(namespace="gpu", model_fingerprint=fp, keys=keys, zero_copy=True, cuda_ipc=True)
        resps = [r async for r in stub.Get(req)]
        leases = sorted({r.descriptor.lease_id for r in resps if r.HasField("descriptor")})
        if leases:
            await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="gpu", lease_ids=leases))
    ipc = sum(1 for r in resps if r.HasField("descriptor") and r.descriptor.HasField("cuda"))
    pool = sum(1 for r in resps if r.HasField("descriptor") and not r.descriptor.HasField("cuda"))
    return pool, ipc


async def main(address: str) -> None:
    async with EngramClient(address, namespace="gpu") as c, \
            EngramClient(address, namespace="gpu", zero_copy=False) as writer:
        fp = await c.register_model(SPEC)
        await writer.register_model(SPEC)
        gen = torch.Generator().manual_seed(0)
        keys: list[bytes] = []
        for s in range(4):  # 64 blocks of 128 KiB: 8 MiB into a 4 MiB HBM pool
            toks = np.arange(s * 1000, s * 1000 + 16 * 16, dtype=np.int32)
            kv = torch.randn(LAYOUT.block_shape(len(toks)), generator=gen).to(torch.bfloat16)
            keys += (await writer.put(fp, toks, kv)).keys
        pool, ipc = await count_paths(address, fp, keys)
        ref = await c.get(fp, keys, zero_copy=False)
        host = await c.get(fp, keys, zero_copy=True)
        gpu = await c.get(fp, keys, device="cuda")
        identical = all(torch.equal(a, b) and torch.equal(a, g.cpu()) and g.is_cuda
                        for a, b, g in zip(ref, host, gpu, strict=True))
        print(json.dumps({"identical": identical, "blocks": len(keys), "descriptors": pool, "ipc_blocks": ipc}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))

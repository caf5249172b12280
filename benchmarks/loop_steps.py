"""The daemon's event loop beside large puts, demotions and decoding gets: its longest steps, in the loop thread's
CPU time (session 51).

A daemon in this process (whichever engram is on PYTHONPATH: run from a neutral cwd), a DRAM pool of 96 MiB over an
NVMe tier (tmp dir, fsync off, write_back_window_s 0: a block is copied down only when it is evicted, so each
put past the pool's room demotes), a ticker task on the daemon's loop recording every step: its end on the host's
clock, the loop thread's CPU time (time.thread_time: the daemon's own work, not the time the host ran others) and
its wall time. A client in another process runs six phases one op at a time, printing each op's window:
  nvfp4_put:   8 puts of one block encoded by the client (a worker's encoding: put_blocks codec=nvfp4), 9 MiB each
               (32 MiB of bf16), over the data channel: the daemon's check_encoded
  decode_get:  16 Gets of those blocks with decode_on_server (the daemon decodes to 32 MiB raw), data channel
  stream_decode_get: 8 Gets with decode_on_server of a stream layout's block (an MLA latent of 16 layers, nvfp4:
               5 MiB stored, 18 MiB raw back), data channel: the streams' decode and the raw block's assembly (53)
  meta_put:    2 puts of 16 blocks of 64Ki tokens each (4 MiB of tokens in the request's metadata, 2 MiB of payload a
               block), data channel: the metadata's receive and parse (session 53)
  raw_put:     24 puts of one raw 16 MiB block, data channel: the pool copy; past the pool's room each demotes
               (the victim's copy out of the pool, its hash, the NVMe write)
  grpc_get:    8 Gets over gRPC (a client without the data channel) of the last 4 raw blocks, in the pool: the
               block's read (session 52) and its frames of server.chunk_bytes (8 MiB before session 53, 1 MiB since)
A second argument picks the memory tiers: shared (the DRAM pool, the default), private (tiers.dram.pool = private:
a dict of payloads) or hbm (an HBM pool of 64 MiB on cuda above the DRAM pool: puts land there and demote to DRAM).
Per phase: the longest step (loop CPU ms, wall ms), steps over 2 ms and over 5 ms of loop CPU, and of wall time (which
also counts the loop waiting for the GIL a worker thread holds, and the host not running the process). One JSON
line out.
A step is the daemon's own work between two turns of its loop: any other call (a hit) waits that long.

    cd /tmp && PYTHONPATH=<a tree's root> .venv/bin/python <repo>/benchmarks/loop_steps.py LABEL [shared|private|hbm] >> F.jsonl

(from a directory without engram/, so that PYTHONPATH picks the tree: alternate two trees' runs, compare medians)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time

CLIENT = r"""
import asyncio, json, sys, time
import numpy as np, torch
from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec, StreamSpec

def make_layout(bt):
    return KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                    block_tokens=bt)

layout = make_layout(1024)  # 16 MiB raw a block
layout4 = make_layout(2048)  # 32 MiB raw, 9 MiB in nvfp4
# an MLA latent of 16 layers: 18 MiB raw a block, 5 MiB in nvfp4
mla = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 16, block_tokens=1024, streams=(StreamSpec("latent", (576,)),))
# 64Ki tokens a block at 32 bytes a token: a put of 16 blocks carries 4 MiB of tokens in its metadata, 2 MiB a payload
tiny = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=8, dtype=DType.BF16, block_tokens=65536)

def block(seed, lay=layout):
    bt = lay.block_tokens
    gen = torch.Generator().manual_seed(seed)
    toks = np.random.default_rng(seed).integers(0, 32000, bt, dtype=np.int32)
    return toks, torch.randn(lay.block_shape(bt), generator=gen).to(torch.bfloat16)

async def main(address):
    async with EngramClient(address, zero_copy=False, timeout_s=300) as c:
        fp4 = await c.register_model(ModelSpec("probe-fp4", "w", layout4, codec="nvfp4"))
        fpr = await c.register_model(ModelSpec("probe-raw", "w", layout, codec="raw"))
        fps = await c.register_model(ModelSpec("probe-mla", "w", mla, codec="nvfp4"))
        fpt = await c.register_model(ModelSpec("probe-tiny", "w", tiny, codec="raw"))
        fp4_blocks = [block(1000 + i, layout4) for i in range(8)]
        mla_blocks = [(np.random.default_rng(3000 + i).integers(0, 32000, 1024, dtype=np.int32),
                       {"latent": torch.randn(mla.stream_shape(mla.streams[0], 1024),
                                              generator=torch.Generator().manual_seed(3000 + i)).to(torch.bfloat16)})
                      for i in range(4)]
        meta_toks = np.random.default_rng(4000).integers(0, 32000, 16 * 65536, dtype=np.int32)
        meta_kv = torch.randn(tiny.block_shape(16 * 65536), generator=torch.Generator().manual_seed(4000)).to(torch.bfloat16)
        raw_blocks = [block(2000 + i) for i in range(24)]
        print("ready", flush=True)
        sys.stdin.readline()
        def op(phase, t0):
            print(json.dumps([phase, t0, time.perf_counter()]), flush=True)
        keys = []
        for b in fp4_blocks:
            t0 = time.perf_counter()
            keys += (await c.put_blocks(fp4, [b], codec="nvfp4")).keys
            op("nvfp4_put", t0)
        for _ in range(2):
            for k in keys:
                t0 = time.perf_counter()
                await c.get(fp4, [k], decode_on_server=True, zero_copy=False)
                op("decode_get", t0)
        mla_keys = []
        for toks, data in mla_blocks:
            mla_keys += (await c.put(fps, toks, data)).keys
        for _ in range(2):
            for k in mla_keys:
                t0 = time.perf_counter()
                await c.get(fps, [k], decode_on_server=True, zero_copy=False)
                op("stream_decode_get", t0)
        for i in range(2):
            t0 = time.perf_counter()
            await c.put(fpt, np.roll(meta_toks, i), meta_kv)
            op("meta_put", t0)
        raw_keys = []
        for b in raw_blocks:
            t0 = time.perf_counter()
            raw_keys += (await c.put_blocks(fpr, [b])).keys
            op("raw_put", t0)
    async with EngramClient(address, zero_copy=False, data_channel=False, timeout_s=300) as g:
        await g.register_model(ModelSpec("probe-raw", "w", layout, codec="raw"))
        for _ in range(2):
            for k in raw_keys[-4:]:  # the last puts' blocks, in the pool
                t0 = time.perf_counter()
                await g.get(fpr, [k], zero_copy=False)
                op("grpc_get", t0)

asyncio.run(main(sys.argv[1]))
"""


PHASES = ("nvfp4_put", "decode_get", "stream_decode_get", "meta_put", "raw_put", "grpc_get")


async def main(label: str, dram: str) -> None:
    from engram.config import load_config
    from engram.server.app import start_server

    tmp = tempfile.mkdtemp(prefix="loop-steps-")
    cfg = load_config(env={}, overrides={
        "server.port": 0, "server.unix_socket": f"{tmp}/e.sock", "tiers.dram.capacity": "96MiB",
        "tiers.dram.prefault": True, "tiers.dram.pool": "private" if dram == "private" else "shared",
        **({"tiers.hbm.capacity": "64MiB", "tiers.hbm.device": "cuda"} if dram == "hbm" else {}), "tiers.nvme.path": f"{tmp}/nvme", "tiers.nvme.capacity": "8GiB",
        "tiers.nvme.fsync": False, "tiers.write_back_window_s": 0, "codec.quality_sample": 0})
    srv = await start_server(cfg)
    steps: list[tuple[float, float, float]] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last_cpu, last_wall = time.thread_time(), time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            cpu, wall = time.thread_time(), time.perf_counter()
            steps.append((wall, cpu - last_cpu, wall - last_wall))
            last_cpu, last_wall = cpu, wall

    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, srv.address, cwd="/tmp",
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert client.stdin is not None and client.stdout is not None
    ops: list[tuple[str, float, float]] = []
    try:
        assert (await asyncio.wait_for(client.stdout.readline(), 300)).strip() == b"ready"
        ticking = asyncio.create_task(ticker())
        gc.disable()
        try:
            client.stdin.write(b"go\n")
            while line := await asyncio.wait_for(client.stdout.readline(), 300):
                ops.append(tuple(json.loads(line)))
        finally:
            gc.enable()
            stop.set()
            await ticking
        assert await client.wait() == 0
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
    counters = srv.store.counters
    demotions = sum(t.demotions for t in counters.tiers.values())
    await srv.stop(0)
    shutil.rmtree(tmp, ignore_errors=True)  # the NVMe tier's files: about 0.5 GB a run
    out: dict[str, object] = {"label": label, "dram": dram, "at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                              "load": round(os.getloadavg()[0], 2), "demotions": demotions,
                              "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}"}
    for phase in PHASES:
        windows = [(t0, t1) for p, t0, t1 in ops if p == phase]
        during = [(cpu, wall) for end, cpu, wall in steps if any(t0 < end <= t1 for t0, t1 in windows)]
        cpus, walls = [c for c, _ in during], [w for _, w in during]
        out[phase] = {"ops": len(windows), "max_cpu_ms": round(1e3 * max(cpus), 2),
                      "max_wall_ms": round(1e3 * max(walls), 2),
                      "over2_cpu": sum(c > 0.002 for c in cpus), "over5_cpu": sum(c > 0.005 for c in cpus),
                      "over2_wall": sum(w > 0.002 for w in walls), "over5_wall": sum(w > 0.005 for w in walls),
                      "op_ms_median": round(1e3 * sorted(t1 - t0 for t0, t1 in windows)[len(windows) // 2], 1)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "run", sys.argv[2] if len(sys.argv) > 2 else "shared"))

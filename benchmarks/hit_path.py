"""The hit path and the put path of a worker on the daemon's host, against the ceilings measured in the same run.

A real `engram serve` subprocess (shared DRAM pool, pinned on a GPU host) and a worker in this process. One
prefix of the largest size is put (in place: encoded where the KV lies, written into pool slots); then its
prefixes of each size are loaded into the worker's KV tensor with `load_prefix_into`, raw and nvfp4.

- load: tokens of a Llama-3-8B-shaped layout (32 layers, 8 KV heads x 128, bf16, 256-token blocks) into a
  (32, 2, T, 8, 128) tensor on the device. Ceiling: a plain `copy_` of the same stored bytes from pinned host
  memory to the device (GPU), or a memcpy of them (CPU). For nvfp4, `vs_raw` is how much faster the bf16 KV
  arrives than with raw blocks (the goal: >= 2.5x).
- put: a 32K-token sequence from device tensors (another prefix each round). Ceiling: a device -> pinned copy of
  the same stored bytes.
- first_load_ms / first_put_ms: the first call of the worker process, which maps the pool and registers the
  mapping with CUDA (once per process).

    python -m benchmarks.hit_path [--device cuda] [--tokens 1024,4096,16384,32768] [--rounds 5] [--json FILE]
    python -m benchmarks.hit_path --smoke        # CPU, small, under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks._harness import engram_daemon, machine, write_rows
from engram.client import EngramClient
from engram.codec.stored import stored_nbytes
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

MiB = 2**20


def llama_layout(block_tokens: int = 256) -> KVLayout:
    return KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 32, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                    block_tokens=block_tokens)


def stored_bytes(layout: KVLayout, codec: str, tokens: int) -> int:
    bt = layout.block_tokens
    return sum(stored_nbytes(codec, layout.block_shape(min(bt, tokens - s)), layout.dtype) for s in range(0, tokens, bt))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def ceiling_in(nbytes: int, device: torch.device, rounds: int) -> float:
    """Seconds to move nbytes into the device's memory: a pinned H2D copy_ (GPU) or a memcpy (CPU)."""
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.random_(0, 255)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        samples = timed(lambda: dst.copy_(src, non_blocking=True), device, rounds + 1)[1:]
    else:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        samples = timed(lambda: dst.copy_(src), device, rounds + 1)[1:]
    return statistics.median(samples)


def ceiling_out(nbytes: int, device: torch.device, rounds: int) -> float:
    """Seconds to move nbytes out of the device into pinned host memory (or a CPU memcpy)."""
    if device.type != "cuda":
        return ceiling_in(nbytes, device, rounds)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return statistics.median(timed(lambda: dst.copy_(src, non_blocking=True), device, rounds + 1)[1:])


async def bench_codec(address: str, codec: str, layout: KVLayout, sizes: list[int], device: torch.device,
                      rounds: int, put_rounds: int) -> list[dict[str, Any]]:
    spec = ModelSpec(name="llama-3-8b-shaped", weights_id="random", layout=layout, codec=codec)
    longest = max(sizes)
    rows: list[dict[str, Any]] = []
    async with EngramClient(address, namespace=f"bench-{codec}") as c:
        fp = await c.register_model(spec)
        gen = torch.Generator(device=device).manual_seed(0)
        kv = torch.randn(layout.block_shape(longest), generator=gen, device=device, dtype=torch.bfloat16)
        toks = np.arange(longest, dtype=np.int32)
        sync(device)
        t0 = time.perf_counter()
        put = await c.put(fp, toks, kv)
        sync(device)
        first_put = time.perf_counter() - t0
        assert put.stored == -(-longest // layout.block_tokens), put
        put_bytes = stored_bytes(layout, codec, longest)
        samples, parts = [], []
        for r in range(put_rounds):  # other sequences of the same length: every block is new
            other = np.arange(longest, dtype=np.int32) + (r + 1) * 1_000_000
            sync(device)
            t0 = time.perf_counter()
            p = await c.put(fp, other, kv)
            sync(device)
            samples.append(time.perf_counter() - t0)
            parts.append((p.reserve_ms, p.write_ms, p.commit_ms))
        if samples:
            ms = statistics.median(samples)
            ceiling = ceiling_out(put_bytes, device, rounds)
            rows.append({"case": "put", "tokens": longest, "codec": codec, "ms": ms * 1e3,
                         "gbs": put_bytes / ms / 1e9, "ceiling_gbs": put_bytes / ceiling / 1e9,
                         "ratio": ceiling / ms, "first_ms": first_put * 1e3,
                         "reserve_ms": statistics.median(x[0] for x in parts),
                         "write_ms": statistics.median(x[1] for x in parts),
                         "commit_ms": statistics.median(x[2] for x in parts)})
        first_load = None
        for n in sizes:
            dest = torch.empty(layout.block_shape(n), dtype=torch.bfloat16, device=device)
            q = toks[:n]

            samples = []
            rpc, copy = [], []
            for i in range(rounds + 1):
                sync(device)
                t0 = time.perf_counter()
                res = await c.load_prefix_into(fp, q, dest)
                sync(device)
                dt = time.perf_counter() - t0
                assert res.loaded_tokens == n and res.bytes_blocks == 0, res
                if i == 0:
                    first_load = dt if first_load is None else first_load
                else:
                    samples.append(dt)
                    rpc.append(res.rpc_ms)
                    copy.append(res.copy_ms)
            if codec == "raw" and not torch.equal(dest, kv[:, :, :n]):
                raise SystemExit(f"the loaded KV differs from what was put ({n} tokens)")
            ms = statistics.median(samples)
            nbytes = stored_bytes(layout, codec, n)
            ceiling = ceiling_in(nbytes, device, rounds)
            row = {"case": "load", "tokens": n, "codec": codec, "ms": ms * 1e3, "gbs": nbytes / ms / 1e9,
                   "ceiling_gbs": nbytes / ceiling / 1e9, "ratio": ceiling / ms,
                   "bf16_gbs": layout.block_nbytes(n) / ms / 1e9, "rpc_ms": statistics.median(rpc),
                   "copy_ms": statistics.median(copy)}
            if n == min(sizes):
                row["first_ms"] = (first_load or 0) * 1e3
            rows.append(row)
    return rows


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    layout = llama_layout()
    sizes = [int(x) for x in args.tokens.split(",")]
    longest = max(sizes)
    need = sum(stored_bytes(layout, c, longest) * (1 + args.put_rounds) for c in args.codecs.split(","))
    dram = f"{int(need * 1.15 / 2**30) + 1}GiB"
    rows: list[dict[str, Any]] = []
    with engram_daemon("unix", dram=dram) as address:
        for codec in args.codecs.split(","):
            rows += await bench_codec(address, codec, layout, sizes, device, args.rounds, args.put_rounds)
    raw = {r["tokens"]: r["ms"] for r in rows if r["case"] == "load" and r["codec"] == "raw"}
    for r in rows:
        if r["case"] == "load" and r["codec"] != "raw" and r["tokens"] in raw:
            r["vs_raw"] = raw[r["tokens"]] / r["ms"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| case | tokens | codec | ms | GB/s (stored) | ceiling GB/s | ratio | bf16 GB/s | vs raw | rpc ms | "
           "copy ms | first call ms |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['tokens']} | {r['codec']} | {r['ms']:.1f} | {r['gbs']:.1f} | "
                   f"{r['ceiling_gbs']:.1f} | {100 * r['ratio']:.0f}% | "
                   f"{r.get('bf16_gbs', float('nan')):.1f} | "
                   + (f"{r['vs_raw']:.2f}x" if "vs_raw" in r else "-") + " | "
                   + (f"{r['rpc_ms']:.1f} | {r['copy_ms']:.1f}" if "rpc_ms" in r else
                      f"{r['reserve_ms'] + r['commit_ms']:.1f} | {r['write_ms']:.1f}" if "write_ms" in r else "- | -")
                   + " | "
                   + (f"{r['first_ms']:.0f}" if "first_ms" in r else "-") + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="1024,4096,16384,32768")
    ap.add_argument("--codecs", default="raw,nvfp4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--put-rounds", type=int, default=2)
    ap.add_argument("--json", default="", help="write one object per row to this file")
    ap.add_argument("--smoke", action="store_true", help="CPU, 512 and 1024 tokens, 2 rounds: under a minute")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.tokens, args.rounds, args.put_rounds = "cpu", "512,1024", 2, 1
    rows = asyncio.run(main_async(args))
    print(f"hit path, {datetime.date.today()}, {machine()}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    print(table(rows))
    if args.json:
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()

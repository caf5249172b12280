"""Writing a loaded prefix into vLLM's paged caches: the torch path against the Triton kernel.

The hit path's last step for a vLLM worker (engram/destinations.py PagedKV): decoded runs of blocks, (blocks, L,
block_tokens, H, D) for K and for V, go into every layer's pages through the request's block table. The torch
path does it per layer and stream (a copy of the layer's slice and an index_copy_); the kernel
(engram/kernels/paged.py) in one launch per run and stream. Both write the same runs, already on the GPU (what
the loader's decode leaves), of the loader's default size (64 MiB of stored bytes), into per-layer caches in
vLLM's standardized layout (num_blocks, H, 16, 2 * D). Llama-3-8B-shaped by default: 32 layers, 8 KV heads x 128,
bf16, 256-token Engram blocks.

- ms: from the first write until the GPU has finished the last (median of ROUNDS);
- host ms: how long the host spends issuing the writes (the part a loader cannot overlap with copies);
- GB/s: the prefix's KV bytes over ms.

The two paths' pages are compared after the timed rounds; a difference fails the run. Run:

    python -m benchmarks.paged_write [--tokens 8192,32768] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

import torch

from benchmarks._harness import machine, write_rows
from engram import destinations
from engram.destinations import PagedKV
from engram.integrations.vllm.paged import kv_pages, page_table

ROUNDS = 5
LAYERS, HEADS, DIM, BLOCK_TOKENS, PAGE_TOKENS = 32, 8, 128, 256, 16
CHUNK_BYTES = 64 * 2**20


def make_dest(caches: list[torch.Tensor], table: torch.Tensor, kernel: bool) -> PagedKV:
    k, v = zip(*(kv_pages(c, HEADS, DIM) for c in caches), strict=True)
    dest = PagedKV(list(k), list(v), table)
    destinations.PAGED_KERNEL = kernel  # as ENGRAM_PAGED_KERNEL unset / =0
    return dest


def write_prefix(dest: PagedKV, runs: list[torch.Tensor], tokens: int) -> None:
    """The loader's calls: per run, K then V."""
    at = 0
    for kv in runs:  # (blocks, L, 2, bt, H, D)
        n = min(kv.shape[0] * BLOCK_TOKENS, tokens - at)
        dest.write(0, kv[:, :, 0], at, n)
        dest.write(1, kv[:, :, 1], at, n)
        at += n


def measure(dest: PagedKV, runs: list[torch.Tensor], tokens: int) -> dict[str, float]:
    ms, host = [], []
    write_prefix(dest, runs, tokens)  # warm-up: compiles the kernel, works out the layer offsets
    torch.cuda.synchronize()
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        write_prefix(dest, runs, tokens)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        ms.append((t2 - t0) * 1e3)
    return {"ms": statistics.median(ms), "host_ms": statistics.median(host)}


def bench(tokens: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    block_bytes = LAYERS * 2 * BLOCK_TOKENS * HEADS * DIM * 2
    per_run = max(1, CHUNK_BYTES // block_bytes)
    blocks = -(-tokens // BLOCK_TOKENS)
    runs = [torch.randn((min(per_run, blocks - b), LAYERS, 2, BLOCK_TOKENS, HEADS, DIM), generator=gen,
                        dtype=torch.bfloat16, device="cuda") for b in range(0, blocks, per_run)]
    vllm_blocks = -(-tokens // PAGE_TOKENS)
    ids = torch.randperm(vllm_blocks + 64, generator=torch.Generator().manual_seed(1))[:vllm_blocks].tolist()
    table = page_table(ids, 1)
    rows = []
    written = {}
    for name, kernel in (("torch", False), ("kernel", True)):
        caches = [torch.zeros((vllm_blocks + 64, HEADS, PAGE_TOKENS, 2 * DIM), dtype=torch.bfloat16, device="cuda")
                  for _ in range(LAYERS)]
        dest = make_dest(caches, table, kernel)
        r = measure(dest, runs, tokens)
        assert (dest._kernel_offsets(0) is not None) == kernel, "the kernel path was not taken where it should be"
        gb = tokens * LAYERS * 2 * HEADS * DIM * 2 / 1e9
        rows.append({"path": name, "tokens": tokens, "runs": len(runs), **r, "gb_s": gb / (r["ms"] / 1e3)})
        written[name] = caches
    for a, b in zip(written["torch"], written["kernel"], strict=True):
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            raise SystemExit(f"{tokens} tokens: the kernel's pages differ from the torch path's")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768", help="prefix lengths, comma-separated")
    ap.add_argument("--json", default="", help="write one object per row to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("paged_write measures CUDA writes: run it on a GPU")
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name()} | {machine()} | torch {torch.__version__}")
    print(f"{'tokens':>7} {'path':>7} {'runs':>5} {'ms':>8} {'host ms':>8} {'GB/s':>7}")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for r in bench(tokens):
            rows.append(r)
            print(f"{r['tokens']:>7} {r['path']:>7} {r['runs']:>5} {r['ms']:>8.2f} {r['host_ms']:>8.2f} "
                  f"{r['gb_s']:>7.1f}")
    if args.json:
        write_rows(args.json, rows)


if __name__ == "__main__":
    main()

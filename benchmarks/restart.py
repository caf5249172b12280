"""Restart time against blocks on disk: how long a daemon takes from exec to serving with N blocks in its NVMe
directory, with the index journal (clean stop: its snapshot; after SIGKILL: snapshot + journal) and without
it (every block file's header read, as before the journal).

The blocks are written straight through NvmeTier (fsync off: only the restart is measured; its journal compacts
as it goes, and it is closed without a final snapshot, as a crash leaves it), chains of 8 blocks
of a small model (`--block-tokens` tokens of 1 global layer, 1 KV head of 8 dims). Each case is timed as
  recover: BlockStore recovery inside one process (journal load or header scan, directory listing, index)
  serve:   `engram serve` from exec until its health check answers SERVING (Python, torch and engram imports
           included: about 2 s of it on the project machine whatever the blocks)

    .venv/bin/python -m benchmarks.restart [--blocks 100000] [--block-tokens 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import _wait_health, machine
from engram.block import BlockRecord, checksum
from engram.config import load_config
from engram.keys import block_key, root_key, tokens_to_bytes
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.server.app import build_store
from engram.tiers.nvme import NvmeTier


def spec(block_tokens: int) -> ModelSpec:
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=1, head_dim=8, dtype=DType.BF16,
                      block_tokens=block_tokens)
    return ModelSpec(name="restart-bench", weights_id="w", layout=layout, codec="raw")


async def fill(root: Path, n: int, block_tokens: int) -> None:
    model = spec(block_tokens)
    ModelRegistry(root / "models").register(model)
    tier = NvmeTier(root, 1 << 50, fsync=False, io_threads=4)
    await tier.recover()
    fp = model.fingerprint
    nbytes = model.layout.block_nbytes(block_tokens)
    payload = os.urandom(nbytes)
    ck = checksum(payload)
    sem = asyncio.Semaphore(64)

    async def one(rec: BlockRecord) -> None:
        async with sem:
            need = tier.space_for(rec)
            assert tier.reserve(need)
            await tier.write(rec, payload, need)

    tasks = []
    parent = root_key("bench", fp)
    for i in range(n):
        if i % 8 == 0:
            parent = root_key("bench", fp)
        toks = [i % 2**31] + [j for j in range(1, block_tokens)]  # distinct per block
        key = block_key(parent, toks)
        tasks.append(one(BlockRecord(key, parent, fp, "bench", DType.BF16, True, model.layout.block_shape(block_tokens),
                                     tokens_to_bytes(toks), nbytes, ck)))
        parent = key
        if len(tasks) >= 4096:
            await asyncio.gather(*tasks)
            tasks.clear()
    await asyncio.gather(*tasks)
    await tier.close(snapshot=False)  # as a crash leaves it: the last snapshot and the journal since


async def recover_s(root: Path) -> tuple[float, int]:
    cfg = load_config(env={}, overrides={"tiers.nvme.path": str(root), "tiers.dram.pool": "private",
                                         "tiers.dram.capacity": "64MiB", "tiers.nvme.capacity": "1TiB"})
    t0 = time.perf_counter()
    store = await build_store(cfg)
    dt = time.perf_counter() - t0
    n = len(store)
    await store.close()
    return dt, n


def serve_s(root: Path, kill: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="engram-restart-") as tmp:
        sock = Path(tmp) / "e.sock"
        cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "warning",
               "--dram-capacity", "64MiB", "--set", f"tiers.nvme.path={root}", "--set", "tiers.nvme.capacity=1TiB",
               "--set", "tiers.dram.pool=private"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        _wait_health(f"unix:{sock}", proc, timeout=300)
        dt = time.perf_counter() - t0
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(120)
        return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--dir", help="where to write the blocks (default: a temp dir)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="engram-restart-"))
    root = base / "nvme"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    asyncio.run(fill(root, args.blocks, args.block_tokens))
    fill_s = time.perf_counter() - t0
    rows = {}
    # As a crash leaves the directory (the last compaction's snapshot and the journal since): a daemon killed
    # again, so that the in-process recovery replays the same state; its clean close then compacts.
    rows["journal, after a crash (snapshot + journal): serve"] = serve_s(root, kill=True)
    rows["journal, after a crash (snapshot + journal): recover"], n = asyncio.run(recover_s(root))
    assert n == args.blocks, f"recovered {n} of {args.blocks}"
    rows["journal, after a clean stop (snapshot): serve"] = serve_s(root, kill=True)
    rows["journal, after a clean stop (snapshot): recover"], n = asyncio.run(recover_s(root))
    shutil.rmtree(root / "index")
    rows["no journal (every header read): recover"], n = asyncio.run(recover_s(root))
    assert n == args.blocks
    shutil.rmtree(root / "index")
    rows["no journal (every header read): serve"] = serve_s(root, kill=True)
    shutil.rmtree(base, ignore_errors=True)
    print(f"# restart: {datetime.date.today()} on {machine()}; {args.blocks} blocks of {args.block_tokens} tokens "
          f"(written in {fill_s:.0f} s)\n")
    print("| case | seconds |\n|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"blocks": args.blocks, "block_tokens": args.block_tokens,
                                               "seconds": rows}, indent=2))


if __name__ == "__main__":
    main()

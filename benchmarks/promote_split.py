"""Where a batched promotion's time goes, on the CPU: the store's DRAM -> HBM path (`transfer.promote`) between
two host pools (the "HBM" pool on the CPU, as the tests run it), split into its copies (synchronous here), its
verify (`transfer._verify`: every source region hashed) and the rest, the store's booking (begin, place, end of
each block). The GPU's figure is `benchmarks.gpu_transfer`; this one shows the Python that runs beside the DMA
there, on any machine. Modes: `full`, `no-copy` (copies skipped: booking + verify) and `booking` (copies and
verify skipped). Rounds after the first report the minimum per column with --best, else the median.

    python3 -m benchmarks.promote_split [--blocks 256] [--kib 1024] [--rounds 10] [--mode full] [--best] [--profile]

Run against an older tree by path: `cd /tmp && PYTHONPATH=OLD python3 /path/to/benchmarks/promote_split.py`
(it needs only `engram`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import engram
import engram.transfer as transfer
from engram.block import BlockHeader, checksum
from engram.keys import root_key
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import shared_dram_tier
from engram.tiers.hbm import hbm_tier


class TimedEngine(transfer.TransferEngine):
    """The CPU copy, timed; with `skip`, no bytes are copied (what the copies cost is left out)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.seconds = 0.0
        self.skip = False

    def copy(self, src: torch.Tensor, dst: torch.Tensor, moves: Sequence[transfer.Move], *,
             page_bytes: int = 0) -> transfer.Done:
        t0 = time.perf_counter()
        done = transfer.Done(None) if self.skip else super().copy(src, dst, moves, page_bytes=page_bytes)
        self.seconds += time.perf_counter() - t0
        return done


def timed_verify(skip: list[bool], seconds: list[float]) -> Any:
    real = transfer._verify

    async def verify(lower: Any, upper: Any, copies: Sequence[Any], done: Any) -> list[bool]:
        t0 = time.perf_counter()
        out = [True] * len(copies) if skip[0] else await real(lower, upper, copies, done)
        seconds[0] += time.perf_counter() - t0
        return out

    return verify


async def run(args: argparse.Namespace) -> None:
    tokens = args.kib // 4  # 4 KiB a token: 8 KV heads of 128 bf16 values, K and V
    block = tokens * 4096
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=tokens)
    spec = ModelSpec(name=f"bench-{args.kib}kib", weights_id="promote-split", layout=layout, codec="raw")
    shm = tempfile.mkdtemp(dir=args.shm_dir)
    page = min(block, 64 * 1024)
    hbm = hbm_tier((args.blocks + 2) * block, "cpu", page_bytes=page)
    dram = shared_dram_tier((args.blocks + 2) * block, shm, page, pin=False)
    store = BlockStore([hbm, dram], ModelRegistry(default_codec="raw"))
    engine = TimedEngine()
    skip_verify, verify_s = [False], [0.0]
    transfer._verify = timed_verify(skip_verify, verify_s)  # type: ignore[assignment]
    try:
        fp = store.registry.register(spec)
        rng = np.random.default_rng(0)
        metas = []
        for i in range(args.blocks):
            payload = rng.integers(0, 256, block, dtype=np.uint8).tobytes()
            header = BlockHeader(np.full(tokens, i, dtype=np.int32), DType.BF16, layout.block_shape(tokens), len(payload),
                                 checksum(payload))
            out = await store.put("bench", fp, root_key("bench", fp), header, payload)
            metas.append(store.block(out.key))
        assert await transfer.copy_blocks(store, metas, engine, src="hbm", dst="dram") == args.blocks
        engine.skip = args.mode != "full"
        skip_verify[0] = args.mode == "booking"
        rows = []
        prof = cProfile.Profile() if args.profile else None
        for r in range(args.rounds):
            for m in metas:
                await store.drop_copy(m, "hbm")
            engine.seconds = verify_s[0] = 0.0
            if prof is not None and r == args.rounds - 1:
                prof.enable()
            t0 = time.perf_counter()
            n = await transfer.promote(store, metas, engine)
            total = time.perf_counter() - t0
            if prof is not None and r == args.rounds - 1:
                prof.disable()
            assert n == args.blocks, f"only {n} of {args.blocks} blocks were promoted"
            rows.append((total, engine.seconds, verify_s[0], total - engine.seconds - verify_s[0]))
        pick = min if args.best else statistics.median
        total, copy, verify, booking = (pick(c) * 1e3 for c in zip(*rows, strict=True))
        print(f"{engram.__file__}: {args.blocks} x {args.kib} KiB, mode {args.mode}, {'best' if args.best else 'median'} of "
              f"{args.rounds} (ms): total {total:.2f}, copy {copy:.2f}, verify {verify:.2f}, booking {booking:.2f}")
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--kib", type=int, default=1024, help="block size in KiB (a multiple of 4)")
    ap.add_argument("--mode", choices=("full", "no-copy", "booking"), default="full")
    ap.add_argument("--best", action="store_true", help="the minimum of each column instead of the median")
    ap.add_argument("--profile", action="store_true", help="cProfile the last round")
    ap.add_argument("--shm-dir", default="/dev/shm")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()

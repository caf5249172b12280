"""DRAM -> HBM promotion through the store's batched path, against a plain pinned `copy_` of the same bytes in
the same run, and HBM hit latency. Meant for the H200; `--device cpu` runs the same steps on a CPU (a
smoke test of the script, not a figure).

Steps: a store over an HBM pool and the shared (pinned) DRAM pool; N raw 1 MiB blocks are put (they land
in HBM), copied down to DRAM in one batch and their HBM copies dropped; then, R rounds: promote all N in
one batch (transfer.promote: begin_copy for each block, one submission on the transfer stream, the event,
end_copy), timed, and the HBM copies dropped again (untimed). Ceiling: the same N MiB copied with one
`copy_` from the pinned segment, and from a `pin_memory()` tensor, to a device tensor. Hit latency: a block
in HBM read as a device tensor (its slot's region cloned, synchronized), and through `store.read` (the
bytes brought to the host, as a Get's payload).

    python3 -m benchmarks.gpu_transfer [--blocks 256] [--rounds 10] [--device cuda] [--shm-dir /dev/shm]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import time

import numpy as np
import torch

from benchmarks._harness import machine, percentiles
from engram.block import BlockHeader, checksum
from engram.keys import root_key
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import shared_dram_tier
from engram.tiers.hbm import hbm_tier
from engram.transfer import TransferEngine, copy_blocks, promote

MiB = 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceiling(src: torch.Tensor, device: torch.device, repeats: int) -> float:
    """GB/s of one plain copy_ of src to a device tensor of the same size (best of `repeats`)."""
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


async def run(args: argparse.Namespace) -> list[tuple[str, str]]:
    device = torch.device(args.device)
    block = MiB
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=256)
    spec = ModelSpec(name="bench-1mib", weights_id="gpu-transfer", layout=layout, codec="raw")
    hbm = hbm_tier((args.blocks + 2) * block, device, page_bytes=64 * 1024)
    dram = shared_dram_tier((args.blocks + 2) * block, args.shm_dir, 64 * 1024, pin=True)
    store = BlockStore([hbm, dram], ModelRegistry(default_codec="raw"))
    engine = TransferEngine(device)
    rows: list[tuple[str, str]] = []
    try:
        fp = store.registry.register(spec)
        gen = torch.Generator().manual_seed(0)
        metas = []
        for i in range(args.blocks):
            kv = torch.randn(layout.block_shape(256), generator=gen).to(torch.bfloat16)
            payload = kv.view(torch.uint8).numpy().tobytes()
            toks = np.full(256, i, dtype=np.int32)
            header = BlockHeader(toks, DType.BF16, layout.block_shape(256), len(payload), checksum(payload))
            out = await store.put("bench", fp, root_key("bench", fp), header, payload)
            metas.append(store.block(out.key))
        t0 = time.perf_counter()
        down = await copy_blocks(store, metas, engine, src="hbm", dst="dram")
        t_down = time.perf_counter() - t0
        assert down == args.blocks, f"only {down} of {args.blocks} blocks reached DRAM"
        times = []
        for _ in range(args.rounds):
            for m in metas:
                await store.drop_copy(m, "hbm")
            sync(device)
            t0 = time.perf_counter()
            n = await promote(store, metas, engine)
            times.append(time.perf_counter() - t0)
            assert n == args.blocks, f"only {n} of {args.blocks} blocks were promoted"
        # Promoted bytes are the stored bytes.
        for m in random.Random(0).sample(metas, min(8, len(metas))):
            assert checksum(await hbm.read(m.key)) == m.checksum
        nbytes = args.blocks * block
        promo = nbytes / min(times) / 1e9
        promo_med = nbytes / statistics.median(times) / 1e9
        assert dram.segment is not None
        seg_src = dram.segment.data[:nbytes]
        pinned_seg = ceiling(seg_src, device, args.rounds)
        pin_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if device.type == "cuda" else seg_src
        pinned_plain = ceiling(pin_src, device, args.rounds)
        rows += [
            ("blocks x size", f"{args.blocks} x 1 MiB ({nbytes / 2**30:.2f} GiB)"),
            ("DRAM pool pinned (cudaHostRegister)", str(dram.segment.pinned)),
            ("HBM -> DRAM batch (copy_blocks, once)", f"{nbytes / t_down / 1e9:.2f} GB/s"),
            ("DRAM -> HBM promotion, best / median", f"{promo:.2f} / {promo_med:.2f} GB/s"),
            ("ceiling: copy_ from the pinned segment", f"{pinned_seg:.2f} GB/s"),
            ("ceiling: copy_ from pin_memory()", f"{pinned_plain:.2f} GB/s"),
            ("promotion / best ceiling (goal >= 85%)", f"{promo / max(pinned_seg, pinned_plain):.0%}"),
        ]
        hot = [m for m in metas if "hbm" in m.locations]
        lat_dev, lat_read = [], []
        for m in random.Random(1).choices(hot, k=args.hits):
            sync(device)
            t0 = time.perf_counter()
            hbm.region(hbm.slot(m.key)).clone()
            sync(device)
            lat_dev.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await store.read(m)
            lat_read.append(time.perf_counter() - t0)
        for name, lat in (("HBM hit as a device tensor", lat_dev), ("HBM hit via store.read (to host)", lat_read)):
            p50, p99 = percentiles(lat)
            rows.append((f"{name}, p50 / p99", f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f} us"))
    finally:
        await store.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--hits", type=int, default=1000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shm-dir", default="/dev/shm")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"gpu_transfer: {datetime.date.today()}; {dev}; {machine()}; torch {torch.__version__}\n")
    print("| measure | value |\n|---|---|")
    for k, v in asyncio.run(run(args)):
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()

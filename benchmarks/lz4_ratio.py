"""What lz4 saves on stored block payloads, per codec (why the NVMe tier's compression is off by default).

For one 256-token block of a gpt-oss-20b-like layout (12 global layers, 8 KV heads of 64, bf16) with
Gaussian KV and with KV from the reference hybrid decoder: the v1 block of each codec, and lz4 (block mode,
as the NVMe tier uses it) on it: compressed / uncompressed size, and compression speed on this CPU.

    .venv/bin/python -m benchmarks.lz4_ratio
"""

from __future__ import annotations

import datetime
import time

import lz4.block
import torch

from benchmarks._harness import machine
from engram.codec import base, blockformat


def blocks() -> dict[str, torch.Tensor]:
    from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern

    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(12, 2, 256, 8, 64, generator=g).to(torch.bfloat16)
    cfg = HybridConfig(layers=gpt_oss_pattern(24), window=128, vocab_size=4096, d_model=512, n_heads=16,
                       n_kv_heads=8, head_dim=64, d_ff=1024, seed=0)
    res = HybridDecoder(cfg, numerics="fast").prefill(torch.randint(0, 4096, (256,), generator=g), logits=False)
    model_kv = torch.stack([torch.stack((k, v)) for k, v in res.global_kv]).to(torch.bfloat16)
    return {"gaussian": gauss, "reference model": model_kv}


def main() -> None:
    print(f"# lz4_ratio: {datetime.date.today()} on {machine()}\n")
    print("| KV | codec | stored bytes | lz4 bytes | lz4 / stored | lz4 MB/s |")
    print("|---|---|---:|---:|---:|---:|")
    for data, kv in blocks().items():
        for name in ("raw", "fp8_e4m3", "nvfp4", "mxfp4"):
            blob = blockformat.encode(kv, base.codec_by_name(name))
            t0 = time.perf_counter()
            packed = lz4.block.compress(blob, store_size=False)
            dt = time.perf_counter() - t0
            print(f"| {data} | {name} | {len(blob)} | {len(packed)} | {len(packed) / len(blob):.3f} | "
                  f"{len(blob) / dt / 1e6:.0f} |")


if __name__ == "__main__":
    main()

"""Accuracy of the block codecs on K-like data, by codec and grouping axis (CPU, reference codecs).

For a (layers, tokens, kv heads, head dim) tensor it reports the relative RMS error, the same restricted to the
channels that are not outliers, and the largest absolute error relative to the tensor's amax, with groups
along tokens ("channel": one scale per channel per 16/32 tokens) or along head_dim ("token"). Data: Gaussian,
heavy-tailed (Student-t, 3 degrees of freedom), and K-like with outlier channels (a few head-dim channels of
every head 20x larger, as seen in the K caches of trained models). Seeds are fixed; runs in seconds.

  python benchmarks/codec_error.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from engram.codec import fp4_reference as ref

SHAPE = (4, 256, 8, 128)  # (layers, tokens, kv heads, head dim): one 256-token block of 4 layers
OUTLIER_CHANNELS = (3, 17, 64, 101)


def datasets(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(SHAPE, generator=g)
    chi2 = (torch.randn((3, *SHAPE), generator=g) ** 2).sum(0)
    student = torch.randn(SHAPE, generator=g) / (chi2 / 3).sqrt()
    k_like = torch.randn(SHAPE, generator=g)
    k_like[..., list(OUTLIER_CHANNELS)] *= 20.0
    out = {"gaussian": gauss, "student-t(3)": student, "outlier channels": k_like}
    out.update(reference_model_kv(seed))
    return out


def reference_model_kv(seed: int) -> dict[str, torch.Tensor]:
    """K and V of the global layers of the reference hybrid decoder (engram.replay), random seeded weights,
    shaped like SHAPE: real attention KV (RoPE'd K, projected V), though not from trained weights."""
    from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern

    layers, tokens, heads, dim = SHAPE
    cfg = HybridConfig(layers=gpt_oss_pattern(2 * layers), window=128, vocab_size=4096, d_model=512, n_heads=16,
                       n_kv_heads=heads, head_dim=dim, d_ff=1024, seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    res = HybridDecoder(cfg, numerics="fast").prefill(ids, logits=False)
    k = torch.stack([k for k, _ in res.global_kv])  # (layers, tokens, heads, dim)
    v = torch.stack([v for _, v in res.global_kv])
    return {"reference model K": k, "reference model V": v}


def to_matrix(x: torch.Tensor, axis: str) -> torch.Tensor:
    layers, tokens, heads, dim = x.shape
    if axis == "channel":
        return x.permute(0, 2, 3, 1).reshape(layers * heads * dim, tokens)  # groups along tokens
    return x.reshape(layers * tokens * heads, dim)  # groups along head_dim


def from_matrix(m: torch.Tensor, axis: str, shape: tuple[int, ...]) -> torch.Tensor:
    layers, tokens, heads, dim = shape
    if axis == "channel":
        return m.reshape(layers, heads, dim, tokens).permute(0, 3, 1, 2)
    return m.reshape(shape)


CODECS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "nvfp4": lambda m: ref.dequantize_nvfp4(ref.quantize_nvfp4(m)),
    "mxfp4": lambda m: ref.dequantize_mxfp4(ref.quantize_mxfp4(m)),
    "mxfp4 (round-up scale)": lambda m: ref.dequantize_mxfp4(ref.quantize_mxfp4(m, round_up=True)),
    "fp8_e4m3 (per tensor)": lambda m: ref.dequantize_fp8_e4m3(ref.quantize_fp8_e4m3(m)),
}


def rel_rms(err: torch.Tensor, x: torch.Tensor) -> float:
    return float(err.double().norm() / x.double().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    normal = torch.ones(SHAPE[-1], dtype=torch.bool)
    normal[list(OUTLIER_CHANNELS)] = False
    print(f"shape (layers, tokens, kv heads, head dim) = {SHAPE}, float32 input, seed {args.seed}\n")
    print("| data | codec | groups along | rel. RMS error | rel. RMS, normal channels | max abs error / amax |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for data_name, x in datasets(args.seed).items():
        for codec_name, roundtrip in CODECS.items():
            for axis, label in (("channel", "tokens (channel)"), ("token", "head_dim (token)")):
                y = from_matrix(roundtrip(to_matrix(x, axis)), axis, SHAPE)
                err = y - x
                cells = [rel_rms(err, x), rel_rms(err[..., normal], x[..., normal]),
                         float(err.abs().max() / x.abs().max())]
                print(f"| {data_name} | {codec_name} | {label} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


if __name__ == "__main__":
    main()

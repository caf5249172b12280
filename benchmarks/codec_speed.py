"""Throughput of the FP4 codecs on a GPU against the copy bandwidth measured in the same run.

For every kernel configuration it first checks the Triton kernels against the PyTorch reference on the same GPU
(codes, scales and decoded bf16 bits identical); a configuration that differs is reported and not timed, and the
script exits non-zero. Then it times, per size of bf16 input (16 MiB .. 1 GiB by default):
- copy: x.copy_ into another buffer (bytes read + written), the ceiling;
- quantize kernel alone (the tensor scale given, as a fused caller would) and the whole quantize_* call
  (NVFP4: with its amax pass; MXFP4: with the NaN/Inf check on the scales and a host sync);
- dequantize kernel to bf16;
- the PyTorch reference on the same GPU (up to --ref-max-mib).
Bytes moved per element: quantize 2 + 1/2 + 1/16 (NVFP4) or 1/32 (MXFP4), dequantize the same; the amax pass of
a whole NVFP4 quantize reads 2 more, counted in its row's own figure. Times are triton.testing.do_bench medians
(L2 flushed between runs). Prints a Markdown table; --out writes JSON.

  python benchmarks/codec_speed.py --out results.json       # on the GPU (about 3 minutes on an H200)
  python benchmarks/codec_speed.py --smoke                   # on the CPU through the Triton interpreter
  python benchmarks/codec_speed.py --cpu                     # the C codecs (backend "cpu"): codec_speed_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch  # Triton is imported in run(), once TRITON_INTERPRET is settled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", help="bf16 input sizes (GPU: 16 64 256 1024; --cpu: 6 64)")
    p.add_argument("--ref-max-mib", type=float, help="largest size to time the reference at (GPU: 256); with --cpu "
                   "the one size it is timed at (2)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, kernels in Triton's interpreter")
    p.add_argument("--cpu", action="store_true", help="time the C codecs (backend 'cpu') on one core instead")
    p.add_argument("--reps", type=int, default=9, help="--cpu: timed runs per cell (the median is reported)")
    args = p.parse_args()
    if args.cpu:
        try:
            from benchmarks.codec_speed_cpu import run_cpu
        except ImportError:  # run as a script: benchmarks/ is sys.path[0]
            from codec_speed_cpu import run_cpu  # type: ignore[no-redef]
        args.ref_mib = args.ref_max_mib or 2
        return run_cpu(args)
    args.sizes_mib = args.sizes_mib or [16, 64, 256, 1024]
    args.ref_max_mib = args.ref_max_mib or 256
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before the import below
    return run(args)


def run(args: argparse.Namespace) -> int:
    import triton

    from engram.codec import fp4_reference as ref
    from engram.kernels import fp4

    if args.smoke:
        device, sizes, configs = "cpu", [1 / 64], fp4.CONFIGS[::4]  # 16 KiB of bf16
        bench: Callable[[Callable[[], object]], float] = _cpu_ms
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, or pass --smoke to check the script on the CPU", file=sys.stderr)
            return 2
        device, sizes, configs = "cuda", args.sizes_mib, fp4.CONFIGS
        bench = _gpu_ms
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "verify": [], "results": [],
    }

    bad = _verify(ref, fp4, device, configs, report)
    for mib in sizes:
        n = int(mib * 2**20) // 2 // 4096 * 4096  # bf16 elements, whole 4096-wide rows
        x = torch.randn(n // 4096, 4096, device=device, dtype=torch.bfloat16)
        copy_gbps = _time_size(ref, fp4, x, mib, configs, bad, bench, mib <= args.ref_max_mib, report["results"])
        print(f"{mib:g} MiB done (copy {copy_gbps:.0f} GB/s)", file=sys.stderr)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()

    _print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if bad:
        print(f"NOT BIT-EXACT: {', '.join(f'{fmt} {cfg}' for cfg, fmt in sorted(bad, key=str))}", file=sys.stderr)
        return 1
    return 0


def _time_size(ref: Any, fp4: Any, x: torch.Tensor, mib: float, configs: Any, bad: set[tuple[Any, str]],
               bench: Callable[[Callable[[], object]], float], with_reference: bool,
               rows: list[dict[str, Any]]) -> float:
    """Append the rows of one input size; returns the copy bandwidth (GB/s) they are measured against."""
    n = x.numel()
    copy_dst = torch.empty_like(x)
    copy_ms = bench(lambda: copy_dst.copy_(x))
    copy_gbps = 2 * n * 2 / copy_ms / 1e6
    rows.append(_row(mib, "-", "copy", "torch", "-", copy_ms, 4 * n, copy_gbps))
    for fmt in ("nvfp4", "mxfp4"):
        _time_format(ref, fp4, fmt, x, mib, [c for c in configs if (c, fmt) not in bad], bench, with_reference,
                     copy_gbps, rows)
    return copy_gbps


def _time_format(ref: Any, fp4: Any, fmt: str, x: torch.Tensor, mib: float, configs: list[Any],
                 bench: Callable[[Callable[[], object]], float], with_reference: bool, copy_gbps: float,
                 rows: list[dict[str, Any]]) -> None:
    """Rows of one format at one size: kernels per configuration, the whole call, the reference."""
    n = x.numel()
    moved = n * (2 + 1 / 2 + 1 / (16 if fmt == "nvfp4" else 32))
    nv = fmt == "nvfp4"
    q = fp4.quantize_nvfp4(x) if nv else fp4.quantize_mxfp4(x)  # verified against the reference above
    codes, scales, out = torch.empty_like(q.codes), torch.empty_like(q.scales), torch.empty_like(x)
    ts = q.tensor_scale if nv else None

    def quantize(cfg: Any) -> None:
        if nv:
            fp4.quantize_nvfp4_into(x, ts, codes, scales, cfg)
        else:
            fp4.quantize_mxfp4_into(x, codes, scales, False, cfg)

    def dequantize(cfg: Any, native: bool = fp4.NATIVE_BF16) -> None:
        if nv:
            fp4.dequantize_nvfp4_into(codes, scales, ts, out, cfg, native_bf16=native)
        else:
            fp4.dequantize_mxfp4_into(codes, scales, out, cfg, native_bf16=native)

    for cfg in configs:
        tag = _tag(cfg)
        rows.append(_row(mib, fmt, "quantize (kernel)", "triton", tag, bench(partial(quantize, cfg)), moved,
                         copy_gbps, cfg == fp4.QUANTIZE_CONFIG))
        rows.append(_row(mib, fmt, "dequantize bf16", "triton", tag, bench(partial(dequantize, cfg)), moved,
                         copy_gbps, cfg == fp4.DEQUANTIZE_CONFIG))
    default = fp4.DEQUANTIZE_CONFIG
    rows.append(_row(mib, fmt, "dequantize bf16, integer rounding", "triton", _tag(default),
                     bench(lambda: dequantize(default, False)), moved, copy_gbps))
    whole = moved + (2 * n if nv else 0)  # NVFP4's whole call reads x once more for its amax
    kquant, rquant = (fp4.quantize_nvfp4, ref.quantize_nvfp4) if nv else (fp4.quantize_mxfp4, ref.quantize_mxfp4)
    rdeq = ref.dequantize_nvfp4 if nv else ref.dequantize_mxfp4
    rows.append(_row(mib, fmt, "quantize (whole call)", "triton", "default", bench(lambda: kquant(x)), whole,
                     copy_gbps))
    if with_reference:
        rows.append(_row(mib, fmt, "quantize (whole call)", "reference", "-", bench(lambda: rquant(x)), whole,
                         copy_gbps))
        rows.append(_row(mib, fmt, "dequantize bf16", "reference", "-",
                         bench(lambda: rdeq(q, torch.bfloat16)), moved, copy_gbps))


def _verify(ref: Any, fp4: Any, device: str, configs: Any, report: dict[str, Any]) -> set[tuple[Any, str]]:
    """Every configuration against the reference on one mixed input; returns the (config, format) pairs that
    differ."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    rows = 256 if device == "cpu" else 8192
    x = torch.randn(rows, 528, generator=g)  # 528 = 16 * 33: NVFP4 needs no padding, MXFP4 pads to 544
    x[1::7] = torch.distributions.StudentT(2.0).sample((x[1::7].shape[0], 528)).clamp(-1e4, 1e4)
    x[2::7] *= 1e-36  # tiny groups: E4M3 scales clamped to the smallest subnormal, small E8M0 exponents
    x[3::7] = 0.0
    x[6::7] *= 3e-38  # amax < 2^-123: E8M0 codes 0-1, float32-subnormal decoded values, flushed inputs
    x[4::7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(66)
    x[:, 5] *= 300.0  # an outlier channel
    x = x.to(device=device, dtype=torch.bfloat16)
    want = {"nvfp4": ref.quantize_nvfp4(x), "mxfp4": ref.quantize_mxfp4(x), "fp8_e4m3": ref.quantize_fp8_e4m3(x)}
    deq = {"nvfp4": ref.dequantize_nvfp4, "mxfp4": ref.dequantize_mxfp4, "fp8_e4m3": ref.dequantize_fp8_e4m3}
    bad = set()
    for cfg in configs:
        for fmt, (quantize, dequantize) in fp4.CODECS.items():
            got = quantize(x, config=cfg)
            differ = [f"{field}: {int((a != b).sum())} bytes" for field, a, b in
                      zip(("codes", "scales", "scale"), _parts(got), _parts(want[fmt]), strict=True) if not torch.equal(a, b)]
            decoded = (dequantize(got, torch.bfloat16, config=cfg).view(torch.int16),
                       deq[fmt](want[fmt], torch.bfloat16).view(torch.int16))
            if not torch.equal(*decoded):
                differ.append(f"decoded: {int((decoded[0] != decoded[1]).sum())} values")
            same = not differ
            report["verify"].append({"config": str(cfg), "fmt": fmt, "bit_exact": same, "differ": differ})
            if not same:
                bad.add((cfg, fmt))
    return bad


def _parts(q: Any) -> list[torch.Tensor]:
    """codes, group scales (FP8: its codes again) and the per-tensor scale (MXFP4: its scales again), as bytes."""
    tensors = [q.codes, getattr(q, "scales", q.codes), getattr(q, "tensor_scale", getattr(q, "scale", q.codes))]
    return [t.reshape(-1).view(torch.uint8) for t in tensors]


def _tag(cfg: Any) -> str:
    return f"{cfg.groups_per_program}g/{cfg.num_warps}w"


def _gpu_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _cpu_ms(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _row(mib: float, fmt: str, op: str, impl: str, config: str, ms: float, moved: float,
         copy_gbps: float, is_default: bool = True) -> dict[str, Any]:
    """is_default: the configuration the codec API uses (always true for rows with one configuration)."""
    gbps = moved / ms / 1e6
    return {"size_mib": mib, "fmt": fmt, "op": op, "impl": impl, "config": config, "default": is_default,
            "ms": ms, "bytes_moved": moved, "gb_per_s": gbps, "pct_of_copy": 100 * gbps / copy_gbps}


def _print_table(report: dict[str, Any]) -> None:
    """The best configuration of each (size, format, op, impl), with the default configuration beside it."""
    print(f"device: {report['device']}; torch {report['torch']}, triton {report['triton']}")
    exact = sum(v["bit_exact"] for v in report["verify"])
    print(f"bit-exact vs reference: {exact}/{len(report['verify'])} (configuration, format) pairs\n")
    print("| bf16 MiB | format | op | impl | best config | ms | GB/s | % of copy | default config % |")
    print("| ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    default: dict[tuple[Any, ...], float] = {}
    for r in report["results"]:
        key = (r["size_mib"], r["fmt"], r["op"], r["impl"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
        if r["default"]:
            default[key] = r["pct_of_copy"]
    for key, r in best.items():
        d = f"{default[key]:.0f}%" if key in default else "-"
        print(f"| {r['size_mib']:g} | {r['fmt']} | {r['op']} | {r['impl']} | {r['config']} | {r['ms']:.4f} | "
              f"{r['gb_per_s']:.0f} | {r['pct_of_copy']:.0f}% | {d} |")


if __name__ == "__main__":
    sys.exit(main())

"""codec_speed --cpu: the C codecs (engram.codec.cpu) on one core, against a copy of the same buffer.

First it checks the cpu backend against the PyTorch reference, bit for bit (codes, scales, tensor scale and
decoded bf16, fp16 and float32 bits), on a mixed input (Gaussian, Student-t, tiny, zero, exact-tie and outlier
rows) and on a slice of each timed input, with every instruction set the module has (baseline x86-64, AVX2);
a difference is reported, nothing of that set is timed, and the script exits non-zero. Then, single-threaded
(torch.set_num_threads(1)), per size of bf16 input and instruction set:
- copy: dst.copy_(x) of the same bf16 buffer, the ceiling; and the copy of K into a contiguous (L*H*D, T)
  matrix that a backend taking 2-D matrices needs first (the cpu backend reads the strided view instead);
- quantize, whole call: a (rows, 4096) matrix through quantize_* (its amax pass, allocation, checks);
- quantize kernel: the C call alone, the tensor scale given, into buffers allocated once;
- dequantize to bf16, into a buffer allocated once (out=);
- K and V of KV blocks (L, 2, 256, 8, 128) through quantize_kv_block / dequantize_kv_block: K grouped along
  tokens is read and written as a strided view of the block (no transposing copy), V along head_dim;
- the PyTorch reference, whole calls, at --ref-mib only (it runs at 0.01-0.1 GB/s).
GB/s is bf16 bytes per second: of the input for quantize, of the output for dequantize, of the buffer for the
copy. Times are medians of --reps runs.

  python benchmarks/codec_speed.py --cpu --sizes-mib 6 64 --out cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

GB = 1e9
FORMATS = ("nvfp4", "mxfp4", "fp8_e4m3")
KV_SHAPE = (256, 8, 128)  # tokens, kv heads, head dim of one block: 0.5 MiB of K or V per layer in bf16


def run_cpu(args: argparse.Namespace) -> int:
    from engram import codec
    from engram.codec import _cpu, cpu
    from engram.codec import fp4_reference as ref

    torch.set_num_threads(1)
    isas = ["avx2", "baseline"] if _cpu.isa() == "avx2" else ["baseline"]
    sizes = args.sizes_mib or [6, 64]
    report: dict[str, Any] = {"device": f"cpu ({platform.processor() or platform.machine()}), 1 thread",
                              "torch": torch.__version__, "isas": isas, "verify": [], "results": []}
    bad: set[str] = set()
    for isa in isas:
        _cpu.use_isa(isa)
        bad |= _verify(ref, cpu, isa, _mixed(), "mixed", report)
    rows: list[dict[str, Any]] = report["results"]
    for mib in sizes:
        x = torch.randn(int(mib * 2**20) // 2 // 4096, 4096).to(torch.bfloat16)
        layers = max(1, int(mib * 2**20) // (2 * 2 * 2 * KV_SHAPE[0] * KV_SHAPE[1] * KV_SHAPE[2]))
        kv = torch.randn(layers, 2, *KV_SHAPE).to(torch.bfloat16)
        copy = _copy_row(x, mib, args.reps)
        k = kv[:, 0].permute(0, 2, 3, 1).flatten(1, 2)  # (L, H*D, T): K's channel-axis matrix, a strided view
        rows += [copy, _row(mib, "-", "K matrix transposing copy (what a 2-D backend pays)", "torch",
                            _median_s(k.contiguous, args.reps), k.numel() * 2, copy["gb_per_s"])]
        for isa in isas:
            _cpu.use_isa(isa)
            bad |= _verify(ref, cpu, isa, x[:128], f"{mib} MiB slice", report)
            if isa in bad:
                continue
            for fmt in FORMATS:
                rows += _time_matrix(cpu, _cpu, ref, fmt, x, mib, isa, args.reps, copy["gb_per_s"])
                rows += _time_kv(codec, fmt, kv, mib, isa, args.reps, copy["gb_per_s"])
        print(f"{mib:g} MiB done (copy {copy['gb_per_s']:.1f} GB/s)", file=sys.stderr)
    rows += _time_reference(ref, args.ref_mib, args.reps)
    _cpu.use_isa(isas[0])
    _print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if bad:
        print(f"NOT BIT-EXACT: {sorted(bad)}", file=sys.stderr)
        return 1
    return 0


def _mixed() -> torch.Tensor:
    """The GPU mode's verification input: every kind of row the formats treat differently."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 528, generator=g)  # 528 = 16 * 33: MXFP4 pads to 544
    x[1::7] = torch.distributions.StudentT(2.0).sample((x[1::7].shape[0], 528)).clamp(-1e4, 1e4)
    x[2::7] *= 1e-36
    x[3::7] = 0.0
    x[6::7] *= 3e-38
    x[4::7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(66)
    x[:, 5] *= 300.0
    return x.to(torch.bfloat16)


def _verify(ref: Any, cpu: Any, isa: str, x: torch.Tensor, what: str, report: dict[str, Any]) -> set[str]:
    """The instruction set's name if the cpu backend differs from the reference on x in any byte or bit."""
    failed = set()
    for fmt in FORMATS:
        (rq, rd), (cq, cd) = ref.CODECS[fmt], cpu.CODECS[fmt]
        want, got = rq(x), cq(x)
        differ = [f"{field}: differs" for field, a, b in zip(("codes", "scales", "scale"), _parts(got), _parts(want),
                                                             strict=True) if not torch.equal(a, b)]
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if not torch.equal(_bits(cd(want, dtype)), _bits(rd(want, dtype))):
                differ.append(f"decoded {dtype}: differs")
        report["verify"].append({"isa": isa, "input": what, "fmt": fmt, "bit_exact": not differ, "differ": differ})
        if differ:
            failed.add(isa)
    return failed


def _parts(q: Any) -> list[torch.Tensor]:
    tensors = [q.codes, getattr(q, "scales", q.codes), getattr(q, "tensor_scale", getattr(q, "scale", q.codes))]
    return [t.reshape(-1).view(torch.uint8) for t in tensors]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: first-touch page faults, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(mib: float, fmt: str, op: str, impl: str, seconds: float, nbytes: int, copy_gbps: float | None
         ) -> dict[str, Any]:
    gbps = nbytes / seconds / GB
    return {"size_mib": mib, "fmt": fmt, "op": op, "impl": impl, "ms": seconds * 1e3, "bf16_bytes": nbytes,
            "gb_per_s": gbps, "pct_of_copy": None if copy_gbps is None else 100 * gbps / copy_gbps}


def _copy_row(x: torch.Tensor, mib: float, reps: int) -> dict[str, Any]:
    dst = torch.empty_like(x)
    return _row(mib, "-", "copy", "torch", _median_s(lambda: dst.copy_(x), reps), x.numel() * 2, None) | {
        "pct_of_copy": 100.0}


def _time_matrix(cpu: Any, _cpu: Any, ref: Any, fmt: str, x: torch.Tensor, mib: float, isa: str, reps: int,
                 copy_gbps: float) -> list[dict[str, Any]]:
    quantize, dequantize = cpu.CODECS[fmt]
    nbytes, impl = x.numel() * 2, f"cpu {isa}"
    q = quantize(x)
    elements, codes = x.view(torch.int16).numpy(), torch.empty_like(q.codes).numpy()
    if fmt == "fp8_e4m3":
        kernel = (lambda: _cpu.encode_fp8(elements, 1, float(q.scale), codes))  # noqa: E731
    else:
        scales, ts = torch.empty_like(q.scales).numpy(), float(getattr(q, "tensor_scale", 1.0))
        kernel = (lambda: _cpu.encode_grouped(elements, 1, fmt == "mxfp4", ts, False, codes, scales))  # noqa: E731
    out = torch.empty_like(x)
    return [_row(mib, fmt, "quantize (whole call)", impl, _median_s(lambda: quantize(x), reps), nbytes, copy_gbps),
            _row(mib, fmt, "quantize (kernel)", impl, _median_s(kernel, reps), nbytes, copy_gbps),
            _row(mib, fmt, "dequantize bf16 (out=)", impl,
                 _median_s(lambda: dequantize(q, torch.bfloat16, out=out), reps), nbytes, copy_gbps)]


def _time_kv(codec: Any, fmt: str, kv: torch.Tensor, mib: float, isa: str, reps: int, copy_gbps: float
             ) -> list[dict[str, Any]]:
    """quantize_kv_block / dequantize_kv_block of (L, 2, 256, 8, 128): K per channel (strided), V per token."""
    q = codec.quantize_kv_block(kv, fmt, backend="cpu")
    nbytes = kv.numel() * 2
    return [_row(mib, fmt, "quantize_kv_block", f"cpu {isa}",
                 _median_s(lambda: codec.quantize_kv_block(kv, fmt, backend="cpu"), reps), nbytes, copy_gbps),
            _row(mib, fmt, "dequantize_kv_block bf16", f"cpu {isa}",
                 _median_s(lambda: codec.dequantize_kv_block(q, torch.bfloat16, backend="cpu"), reps), nbytes,
                 copy_gbps)]


def _time_reference(ref: Any, mib: float, reps: int) -> list[dict[str, Any]]:
    x = torch.randn(int(mib * 2**20) // 2 // 4096, 4096).to(torch.bfloat16)
    rows = []
    for fmt in FORMATS:
        quantize, dequantize = ref.CODECS[fmt]
        q = quantize(x)
        encode = partial(quantize, x)
        decode = partial(dequantize, q, torch.bfloat16)
        rows.append(_row(mib, fmt, "quantize (whole call)", "reference", _median_s(encode, reps), x.numel() * 2,
                         None))
        rows.append(_row(mib, fmt, "dequantize bf16", "reference", _median_s(decode, reps), x.numel() * 2, None))
    return rows


def _print_table(report: dict[str, Any]) -> None:
    exact = sum(v["bit_exact"] for v in report["verify"])
    print(f"device: {report['device']}; torch {report['torch']}; instruction sets {', '.join(report['isas'])}")
    print(f"bit-exact vs reference: {exact}/{len(report['verify'])} (instruction set, input, format) checks\n")
    print("| bf16 MiB | format | op | impl | ms | GB/s | % of copy |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: |")
    for r in report["results"]:
        pct = "-" if r["pct_of_copy"] is None else f"{r['pct_of_copy']:.0f}%"
        print(f"| {r['size_mib']:g} | {r['fmt']} | {r['op']} | {r['impl']} | {r['ms']:.2f} | {r['gb_per_s']:.2f} | "
              f"{pct} |")

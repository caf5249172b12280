"""FP4 on the MLA latent stream: DeepSeek-V3's one 576-wide latent a token and layer (kv_lora_rank 512 normalized
latent c, then 64 RoPE key dims k_pe; engram/presets.py deepseek-v3), stored as Engram stores it (a v2 block's
"latent" stream, groups along the entry).

error (CPU, the reference codecs, through the v2 block format): one full block (61 layers x 256 tokens x 576) of
random bf16 data, seeded: "gaussian" (N(0, 1) everywhere) and "outlier channels" (the same with 9 of the 576
channels, one in 64, scaled by 10: a stand-in for the channels a trained latent's norm gain makes large; not a
trained model's latent). Per codec and grouping axis: relative RMS error of the whole latent, of its other
("normal") channels, of c and of k_pe,
max abs error / amax, and the stored bytes per token of the block.

speed (GPU): runs of full blocks of that latent (17.98 MB of bf16 a block), moved as the put path moves them
(engram/codec/batched.py encode_streams: per run one amax reduction and one encode launch; what the writer runs)
and as the hit path does (decode_streams: one launch per run; what the loader runs), against a device-to-device
copy of the run's bf16 latent measured in the same run. Before timing, each codec's Triton encode of a run is
compared byte for byte with the reference's v2 blocks and its decode bit for bit with the reference's decode; a
mismatch is reported, not timed, and the script exits 1. Times are triton.testing.do_bench medians. GB/s = bytes
moved (the bf16 latent read or written, plus its stored payload) / time; "% of copy" compares that with the
copy's GB/s (2 x bf16 bytes); "time / copy" compares the times themselves.

  python -m benchmarks.latent_fp4 --json latent.json         # on the GPU: error, then speed (a few minutes)
  python -m benchmarks.latent_fp4 --error-only                # the error table alone, on the CPU
  python -m benchmarks.latent_fp4 --smoke                     # CPU, Triton interpreter, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch  # Triton is imported in _speed(), once TRITON_INTERPRET is settled

LATENT, RANK = 576, 512  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64
LAYERS, TOKENS = 61, 256
CODECS = ("nvfp4", "mxfp4", "fp8_e4m3")
_OUTLIERS = slice(5, None, 64)
_NORMAL = torch.ones(LATENT, dtype=torch.bool)
_NORMAL[_OUTLIERS] = False
PAYLOAD_BYTES = {"nvfp4": 1 / 2 + 1 / 16, "mxfp4": 1 / 2 + 1 / 32, "fp8_e4m3": 1.0}  # per element, scales included


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 56], help="blocks a run (speed)")
    p.add_argument("--error-only", action="store_true", help="the error table alone (CPU)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, kernels in Triton's interpreter")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, so before they are imported
    layers, tokens = (2, 32) if args.smoke else (LAYERS, TOKENS)
    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "torch": torch.__version__, "shape": [layers, tokens, LATENT]}
    report["error"] = _error(layers, tokens)
    _print_error(report["error"], layers, tokens)
    rc = 0
    if not args.error_only:
        if not args.smoke and not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, --error-only for the error table, or --smoke", file=sys.stderr)
            return 2
        rc = _speed(report, layers, tokens, [2] if args.smoke else args.blocks, args.smoke)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return rc


def _stream(codec: str, axis: str = "token") -> Any:
    from engram.layout import Axis, DType, StreamSpec

    return StreamSpec("latent", (LATENT,), DType.BF16, codec, Axis.CHANNEL if axis == "channel" else Axis.TOKEN)


def _data(layers: int, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(layers, tokens, LATENT, generator=g)
    outliers = gaussian.clone()
    outliers[..., _OUTLIERS] *= 10.0  # 9 of 576 channels, c's and k_pe's alike
    return {"gaussian": gaussian.bfloat16(), "outlier channels": outliers.bfloat16()}


def _error(layers: int, tokens: int) -> list[dict[str, Any]]:
    """Each codec (and nvfp4 along both axes) on each data set, through streamformat encode/decode."""
    from engram.codec import streamformat

    rows = []
    for name, x in _data(layers, tokens).items():
        for codec, axis in [("nvfp4", "token"), ("nvfp4", "channel"), ("mxfp4", "token"), ("fp8_e4m3", "token")]:
            blob = streamformat.encode({"latent": x}, (_stream(codec, axis),), tokens)
            y = streamformat.decode(blob)["latent"].double()
            want = x.double()
            err = y - want

            def rel(sl: slice | torch.Tensor, err: torch.Tensor = err, want: torch.Tensor = want) -> float:
                return float(err[..., sl].pow(2).mean().sqrt() / want[..., sl].pow(2).mean().sqrt())

            rows.append({"data": name, "codec": codec, "axis": axis, "rel_rms": rel(slice(None)),
                         "rel_rms_normal": rel(_NORMAL), "rel_rms_c": rel(slice(0, RANK)),
                         "rel_rms_k_pe": rel(slice(RANK, None)),
                         "max_abs_over_amax": float(err.abs().max() / want.abs().max()),
                         "bytes_per_token": len(blob) / tokens, "bf16_bytes_per_token": layers * LATENT * 2})
    return rows


def _print_error(rows: list[dict[str, Any]], layers: int, tokens: int) -> None:
    print(f"latent ({layers} layers x {tokens} tokens x {LATENT}), bf16 {layers * LATENT * 2} bytes/token\n")
    print("| data | codec | groups along | rel. RMS | normal channels | c (512) | k_pe (64) | max abs err / amax | "
          "bytes/token |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['data']} | {r['codec']} | {r['axis']} | {r['rel_rms']:.4f} | {r['rel_rms_normal']:.4f} | "
              f"{r['rel_rms_c']:.4f} | "
              f"{r['rel_rms_k_pe']:.4f} | {r['max_abs_over_amax']:.4f} | {r['bytes_per_token']:,.1f} |")
    print()


def _speed(report: dict[str, Any], layers: int, tokens: int, runs: list[int], smoke: bool) -> int:
    import triton

    from benchmarks.codec_speed import _cpu_ms, _gpu_ms
    from engram.codec import batched, streamformat

    device = "cpu" if smoke else "cuda"
    bench: Callable[[Callable[[], object]], float] = _cpu_ms if smoke else _gpu_ms
    report["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    report["triton"] = triton.__version__
    report["verify"], report["speed"] = [], []
    plans = {c: batched.streams_plan((_stream(c),), layers, tokens) for c in CODECS}
    bad = {c for c in CODECS if not _verify(plans[c], layers, tokens, device, report["verify"])}
    for n in runs:
        copy_gbps = _time_run(n, layers, tokens, device, plans, bad, bench, report["speed"])
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{n} blocks done (copy {copy_gbps:.0f} GB/s)", file=sys.stderr)
    _print_speed(report, streamformat.plan((_stream("nvfp4"),), layers, tokens).nbytes)
    if bad:
        print(f"NOT BIT-EXACT: {sorted(bad)}", file=sys.stderr)
        return 1
    return 0


def _time_run(n: int, layers: int, tokens: int, device: str, plans: dict[str, Any], bad: set[str],
              bench: Callable[[Callable[[], object]], float], rows: list[dict[str, Any]]) -> float:
    """The rows of one run of n blocks: the copy, then each codec's encode and decode. Returns the copy's GB/s."""
    from engram.codec import batched

    x = torch.randn(n, layers, tokens, LATENT, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    elems = x.numel()
    copy_gbps = 4 * elems / copy_ms / 1e6
    rows.append(_row(n, "bf16", "copy", copy_ms, 4 * elems, copy_gbps, copy_ms))
    for codec in CODECS:
        if codec in bad:
            continue
        plan = plans[codec]
        step = -(-plan.nbytes // 256) * 256
        dst = torch.zeros(n * step, dtype=torch.uint8, device=device)
        offsets = torch.arange(n, device=device, dtype=torch.int64) * step
        listed = offsets.tolist()
        moved = elems * (2 + PAYLOAD_BYTES[codec])

        def encode(plan: Any = plan, dst: torch.Tensor = dst, offsets: torch.Tensor = offsets) -> object:
            return batched.encode_streams([x], plan, dst, offsets, backend="triton")

        def decode(plan: Any = plan, dst: torch.Tensor = dst, offsets: torch.Tensor = offsets,
                   listed: list[int] = listed) -> object:
            return batched.decode_streams(dst, listed, offsets, plan, backend="triton")

        rows.append(_row(n, codec, "encode (put path)", bench(encode), moved, copy_gbps, copy_ms))
        rows.append(_row(n, codec, "decode (hit path)", bench(decode), moved, copy_gbps, copy_ms))
    return copy_gbps


def _verify(plan: Any, layers: int, tokens: int, device: str, out: list[dict[str, Any]]) -> bool:
    """The Triton encode of two blocks against the reference's v2 blocks (payload bytes), and its decode against
    the reference's decode (bits)."""
    from engram.codec import batched, streamformat

    g = torch.Generator().manual_seed(7)
    stream = plan.fmt.parts[0]
    x = (torch.randn(2, layers, tokens, LATENT, generator=g) * 3).bfloat16()
    x[0, :, :, 5::64] *= 40.0
    x[1, 0] = 0.0  # a layer of zeros
    spec = _stream(stream.codec.name)
    blobs = [streamformat.encode({"latent": x[b]}, (spec,), tokens) for b in range(2)]
    step = -(-plan.nbytes // 256) * 256
    dst = torch.zeros(2 * step, dtype=torch.uint8, device=device)
    offsets = torch.arange(2, device=device, dtype=torch.int64) * step
    flagged = bool(batched.encode_streams([x.to(device)], plan, dst, offsets, backend="triton"))
    head = len(streamformat.unsealed_header(plan.fmt))
    got = bytes(dst.cpu().numpy())
    same_bytes = not flagged and all(got[b * step + head : b * step + len(blob)] == blob[head:]
                                     for b, blob in enumerate(blobs))
    src = torch.frombuffer(bytearray(b"".join(blob + bytes(step - len(blob)) for blob in blobs)),
                           dtype=torch.uint8).to(device)
    decoded = batched.decode_streams(src, offsets.tolist(), offsets, plan, backend="triton")[0].cpu()
    want = torch.stack([streamformat.decode(blob)["latent"] for blob in blobs])
    same_bits = torch.equal(decoded.view(torch.int16), want.view(torch.int16))
    out.append({"codec": stream.codec.name, "encode_bytes_identical": same_bytes, "decode_bits_identical": same_bits})
    return same_bytes and same_bits


def _row(blocks: int, codec: str, op: str, ms: float, moved: float, copy_gbps: float, copy_ms: float
         ) -> dict[str, Any]:
    gbps = moved / ms / 1e6
    return {"blocks": blocks, "codec": codec, "op": op, "ms": ms, "bytes_moved": moved, "gb_per_s": gbps,
            "pct_of_copy": 100 * gbps / copy_gbps, "time_over_copy": ms / copy_ms}


def _print_speed(report: dict[str, Any], block_nbytes: int) -> None:
    print(f"device: {report['device']}; torch {report['torch']}, triton {report['triton']}")
    exact = [v for v in report["verify"] if v["encode_bytes_identical"] and v["decode_bits_identical"]]
    print(f"bit-exact vs reference: {len(exact)}/{len(report['verify'])} codecs; nvfp4 block {block_nbytes} bytes\n")
    print("| blocks | bf16 MiB | codec | op | ms | GB/s | % of copy | time / copy |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    shape = report["shape"]
    for r in report["speed"]:
        mib = r["blocks"] * shape[0] * shape[1] * shape[2] * 2 / 2**20
        print(f"| {r['blocks']} | {mib:,.0f} | {r['codec']} | {r['op']} | {r['ms']:.4f} | {r['gb_per_s']:.0f} | "
              f"{r['pct_of_copy']:.0f}% | {r['time_over_copy']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())

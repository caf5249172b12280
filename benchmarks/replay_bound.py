"""What exact bounded replay costs, next to a full prefill, as the context grows.

A hybrid decoder with realistic shapes for a small model (16 layers alternating sliding/global as in gpt-oss,
d_model 2048, 16 query heads and 4 KV heads of 128, SwiGLU 8192, W = 128, bf16, FAST numerics: cuBLAS and
scaled_dot_product_attention) prefills P tokens; then the SWA window is rebuilt from the tokens and the stored
global KV by an exact replay (R = L_swa * (W - 1) = 8 * 127 = 1016 tokens), flat and cone, and by an approx
replay (k = 1, R = W). Per context it reports the median times; the time to load the same window from pinned
host memory instead (the alternative to replaying); the errors: the bf16 replay against the bf16 prefill, and,
against a float32 run of the same (bf16-valued) weights, both the bf16 prefill and the bf16 replay (if the two
are alike, the replay is as good as a prefill: what differs is bf16 rounding, which the CPU float64 tests rule
out as the source of any replay error) and a float32 replay (a full-size check of the replay logic, the chunked
prefill attention included); and analytic FLOPs split into the
part fixed by R and W (projections, MLP, sliding attention) and the part that grows with P (the replayed
queries of the global layers attend over all P stored keys). So replay time is NOT flat in P: it is flat plus
a term linear in P, small next to the prefill's, which grows quadratically. A bf16 GEMM measured in the same
run is the compute ceiling.

  python benchmarks/replay_bound.py --out replay.json     # on the GPU (under a minute on an H200)
  python benchmarks/replay_bound.py --smoke               # tiny sizes on the CPU (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from engram.replay import (
    AttentionKind,
    HybridConfig,
    HybridDecoder,
    Numerics,
    ReplayMode,
    exact_bound,
    gpt_oss_pattern,
    reconstruct_swa,
    window_error,
)

FULL = {"layers": gpt_oss_pattern(16), "window": 128, "vocab_size": 32_000, "d_model": 2048, "n_heads": 16,
        "n_kv_heads": 4, "head_dim": 128, "d_ff": 8192, "dtype": torch.bfloat16}
SMOKE = {"layers": gpt_oss_pattern(4), "window": 16, "vocab_size": 256, "d_model": 64, "n_heads": 4,
         "n_kv_heads": 2, "head_dim": 16, "d_ff": 128, "dtype": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = _median_s(lambda: a @ b, device, repeats=10, warmup=3)
    return 2 * n**3 / s / 1e12


def _h2d_ms(nbytes: int, device: torch.device) -> float | None:
    """Copy nbytes from pinned host memory to the GPU: what persisting the SWA window would cost to resume."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _median_s(lambda: dst.copy_(src, non_blocking=True), device, repeats=20, warmup=3) * 1e3


def _replay_flops(cfg: HybridConfig, starts: tuple[int, ...], p: int) -> tuple[float, float]:
    """(FLOPs fixed by R and W, FLOPs that grow with P) of a replay whose layer l reads rows [starts[l], P)."""
    d, hd, h, kvh = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    fixed = grows = 0.0
    for layer, kind in enumerate(cfg.layers):
        rows_in, rows_out = p - starts[layer], p - starts[layer + 1]
        fixed += 2 * rows_out * (2 * d * h * hd + 3 * d * cfg.d_ff)  # q, o, gate, up, down
        if kind is AttentionKind.SLIDING:
            fixed += 2 * rows_in * 2 * d * kvh * hd  # k, v projections (global layers read them from storage)
            fixed += 4 * rows_out * cfg.window * h * hd  # QK^T and PV over W keys
        else:
            grows += 4 * rows_out * p * h * hd  # each replayed query attends over ~P stored keys
    return fixed, grows


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shape = SMOKE if args.smoke else FULL
    cfg = HybridConfig(**shape, seed=0)
    t0 = time.perf_counter()
    model = HybridDecoder(cfg, device=device, numerics=Numerics.FAST)
    init_s = time.perf_counter() - t0
    spec = model.replay_spec
    ceiling = _gemm_tflops(device, cfg.dtype, 256 if args.smoke else 8192)
    ref_model = None
    if not args.no_fp32_check:  # the same weights (bf16 values) computed in float32
        ref_model = HybridDecoder(replace(cfg, dtype=torch.float32), device=device, numerics=Numerics.FAST)
        ref_model.load_state_dict(model.state_dict())
    rows = []
    for p in args.contexts:
        tokens = torch.randint(0, cfg.vocab_size, (p,), generator=torch.Generator().manual_seed(p))
        pre = model.prefill(tokens, logits=False)
        stored, ref = pre.stored_global_kv(p), pre.swa_window(p)
        prefill_s = _median_s(lambda t=tokens: model.prefill(t, logits=False), device, args.prefill_repeats)
        del pre
        window_bytes = sum(k.nbytes + v.nbytes for k, v in ref.kv)
        row: dict[str, Any] = {"context": p, "prefill_ms": prefill_s * 1e3, "window_bytes": window_bytes,
                               "load_window_ms": _h2d_ms(window_bytes, device)}
        if ref_model is not None:
            pre32 = ref_model.prefill(tokens, logits=False)
            ref32 = pre32.swa_window(p)
            rec32 = reconstruct_swa(ref_model, tokens, pre32.stored_global_kv(p))
            bf16_replay = reconstruct_swa(model, tokens, stored).window
            row["fp32_check"] = {"fp32_replay_vs_fp32_prefill": window_error(rec32.window, ref32),
                                 "bf16_prefill_vs_fp32": window_error(ref, ref32),
                                 "bf16_replay_vs_fp32": window_error(bf16_replay, ref32)}
            del pre32, ref32, rec32, bf16_replay
        for name, mode, cone in (("exact_flat", ReplayMode.exact(), False), ("exact_cone", ReplayMode.exact(), True),
                                 ("approx1_cone", ReplayMode.approx(1), True)):
            rec = reconstruct_swa(model, tokens, stored, mode, cone=cone)
            secs = _median_s(lambda m=mode, c=cone, t=tokens, s=stored: reconstruct_swa(model, t, s, m, cone=c),
                             device, args.replay_repeats)
            fixed, grows = _replay_flops(cfg, rec.starts, p)
            row[name] = {"ms": secs * 1e3, "replayed": rec.replayed, "token_layers": rec.token_layers,
                         "rel_error": window_error(rec.window, ref), "gflop_fixed": fixed / 1e9,
                         "gflop_grows_with_p": grows / 1e9, "tflops": (fixed + grows) / secs / 1e12}
        rows.append(row)
        del stored, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "benchmark": "replay_bound", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "smoke": args.smoke,
        "config": json.loads(cfg.to_json()), "exact_bound": exact_bound(spec), "init_s": init_s,
        "gemm_ceiling_tflops": ceiling, "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"Replay cost on {result['device']} (torch {result['torch']}): {len(cfg['layers'])} layers, "
        f"d_model {cfg['d_model']}, W {cfg['window']}, {cfg['dtype']}; exact R = {result['exact_bound']}; "
        f"{cfg['dtype']} GEMM ceiling {result['gemm_ceiling_tflops']:.3g} TFLOP/s.",
        "",
        "| context | prefill ms | exact flat ms | exact cone ms | approx k=1 ms | load window ms "
        "| cone/flat token-layers | GFLOP fixed / grows-with-P (cone) | cone TFLOP/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        f, c, a = r["exact_flat"], r["exact_cone"], r["approx1_cone"]
        load = "n/a" if r["load_window_ms"] is None else f"{r['load_window_ms']:.3f}"
        lines.append(f"| {r['context']} | {r['prefill_ms']:.1f} | {f['ms']:.2f} | {c['ms']:.2f} | {a['ms']:.2f} "
                     f"| {load} | {c['token_layers']}/{f['token_layers']} | {c['gflop_fixed']:.3g} / "
                     f"{c['gflop_grows_with_p']:.3g} | {c['tflops']:.3g} |")
    lines += ["", "Errors (max |diff| / max |reference| over the rebuilt window):", "",
              "| context | exact cone vs prefill | approx k=1 vs prefill | prefill vs fp32 | replay vs fp32 "
              "| fp32 replay vs fp32 prefill |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["rows"]:
        chk = r.get("fp32_check")
        extra = (f"{chk['bf16_prefill_vs_fp32']:.2g} | {chk['bf16_replay_vs_fp32']:.2g} | "
                 f"{chk['fp32_replay_vs_fp32_prefill']:.2g}") if chk else "- | - | -"
        lines.append(f"| {r['context']} | {r['exact_cone']['rel_error']:.2g} | {r['approx1_cone']['rel_error']:.2g} "
                     f"| {extra} |")
    first, last = result["rows"][0], result["rows"][-1]
    growth = last["exact_cone"]["ms"] / first["exact_cone"]["ms"]
    lines += ["", f"Exact cone replay at {last['context']} tokens takes {growth:.2f}x its time at "
              f"{first['context']}; the prefill takes {last['prefill_ms'] / first['prefill_ms']:.1f}x. "
              f"The SWA window is {first['window_bytes'] / 2**20:.2f} MiB."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", help="prefix lengths P (default 4096 16384 65536)")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--replay-repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny model and contexts on the CPU")
    p.add_argument("--no-fp32-check", action="store_true", help="skip the float32 reference runs")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.contexts is None:
        args.contexts = [128, 256, 512] if args.smoke else [4096, 16384, 65536]
    if args.smoke:
        args.prefill_repeats, args.replay_repeats = 1, 2
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    with torch.inference_mode():
        result = run(args)
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels against the reference codecs on the same inputs, bit for bit: code bytes, scale bytes,
tensor scales and the bits of the decoded values.

On the CPU the kernels run in Triton's interpreter. Triton chooses interpreter or compiler when a kernel is
decorated, i.e. when engram.kernels.fp4 is first imported, from TRITON_INTERPRET. So this module sets
TRITON_INTERPRET=1 before importing the kernels when there is no CUDA device, and the CPU tests run in this
process. Where that is impossible (CUDA is present and the kernels are compiled for the GPU tests, or another
module imported the kernels before this one without the variable), the CPU tests are skipped here and
test_cpu_tests_in_subprocess runs them in a fresh process with TRITON_INTERPRET=1, failing if any fails.

Inputs are fresh random draws every run; the seed is in each failure message (set ENGRAM_TEST_SEED to replay).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import missing

if importlib.util.find_spec("triton") is None:  # a declared test dependency: fails, unless ENGRAM_TESTS_WITHOUT names it
    missing("triton", "the kernels' tests need it (pip install -e '.[dev]' or '.[kernels]')")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import engram.codec as codec
from engram.codec import fp4_reference as ref
from engram.kernels import fp4

SEED = int(os.environ.get("ENGRAM_TEST_SEED", random.SystemRandom().randrange(2**31)))
FORMATS = sorted(ref.CODECS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["gaussian", "student_t", "cauchy", "outlier_channels", "ties", "tiny", "zero_rows", "huge"]

cpu = pytest.mark.skipif(not fp4.INTERPRETED, reason="kernels are compiled in this process; "
                         "test_cpu_tests_in_subprocess runs the CPU tests in interpreter mode")


def on_gpu(test):  # type: ignore[no-untyped-def]
    """A GPU test: skipped, saying why, without a CUDA device or with interpreted kernels."""
    for mark in (pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: run on a GPU"),
                 pytest.mark.skipif(fp4.INTERPRETED, reason="TRITON_INTERPRET is set: GPU tests need compiled kernels")):
        test = mark(test)
    return test


# --- inputs -------------------------------------------------------------------------------------------


def sample(kind: str, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """(rows, cols) float32 of one kind."""
    x = torch.randn(rows, cols, generator=g)
    if kind == "student_t":  # 3 degrees of freedom: z / sqrt(chi2_3 / 3)
        chi2 = (torch.randn(3, rows, cols, generator=g) ** 2).sum(0)
        x = x / (chi2 / 3).sqrt()
    elif kind == "cauchy":
        x = torch.empty(rows, cols).cauchy_(generator=g).clamp(-1e4, 1e4)
    elif kind == "outlier_channels":
        x[:, ::37] *= 100.0
        x[:, 5] *= 1000.0
    elif kind == "ties":
        # E2M1 tie points and values times 2^k, with 6 * 2^k at every 16th element: the MXFP4 scale is then
        # exactly 2^k, so q lands on the ties themselves; NVFP4 sees them with tensor_scale=1 (ties test).
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 6.5])
        x = grid[torch.randint(len(grid), (rows, cols), generator=g)]
        x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
        x[:, ::16] = 6.0
        x = x * torch.exp2(torch.randint(-9, 9, (rows, 1), generator=g).float())
    elif kind == "tiny":  # float32 subnormals (flushed), E4M3 scale floor, E8M0 codes near 0
        x = x * torch.exp2(torch.randint(-135, -115, (rows, 1), generator=g).float())
    elif kind == "zero_rows":
        x[::2] = 0.0
        x[:, 16:48] = 0.0
    elif kind == "huge":
        x = x * torch.exp2(torch.randint(90, 126, (rows, 1), generator=g).float())
    return x


def matrix(kind: str, rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "mixed":  # a band of rows of every kind
        x = torch.cat([sample(k, -(-rows // len(KINDS)), cols, g) for k in KINDS])[:rows]
    else:
        x = sample(kind, rows, cols, g)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)  # float16 has no room for "huge"
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a, b = bits(got), bits(want)
    if not torch.equal(a, b):
        where = (a != b).nonzero().flatten()
        raise AssertionError(f"{what}: {where.numel()} of {a.numel()} bytes differ (first at byte {int(where[0])}: "
                             f"{int(a[where[0]]):#04x} != {int(b[where[0]]):#04x}); seed {SEED}")


def check(fmt: str, x: torch.Tensor, config: fp4.KernelConfig | None = None,
          out_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,), **options: object) -> None:
    """Quantize and dequantize x with both backends (the kernels with `config`, else their defaults);
    everything must match bit for bit."""
    rq, rd = ref.CODECS[fmt]
    kq, kd = fp4.CODECS[fmt]
    if config is not None:
        options["config"] = config
    want, got = rq(x, **{k: v for k, v in options.items() if k != "config"}), kq(x, **options)
    what = f"{fmt} {config} {x.dtype} {tuple(x.shape)}"
    for field in ("codes", "scales", "tensor_scale", "scale"):
        if hasattr(want, field):
            assert_same(getattr(got, field), getattr(want, field), f"{what} {field}")
    assert got.shape == want.shape
    for out in out_dtypes:
        decoded = kd(want, out) if config is None else kd(want, out, config=config)
        assert_same(decoded, rd(want, out), f"{what} decoded to {out}")


# --- CPU, through the interpreter ---------------------------------------------------------------------


@cpu
@pytest.mark.parametrize("config", fp4.CONFIGS, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_config_matches_reference(fmt: str, config: fp4.KernelConfig) -> None:
    # 200 columns: NVFP4 pads to 208, MXFP4 to 224; 40 rows leave the last tile part-empty for every config.
    check(fmt, matrix("mixed", 40, 200, torch.bfloat16, SEED + 1), config)


@cpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_distributions_match_reference(fmt: str, kind: str) -> None:
    check(fmt, matrix(kind, 48, 256, torch.bfloat16, SEED + 2))


@cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_input_and_output_dtypes_match_reference(fmt: str, dtype: torch.dtype) -> None:
    x = matrix("mixed", 32, 160, dtype, SEED + 3)
    if dtype != torch.float16:
        x = x.clamp(-6e4, 6e4)  # decoded to float16 below
    check(fmt, x, out_dtypes=(torch.float32, torch.bfloat16, torch.float16))


@cpu
@pytest.mark.parametrize("shape", [(1, 1), (1, 17), (3, 33), (7, 100), (65, 64)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_shapes_match_reference(fmt: str, shape: tuple[int, int]) -> None:
    check(fmt, matrix("gaussian", *shape, torch.float32, SEED + 4))


@cpu
def test_exact_ties_match_reference() -> None:
    x = matrix("ties", 64, 256, torch.float32, SEED + 5)
    check("mxfp4", x)
    check("mxfp4", x, round_up=True)
    check("nvfp4", x, tensor_scale=1.0)  # group scales 2^k exactly: q hits the ties
    e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    x8 = torch.cat([mids, -mids, torch.tensor([460.0, 1e4])]).view(1, -1)
    check("fp8_e4m3", x8, scale=1.0)
    got = fp4.quantize_fp8_e4m3(x8, scale=1.0).codes
    assert_same(got, x8.to(torch.float8_e4m3fn).view(torch.uint8), "fp8 codes vs torch's cast")


@cpu
def test_e2m1_rounding_grid_matches_reference() -> None:
    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    near = torch.cat([points, torch.nextafter(points, torch.zeros(1)), torch.nextafter(points, torch.full((1,), 8.0))])
    q = torch.cat([near, torch.linspace(0, 7.99, 31 * 64 - near.numel())])
    x = torch.cat([q.view(-1, 31), torch.full((64, 1), 4.0)], dim=1)  # scale 2^0: codes are the rounding itself
    want = ref.quantize_mxfp4(x)
    assert torch.equal(want.scales, torch.full_like(want.scales, 127))
    check("mxfp4", x)


@cpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", ["default", "option"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises(fmt: str, variant: str, bad: float) -> None:
    """Both detection paths: the amax pass, and the kernels' NaN marks (a given scale, or MXFP4)."""
    quantize, _ = fp4.CODECS[fmt]
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    x[5, 40] = bad
    x[6, 3] = -bad
    option = {"nvfp4": {"tensor_scale": 1.0}, "fp8_e4m3": {"scale": 1.0}, "mxfp4": {"round_up": True}}[fmt]
    options = option if variant == "option" else {}
    with pytest.raises(ValueError, match="x: 2 of 512 values are NaN or Inf"):
        quantize(x, **options)


@cpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 17, 255])
def test_kv_block_triton_backend_matches_reference(fmt: str, tokens: int) -> None:
    g = torch.Generator().manual_seed(SEED + 6)
    kv = torch.randn(1, 2, tokens, 2, 16, generator=g).to(torch.bfloat16)
    want = codec.quantize_kv_block(kv, fmt)
    got = codec.quantize_kv_block(kv, fmt, backend="triton")
    assert codec.to_bytes(got) == codec.to_bytes(want), f"seed {SEED}"
    assert_same(codec.dequantize_kv_block(want, torch.bfloat16, backend="triton"),
                codec.dequantize_kv_block(want, torch.bfloat16), f"{fmt} T={tokens} decoded")


def _stored_blocks(fmt: str, shape: tuple[int, ...], n: int, device: str, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """n random blocks encoded as v1 blocks by the reference, laid at uneven offsets of one uint8 buffer (as in
    a pool): (buffer, int64 offsets, the blocks' reference decodes)."""
    from engram.codec import blockformat
    from engram.codec.base import codec_by_name

    g = torch.Generator().manual_seed(seed)
    blobs, want = [], []
    for _ in range(n):
        kv = (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 4).to(torch.bfloat16)
        blob = blockformat.encode(kv, codec_by_name(fmt))
        blobs.append(blob)
        want.append(blockformat.decode(blob))
    buf, offsets, at = bytearray(), [], 3  # odd offsets: the kernels may not assume alignment
    for blob in blobs:
        buf += b"\x5a" * (at - len(buf)) + blob
        offsets.append(at)
        at = len(buf) + 37
    src = torch.frombuffer(buf, dtype=torch.uint8).to(device)
    return src, torch.tensor(offsets, dtype=torch.int64, device=device), want


def check_batched(fmt: str, shape: tuple[int, ...], n: int, device: str, seed: int) -> None:
    from engram.codec import batched
    from engram.layout import DType

    src, offsets, want = _stored_blocks(fmt, shape, n, device, seed)
    plan = batched.plan(fmt, DType.BF16, shape)
    k, v = batched.decode_blocks(src, offsets, plan, backend="triton")
    for b in range(n):
        assert_same(k[b].cpu(), want[b][:, 0], f"{fmt} block {b} K (batched)")
        assert_same(v[b].cpu(), want[b][:, 1], f"{fmt} block {b} V (batched)")


@cpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_decode_of_blocks_at_offsets_matches_reference(fmt: str) -> None:
    check_batched(fmt, (2, 2, 32, 2, 32), 3, "cpu", SEED + 11)


def check_batched_streams(widths: tuple[int, int, int], layers: int, tokens: int, n: int, device: str, seed: int) -> None:
    """A stream layout's v2 blocks (a latent per token, indexer keys compressed 4:1, K grouped per channel, a raw
    stream) decoded and encoded by the batched kernels, one launch per stream and run: identical bits and bytes to
    the reference, at uneven offsets (as in a pool) and evenly spaced ones (a staging buffer)."""
    from engram.codec import batched, streamformat
    from engram.layout import Axis, DType, StreamSpec

    latent, index, heads = widths
    streams = (StreamSpec("latent", (latent,), DType.BF16, "nvfp4"),
               StreamSpec("index_k", (index,), DType.BF16, "fp8_e4m3", compress=4),
               StreamSpec("k", (heads, 32), DType.FP16, "mxfp4", Axis.CHANNEL),
               StreamSpec("exact", (3,), DType.FP32, "raw"))
    g = torch.Generator().manual_seed(seed)
    datas = [{s.name: (torch.randn(layers, s.entries(tokens), *s.shape, generator=g) * 3).to(s.dtype.torch_dtype)
              for s in streams} for _ in range(n)]
    blobs = [streamformat.encode(d, streams, tokens) for d in datas]
    plan = batched.streams_plan(streams, layers, tokens)
    step = -(-plan.nbytes // 256) * 256
    for offsets in ([3 + i * (plan.nbytes + 37) for i in range(n)], [i * step for i in range(n)]):
        buf = bytearray(offsets[-1] + plan.nbytes)
        for off, blob in zip(offsets, blobs, strict=True):
            buf[off : off + len(blob)] = blob
        src = torch.frombuffer(buf, dtype=torch.uint8).to(device)
        dev_offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        got = batched.decode_streams(src, offsets, dev_offsets, plan, backend="triton")
        for b, blob in enumerate(blobs):
            want = streamformat.decode(blob)
            for s, part in zip(streams, got, strict=True):
                assert_same(part[b].cpu(), want[s.name], f"stream {s.name} block {b} (batched, offsets {offsets[:2]})")
    dst = torch.full((n * step,), 0xA5, dtype=torch.uint8, device=device)  # a staging buffer used before
    stacked = [torch.stack([d[s.name] for d in datas]).to(device) for s in streams]
    bad = batched.encode_streams(stacked, plan, dst, torch.arange(n, device=device) * step, backend="triton")
    assert not bool(bad)
    head = len(streamformat.unsealed_header(plan.fmt))
    for b, blob in enumerate(blobs):
        got_bytes = bytes(dst[b * step : b * step + len(blob)].cpu().numpy())
        assert got_bytes[head:] == blob[head:], f"block {b}: batched encode differs from the reference"
        assert got_bytes[:head] == streamformat.unsealed_header(plan.fmt)


@cpu
def test_batched_streams_match_reference() -> None:
    check_batched_streams((80, 32, 2), 2, 32, 3, "cpu", SEED + 13)


@pytest.mark.skipif(fp4.INTERPRETED, reason="the CPU tests ran in this process, in interpreter mode")
def test_cpu_tests_in_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
           "-m", "not gpu", "-k", "not test_cpu_tests_in_subprocess"]
    run = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary  # they ran, none skipped


# --- GPU: every configuration, larger inputs ----------------------------------------------------------


@on_gpu
def test_gpu_batched_streams_of_deepseek_widths_match_reference() -> None:
    check_batched_streams((576, 128, 8), 4, 256, 5, "cuda", SEED + 17)


@on_gpu
@pytest.mark.parametrize("config", fp4.CONFIGS, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_every_config_matches_reference(fmt: str, config: fp4.KernelConfig) -> None:
    x = matrix("mixed", 2048, 4112, torch.bfloat16, SEED + 7).cuda()  # 8.4M elements; MXFP4 pads 4112 -> 4128
    check(fmt, x, config, out_dtypes=(torch.bfloat16, torch.float32))


@on_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_distributions_and_dtypes_match_reference(fmt: str, dtype: torch.dtype, kind: str) -> None:
    x = matrix(kind, 1024, 2048, dtype, SEED + 8).cuda()
    check(fmt, x, out_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if kind == "ties":
        check("mxfp4", x, round_up=True)
        check("nvfp4", x.float(), tensor_scale=1.0)


@on_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_integer_bf16_rounding_matches_reference(fmt: str) -> None:
    """The interpreter's bf16 path (integer rounding) on the GPU too; the native cvt is the default there."""
    x = matrix("mixed", 1024, 2048, torch.bfloat16, SEED + 10).cuda()
    q = ref.CODECS[fmt][0](x)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    if fmt == "nvfp4":
        fp4.dequantize_nvfp4_into(q.codes, q.scales, q.tensor_scale, out, native_bf16=False)
    elif fmt == "mxfp4":
        fp4.dequantize_mxfp4_into(q.codes, q.scales, out, native_bf16=False)
    else:
        fp4.dequantize_fp8_e4m3_into(q.codes, q.scale, out, native_bf16=False)
    assert_same(out, ref.CODECS[fmt][1](q, torch.bfloat16), f"{fmt} integer-rounded bf16")


@on_gpu
def test_gpu_reference_is_device_independent() -> None:
    x = matrix("mixed", 512, 1000, torch.bfloat16, SEED + 9)
    for fmt, (quantize, dequantize) in ref.CODECS.items():
        on_cpu, on_gpu = quantize(x), quantize(x.cuda())
        for field in ("codes", "scales", "tensor_scale", "scale"):
            if hasattr(on_cpu, field):
                assert_same(getattr(on_gpu, field).cpu(), getattr(on_cpu, field), f"{fmt} {field}")
        assert_same(dequantize(on_gpu, torch.bfloat16).cpu(), dequantize(on_cpu, torch.bfloat16), f"{fmt} decoded")



@on_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_batched_decode_matches_reference(fmt: str) -> None:
    """Llama-3-8B-shaped blocks of 64 tokens (32 layers, 8 KV heads x 128) at uneven offsets."""
    check_batched(fmt, (32, 2, 64, 8, 128), 5, "cuda", SEED + 12)

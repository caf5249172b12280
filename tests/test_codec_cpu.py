"""The cpu codec backend (engram.codec.cpu, C in engram/codec/_cpu*.c) against the PyTorch reference: the same code
bytes, scale bytes, tensor scales and decoded bits for every format, input and output dtype, strided view and
KV axis, with both compiled instruction sets; the same errors; the GIL released while it loops."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engram.codec as codec
from engram.codec import base, batched, stored
from engram.codec import fp4_reference as ref
from engram.layout import DType

from helpers import missing

# The extension is compiled by every install (pyproject.toml's ext-modules; `make test` installs with it): a tree
# without it fails this file unless ENGRAM_TESTS_WITHOUT names it, and one that does not import fails it too.
if importlib.util.find_spec("engram.codec._cpu") is None:
    missing("engram.codec._cpu", "the C codec extension, compiled by `pip install -e .`")
from engram.codec import _cpu, cpu

FORMATS = ("nvfp4", "mxfp4", "fp8_e4m3")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = [isa for isa in ("baseline", "avx2") if isa == "baseline" or _cpu.isa() == "avx2"]
E2M1_POINTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.fixture(params=ISAS, autouse=True)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs on each instruction set this build and CPU have: both must give the reference's bytes."""
    before = _cpu.isa()
    _cpu.use_isa(request.param)
    yield request.param
    _cpu.use_isa(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integers of the same width (so -0.0 != 0.0 and NaN == NaN)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


def assert_same_payload(got: ref.Payload, want: ref.Payload) -> None:
    assert type(got) is type(want) and got.shape == want.shape
    assert torch.equal(got.codes, want.codes), f"{int((got.codes != want.codes).sum())} code bytes differ"
    if not isinstance(got, ref.FP8Tensor):
        assert isinstance(want, type(got))
        assert torch.equal(got.scales, want.scales), f"{int((got.scales != want.scales).sum())} scales differ"
    for field in ("tensor_scale", "scale"):
        if hasattr(want, field):
            assert bits(getattr(got, field)).item() == bits(getattr(want, field)).item(), field
    assert got.to_bytes() == want.to_bytes()


def assert_same_decode(payload: ref.Payload, fmt: str) -> None:
    """The cpu decoder's bits equal the reference's, to every output dtype, fresh and into a transposed out=."""
    _, rdeq = ref.CODECS[fmt]
    _, cdeq = cpu.CODECS[fmt]
    rows, cols = payload.shape
    for dtype in (*DTYPES, torch.float64):
        want = rdeq(payload, dtype)
        assert torch.equal(bits(cdeq(payload, dtype)), bits(want)), dtype
        out = torch.empty(cols, rows, dtype=dtype).t()  # rows adjacent in memory, as K's channel view
        assert cdeq(payload, dtype, out=out) is out
        assert torch.equal(bits(out), bits(want)), f"{dtype} into a transposed view"


def check_matrix(x: torch.Tensor, fmt: str, **kwargs: object) -> None:
    """x through both backends, as it is, as a transposed view and stacked as (blocks, rows, cols)."""
    rq, _ = ref.CODECS[fmt]
    cq, _ = cpu.CODECS[fmt]
    want = rq(x, **kwargs)
    assert_same_payload(cq(x, **kwargs), want)
    assert_same_payload(cq(x.t().contiguous().t(), **kwargs), want)  # strided rows: the channel-axis path
    if x.shape[0] % 2 == 0:
        assert_same_payload(cq(x.view(2, -1, x.shape[1]), **kwargs), want)
        assert_same_payload(cq(x.t().contiguous().t().unflatten(0, (2, -1)), **kwargs), want)
    assert_same_decode(want, fmt)


# --- properties ---------------------------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17e-38, 3e-38, -1e-9, *E2M1_POINTS, *E2M1_TIES,
           *(-v for v in E2M1_TIES), 448.0, 449.0, 65504.0, 65520.0, 1e30, -3e38]


@st.composite
def matrices(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    rows = draw(st.integers(1, 9))
    cols = draw(st.integers(1, 80))  # cols not a multiple of 16 or 32: padded groups
    seed = draw(st.integers(0, 2**31 - 1))
    exp = draw(st.integers(-130, 120))  # magnitudes from float32 subnormals to near the largest float
    dtype = draw(st.sampled_from(DTYPES))
    g = np.random.default_rng(seed)
    x = g.standard_normal((rows, cols)).astype(np.float32) * np.float32(2.0**exp / 4)
    x *= np.where(g.random((rows, 1)) < 0.2, 0.0, 1.0).astype(np.float32)  # all-zero rows
    special = g.random((rows, cols)) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    x[special] = g.choice(np.array(SPECIAL, dtype=np.float32), size=int(special.sum()))
    x[~np.isfinite(x)] = 0.0
    t = torch.from_numpy(x).to(dtype)
    t[~torch.isfinite(t)] = 0.0  # a value past fp16's range
    return t, seed


@settings(max_examples=120, deadline=None)
@given(case=matrices(), fmt=st.sampled_from(FORMATS))
def test_property_same_bytes_and_bits_as_the_reference(case: tuple[torch.Tensor, int], fmt: str) -> None:
    x, _ = case
    check_matrix(x, fmt)


@settings(max_examples=40, deadline=None)
@given(case=matrices(), exp=st.integers(-116, 116))
def test_property_given_tensor_scales(case: tuple[torch.Tensor, int], exp: int) -> None:
    """A caller's tensor scale (a layer's, say), any power of two or not, in range."""
    x, seed = case
    scale = 2.0**exp * (1.0 + (seed % 7) / 7)
    if ref.NVFP4_TENSOR_SCALE_RANGE[0] <= scale <= ref.NVFP4_TENSOR_SCALE_RANGE[1]:
        check_matrix(x, "nvfp4", tensor_scale=scale)
    if ref.FP8_SCALE_RANGE[0] <= scale <= ref.FP8_SCALE_RANGE[1]:
        check_matrix(x, "fp8_e4m3", scale=torch.tensor(scale))


@settings(max_examples=40, deadline=None)
@given(case=matrices())
def test_property_mxfp4_round_up(case: tuple[torch.Tensor, int]) -> None:
    check_matrix(case[0], "mxfp4", round_up=True)


# --- edge cases ---------------------------------------------------------------------------------------


def tie_values() -> torch.Tensor:
    """Every E2M1 value and tie point and their float32 neighbours."""
    points = np.array([*E2M1_POINTS, *E2M1_TIES, 6.5, 7.0, 100.0], dtype=np.float32)
    near = np.concatenate([np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))])
    return torch.from_numpy(np.concatenate([points, near, -points]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_at_every_e2m1_threshold(dtype: torch.dtype) -> None:
    """Groups whose scale is exactly 1, so every element lands on its tie point: NVFP4 with tensor scale 1 and
    group amax 6 (E4M3 scale 1), MXFP4 with amax in [4, 8) (E8M0 scale 2^0)."""
    v = tie_values()
    v = v[v.abs() <= 6.0]
    body = torch.cat([v, v.flip(0)])[: v.numel() // 15 * 15].view(-1, 15)
    nv = torch.cat([torch.full((body.shape[0], 1), 6.0), body], dim=1).to(dtype)  # groups of 16, amax 6
    want = ref.quantize_nvfp4(nv, tensor_scale=1.0)
    assert torch.equal(want.scales, torch.full_like(want.scales, 0x38))  # E4M3 1.0: the ties are exact
    check_matrix(nv, "nvfp4", tensor_scale=1.0)
    mx = torch.cat([nv, nv], dim=1)  # groups of 32, amax 6
    assert torch.equal(ref.quantize_mxfp4(mx).scales, torch.full((mx.shape[0], 1), 127, dtype=torch.uint8))
    check_matrix(mx, "mxfp4")
    check_matrix(nv, "fp8_e4m3", scale=1.0)  # and E4M3 rounding of the same points


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zeros_and_negative_values_that_round_to_zero(fmt: str, dtype: torch.dtype) -> None:
    x = torch.tensor([[-0.0, 0.0, -1e-4, 1e-4, -0.01, 0.2, -0.05, 4.0] * 4] * 2).to(dtype)
    check_matrix(x, fmt)
    if fmt != "fp8_e4m3":
        nibbles = cpu.CODECS[fmt][0](x).codes.flatten()[:4]
        assert [int(b) & 15 for b in nibbles] == [8, 8, 8, 8]  # -0.0, -1e-4, -0.01, -0.05: code 8 (-0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_subnormals_are_values(fmt: str) -> None:
    x = torch.tensor([[1e-45, -3e-45, 1e-41, -2.5e-39, 1.1e-38, 0.0, -0.0, 7e-39] * 4] * 4)
    check_matrix(x, fmt)
    check_matrix(x * torch.linspace(1, 2**20, 32), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_tensor_and_groups(fmt: str, dtype: torch.dtype) -> None:
    check_matrix(torch.zeros(4, 40, dtype=dtype), fmt)
    x = torch.randn(4, 64)
    x[:, 16:48] = 0.0
    x[1] = -0.0
    check_matrix(x.to(dtype), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("magnitude", [1e-38, 3e-35, 1e-32, 1e30, 3e38])
def test_tensor_scale_clamps(fmt: str, magnitude: float) -> None:
    """amax small or large enough that the NVFP4 and FP8 tensor scales meet their bounds, or just do not."""
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(3))
    x = (x / x.abs().max() * magnitude).float()
    check_matrix(x, fmt)
    check_matrix(x.to(torch.bfloat16), fmt)


def test_huge_mxfp4_scales_decode_past_fp16_and_float32() -> None:
    """E8M0 scales up to 2^127: decoded values overflow fp16 (and float32 at code 254 with a 6): Inf, as the
    reference's cast and product give."""
    x = torch.tensor([[3e38, -1e38, 2e5, 1.0] * 8, [65520.0, 65504.0, -7e4, 1e-3] * 8])
    check_matrix(x, "mxfp4")
    q = ref.MXFP4Tensor(torch.full((1, 16), 0x77, dtype=torch.uint8), torch.tensor([[254]], dtype=torch.uint8),
                        (1, 32))
    assert_same_decode(q, "mxfp4")


@pytest.mark.parametrize("cols", [1, 15, 17, 31, 33, 2049])
@pytest.mark.parametrize("rows", [1, 63, 65, 130])
def test_shapes_around_tiles_and_groups(rows: int, cols: int) -> None:
    """Tile edges of the C loops (2048 elements, 64 rows) and group padding, for every format."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).to(torch.bfloat16)
    for fmt in FORMATS:
        check_matrix(x, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_raise_the_reference_error(fmt: str, bad: float, dtype: torch.dtype) -> None:
    x = torch.randn(5, 40)
    x[1, 3] = bad
    x[4, 39] = bad
    x = x.to(dtype)
    given = {"nvfp4": {"tensor_scale": 0.5}, "fp8_e4m3": {"scale": 0.5}, "mxfp4": {"round_up": True}}[fmt]
    for kwargs in ({}, given):
        with pytest.raises(ValueError) as want:
            ref.CODECS[fmt][0](x, name="K (kv[:, 0])", **kwargs)
        with pytest.raises(ValueError) as got:
            cpu.CODECS[fmt][0](x.t().contiguous().t(), name="K (kv[:, 0])", **kwargs)
        assert str(got.value) == str(want.value)
        assert "2 of 200 values are NaN or Inf" in str(got.value)


def test_a_bad_given_scale_on_a_nan_input_reports_the_nan_first() -> None:
    x = torch.tensor([[1.0, float("nan")] * 8])
    for rq, cq, kw in ((ref.quantize_nvfp4, cpu.quantize_nvfp4, {"tensor_scale": 1e-40}),
                       (ref.quantize_fp8_e4m3, cpu.quantize_fp8_e4m3, {"scale": 1e39})):
        with pytest.raises(ValueError, match="NaN or Inf"):
            rq(x, **kw)
        with pytest.raises(ValueError, match="NaN or Inf"):
            cq(x, **kw)
    with pytest.raises(ValueError, match="outside"):
        cpu.quantize_nvfp4(torch.ones(1, 16), tensor_scale=2.0**117)


def test_argument_errors() -> None:
    for bad, match in ((torch.ones(16), "2-D"), (torch.ones(2, 16, dtype=torch.int32), "float32, bfloat16"),
                       (torch.ones(0, 16), "empty"), (torch.ones(2, 0, 16), "empty")):
        with pytest.raises(ValueError, match=match):
            cpu.quantize_nvfp4(bad)
    q = cpu.quantize_nvfp4(torch.ones(4, 16))
    with pytest.raises(ValueError, match="out must be"):
        cpu.dequantize_nvfp4(q, torch.bfloat16, out=torch.empty(4, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cpu.dequantize_nvfp4(q, torch.bfloat16, out=torch.empty(4, 16))
    with pytest.raises(ValueError, match="no avx512 kernels"):
        _cpu.use_isa("avx512")


# --- KV blocks, stored blocks, batched decoding --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "k_axis", "v_axis"), [(32, "channel", "token"), (37, "channel", "token"),
                                                          (17, "token", "channel"), (64, "channel", "channel")])
def test_kv_blocks_through_both_axes(fmt: str, dtype: torch.dtype, tokens: int, k_axis: str, v_axis: str) -> None:
    g = torch.Generator().manual_seed(tokens)
    kv = torch.randn(3, 2, tokens, 2, 48, generator=g)
    kv[:, 0, :, :, 5] *= 40.0  # an outlier channel in K
    kv = kv.to(dtype)
    want = codec.quantize_kv_block(kv, fmt, k_axis=k_axis, v_axis=v_axis)
    got = codec.quantize_kv_block(kv, fmt, k_axis=k_axis, v_axis=v_axis, backend="cpu")
    assert_same_payload(got.k, want.k)
    assert_same_payload(got.v, want.v)
    assert codec.to_bytes(got) == codec.to_bytes(want)
    for out in DTYPES:
        a = codec.dequantize_kv_block(want, out, backend="cpu")
        b = codec.dequantize_kv_block(want, out)
        assert a.shape == b.shape == kv.shape and torch.equal(bits(a), bits(b))
    sliced = torch.randn(3, 2, tokens + 8, 2, 48, generator=g).to(dtype)[:, :, 4 : 4 + tokens]  # not contiguous
    assert codec.to_bytes(codec.quantize_kv_block(sliced, fmt, backend="cpu")) == \
        codec.to_bytes(codec.quantize_kv_block(sliced, fmt))


def test_kv_nan_names_k_or_v() -> None:
    kv = torch.randn(1, 2, 16, 2, 16)
    kv[0, 1, 3, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^V \(kv\[:, 1\]\): 1 of 512 values"):
        codec.quantize_kv_block(kv, "nvfp4", backend="cpu")


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_blocks_encode_and_decode_the_same(fmt: str) -> None:
    kv = torch.randn(2, 2, 32, 2, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    blob = stored.encode(kv, fmt, backend="cpu")
    assert blob == stored.encode(kv, fmt)
    for backend in ("cpu", "reference"):
        out = stored.decode(blob, fmt, DType.BF16, tuple(kv.shape), backend=backend)
        assert torch.equal(bits(out), bits(stored.decode(blob, fmt, DType.BF16, tuple(kv.shape))))
    block = stored.decode_block(blob, fmt, DType.BF16, tuple(kv.shape), backend="cpu")
    assert isinstance(block, torch.Tensor) and torch.equal(bits(block), bits(out))
    assert stored.as_raw(blob, fmt, DType.BF16, tuple(kv.shape), backend="cpu") == \
        stored.as_raw(blob, fmt, DType.BF16, tuple(kv.shape))


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_encode_and_decode_blocks(fmt: str) -> None:
    shape = (2, 2, 32, 2, 32)
    plan = batched.plan(fmt, DType.BF16, shape)
    kv = torch.randn(3, *shape, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    offsets = torch.tensor([0, plan.nbytes + 8, 2 * plan.nbytes + 64])
    bufs = {}
    for backend in ("cpu", "reference"):
        dst = torch.zeros(3 * plan.nbytes + 64, dtype=torch.uint8)
        assert not bool(batched.encode_blocks(kv, plan, dst, offsets, backend=backend))
        bufs[backend] = dst
    assert torch.equal(bufs["cpu"], bufs["reference"])
    k_cpu, v_cpu = batched.decode_blocks(bufs["cpu"], offsets, plan, backend="cpu")
    k_ref, v_ref = batched.decode_blocks(bufs["cpu"], offsets, plan, backend="reference")
    assert torch.equal(bits(k_cpu), bits(k_ref)) and torch.equal(bits(v_cpu), bits(v_ref))


def test_host_backend_is_cpu_where_the_extension_is_built() -> None:
    from engram.client import _backend_for

    assert codec.host_backend() == "cpu"
    assert _backend_for("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert base.default_backend() == "cpu"


def test_a_tree_without_the_extension_falls_back_to_the_reference_and_says_so_once() -> None:
    """A source tree where the extension was never built: host_backend() is "reference" (one warning, however
    often it is asked), and asking for the cpu backend by name says how to build it."""
    code = """
import logging, sys
sys.modules["engram.codec._cpu"] = None  # what a tree with no built extension looks like to import
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
import torch
from engram import codec
from engram.codec import base
assert [codec.host_backend() for _ in range(3)] == ["reference"] * 3
assert base.default_backend() == "reference" or torch.cuda.is_available()
try:
    codec.quantize_kv_block(torch.ones(1, 2, 16, 1, 16), "nvfp4", backend="cpu")
except ImportError as exc:
    print("ImportError:", exc)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    warnings = [line for line in run.stderr.splitlines() if line.startswith("engram.codec:")]
    assert len(warnings) == 1 and "reference" in warnings[0], run.stderr
    assert "ImportError: the 'cpu' codec backend needs its C extension" in run.stdout
    assert "pip install -e ." in run.stdout


# --- the GIL ----------------------------------------------------------------------------------------------


def test_the_gil_is_released_in_every_c_call() -> None:
    """A Python thread counts while the main thread is inside a long C call. The switch interval is raised far
    past the calls' length, so the counter can only move during a call if the call released the GIL."""
    x = torch.randn(2048, 8192).to(torch.bfloat16)  # 32 MiB: tens of milliseconds per call
    elements = x.view(torch.int16).numpy()
    out = torch.empty_like(x).view(torch.int16).numpy()
    codes = np.empty(x.numel(), dtype=np.uint8)
    scales = np.empty(x.numel() // 16, dtype=np.uint8)
    grouped = codes[: x.numel() // 2]
    calls = {
        "amax": lambda: _cpu.amax(elements[:, ::2], 1),  # the slower strided loop: the max alone is a ms
        "encode_grouped": lambda: _cpu.encode_grouped(elements, 1, 0, 1e-3, False, grouped, scales),
        "encode_fp8": lambda: _cpu.encode_fp8(elements, 1, 1e-2, codes),
        "decode_grouped": lambda: _cpu.decode_grouped(grouped, scales, 0, 1e-3, out, 1),
        "decode_fp8": lambda: _cpu.decode_fp8(codes, 1e-2, out, 1),
    }
    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1
            if count[0] % 64 == 0:
                time.sleep(0)  # hands the GIL back, so the main thread is not kept waiting after its call

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    thread = threading.Thread(target=counter)
    thread.start()
    try:
        while count[0] == 0:  # the counter runs: from here on it waits for the GIL
            time.sleep(0.001)
        progress = {}
        for name, call in calls.items():
            # Up to 50 calls each: on a busy machine the counter thread may not be scheduled within one short
            # call (amax: about a millisecond) even though the GIL is free. Between calls the main thread runs
            # Python without a switch for 30 s, so any count still comes from inside a call.
            before = count[0]
            for _ in range(50):
                call()
                if count[0] > before:
                    break
            progress[name] = count[0] - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert all(n > 0 for n in progress.values()), progress  # a call that kept the GIL shows exactly 0


def test_a_block_of_no_layers_is_the_references_error_on_the_c_backend() -> None:
    """quantize_kv_block with L = 0 raised IndexError on the C backend (the reference's ValueError, which the
    codec wrapper turns into InvalidArgument, came after an x[0] of nothing)."""
    kv = torch.zeros(0, 2, 16, 2, 32)
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError, match="empty"):
            codec.quantize_kv_block(kv, "nvfp4", backend=backend)


@pytest.mark.parametrize("case", ["encode_grouped", "decode_grouped"])
def test_dimensions_whose_product_wraps_are_refused_by_the_c_glue(case: str) -> None:
    """A view of 2^60 + 1 rows of stride 0 costs no memory; its groups' byte counts (rows x the padded width 16),
    computed in Py_ssize_t, wrapped to a few bytes, passed the length checks, and the kernel walked 2^60 rows past
    the buffers (a segfault). Such dims are a ValueError now. Only the private _cpu API takes such views; the codec
    never builds them (FP8's products cannot wrap: numpy bounds them by the itemsize already)."""
    from engram.codec import _cpu

    rows = 2**60 + 1
    view = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), shape=(rows, 1), strides=(0, 0))
    with pytest.raises(ValueError, match="multiply past"):
        if case == "encode_grouped":
            _cpu.encode_grouped(view, 0, 0, 1.0, False, bytearray(8), bytearray(1))
        else:
            _cpu.decode_grouped(bytearray(8), bytearray(1), 0, 1.0, view, 0)

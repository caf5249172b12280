"""The reference FP4/FP8 codecs against independent oracles (float64 nearest-even rounding, torch's own
float8 casts, math.frexp) and the KV-block layer built on them."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import engram.codec as codec
from engram.codec import fp4_reference as ref

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def oracle_e2m1(q: np.ndarray) -> np.ndarray:
    """Nearest E2M1 magnitude code of q >= 0 in float64, ties to the even code, saturating at 6."""
    d = np.abs(q.astype(np.float64)[:, None] - GRID[None, :])
    best = d.min(axis=1, keepdims=True)
    ties = d == best
    even = ties & (np.arange(8)[None, :] % 2 == 0)
    return np.where(ties.sum(axis=1) > 1, even.argmax(axis=1), d.argmin(axis=1))


def tie_grid() -> torch.Tensor:
    """Every E2M1 value and midpoint, their float32 neighbours, and a dense sweep of [0, 8]."""
    points = np.concatenate([GRID, (GRID[1:] + GRID[:-1]) / 2, [6.5, 7.0, 100.0]]).astype(np.float32)
    near = np.concatenate([np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))])
    sweep = np.linspace(0, 8, 20001, dtype=np.float32)
    return torch.from_numpy(np.concatenate([points, near, sweep]))


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(rows, n/2) bytes -> (rows, n) 4-bit codes, the first element from the low nibble."""
    p = packed.long()
    return torch.stack((p & 15, p >> 4), dim=-1).reshape(packed.shape[0], -1)


def rel_rms(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


# --- rounding primitives ------------------------------------------------------------------------------


def test_e2m1_round_matches_nearest_even_oracle_on_all_ties() -> None:
    q = tie_grid()
    assert torch.equal(ref.e2m1_round(q), torch.from_numpy(oracle_e2m1(q.numpy())).int())


@pytest.mark.parametrize(("q", "code"), [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6),
                                         (5.0, 6), (5.0001, 7), (6.0, 7), (1e30, 7), (0.2500001, 1)])
def test_e2m1_named_ties(q: float, code: int) -> None:
    assert int(ref.e2m1_round(torch.tensor([q]))) == code


def test_mxfp4_codes_are_plain_e2m1_rounding_when_the_scale_is_one() -> None:
    q = tie_grid()
    q = q[q < 8]  # keeps amax (with the 4.0 column) in [4, 8)
    q = q[: q.numel() // 31 * 31].view(-1, 31)
    x = torch.cat([q, torch.full((q.shape[0], 1), 4.0)], dim=1)  # amax in [4, 8): E8M0 scale 2^0
    p = ref.quantize_mxfp4(x)
    assert torch.equal(p.scales, torch.full_like(p.scales, 127))
    assert torch.equal(nibbles(p.codes)[:, :31].reshape(-1), torch.from_numpy(oracle_e2m1(q.reshape(-1).numpy())))


def test_e4m3_code_matches_torch_float8_cast() -> None:
    g = torch.Generator().manual_seed(7)
    logs = torch.rand(200_000, generator=g) * 22 - 13  # 2^-13 .. 2^9, subnormals to past 448
    s = torch.exp2(logs)
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2  # every tie point, normal and subnormal
    s = torch.cat([s, values, mids, torch.tensor([0.0, 448.0, 460.0, 464.0, 1e6])]).clamp(max=ref.E4M3_MAX)
    # torch saturates at 448 (2.12+) and rounds to nearest even: it is the oracle here.
    want = s.to(torch.float8_e4m3fn).view(torch.uint8).int()
    assert torch.equal(ref.e4m3_code(s), want)
    assert torch.equal(ref.e4m3_value(want), s.to(torch.float8_e4m3fn).float())


def test_e8m0_exponent_is_the_ocp_floor_of_log2() -> None:
    g = torch.Generator().manual_seed(3)
    amax = torch.exp2(torch.rand(20_000, generator=g) * 252 - 125)  # 2^-125 .. 2^127
    powers = torch.exp2(torch.arange(-125, 128, dtype=torch.float32))
    amax = torch.cat([amax, powers, powers * 1.5, powers * 1.5000001, torch.nextafter(powers, torch.zeros(1))])
    amax = amax[torch.isfinite(amax) & (amax >= 2.0**-126)]
    x = torch.zeros(amax.numel(), 32)
    x[:, 7] = -amax  # the sign must not matter
    for round_up in (False, True):
        got = ref.quantize_mxfp4(x, round_up=round_up).scales[:, 0].tolist()
        for a, code in zip(amax.tolist(), got, strict=True):
            m, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
            k = e - 1 - 2
            if round_up and a > 6 * 2.0**k:  # the smallest power of two with a / 2^k <= 6
                k += 1
            assert code == max(0, min(254, k + 127)), (a, round_up)


def test_e8m0_value() -> None:
    codes = torch.arange(255)
    assert torch.equal(ref.e8m0_value(codes), torch.tensor([2.0 ** (c - 127) for c in range(255)]))


# --- codecs: conventions ------------------------------------------------------------------------------


def test_packing_order_first_element_in_low_nibble() -> None:
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([0.5, -1.0, 6.0, 0.0, -0.0, 3.0])  # amax 6: E8M0 scale 2^0, codes are the values
    p = ref.quantize_mxfp4(x)
    # codes: 0.5 -> 1, -1.0 -> 8|2, 6 -> 7, 0 -> 0, -0.0 -> 8, 3 -> 5
    assert p.codes[0, :3].tolist() == [0xA1, 0x07, 0x58]
    assert p.codes[0, 3:].tolist() == [0] * 13
    assert p.scales.tolist() == [[127]]
    y = ref.dequantize_mxfp4(p)
    assert torch.equal(y, x)
    assert math.copysign(1.0, float(y[0, 4])) == -1.0  # code 8 decodes to -0.0


def test_tiny_and_negative_zero_inputs_encode_as_signed_zero() -> None:
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([1.0, -1e-39, 1e-39, -0.0])  # subnormals round to (signed) zero here
    p = ref.quantize_nvfp4(x)
    assert nibbles(p.codes)[0, :4].tolist() == [7, 8, 0, 8]
    assert ref.dequantize_nvfp4(p)[0, 1:4].abs().max() == 0


def test_nvfp4_scales_tensor_scale_and_hand_example() -> None:
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-3, 3, 16)  # amax 3
    x[1, 16:] = 0.001  # a small group in a tensor of amax 3
    p = ref.quantize_nvfp4(x)
    ts = 3.0 / (448 * 6)
    assert float(p.tensor_scale) == pytest.approx(ts, rel=1e-7)
    # group scale = (amax / 6) / ts = 448 for the largest group: E4M3 code 0x7E
    assert p.scales.tolist() == [[0x7E, 0], [0, int(ref.e4m3_code(torch.tensor([0.001 / 6 / ts])))]]
    assert p.codes[0, 8:].tolist() == [0] * 8  # an all-zero group: scale 0, codes 0
    assert torch.equal(ref.dequantize_nvfp4(p)[1, :16], torch.zeros(16))


def test_all_zero_tensor_and_groups() -> None:
    x = torch.zeros(4, 64)
    for quantize, dequantize in ref.CODECS.values():
        y = dequantize(quantize(x))
        assert torch.equal(y, x)
    nv = ref.quantize_nvfp4(x)
    assert float(nv.tensor_scale) == ref.NVFP4_TENSOR_SCALE_RANGE[0]
    assert int(nv.scales.max()) == 0 and int(nv.codes.max()) == 0
    assert int(ref.quantize_mxfp4(x).scales.max()) == 0  # a zero group gets the smallest E8M0 scale


def test_nonzero_group_never_gets_a_zero_scale() -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = 1000.0
    x[0, 16] = 1e-6  # far below 448 * 2^9 times smaller than the tensor's amax
    p = ref.quantize_nvfp4(x)
    assert p.scales[0].tolist() == [0x7E, 1]


def test_extreme_magnitudes_stay_finite() -> None:
    x = torch.tensor([[3.0e38, -1.0, 2.0e-38] + [0.0] * 29])
    for quantize, dequantize in ref.CODECS.values():
        y = dequantize(quantize(x))
        assert bool(torch.isfinite(y).all())
        assert float(y[0, 0]) == pytest.approx(3.0e38, rel=0.3)


def test_given_tensor_scale_is_used_and_checked() -> None:
    x = torch.randn(8, 64)
    computed = ref.quantize_nvfp4(x)
    given = ref.quantize_nvfp4(x, tensor_scale=float(computed.tensor_scale))
    assert torch.equal(given.codes, computed.codes) and torch.equal(given.scales, computed.scales)
    with pytest.raises(ValueError, match="outside"):
        ref.quantize_nvfp4(x, tensor_scale=0.0)
    with pytest.raises(ValueError, match="outside"):
        ref.quantize_fp8_e4m3(x, scale=float("nan"))


@pytest.mark.parametrize("fmt", sorted(ref.CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(fmt: str, bad: float) -> None:
    quantize, _ = ref.CODECS[fmt]
    x = torch.randn(4, 64)
    x[1, 3] = bad
    x[2, 60] = bad
    with pytest.raises(ValueError, match="K: 2 of 256 values are NaN or Inf"):
        quantize(x, name="K")


def test_bad_shapes_and_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="2-D"):
        ref.quantize_nvfp4(torch.zeros(16))
    with pytest.raises(ValueError, match="dtype"):
        ref.quantize_mxfp4(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty"):
        ref.quantize_fp8_e4m3(torch.zeros(0, 32))
    with pytest.raises(ValueError, match="codes must be uint8"):
        ref.NVFP4Tensor(torch.zeros(2, 7, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8),
                        torch.tensor(1.0), (2, 16))


def test_torch_dtype_views() -> None:
    x = torch.randn(2, 64)
    nv, mx, f8 = ref.quantize_nvfp4(x), ref.quantize_mxfp4(x), ref.quantize_fp8_e4m3(x)
    assert nv.codes_fp4().dtype == torch.float4_e2m1fn_x2 and nv.scales_fp8().dtype == torch.float8_e4m3fn
    assert mx.scales_e8m0().dtype == torch.float8_e8m0fnu and mx.codes_fp4().shape == (2, 32)
    assert torch.equal(f8.codes_fp8().float() * f8.scale, ref.dequantize_fp8_e4m3(f8))


# --- codecs: accuracy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "lo", "hi"), [("nvfp4", 0.09, 0.10), ("mxfp4", 0.11, 0.12),
                                               ("fp8_e4m3", 0.02, 0.03)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gaussian_relative_rms_error(fmt: str, lo: float, hi: float, dtype: torch.dtype) -> None:
    quantize, dequantize = ref.CODECS[fmt]
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(11)).to(dtype)
    assert lo <= rel_rms(dequantize(quantize(x)), x.float()) <= hi


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
def test_decode_to_half_types_is_the_rounded_float32_decode(out: torch.dtype) -> None:
    x = torch.randn(16, 96)
    for quantize, dequantize in ref.CODECS.values():
        q = quantize(x)
        assert torch.equal(dequantize(q, out), dequantize(q).to(out))


def nvfp4_bound(x: torch.Tensor, q: ref.NVFP4Tensor) -> torch.Tensor:
    """Per-element worst case: within range, half the widest E2M1 gap (1) times the group scale; past 6 * scale,
    the excess (saturation)."""
    s = (ref.e4m3_value(q.scales) * q.tensor_scale).repeat_interleave(16, dim=1)[:, : x.shape[1]]
    return torch.where(x.abs() <= 6 * s, s, x.abs() - 6 * s)


def mxfp4_bound(x: torch.Tensor, q: ref.MXFP4Tensor) -> torch.Tensor:
    s = ref.e8m0_value(q.scales).repeat_interleave(32, dim=1)[:, : x.shape[1]]
    return torch.where(x.abs() <= 6 * s, s, x.abs() - 6 * s)


def fp8_bound(x: torch.Tensor, q: ref.FP8Tensor) -> torch.Tensor:
    """Half an E4M3 ulp: 2^-4 relative for normals, 2^-10 * scale in the subnormal range."""
    return torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * q.scale)


matrices = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 4), st.integers(1, 80)),
    elements=st.one_of(st.floats(-(2.0**14), 2.0**14, width=32), st.floats(-(2.0**-10), 2.0**-10, width=32),
                       st.just(0.0)),
)


@settings(max_examples=150, deadline=None)
@given(matrices, st.integers(-100, 100), st.booleans())
def test_property_decode_within_worst_case_bound(a: np.ndarray, exp: int, round_up: bool) -> None:
    x = torch.from_numpy(a) * 2.0**exp  # exact: moves the whole matrix across the float32 range
    slack = 1e-6 * x.abs() + 1e-30  # float32 rounding of the reciprocal and of the products
    for q, y, bound in (
        (qn := ref.quantize_nvfp4(x), ref.dequantize_nvfp4(qn), nvfp4_bound(x, qn)),
        (qm := ref.quantize_mxfp4(x, round_up=round_up), ref.dequantize_mxfp4(qm), mxfp4_bound(x, qm)),
        (qf := ref.quantize_fp8_e4m3(x), ref.dequantize_fp8_e4m3(qf), fp8_bound(x, qf)),
    ):
        err = (y - x).abs()
        assert bool((err <= bound + slack).all()), (type(q).__name__, float((err - bound).max()))
    if round_up:  # the round-up MX scale never clips
        s = ref.e8m0_value(qm.scales).repeat_interleave(32, dim=1)[:, : x.shape[1]]
        assert bool((x.abs() <= 6 * s).all())


# --- KV blocks ----------------------------------------------------------------------------------------


def kv_block(tokens: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 2, tokens, 2, 32, generator=g)
    kv[:, 0, :, :, 3] *= 20  # an outlier K channel
    return kv.to(dtype)


@pytest.mark.parametrize("fmt", sorted(codec.FORMATS))
@pytest.mark.parametrize("tokens", [1, 17, 255])
@pytest.mark.parametrize(("k_axis", "v_axis"), [("channel", "token"), ("token", "channel")])
def test_partial_blocks_round_trip(fmt: str, tokens: int, k_axis: str, v_axis: str) -> None:
    kv = kv_block(tokens)
    q = codec.quantize_kv_block(kv, fmt, k_axis=k_axis, v_axis=v_axis)
    group = codec.FORMATS[fmt].GROUP
    padded = -(-tokens // group) * group
    # the stored matrices are padded along the grouped axis: channel -> tokens, token -> head_dim (32)
    for part, axis in ((q.k, k_axis), (q.v, v_axis)):
        stored = part.codes.shape[1] * (1 if fmt == "fp8_e4m3" else 2)
        assert stored == (padded if axis == "channel" else 32)
    y = codec.dequantize_kv_block(q, torch.float32)
    assert y.shape == kv.shape
    bound = {"nvfp4": 0.2, "mxfp4": 0.25, "fp8_e4m3": 0.05}[fmt]  # K on the token axis suffers its outlier
    for i in (0, 1):
        assert rel_rms(y[:, i], kv[:, i].float()) < bound
    assert codec.dequantize_kv_block(q, torch.bfloat16).dtype == torch.bfloat16


def test_channel_axis_is_tokens_of_one_channel() -> None:
    kv = torch.zeros(1, 2, 16, 1, 16)
    kv[0, 0, :, 0, 5] = torch.arange(16.0) / 2.5  # channel 5 of K over 16 tokens: one NVFP4 group
    q = codec.quantize_kv_block(kv, "nvfp4")
    assert q.k.shape == (16, 16)  # (L*H*D, T)
    assert int((q.k.scales != 0).sum()) == 1 and int(q.k.scales[5, 0]) != 0
    assert q.v.shape == (16, 16)  # (L*T*H, D)


def test_kv_non_finite_names_k_or_v() -> None:
    kv = kv_block(16)
    kv[0, 1, 3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"V \(kv\[:, 1\]\): 1 of"):
        codec.quantize_kv_block(kv)


def test_kv_argument_errors() -> None:
    kv = kv_block(16)
    with pytest.raises(ValueError, match="unknown KV codec"):
        codec.quantize_kv_block(kv, "int4")
    with pytest.raises(ValueError, match="k_axis"):
        codec.quantize_kv_block(kv, k_axis="head")
    with pytest.raises(ValueError, match="backend"):
        codec.quantize_kv_block(kv, backend="cuda")
    with pytest.raises(ValueError, match="shape"):
        codec.quantize_kv_block(kv[:, 0])


@pytest.mark.parametrize("fmt", sorted(codec.FORMATS))
@pytest.mark.parametrize("tokens", [1, 40])
def test_to_bytes_from_bytes_round_trip(fmt: str, tokens: int) -> None:
    q = codec.quantize_kv_block(kv_block(tokens, seed=5), fmt)
    buf = codec.to_bytes(q)
    assert len(buf) == codec.payload_nbytes(fmt, q.shape)
    back = codec.from_bytes(buf, fmt, q.shape)
    assert back.shape == q.shape and back.fmt == fmt
    for a, b in ((q.k, back.k), (q.v, back.v)):
        assert a.shape == b.shape
        for field in ("codes", "scales", "tensor_scale", "scale"):
            if hasattr(a, field):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(codec.dequantize_kv_block(back, torch.float32), codec.dequantize_kv_block(q, torch.float32))


def test_byte_layout_is_documented_order() -> None:
    q = codec.quantize_kv_block(kv_block(16, seed=2), "nvfp4")
    buf = codec.to_bytes(q)
    k_rows = 2 * 2 * 32  # L*H*D for K on the channel axis; T = 16: one group a row
    assert struct.unpack_from("<f", buf, 0)[0] == float(q.k.tensor_scale)
    assert buf[4 : 4 + k_rows] == q.k.scales.numpy().tobytes()
    assert buf[4 + k_rows : 4 + k_rows + k_rows * 8] == q.k.codes.numpy().tobytes()
    v_at = 4 + k_rows * 9
    assert struct.unpack_from("<f", buf, v_at)[0] == float(q.v.tensor_scale)
    mx = codec.quantize_kv_block(kv_block(16, seed=2), "mxfp4")
    assert codec.to_bytes(mx)[: k_rows] == mx.k.scales.numpy().tobytes()  # no tensor scale in MXFP4


def test_from_bytes_rejects_bad_payloads() -> None:
    q = codec.quantize_kv_block(kv_block(16), "nvfp4")
    buf = codec.to_bytes(q)
    with pytest.raises(ValueError, match="must be"):
        codec.from_bytes(buf[:-1], "nvfp4", q.shape)
    nan_scale = bytearray(buf)
    nan_scale[4] = 0x7F  # K's first group scale: the E4M3 NaN code
    with pytest.raises(ValueError, match="corrupt NVFP4"):
        codec.from_bytes(bytes(nan_scale), "nvfp4", q.shape)
    bad_ts = struct.pack("<f", float("inf")) + buf[4:]
    with pytest.raises(ValueError, match="tensor scale"):
        codec.from_bytes(bad_ts, "nvfp4", q.shape)
    mx = codec.to_bytes(codec.quantize_kv_block(kv_block(16), "mxfp4"))
    with pytest.raises(ValueError, match="corrupt MXFP4"):
        codec.from_bytes(b"\xff" + mx[1:], "mxfp4", q.shape)


def test_public_surface() -> None:
    assert sorted(codec.__all__) == sorted(
        ["AXES", "BACKENDS", "FORMATS", "FP8Tensor", "MXFP4Tensor", "NVFP4Tensor", "QuantizedKV", "check_bytes",
         "dequantize_kv_block", "from_bytes", "host_backend", "payload_nbytes", "quantize_kv_block", "to_bytes"])


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_e4m3"])
def test_check_bytes_refuses_what_from_bytes_refuses_without_copying(fmt: str) -> None:
    """check_bytes (what a daemon runs on a block a worker encoded) and from_bytes agree on every scale byte
    that cannot decode, and check_bytes accepts every payload the encoder writes."""
    shape = (2, 32, 2, 32)
    kv = torch.randn(2, 2, 32, 2, 32)
    good = codec.to_bytes(codec.quantize_kv_block(kv, fmt))
    codec.check_bytes(good, fmt, shape)
    bad_byte = {"nvfp4": 0x7F, "mxfp4": 0xFF, "fp8_e4m3": 0x7F}[fmt]
    for offset in (0, 4):  # a float32 tensor scale (nvfp4, fp8) or the first group scale / code
        broken = bytearray(good)
        if offset == 0 and fmt != "mxfp4":
            broken[0:4] = np.array([np.nan], dtype="<f4").tobytes()
        else:
            broken[offset] = bad_byte
        with pytest.raises(ValueError, match="corrupt"):
            codec.from_bytes(bytes(broken), fmt, shape)
        with pytest.raises(ValueError, match="corrupt"):
            codec.check_bytes(bytes(broken), fmt, shape)
    with pytest.raises(ValueError, match="must be"):
        codec.check_bytes(good[:-1], fmt, shape)


def test_mxfp4_scale_codes_no_encoder_writes_are_refused() -> None:
    """E8M0 codes 254 and 253 are not NaN, but with the larger E2M1 codes they decode to Inf: above 253 (round_up's
    top for float32) a worker's block is refused; every code an encoder writes, up to float32's largest values,
    is accepted."""
    shape = (2, 32, 2, 32)
    kv = torch.randn(2, 2, 32, 2, 32)
    kv[0, 0, 0, 0, 0] = torch.finfo(torch.float32).max  # the largest code the floor encoder writes (252)
    good = codec.to_bytes(codec.quantize_kv_block(kv, "mxfp4"))
    codec.check_bytes(good, "mxfp4", shape)
    for code in (254, 0xFE):
        broken = bytearray(good)
        broken[0] = code
        with pytest.raises(ValueError, match="above 253"):
            codec.check_bytes(bytes(broken), "mxfp4", shape)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_e4m3"])
def test_scales_that_decode_past_the_dtypes_range_are_refused_for_that_dtype(fmt: str) -> None:
    """A payload is checked against the dtype it decodes to: float16 blocks at float16's largest values pass,
    the same payload with its scales raised 2^20 fold (tensor scale; MXFP4's first group scale code) decodes to
    Inf in float16 and is refused, but not in bfloat16, whose range holds it."""
    shape = (2, 32, 2, 32)
    kv = torch.randn(2, 2, 32, 2, 32).half()
    kv[0, 0, 0, 0, 0], kv[1, 1, 3, 1, 5] = 65504.0, -65504.0
    good = codec.to_bytes(codec.quantize_kv_block(kv, fmt))
    codec.check_bytes(good, fmt, shape, dtype=torch.float16)
    decoded = codec.dequantize_kv_block(codec.from_bytes(good, fmt, shape), torch.float16)
    assert bool(torch.isfinite(decoded).all())
    raised = bytearray(good)
    if fmt == "mxfp4":
        raised[0] += 20
    else:
        struct.pack_into("<f", raised, 0, struct.unpack_from("<f", raised, 0)[0] * 2.0**20)
    assert not bool(torch.isfinite(codec.dequantize_kv_block(codec.from_bytes(bytes(raised), fmt, shape),
                                                              torch.float16)).all())
    with pytest.raises(ValueError, match=r"Inf in torch\.float16"):
        codec.check_bytes(bytes(raised), fmt, shape, dtype=torch.float16)
    codec.check_bytes(bytes(raised), fmt, shape, dtype=torch.bfloat16)
    codec.check_bytes(bytes(raised), fmt, shape)  # the dtype unknown: the old checks only

"""Reference FP4 (NVFP4, MXFP4) and FP8 (E4M3) codecs in plain PyTorch, on any device.

These functions define the formats bit for bit. The Triton kernels (engram.kernels.fp4) must produce the same
code bytes, scale bytes and decoded values for the same input, and the tests hold them to it; docs/FP4_NOTES.md
states the rules. They are written to be read, not to be fast.

Every codec works on a 2-D (rows, cols) matrix whose groups are consecutive elements of a row. cols is padded
with zeros to a multiple of the group size (zeros never raise a group's amax) and the padded matrix is what is
stored; `shape` remembers the unpadded one. Inputs may be float32, bfloat16 or float16; all arithmetic is float32.

Rules shared by every format (the kernels follow them too):
- Codes keep the input's sign bit, so a negative value that rounds to zero, or -0.0, encodes as E2M1 code 8
  (-0), which decodes to -0.0. float32 subnormals are ordinary values (IEEE arithmetic, no flush to zero).
- Per-tensor scales are clamped to ranges where decoded values stay finite and group scales nonzero.
- Division is IEEE division, always by a tensor: PyTorch on CUDA turns `tensor / python_number` into a multiply
  by the reciprocal. The per-element step multiplies by a per-group reciprocal computed once by IEEE division.
- NaN/Inf inputs raise ValueError naming the tensor and the count: the formats have no NaN/Inf codes.

Not here: the KV-block layout and serialisation of a whole block (engram.codec), headers and checksums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
# Per-tensor scale bounds. NVFP4: 0.5 * 2^-9 (smallest code times smallest E4M3 scale) * 2^-116 = 2^-126 keeps
# a nonzero group's decoded values normal and its reciprocal scale finite; 6 * 448 * 2^116 < 2^128 keeps the
# largest finite. FP8: 2^-9 * 2^-117 and 448 * 2^119 likewise. Only tensors with amax below ~3e-32 or above
# ~2e38 ever meet a bound.
NVFP4_TENSOR_SCALE_RANGE = (2.0**-116, 2.0**116)
FP8_SCALE_RANGE = (2.0**-117, 2.0**119)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_NAN = 0x7F
_E8M0_NAN = 0xFF
_E8M0_MAX_ENCODED = 253  # float32's largest amax: 252 by floor, 253 by round_up (whose top codes may overflow)
# E2M1 round-to-nearest-even as thresholds on |q|: past a "strict" threshold only (ties go down to the even
# code below: 0, 1.0, 2.0, 4.0), at or past an "inclusive" one (ties go up to the even code: 1.0, 2.0, 4.0).
_E2M1_STRICT = (0.25, 1.25, 2.5, 5.0)
_E2M1_INCLUSIVE = (0.75, 1.75, 3.5)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---------------------------------------------------------------------------------------------------------
# Payloads


def _check_payload(kind: str, shape: tuple[int, int], codes: Tensor, codes_cols: int,
                   scales: Tensor | None, scales_cols: int, tensor_scale: Tensor | None) -> None:
    rows = shape[0]
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (rows, codes_cols):
        raise ValueError(f"{kind}: codes must be uint8 of shape {(rows, codes_cols)} for matrix shape {shape}, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    if scales is not None and (scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, scales_cols)):
        raise ValueError(f"{kind}: scales must be uint8 of shape {(rows, scales_cols)} for matrix shape {shape}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if tensor_scale is not None and (tensor_scale.dtype != torch.float32 or tensor_scale.dim() != 0):
        raise ValueError(f"{kind}: the tensor scale must be a 0-d float32 tensor, got {tensor_scale.dtype} "
                         f"{tuple(tensor_scale.shape)}")


def padded(cols: int, group: int) -> int:
    """cols rounded up to a whole number of groups: the stored width."""
    return -(-cols // group) * group


def _u8(t: Tensor) -> bytes:
    return t.contiguous().cpu().numpy().tobytes()


def _f32(t: Tensor) -> bytes:
    return t.cpu().numpy().astype("<f4").tobytes()


class _Reader:
    """Reads the parts of one payload from a buffer, in order; the buffer must hold exactly `nbytes`."""

    def __init__(self, kind: str, buf: bytes | memoryview, nbytes: int, device: torch.device | str) -> None:
        if len(buf) != nbytes:
            raise ValueError(f"corrupt {kind} payload: {len(buf)} bytes, the shape needs {nbytes}")
        self.buf, self.pos, self.device = memoryview(buf), 0, device

    def u8(self, rows: int, cols: int) -> Tensor:
        n = rows * cols
        arr = np.frombuffer(self.buf, dtype=np.uint8, count=n, offset=self.pos).copy()
        self.pos += n
        return torch.from_numpy(arr).view(rows, cols).to(self.device)

    def f32(self) -> Tensor:
        arr = np.frombuffer(self.buf, dtype="<f4", count=1, offset=self.pos).astype(np.float32)
        self.pos += 4
        return torch.from_numpy(arr).view(()).to(self.device)


def _check_scale_value(kind: str, value: Tensor | float, bounds: tuple[float, float]) -> None:
    v = float(value)
    if not bounds[0] <= v <= bounds[1]:
        raise ValueError(f"corrupt {kind} payload: tensor scale {v!r} is outside [{bounds[0]!r}, {bounds[1]!r}]")


# every E4M3 code's value (0x7F and 0xFF are NaN): a scale's largest code read in place gives its largest value
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double().tolist()


def _check_finite_in(kind: str, largest: float, dtype: torch.dtype | None) -> None:
    """Raise ValueError when a payload's largest decodable magnitude is Inf in the dtype it decodes to (a
    float16 block whose tensor scale another encoder set): every hit would hand the model Inf. dtype None:
    the dtype is not known here, nothing checked."""
    if dtype is None:
        return
    if math.isinf(float(torch.tensor(largest, dtype=torch.float64).to(torch.float32).to(dtype))):
        raise ValueError(f"corrupt {kind} payload: its scales decode to {largest:.4g}, Inf in {dtype} (no encoder "
                         f"of {dtype} values writes them)")


def _check_length(kind: str, buf: bytes | memoryview, nbytes: int) -> None:
    if len(buf) != nbytes:
        raise ValueError(f"corrupt {kind} payload: {len(buf)} bytes, the shape needs {nbytes}")


def _f32_at(buf: bytes | memoryview, offset: int) -> float:
    return float(np.frombuffer(buf, dtype="<f4", count=1, offset=offset)[0])


def _u8_at(buf: bytes | memoryview, count: int, offset: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8, count=count, offset=offset)  # a view: nothing is copied


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 payload of a (rows, cols) matrix: 4.5 bits per element."""

    codes: Tensor  # (rows, padded_cols/2) uint8: two E2M1 codes a byte, the first element in the low nibble
    scales: Tensor  # (rows, padded_cols/16) uint8: E4M3 bit patterns, one per group of 16
    tensor_scale: Tensor  # () float32
    shape: tuple[int, int]  # (rows, cols) before padding

    GROUP: ClassVar[int] = NVFP4_GROUP

    def __post_init__(self) -> None:
        cols = padded(self.shape[1], self.GROUP)
        _check_payload("NVFP4", self.shape, self.codes, cols // 2, self.scales, cols // self.GROUP,
                       self.tensor_scale)

    @classmethod
    def payload_nbytes(cls, shape: tuple[int, int]) -> int:
        cols = padded(shape[1], cls.GROUP)
        return 4 + shape[0] * (cols // cls.GROUP + cols // 2)

    def to_bytes(self) -> bytes:
        """tensor scale (float32 LE), scales (row-major), codes (row-major)."""
        return _f32(self.tensor_scale) + _u8(self.scales) + _u8(self.codes)

    @classmethod
    def check_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype | None = None) -> None:
        """Raise ValueError unless `buf` decodes: its length, its tensor scale's range, its group scales
        (positive, never NaN), and with `dtype` to finite values in it. Reads the scales in place; the codes
        (any nibble is a value) are not read."""
        _check_length("NVFP4", buf, cls.payload_nbytes(shape))
        ts = _f32_at(buf, 0)
        _check_scale_value("NVFP4", ts, NVFP4_TENSOR_SCALE_RANGE)
        scales = _u8_at(buf, shape[0] * (padded(shape[1], cls.GROUP) // cls.GROUP), 4)
        if not scales.size:
            return
        # One pass over the scales, no temporary: the largest code is NaN or signed iff any is (codes at or above
        # 0x7F are), and gives the largest value. A comparison, .any() and a max were three passes and a bool array
        # as large as the scales (128 MiB at 32K tokens of an 8B model: 35 ms of each in-place put's commit).
        top = int(scales.max())
        if top >= _E4M3_NAN:
            raise ValueError("corrupt NVFP4 payload: a group scale has its sign bit set or is NaN")
        _check_finite_in("NVFP4", ts * _E4M3_VALUES[top] * E2M1_MAX, dtype)

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int],
                   device: torch.device | str = "cpu") -> NVFP4Tensor:
        cls.check_bytes(buf, shape)
        cols = padded(shape[1], cls.GROUP)
        r = _Reader("NVFP4", buf, cls.payload_nbytes(shape), device)
        ts = r.f32()
        scales = r.u8(shape[0], cols // cls.GROUP)
        return cls(r.u8(shape[0], cols // 2), scales, ts, shape)

    def codes_fp4(self) -> Tensor:
        """The codes as torch.float4_e2m1fn_x2 (same bytes): for APIs that take torch's FP4 dtype."""
        return self.codes.view(torch.float4_e2m1fn_x2)

    def scales_fp8(self) -> Tensor:
        return self.scales.view(torch.float8_e4m3fn)


@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 (OCP MX) payload of a (rows, cols) matrix: 4.25 bits per element."""

    codes: Tensor  # (rows, padded_cols/2) uint8: two E2M1 codes a byte, the first element in the low nibble
    scales: Tensor  # (rows, padded_cols/32) uint8: E8M0 biased exponents, one per group of 32
    shape: tuple[int, int]  # (rows, cols) before padding

    GROUP: ClassVar[int] = MXFP4_GROUP

    def __post_init__(self) -> None:
        cols = padded(self.shape[1], self.GROUP)
        _check_payload("MXFP4", self.shape, self.codes, cols // 2, self.scales, cols // self.GROUP, None)

    @classmethod
    def payload_nbytes(cls, shape: tuple[int, int]) -> int:
        cols = padded(shape[1], cls.GROUP)
        return shape[0] * (cols // cls.GROUP + cols // 2)

    def to_bytes(self) -> bytes:
        """scales (row-major), codes (row-major)."""
        return _u8(self.scales) + _u8(self.codes)

    @classmethod
    def check_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype | None = None) -> None:
        """Raise ValueError unless `buf` decodes: its length and its group scales (never the NaN code), and
        with `dtype` to finite values in it."""
        _check_length("MXFP4", buf, cls.payload_nbytes(shape))
        scales = _u8_at(buf, shape[0] * (padded(shape[1], cls.GROUP) // cls.GROUP), 0)
        if not scales.size:
            return
        top = int(scales.max())  # one pass (NVFP4's check says why): 0xFF, the largest code, is there iff it is the max
        if top == _E8M0_NAN:
            raise ValueError("corrupt MXFP4 payload: a group scale is the E8M0 NaN code 0xFF")
        if top > _E8M0_MAX_ENCODED:
            raise ValueError(f"corrupt MXFP4 payload: a group scale code is above {_E8M0_MAX_ENCODED}, the largest "
                             "an encoder writes (its codes would decode to Inf)")
        _check_finite_in("MXFP4", 2.0 ** (top - 127) * E2M1_MAX, dtype)

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int],
                   device: torch.device | str = "cpu") -> MXFP4Tensor:
        cls.check_bytes(buf, shape)
        cols = padded(shape[1], cls.GROUP)
        r = _Reader("MXFP4", buf, cls.payload_nbytes(shape), device)
        scales = r.u8(shape[0], cols // cls.GROUP)
        return cls(r.u8(shape[0], cols // 2), scales, shape)

    def codes_fp4(self) -> Tensor:
        return self.codes.view(torch.float4_e2m1fn_x2)

    def scales_e8m0(self) -> Tensor:
        return self.scales.view(torch.float8_e8m0fnu)


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 E4M3 payload of a (rows, cols) matrix with one float32 scale: 8 bits per element."""

    codes: Tensor  # (rows, cols) uint8: E4M3 bit patterns
    scale: Tensor  # () float32
    shape: tuple[int, int]

    GROUP: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check_payload("FP8", self.shape, self.codes, self.shape[1], None, 0, self.scale)

    @classmethod
    def payload_nbytes(cls, shape: tuple[int, int]) -> int:
        return 4 + shape[0] * shape[1]

    def to_bytes(self) -> bytes:
        """scale (float32 LE), codes (row-major)."""
        return _f32(self.scale) + _u8(self.codes)

    @classmethod
    def check_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype | None = None) -> None:
        """Raise ValueError unless `buf` decodes: its length, its scale's range, no NaN code, and with `dtype`
        to finite values in it."""
        _check_length("FP8", buf, cls.payload_nbytes(shape))
        scale = _f32_at(buf, 0)
        _check_scale_value("FP8", scale, FP8_SCALE_RANGE)
        magnitudes = _u8_at(buf, shape[0] * shape[1], 4) & 0x7F
        if not magnitudes.size:
            return
        top = int(magnitudes.max())  # the NaN pattern 0x7F is the largest magnitude: there iff it is the max
        if top == _E4M3_NAN:
            raise ValueError("corrupt FP8 payload: a code is the E4M3 NaN pattern")
        _check_finite_in("FP8", scale * _E4M3_VALUES[top], dtype)

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, shape: tuple[int, int],
                   device: torch.device | str = "cpu") -> FP8Tensor:
        cls.check_bytes(buf, shape)
        r = _Reader("FP8", buf, cls.payload_nbytes(shape), device)
        scale = r.f32()
        return cls(r.u8(*shape), scale, shape)

    def codes_fp8(self) -> Tensor:
        return self.codes.view(torch.float8_e4m3fn)


Payload = NVFP4Tensor | MXFP4Tensor | FP8Tensor
FORMATS: dict[str, type[Payload]] = {"nvfp4": NVFP4Tensor, "mxfp4": MXFP4Tensor, "fp8_e4m3": FP8Tensor}


# ---------------------------------------------------------------------------------------------------------
# Checks and per-tensor scales, shared with the Triton wrappers so both backends see the same scale bits.


def check_matrix(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, cols) tensor with groups along the last dim, "
                         f"got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported; use float32, bfloat16 or float16")
    if x.numel() == 0:
        raise ValueError(f"{name}: the tensor is empty (shape {tuple(x.shape)})")


def raise_if_not_finite(x: Tensor, name: str) -> None:
    bad = x.numel() - int(torch.isfinite(x).sum())
    if bad:
        raise ValueError(f"{name}: {bad} of {x.numel()} values are NaN or Inf; FP4/FP8 codes cannot hold them, "
                         "so fix or mask them before quantizing")


def _div(a: Tensor, b: float) -> Tensor:
    """a / b by IEEE division on every device (a Python divisor becomes a reciprocal multiply on CUDA)."""
    return a / torch.full_like(a, b)


def finite_amax(x: Tensor, name: str) -> Tensor:
    """max |x| as a 0-d float32 tensor, in one pass; raises ValueError if x holds NaN or Inf (the max shows it)."""
    amax = torch.linalg.vector_norm(x, ord=float("inf")).float()
    if not bool(torch.isfinite(amax)):
        raise_if_not_finite(x, name)
    return amax


def nvfp4_tensor_scale(amax: Tensor) -> Tensor:
    """torchao's recipe amax / (448 * 6), clamped to NVFP4_TENSOR_SCALE_RANGE."""
    lo, hi = NVFP4_TENSOR_SCALE_RANGE
    return _div(amax.float(), E4M3_MAX * E2M1_MAX).clamp(lo, hi)


def fp8_tensor_scale(amax: Tensor) -> Tensor:
    """amax / 448, clamped to FP8_SCALE_RANGE."""
    lo, hi = FP8_SCALE_RANGE
    return _div(amax.float(), E4M3_MAX).clamp(lo, hi)


def checked_scale(scale: Tensor | float, bounds: tuple[float, float], device: torch.device, name: str) -> Tensor:
    """A caller-provided per-tensor scale as a 0-d float32 tensor on `device`, checked against `bounds`."""
    t = torch.as_tensor(scale, dtype=torch.float32).to(device).reshape(())
    v = float(t)
    if not bounds[0] <= v <= bounds[1]:
        raise ValueError(f"{name}: the given per-tensor scale {v!r} is outside [{bounds[0]!r}, {bounds[1]!r}]; "
                         "derive it from the tensor's amax (see nvfp4_tensor_scale / fp8_tensor_scale)")
    return t


def pad_cols(x: Tensor, group: int) -> Tensor:
    """x made contiguous and zero-padded along its last dim to a multiple of `group` (its own dtype)."""
    extra = padded(x.shape[1], group) - x.shape[1]
    return torch.nn.functional.pad(x, (0, extra)).contiguous() if extra else x.contiguous()


# ---------------------------------------------------------------------------------------------------------
# Bit-level pieces


def _magnitude_and_sign(x32: Tensor) -> tuple[Tensor, Tensor]:
    """(|x| as int32 float bits, sign bit as int32 0/1) of a float32 tensor. Integer bits make the group max
    exact and let NaN/Inf show as bits >= 0x7F800000."""
    bits = x32.contiguous().view(torch.int32)
    return bits & 0x7FFF_FFFF, (bits >> 31) & 1


def e2m1_round(q: Tensor) -> Tensor:
    """E2M1 magnitude code (int32, 0..7) of q >= 0: round to nearest, ties to even, saturating at 6."""
    code = torch.zeros(q.shape, dtype=torch.int32, device=q.device)
    for t in _E2M1_STRICT:
        code += q > t
    for t in _E2M1_INCLUSIVE:
        code += q >= t
    return code


def e4m3_code(s: Tensor) -> Tensor:
    """E4M3 code (int32) of float32 s in [0, 448], round to nearest even, built from the bits (no fp8 cast)."""
    bits = s.contiguous().view(torch.int32)
    # Normal range: round the 23-bit mantissa to 3 bits (a carry moves into the exponent), re-bias 127 -> 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: multiples of 2^-9; round(s * 2^9) is exact to compute and 8 is the smallest normal code.
    sub = torch.round(s * 512.0).to(torch.int32)
    return torch.where(s < _E4M3_MIN_NORMAL, sub, normal)


def e4m3_value(code: Tensor) -> Tensor:
    """float32 value of E4M3 codes (no NaN codes expected)."""
    return code.to(torch.uint8).view(torch.float8_e4m3fn).float()


def e8m0_value(code: Tensor) -> Tensor:
    """float32 value 2^(code - 127) of E8M0 codes 0..254; code 0 is the float32 subnormal 2^-127."""
    c = code.to(torch.int32)
    return torch.where(c == 0, 0x0040_0000, c << 23).view(torch.float32)


def _pack(codes: Tensor) -> Tensor:
    """(rows, n) int32 4-bit codes -> (rows, n/2) uint8, the first of each pair in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _unpack_values(packed: Tensor) -> Tensor:
    """(rows, n/2) uint8 -> (rows, n) float32 E2M1 values."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    p = packed.long()
    return torch.stack((table[p & 15], table[p >> 4]), dim=-1).view(packed.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------
# Codecs


def quantize_nvfp4(x: Tensor, tensor_scale: Tensor | float | None = None, *, name: str = "x") -> NVFP4Tensor:
    """NVFP4: E2M1 codes, an E4M3 scale per 16 elements computed on x / tensor_scale, an FP32 tensor scale.

    tensor_scale defaults to amax / (448 * 6); pass one to skip the amax pass (e.g. a scale shared by a layer).
    """
    check_matrix(x, name)
    rows, cols = x.shape
    if tensor_scale is None:
        ts = nvfp4_tensor_scale(finite_amax(x, name))
    else:
        raise_if_not_finite(x, name)
        ts = checked_scale(tensor_scale, NVFP4_TENSOR_SCALE_RANGE, x.device, name)
    mag, sign = _magnitude_and_sign(pad_cols(x, NVFP4_GROUP).float())  # (rows, cols_p) each
    groups = mag.view(rows, -1, NVFP4_GROUP)  # (rows, cols_p/16, 16) int32 bits
    amax = groups.amax(dim=-1).view(torch.float32)  # (rows, cols_p/16)
    raw = torch.clamp(_div(amax, E2M1_MAX) / ts, max=E4M3_MAX)  # (amax / 6) / ts, torchao's order
    scales = torch.where(amax > 0, e4m3_code(raw).clamp(min=1), 0)  # a nonzero group never gets scale 0
    s = e4m3_value(scales) * ts  # decoded group scale
    inv = torch.ones_like(s) / torch.where(s > 0, s, 1.0)
    q = groups.view(torch.float32) * inv[..., None]
    codes = e2m1_round(q).view(rows, -1) | (sign << 3)
    return NVFP4Tensor(_pack(codes), scales.to(torch.uint8), ts, (rows, cols))


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(rows, cols) values (code * e4m3_scale) * tensor_scale, in float32 then cast (RNE) to dtype."""
    rows, cols = q.shape
    v = _unpack_values(q.codes).view(rows, -1, NVFP4_GROUP)  # (rows, cols_p/16, 16)
    out = (v * e4m3_value(q.scales)[..., None]) * q.tensor_scale
    return out.view(rows, -1)[:, :cols].to(dtype)


def quantize_mxfp4(x: Tensor, *, round_up: bool = False, name: str = "x") -> MXFP4Tensor:
    """MXFP4 (OCP MX): E2M1 codes and an E8M0 scale per 32 elements.

    The OCP scale 2^(floor(log2 amax) - 2) leaves amax/scale in [4, 8), so values past 6 * scale saturate.
    round_up=True takes the smallest power of two with amax/scale <= 6 instead: it never clips (one bit less
    resolution for about a third of groups), except at the top of the input dtype's range, where the rounded-up
    code (value 4 at scale 2^e) decodes past the largest finite value to Inf (|x| >= 1.75 * 2^127 in float32,
    >= 57344 in float16); the daemon encodes with the default. Both are decoded the same way.
    """
    check_matrix(x, name)
    raise_if_not_finite(x, name)
    rows, cols = x.shape
    mag, sign = _magnitude_and_sign(pad_cols(x, MXFP4_GROUP).float())
    groups = mag.view(rows, -1, MXFP4_GROUP)  # (rows, cols_p/32, 32) int32 bits
    amax = groups.amax(dim=-1)  # (rows, cols_p/32) bits
    scales = (amax >> 23) - 2  # biased exponent of amax (0 for a zero group), minus 2
    if round_up:
        scales = scales + ((amax & 0x7F_FFFF) > 0x40_0000)  # mantissa above 1.5: 4 * 1.5 * 2^e would clip
    scales = scales.clamp(0, 254)
    inv = ((254 - scales) << 23).view(torch.float32)  # 2^(127 - code): exactly 1/scale, always normal
    q = groups.view(torch.float32) * inv[..., None]
    codes = e2m1_round(q).view(rows, -1) | (sign << 3)
    return MXFP4Tensor(_pack(codes), scales.to(torch.uint8), (rows, cols))


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    rows, cols = q.shape
    v = _unpack_values(q.codes).view(rows, -1, MXFP4_GROUP)
    out = v * e8m0_value(q.scales)[..., None]
    return out.view(rows, -1)[:, :cols].to(dtype)


def quantize_fp8_e4m3(x: Tensor, scale: Tensor | float | None = None, *, name: str = "x") -> FP8Tensor:
    """FP8 E4M3 with one FP32 scale per tensor (default amax / 448), round to nearest even, saturating at 448."""
    check_matrix(x, name)
    if scale is None:
        s = fp8_tensor_scale(finite_amax(x, name))
    else:
        raise_if_not_finite(x, name)
        s = checked_scale(scale, FP8_SCALE_RANGE, x.device, name)
    mag, sign = _magnitude_and_sign(x.float())
    q = torch.clamp(mag.view(torch.float32) * (torch.ones_like(s) / s), max=E4M3_MAX)
    codes = e4m3_code(q) | (sign << 7)
    return FP8Tensor(codes.to(torch.uint8), s, tuple(x.shape))  # type: ignore[arg-type]


def dequantize_fp8_e4m3(q: FP8Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.codes.view(torch.float8_e4m3fn).float() * q.scale).to(dtype)


Quantize = Callable[..., Payload]
Dequantize = Callable[..., Tensor]
# format name -> (quantize, dequantize); engram.kernels.fp4 has the same table for its kernels.
CODECS: dict[str, tuple[Quantize, Dequantize]] = {
    "nvfp4": (quantize_nvfp4, dequantize_nvfp4),
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4),
    "fp8_e4m3": (quantize_fp8_e4m3, dequantize_fp8_e4m3),
}

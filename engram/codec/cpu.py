"""The "cpu" codec backend: NVFP4, MXFP4 and FP8 E4M3 in C (engram/codec/_cpu.c), the same bytes as the reference.

A daemon or worker without a GPU used to encode with the PyTorch reference at 0.01-0.08 GB/s; this backend runs
at memory speed on one core (benchmarks/RESULTS.md, "CPU backend"). It has the reference's signatures, payloads
(NVFP4Tensor, MXFP4Tensor, FP8Tensor) and errors, and the tests hold it to the reference's codes, scales,
tensor scales and decoded bits (tests/test_codec_cpu.py).

Why a C extension: it is compiled once at install (no JIT at each daemon start, as numba would need, and no
llvmlite dependency), and one pass over L1-sized tiles reaches memory speed where numpy's ~10 whole-array passes
cannot. It releases the GIL while it loops, so a daemon can encode on one thread per core.

Beyond the reference's API:
- an input may be a (blocks, rows, cols) view of any strides, read as the (blocks * rows, cols) matrix, so K's
  channel-axis matrix (a transposed view of the block) is read in place, without a transposing copy;
- the decoders take `out=`: a (rows, cols) or (blocks, rows, cols) view of any strides to write into;
- bf16 and fp16 are read and written as their bits, without a conversion pass through torch.
engram.codec uses both where a backend sets STRIDED_VIEWS.

Not here: CUDA tensors (use the reference or the Triton backend), and payloads with NaN scale or code bytes
(from_bytes rejects them; their decoded NaN bits are not promised to match torch's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from engram.codec import _cpu  # ImportError when the extension was not built: engram.codec falls back
from engram.codec import fp4_reference as ref
from engram.codec.fp4_reference import FP8Tensor, MXFP4Tensor, NVFP4Tensor

__all__ = ["CODECS", "STRIDED_VIEWS", "dequantize_fp8_e4m3", "dequantize_mxfp4", "dequantize_nvfp4",
           "quantize_fp8_e4m3", "quantize_mxfp4", "quantize_nvfp4"]

STRIDED_VIEWS = True  # quantize_* read (blocks, rows, cols) views; dequantize_* write into out=
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the element kinds of _cpu.c
_NVFP4, _MXFP4 = 0, 1


def _matrix(x: Tensor, name: str) -> tuple[int, int]:
    """(rows, cols) of x read as a matrix: x is (rows, cols), or (blocks, rows, cols) stacked along rows."""
    if x.dim() == 3:
        if x.numel() == 0:  # before x[0]: a stack of no blocks has none (IndexError, not the reference's error)
            raise ValueError(f"{name}: the tensor is empty (shape {tuple(x.shape)})")
        ref.check_matrix(x[0], name)
    else:
        ref.check_matrix(x, name)
    if x.device.type != "cpu":
        raise ValueError(f"{name}: the cpu codec backend takes CPU tensors, got one on {x.device}; use "
                         "backend='triton' on a GPU, or move the tensor to the CPU")
    return x.shape[-3] * x.shape[-2] if x.dim() == 3 else x.shape[0], x.shape[-1]


def _elements(x: Tensor) -> np.ndarray:
    """x's elements as a numpy view with x's strides (16-bit floats as their int16 bits): no copy."""
    x = x.detach()
    return x.numpy() if x.dtype == torch.float32 else x.view(torch.int16).numpy()


def _u8(t: Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _raise_non_finite(x: Tensor, name: str) -> None:
    """The C loop saw NaN/Inf: raise the reference's error (it counts them)."""
    ref.raise_if_not_finite(x, name)
    raise AssertionError(f"{name}: the C codec saw NaN/Inf, but torch.isfinite finds none")


def _tensor_scale(x: Tensor, name: str, given: Tensor | float | None, divisor: float,
                  bounds: tuple[float, float]) -> float:
    """The per-tensor scale as the reference computes it: clamp(amax / divisor) in float32, or the given one."""
    if given is not None:
        try:
            return float(ref.checked_scale(given, bounds, x.device, name))
        except ValueError:
            ref.raise_if_not_finite(x, name)  # the reference checks the input first
            raise
    amax, non_finite = _cpu.amax(_elements(x), _KINDS[x.dtype])
    if non_finite:
        _raise_non_finite(x, name)
    scale = np.float32(amax) / np.float32(divisor)  # IEEE float32 division, as the reference's _div
    return float(min(max(scale, np.float32(bounds[0])), np.float32(bounds[1])))


def _out(out: Tensor | None, dtype: torch.dtype, shape: tuple[int, int], kind: str) -> tuple[Tensor, Tensor]:
    """(the tensor to return, the one C writes: float32 when dtype is one C does not write)."""
    rows, cols = shape
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype)
    elif (out.dtype != dtype or out.device.type != "cpu" or out.dim() not in (2, 3)
          or (out.shape[-3] * out.shape[-2] if out.dim() == 3 else out.shape[0], out.shape[-1]) != shape):
        raise ValueError(f"{kind}: out must be a CPU {dtype} tensor of shape {shape} or (blocks, rows/blocks, "
                         f"{cols}), got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out, out if dtype in _KINDS else torch.empty(out.shape, dtype=torch.float32)


def quantize_nvfp4(x: Tensor, tensor_scale: Tensor | float | None = None, *, name: str = "x") -> NVFP4Tensor:
    """engram.codec.fp4_reference.quantize_nvfp4 in C."""
    rows, cols = _matrix(x, name)
    ts = _tensor_scale(x, name, tensor_scale, ref.E4M3_MAX * ref.E2M1_MAX, ref.NVFP4_TENSOR_SCALE_RANGE)
    cp = ref.padded(cols, ref.NVFP4_GROUP)
    codes = torch.empty(rows, cp // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cp // ref.NVFP4_GROUP, dtype=torch.uint8)
    if _cpu.encode_grouped(_elements(x), _KINDS[x.dtype], _NVFP4, ts, False, codes.numpy(), scales.numpy()):
        _raise_non_finite(x, name)
    return NVFP4Tensor(codes, scales, torch.tensor(ts, dtype=torch.float32), (rows, cols))


def dequantize_nvfp4(q: NVFP4Tensor, dtype: torch.dtype = torch.float32, *, out: Tensor | None = None) -> Tensor:
    """(rows, cols) values (code * e4m3_scale) * tensor_scale, in float32, cast (RNE) to dtype."""
    result, target = _out(out, dtype, q.shape, "NVFP4")
    _cpu.decode_grouped(_u8(q.codes), _u8(q.scales), _NVFP4, float(q.tensor_scale), _elements(target),
                        _KINDS[target.dtype])
    return result if target is result else result.copy_(target)


def quantize_mxfp4(x: Tensor, *, round_up: bool = False, name: str = "x") -> MXFP4Tensor:
    """engram.codec.fp4_reference.quantize_mxfp4 in C."""
    rows, cols = _matrix(x, name)
    cp = ref.padded(cols, ref.MXFP4_GROUP)
    codes = torch.empty(rows, cp // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cp // ref.MXFP4_GROUP, dtype=torch.uint8)
    if _cpu.encode_grouped(_elements(x), _KINDS[x.dtype], _MXFP4, 1.0, round_up, codes.numpy(), scales.numpy()):
        _raise_non_finite(x, name)
    return MXFP4Tensor(codes, scales, (rows, cols))


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.float32, *, out: Tensor | None = None) -> Tensor:
    result, target = _out(out, dtype, q.shape, "MXFP4")
    _cpu.decode_grouped(_u8(q.codes), _u8(q.scales), _MXFP4, 1.0, _elements(target), _KINDS[target.dtype])
    return result if target is result else result.copy_(target)


def quantize_fp8_e4m3(x: Tensor, scale: Tensor | float | None = None, *, name: str = "x") -> FP8Tensor:
    """engram.codec.fp4_reference.quantize_fp8_e4m3 in C."""
    rows, cols = _matrix(x, name)
    s = _tensor_scale(x, name, scale, ref.E4M3_MAX, ref.FP8_SCALE_RANGE)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    if _cpu.encode_fp8(_elements(x), _KINDS[x.dtype], s, codes.numpy()):
        _raise_non_finite(x, name)
    return FP8Tensor(codes, torch.tensor(s, dtype=torch.float32), (rows, cols))


def dequantize_fp8_e4m3(q: FP8Tensor, dtype: torch.dtype = torch.float32, *, out: Tensor | None = None) -> Tensor:
    result, target = _out(out, dtype, q.shape, "FP8")
    _cpu.decode_fp8(_u8(q.codes), float(q.scale), _elements(target), _KINDS[target.dtype])
    return result if target is result else result.copy_(target)


CODECS: dict[str, tuple[ref.Quantize, ref.Dequantize]] = {
    "nvfp4": (quantize_nvfp4, dequantize_nvfp4),
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4),
    "fp8_e4m3": (quantize_fp8_e4m3, dequantize_fp8_e4m3),
}

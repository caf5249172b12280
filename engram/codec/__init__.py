"""Block codecs: a KV block (L, 2, T, H, D) as FP4/FP8 payloads, and their fixed byte serialisation.

K and V are quantized separately, each as a 2-D matrix whose groups run along one axis of the block:
- "channel": for every (layer, kv head, head-dim channel), groups of consecutive tokens. K's default: K has
  outlier channels, and groups inside a channel keep them from inflating their neighbours' scales (KIVI).
- "token": for every (layer, token, kv head), groups along head_dim. V's default.
A partial block (T < block_tokens, T not a multiple of the group) is padded with zeros to whole groups along the
grouped axis, and the padded size is what is stored; decoding drops the padding.

Numerics live in engram.codec.fp4_reference (the definition), engram.kernels.fp4 (Triton, the same bytes) and
engram.codec.cpu (C, the same bytes; `host_backend()` says whether it was built). A backend that sets STRIDED_VIEWS
(the cpu one) is handed each matrix as a (layers, rows, cols) view of the block and decodes straight into the
block, so K's channel-axis matrix is never copied into a transposed matrix on either side.
Not here: block headers, checksums, compression; the block format wraps `to_bytes` output with those.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from engram.codec import fp4_reference
from engram.codec.fp4_reference import FORMATS, FP8Tensor, MXFP4Tensor, NVFP4Tensor, Payload

__all__ = [
    "AXES",
    "BACKENDS",
    "FORMATS",
    "FP8Tensor",
    "MXFP4Tensor",
    "NVFP4Tensor",
    "QuantizedKV",
    "check_bytes",
    "dequantize_kv_block",
    "from_bytes",
    "host_backend",
    "payload_nbytes",
    "quantize_kv_block",
    "to_bytes",
]

log = logging.getLogger("engram.codec")

AXES = ("channel", "token")
# backend name -> module with a CODECS table; the others are imported on first use (Triton is optional, and the
# cpu backend's C extension is built at install, so a bare source tree has none).
BACKENDS = {"reference": "engram.codec.fp4_reference", "triton": "engram.kernels.fp4", "cpu": "engram.codec.cpu"}
_MISSING = {
    "triton": "the 'triton' codec backend needs Triton (pip install 'engram-kv[kernels]')",
    "cpu": "the 'cpu' codec backend needs its C extension engram.codec._cpu, built when the package is installed "
           "with a C compiler present (pip install -e .)",
}


@dataclass(frozen=True)
class QuantizedKV:
    """One KV block's payloads. shape is (L, T, H, D): layers, tokens, kv heads, head dim."""

    fmt: str
    shape: tuple[int, int, int, int]
    k_axis: str
    v_axis: str
    k: Payload
    v: Payload


def _backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown codec backend {name!r}; use one of {sorted(BACKENDS)}")
    if name == "reference":
        return fp4_reference
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as exc:
        raise ImportError(f"{_MISSING[name]}; use backend='reference' without it") from exc


@functools.cache
def host_backend() -> str:
    """The backend for tensors in host memory: "cpu" where its C extension was built, else "reference" (said once
    in the log: the reference is ~100x slower)."""
    try:
        _backend("cpu")
    except ImportError as exc:
        log.warning("CPU codecs run on the PyTorch reference, not the C extension: %s", exc.__cause__ or exc)
        return "reference"
    return "cpu"


def _strided(backend: ModuleType) -> bool:
    """Whether a backend's codecs read (layers, rows, cols) views of any strides and decode into `out=`."""
    return bool(getattr(backend, "STRIDED_VIEWS", False))


def _check_spec(fmt: str, k_axis: str, v_axis: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV codec {fmt!r}; use one of {sorted(FORMATS)}")
    for which, axis in (("k_axis", k_axis), ("v_axis", v_axis)):
        if axis not in AXES:
            raise ValueError(f"{which}={axis!r}: use 'channel' (groups along tokens) or 'token' (along head_dim)")


def _matrix_shape(shape: tuple[int, int, int, int], axis: str) -> tuple[int, int]:
    layers, tokens, heads, dim = shape
    return (layers * heads * dim, tokens) if axis == "channel" else (layers * tokens * heads, dim)


def _to_matrix(x: Tensor, axis: str) -> Tensor:
    """(L, T, H, D) -> the 2-D matrix whose rows hold the groups."""
    layers, tokens, heads, dim = x.shape
    if axis == "channel":
        return x.permute(0, 2, 3, 1).reshape(layers * heads * dim, tokens)  # (L*H*D, T)
    return x.reshape(layers * tokens * heads, dim)  # (L*T*H, D)


def _to_rows(x: Tensor, axis: str) -> Tensor:
    """(L, T, H, D) -> the matrix as a (L, rows, cols) view of x, nothing copied: (L, H*D, T) for "channel"
    (rows adjacent in memory, columns H*D apart), (L, T*H, D) for "token"."""
    if axis == "channel":
        return x.permute(0, 2, 3, 1).flatten(1, 2)
    return x.flatten(1, 2)


def _from_matrix(m: Tensor, axis: str, shape: tuple[int, int, int, int]) -> Tensor:
    layers, tokens, heads, dim = shape
    if axis == "channel":
        return m.reshape(layers, heads, dim, tokens).permute(0, 3, 1, 2)  # (L, T, H, D)
    return m.reshape(layers, tokens, heads, dim)


def quantize_kv_block(kv: Tensor, fmt: str = "nvfp4", *, k_axis: str = "channel", v_axis: str = "token",
                      backend: str = "reference") -> QuantizedKV:
    """Quantize a KV block (L, 2, T, H, D) in bf16/fp16/fp32. NaN/Inf raise ValueError naming K or V."""
    _check_spec(fmt, k_axis, v_axis)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"expected a KV block of shape (layers, 2, tokens, kv_heads, head_dim), got {tuple(kv.shape)}")
    module = _backend(backend)
    quantize, _ = module.CODECS[fmt]
    shape = (kv.shape[0], kv.shape[2], kv.shape[3], kv.shape[4])
    matrix = _to_rows if _strided(module) else _to_matrix
    k = quantize(matrix(kv[:, 0], k_axis), name="K (kv[:, 0])")
    v = quantize(matrix(kv[:, 1], v_axis), name="V (kv[:, 1])")
    return QuantizedKV(fmt, shape, k_axis, v_axis, k, v)


def dequantize_kv_block(q: QuantizedKV, dtype: torch.dtype, *, backend: str = "reference") -> Tensor:
    """The block (L, 2, T, H, D) in dtype."""
    module = _backend(backend)
    _, dequantize = module.CODECS[q.fmt]
    if _strided(module):  # each half decoded in place: no matrix, no transposing copy, no stack
        layers, tokens, heads, dim = q.shape
        out = torch.empty(layers, 2, tokens, heads, dim, dtype=dtype, device=q.k.codes.device)
        dequantize(q.k, dtype, out=_to_rows(out[:, 0], q.k_axis))
        dequantize(q.v, dtype, out=_to_rows(out[:, 1], q.v_axis))
        return out
    k = _from_matrix(dequantize(q.k, dtype), q.k_axis, q.shape)
    v = _from_matrix(dequantize(q.v, dtype), q.v_axis, q.shape)
    return torch.stack((k, v), dim=1)


def payload_nbytes(fmt: str, shape: tuple[int, int, int, int], *, k_axis: str = "channel",
                   v_axis: str = "token") -> int:
    """Bytes `to_bytes` writes for a block of shape (L, T, H, D)."""
    _check_spec(fmt, k_axis, v_axis)
    payload = FORMATS[fmt]
    return payload.payload_nbytes(_matrix_shape(shape, k_axis)) + payload.payload_nbytes(_matrix_shape(shape, v_axis))


def to_bytes(q: QuantizedKV) -> bytes:
    """K's payload, then V's, each in its own fixed order (see docs/FP4_NOTES.md); little-endian.

    The format, the shape and the axes are not written: they belong in the block header."""
    return q.k.to_bytes() + q.v.to_bytes()


def _split_kv(buf: bytes | memoryview, fmt: str, shape: tuple[int, int, int, int], k_axis: str, v_axis: str
              ) -> tuple[Any, tuple[memoryview, tuple[int, int]], tuple[memoryview, tuple[int, int]]]:
    """A `to_bytes` payload checked for length and cut into its K and V matrices' bytes, with their shapes."""
    expected = payload_nbytes(fmt, shape, k_axis=k_axis, v_axis=v_axis)
    if len(buf) != expected:
        raise ValueError(f"{fmt} KV payload of shape {shape} must be {expected} bytes, got {len(buf)}")
    payload = FORMATS[fmt]
    k_shape, v_shape = _matrix_shape(shape, k_axis), _matrix_shape(shape, v_axis)
    split = payload.payload_nbytes(k_shape)
    view = memoryview(buf)
    return payload, (view[:split], k_shape), (view[split:], v_shape)


def check_bytes(buf: bytes | memoryview, fmt: str, shape: tuple[int, int, int, int], *, k_axis: str = "channel",
                v_axis: str = "token", dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless `to_bytes` output would parse (`from_bytes`): its length and every scale, read
    in place, without building tensors (what a daemon asks of a block a worker encoded, at put time); with
    `dtype`, unless its scales could decode to Inf in it."""
    payload, (k_buf, k_shape), (v_buf, v_shape) = _split_kv(buf, fmt, shape, k_axis, v_axis)
    payload.check_bytes(k_buf, k_shape, dtype)
    payload.check_bytes(v_buf, v_shape, dtype)


def from_bytes(buf: bytes | memoryview, fmt: str, shape: tuple[int, int, int, int], *, k_axis: str = "channel",
               v_axis: str = "token", device: torch.device | str = "cpu") -> QuantizedKV:
    """Parse `to_bytes` output; raises ValueError on a wrong length or impossible scale bytes."""
    payload, (k_buf, k_shape), (v_buf, v_shape) = _split_kv(buf, fmt, shape, k_axis, v_axis)
    k = payload.from_bytes(k_buf, k_shape, device)
    v = payload.from_bytes(v_buf, v_shape, device)
    return QuantizedKV(fmt, tuple(shape), k_axis, v_axis, k, v)  # type: ignore[arg-type]

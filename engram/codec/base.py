"""Storage codecs behind one Protocol, in a registry keyed by codec id and by name.

A codec turns a KV block (L, 2, T, H, D) into the body of a v1 block (engram/codec/blockformat.py) and
back, and one stream's (rows, cols) matrix into its payload in a v2 block (engram/codec/streamformat.py). `raw` keeps the element bytes as sent (bf16/fp16/fp32); the quantizing codecs (fp8_e4m3, nvfp4,
mxfp4) use the numerics of engram.codec on the reference backend (PyTorch, any device), the Triton kernels
(engram.kernels.fp4, on the GPU) or the C codecs (engram.codec.cpu, host memory), which produce the same bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engram import codec as kvcodec
from engram.errors import InvalidArgument
from engram.layout import Axis

__all__ = ["Axis", "Codec", "CodecId", "codec_by_id", "codec_by_name", "default_backend"]


class CodecId(enum.IntEnum):
    RAW = 0
    FP8_E4M3 = 1
    NVFP4 = 2
    MXFP4 = 3


Shape = tuple[int, int, int, int, int]  # (layers, 2, tokens, kv heads, head dim)


class Codec(Protocol):
    @property
    def codec_id(self) -> CodecId: ...

    @property
    def name(self) -> str: ...

    def body_nbytes(self, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis) -> int: ...

    def encode(self, kv: Tensor, k_axis: Axis, v_axis: Axis, backend: str) -> bytes: ...

    def decode(self, body: bytes | memoryview, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis,
               backend: str, device: torch.device | str) -> Tensor: ...

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str,
              dtype: torch.dtype | None = None) -> None:
        """Raise InvalidArgument unless `body` decodes (its scales are valid; with `dtype`, to finite values in
        it), without decoding it."""
        ...

    def matrix_nbytes(self, shape: tuple[int, int], dtype: torch.dtype) -> int:
        """Payload bytes of one (rows, cols) matrix whose groups run along its rows."""
        ...

    def encode_matrix(self, x: Tensor, backend: str, name: str) -> bytes: ...

    def decode_matrix(self, body: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype, backend: str,
                      device: torch.device | str) -> Tensor: ...

    def check_matrix(self, body: bytes | memoryview, shape: tuple[int, int], where: str,
                     dtype: torch.dtype | None = None) -> None:
        """Raise InvalidArgument unless one matrix's payload decodes (its length, its scales; with `dtype`, to
        finite values in it), without decoding."""
        ...


@dataclass(frozen=True)
class RawCodec:
    """The element bytes as they are: bit-exact, 2 bytes per element for bf16."""

    codec_id: CodecId = CodecId.RAW
    name: str = "raw"

    def body_nbytes(self, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis) -> int:
        n = dtype.itemsize
        for d in shape:
            n *= d
        return n

    def encode(self, kv: Tensor, k_axis: Axis, v_axis: Axis, backend: str) -> bytes:
        return kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def decode(self, body: bytes | memoryview, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis,
               backend: str, device: torch.device | str) -> Tensor:
        t = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(shape)
        return t.to(device)

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str,
              dtype: torch.dtype | None = None) -> None:
        return None  # any element bytes are a block

    def matrix_nbytes(self, shape: tuple[int, int], dtype: torch.dtype) -> int:
        return shape[0] * shape[1] * dtype.itemsize

    def encode_matrix(self, x: Tensor, backend: str, name: str) -> bytes:
        return x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def decode_matrix(self, body: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype, backend: str,
                      device: torch.device | str) -> Tensor:
        return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).reshape(shape).to(device)

    def check_matrix(self, body: bytes | memoryview, shape: tuple[int, int], where: str,
                     dtype: torch.dtype | None = None) -> None:
        return None  # any element bytes are a matrix (its length is the block format's to check)


@dataclass(frozen=True)
class QuantCodec:
    """A quantizing codec: K and V quantized separately along their axes (engram.codec)."""

    codec_id: CodecId
    name: str  # the engram.codec format name

    def body_nbytes(self, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis) -> int:
        layers, _, tokens, heads, dim = shape
        return kvcodec.payload_nbytes(self.name, (layers, tokens, heads, dim), k_axis=_axis_name(k_axis),
                                      v_axis=_axis_name(v_axis))

    def encode(self, kv: Tensor, k_axis: Axis, v_axis: Axis, backend: str) -> bytes:
        kv = _on_backend(kv, backend)
        try:
            q = kvcodec.quantize_kv_block(kv, self.name, k_axis=_axis_name(k_axis), v_axis=_axis_name(v_axis),
                                          backend=backend)
        except ValueError as exc:  # NaN/Inf, or a malformed block
            raise InvalidArgument(f"cannot encode the block as {self.name}: {exc}") from None
        return kvcodec.to_bytes(q)

    def decode(self, body: bytes | memoryview, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis,
               backend: str, device: torch.device | str) -> Tensor:
        layers, _, tokens, heads, dim = shape
        on = _device_for(backend, device)
        q = kvcodec.from_bytes(body, self.name, (layers, tokens, heads, dim), k_axis=_axis_name(k_axis),
                               v_axis=_axis_name(v_axis), device=on)
        return kvcodec.dequantize_kv_block(q, dtype, backend=backend).to(device)

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str,
              dtype: torch.dtype | None = None) -> None:
        layers, _, tokens, heads, dim = shape
        try:  # parsing is what decoding fails on: NaN or negative scales, out-of-range tensor scales
            kvcodec.check_bytes(body, self.name, (layers, tokens, heads, dim), k_axis=_axis_name(k_axis),
                                v_axis=_axis_name(v_axis), dtype=dtype)
        except ValueError as exc:
            raise InvalidArgument(f"{where}: the {self.name} body would not decode: {exc}") from None

    def matrix_nbytes(self, shape: tuple[int, int], dtype: torch.dtype) -> int:
        return kvcodec.FORMATS[self.name].payload_nbytes(shape)

    def encode_matrix(self, x: Tensor, backend: str, name: str) -> bytes:
        x = _on_backend(x, backend)
        quantize, _ = kvcodec._backend(backend).CODECS[self.name]
        try:
            return quantize(x.contiguous(), name=name).to_bytes()  # type: ignore[no-any-return]
        except ValueError as exc:  # NaN/Inf
            raise InvalidArgument(f"cannot encode {name} as {self.name}: {exc}") from None

    def decode_matrix(self, body: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype, backend: str,
                      device: torch.device | str) -> Tensor:
        on = _device_for(backend, device)
        q = kvcodec.FORMATS[self.name].from_bytes(body, shape, on)
        _, dequantize = kvcodec._backend(backend).CODECS[self.name]
        return dequantize(q, dtype).to(device)  # type: ignore[no-any-return]

    def check_matrix(self, body: bytes | memoryview, shape: tuple[int, int], where: str,
                     dtype: torch.dtype | None = None) -> None:
        try:
            kvcodec.FORMATS[self.name].check_bytes(body, shape, dtype)
        except ValueError as exc:
            raise InvalidArgument(f"{where}: the {self.name} payload would not decode: {exc}") from None


# backends that run on one kind of device: the Triton kernels on the GPU (the daemon's payloads arrive in host
# memory), the C codecs on the host (a worker's CUDA tensor is copied down)
_BACKEND_DEVICE = {"triton": "cuda", "cpu": "cpu"}


def _on_backend(x: Tensor, backend: str) -> Tensor:
    where = _BACKEND_DEVICE.get(backend)
    return x if where is None or x.device.type == where else x.to(where)


def _device_for(backend: str, device: torch.device | str) -> torch.device | str:
    """Where a payload is parsed for decoding on `device` with `backend`."""
    where = _BACKEND_DEVICE.get(backend)
    return device if where is None or torch.device(device).type == where else where


def _axis_name(axis: Axis) -> str:
    return "channel" if axis == Axis.CHANNEL else "token"


CODECS: dict[CodecId, Codec] = {
    CodecId.RAW: RawCodec(),
    CodecId.FP8_E4M3: QuantCodec(CodecId.FP8_E4M3, "fp8_e4m3"),
    CodecId.NVFP4: QuantCodec(CodecId.NVFP4, "nvfp4"),
    CodecId.MXFP4: QuantCodec(CodecId.MXFP4, "mxfp4"),
}
CODEC_NAMES: dict[str, CodecId] = {c.name: cid for cid, c in CODECS.items()}


def codec_by_name(name: str) -> Codec:
    try:
        return CODECS[CODEC_NAMES[name or "raw"]]
    except KeyError:
        raise InvalidArgument(f"unknown codec {name!r}; use one of {sorted(CODEC_NAMES)}") from None


def codec_by_id(codec_id: int) -> Codec:
    try:
        return CODECS[CodecId(codec_id)]
    except ValueError:
        raise InvalidArgument(f"unknown codec id {codec_id}; this daemon knows {[int(c) for c in CodecId]}") from None


def default_backend() -> str:
    """Triton kernels on a CUDA host (where Triton is installed), else the C codecs on the CPU (the PyTorch
    reference where the C extension was not built: engram.codec.host_backend)."""
    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401
        except ImportError:
            return kvcodec.host_backend()
        return "triton"
    return kvcodec.host_backend()


# Backends that encode at memory speed (>= 1 GB/s per core; benchmarks/RESULTS.md, codec_speed): where the daemon
# has one, a lossy default codec costs its puts little; the PyTorch reference (0.01 GB/s) would dominate them.
FAST_BACKENDS = ("triton", "cpu")


def resolve_default_codec(configured: str, backend: str) -> tuple[str, str]:
    """The daemon's default codec and why: codec.default = auto picks nvfp4 where the daemon itself encodes fast
    (Triton on its GPU, or the compiled CPU codec; workers with a GPU encode on theirs), raw where it could only
    use the PyTorch reference. An explicit codec.default is taken as given."""
    if configured != "auto":
        return configured, "codec.default"
    if backend in FAST_BACKENDS:
        where = "the daemon's GPU" if backend == "triton" else "the compiled CPU codec"
        return "nvfp4", f"auto: encoded by {where}"
    return "raw", "auto: no GPU or compiled CPU codec, and the PyTorch reference encodes nvfp4 at 0.01-0.2 GB/s"

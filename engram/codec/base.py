"""Storage codecs behind one Protocol, in a registry keyed by codec id and by name.

A codec turns a KV block (L, 2, T, H, D) into the body of a v1 block (engram/codec/blockformat.py) and
back. `raw` keeps the element bytes as sent (bf16/fp16/fp32); the quantizing codecs (fp8_e4m3, nvfp4,
mxfp4) use the numerics of engram.codec on the reference backend (PyTorch, any device) or the Triton
kernels (engram.kernels.fp4), which produce the same bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engram import codec as kvcodec
from engram.errors import InvalidArgument


class CodecId(enum.IntEnum):
    RAW = 0
    FP8_E4M3 = 1
    NVFP4 = 2
    MXFP4 = 3


class Axis(enum.IntEnum):
    CHANNEL = 0  # groups of consecutive tokens within one (layer, head, channel): K's default
    TOKEN = 1  # groups along head_dim within one (layer, token, head): V's default


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

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str) -> None:
        """Raise InvalidArgument unless `body` decodes (its scales are valid), without decoding it."""
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

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str) -> None:
        return None  # any element bytes are a block


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
        if backend == "triton" and not kv.is_cuda:
            kv = kv.cuda()  # the kernels run on the GPU; the daemon's payloads arrive in host memory
        try:
            q = kvcodec.quantize_kv_block(kv, self.name, k_axis=_axis_name(k_axis), v_axis=_axis_name(v_axis),
                                          backend=backend)
        except ValueError as exc:  # NaN/Inf, or a malformed block
            raise InvalidArgument(f"cannot encode the block as {self.name}: {exc}") from None
        return kvcodec.to_bytes(q)

    def decode(self, body: bytes | memoryview, shape: Shape, dtype: torch.dtype, k_axis: Axis, v_axis: Axis,
               backend: str, device: torch.device | str) -> Tensor:
        layers, _, tokens, heads, dim = shape
        on = "cuda" if backend == "triton" and torch.device(device).type != "cuda" else device
        q = kvcodec.from_bytes(body, self.name, (layers, tokens, heads, dim), k_axis=_axis_name(k_axis),
                               v_axis=_axis_name(v_axis), device=on)
        return kvcodec.dequantize_kv_block(q, dtype, backend=backend).to(device)

    def check(self, body: bytes | memoryview, shape: Shape, k_axis: Axis, v_axis: Axis, where: str) -> None:
        layers, _, tokens, heads, dim = shape
        try:  # parsing is what decoding fails on: NaN or negative scales, out-of-range tensor scales
            kvcodec.check_bytes(body, self.name, (layers, tokens, heads, dim), k_axis=_axis_name(k_axis),
                                v_axis=_axis_name(v_axis))
        except ValueError as exc:
            raise InvalidArgument(f"{where}: the {self.name} body would not decode: {exc}") from None


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
    """Triton kernels on a CUDA host (where Triton is installed), the PyTorch reference otherwise."""
    if torch.cuda.is_available():
        try:
            import triton  # noqa: F401
        except ImportError:
            return "reference"
        return "triton"
    return "reference"

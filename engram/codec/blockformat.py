"""Block format v1: one encoded KV block, self-describing (docs/FORMAT.md).

    offset size field
    0      4    magic b"EGKV"
    4      1    version (1)
    5      1    codec id (engram/codec/base.py CodecId)
    6      1    K scaling axis (0 channel, 1 token)
    7      1    V scaling axis
    8      1    dtype of the decoded block (1 bf16, 2 fp16, 3 fp32)
    9      1    ndim (5)
    10     2    reserved, zero
    12     20   shape: layers, 2, tokens, kv heads, head dim (u32 each)
    32     8    body length in bytes
    40     8    body checksum (xxh3_64)
    48     8    header checksum (xxh3_64 of bytes 0..48)
    56     ...  body, as the codec writes it

Everything little-endian. Parsing rejects a bad magic, an unknown version or codec, a body of the wrong
size for its codec and shape, and either checksum failing, with an error that says which.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash
from torch import Tensor

from engram.codec.base import Axis, Codec, CodecId, Shape, codec_by_id
from engram.errors import InvalidArgument
from engram.layout import DType

MAGIC = b"EGKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBBBBH5IQQ")
_CHECK = struct.Struct("<Q")
HEADER_LEN = _HEADER.size + _CHECK.size  # 56


@dataclass(frozen=True)
class BlockFormat:
    """The parsed header of a v1 block."""

    codec: Codec
    k_axis: Axis
    v_axis: Axis
    dtype: DType
    shape: Shape
    body_len: int
    body_checksum: int

    @property
    def codec_id(self) -> CodecId:
        return self.codec.codec_id


def encoded_nbytes(codec: Codec, shape: Shape, dtype: DType, k_axis: Axis = Axis.CHANNEL,
                   v_axis: Axis = Axis.TOKEN) -> int:
    return HEADER_LEN + codec.body_nbytes(shape, dtype.torch_dtype, k_axis, v_axis)


def encode(kv: Tensor, codec: Codec, *, k_axis: Axis = Axis.CHANNEL, v_axis: Axis = Axis.TOKEN,
           backend: str = "reference") -> bytes:
    """A KV block (L, 2, T, H, D) as a v1 block."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise InvalidArgument(f"a KV block is (layers, 2, tokens, kv_heads, head_dim), got {tuple(kv.shape)}")
    dtype = DType.from_torch(kv.dtype)
    body = codec.encode(kv, k_axis, v_axis, backend)
    shape = tuple(int(d) for d in kv.shape)
    head = header_fields(codec, k_axis, v_axis, dtype, shape, len(body), xxhash.xxh3_64_intdigest(body))
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head)) + body


def header_fields(codec: Codec, k_axis: Axis, v_axis: Axis, dtype: DType, shape: tuple[int, ...], body_len: int,
                  body_checksum: int) -> bytes:
    """Bytes 0..48 of a v1 header (everything but the header's own checksum)."""
    return _HEADER.pack(MAGIC, VERSION, int(codec.codec_id), int(k_axis), int(v_axis), int(dtype), 5, 0, *shape,
                        body_len, body_checksum)


def parse_header(blob: bytes | memoryview, where: str = "block") -> BlockFormat:
    """Parse and verify a v1 block's 56-byte header (its own checksum, known version, codec and fields); the
    body is not read. InvalidArgument says what is wrong."""
    if len(blob) < HEADER_LEN:
        raise InvalidArgument(f"{where}: {len(blob)} bytes is shorter than a v1 block header ({HEADER_LEN})")
    fields = _HEADER.unpack_from(blob)
    magic, version, codec_id, k_axis, v_axis, dtype, ndim, _, *shape, body_len, body_ck = fields
    if magic != MAGIC:
        raise InvalidArgument(f"{where}: bad magic {bytes(magic)!r}; not an Engram v1 block")
    if version != VERSION:
        raise InvalidArgument(f"{where}: block format version {version}; this daemon reads version {VERSION}")
    (head_ck,) = _CHECK.unpack_from(blob, _HEADER.size)
    if xxhash.xxh3_64_intdigest(bytes(blob[: _HEADER.size])) != head_ck:
        raise InvalidArgument(f"{where}: header checksum mismatch")
    codec = codec_by_id(codec_id)
    try:
        fmt = BlockFormat(codec, Axis(k_axis), Axis(v_axis), DType(dtype), tuple(shape), body_len, body_ck)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidArgument(f"{where}: bad header field: {exc}") from None
    if ndim != 5 or shape[1] != 2:
        raise InvalidArgument(f"{where}: shape {tuple(shape)} is not (layers, 2, tokens, kv_heads, head_dim)")
    return fmt


def parse(blob: bytes | memoryview, where: str = "block") -> BlockFormat:
    """Parse and verify a v1 block: its header, then its body's size and checksum."""
    fmt = parse_header(blob, where)
    codec = fmt.codec
    want = codec.body_nbytes(fmt.shape, fmt.dtype.torch_dtype, fmt.k_axis, fmt.v_axis)
    if fmt.body_len != want or len(blob) != HEADER_LEN + fmt.body_len:
        raise InvalidArgument(f"{where}: body is {len(blob) - HEADER_LEN} bytes (header says {fmt.body_len}); "
                              f"{codec.name} for shape {fmt.shape} needs {want}")
    if xxhash.xxh3_64_intdigest(memoryview(blob)[HEADER_LEN:]) != fmt.body_checksum:
        raise InvalidArgument(f"{where}: body checksum mismatch")
    return fmt


def check(blob: bytes | memoryview, where: str = "block") -> BlockFormat:
    """`parse`, and the body's scales too: what a block from outside (a worker's own encoding) must pass
    before it is stored, so that no stored block fails every later decode."""
    fmt = parse(blob, where)
    fmt.codec.check(memoryview(blob)[HEADER_LEN:], fmt.shape, fmt.k_axis, fmt.v_axis, where, fmt.dtype.torch_dtype)
    return fmt


def decode(blob: bytes | memoryview, *, backend: str = "reference", device: torch.device | str = "cpu",
           where: str = "block") -> Tensor:
    """A v1 block back to its KV tensor (L, 2, T, H, D) in its recorded dtype."""
    fmt = parse(blob, where)
    body = memoryview(blob)[HEADER_LEN:]
    return fmt.codec.decode(body, fmt.shape, fmt.dtype.torch_dtype, fmt.k_axis, fmt.v_axis, backend, device)

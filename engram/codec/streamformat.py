"""Block format v2: one block of a stream layout (engram/layout.py), self-describing (docs/FORMAT.md).

    offset      size   field
    0           4      magic b"EGKV"
    4           1      version (2)
    5           1      streams S (1..16)
    6           2      reserved, zero
    8           4      tokens in the block (u32)
    12          4      reserved, zero
    16          8      body length (from the body's first byte to the block's last)
    24          8      body checksum (xxh3_64 of the body)
    32          32*S   one record per stream:
                         +0  8   name, ASCII, NUL-padded
                         +8  1   codec id (engram/codec/base.py CodecId)
                         +9  1   grouping axis (0 channel, 1 token)
                         +10 1   dtype of the decoded stream (1 bf16, 2 fp16, 3 fp32)
                         +11 1   ndim of an entry's shape (1..3)
                         +12 4   layers
                         +16 4   entries (tokens // the stream's compress)
                         +20 12  an entry's shape, u32 each, unused ones zero
    32+32*S     8      header checksum (xxh3_64 of every header byte before it)
    then the body: each stream's payload in record order, each starting at a multiple of 16 bytes from the
    block's start (zero bytes between them), in its codec.

A stream's payload: raw, its elements (layers, entries, *shape) as they are; a quantizing codec, the payload of
one 2-D matrix (engram/codec/fp4_reference.py to_bytes) whose groups run along its rows: axis token,
(layers * entries * prod(shape[:-1]), shape[-1]); axis channel, (layers * width, entries), entries padded to
whole groups. A stream with no entries (a compressed stream in a short partial block) has an empty payload.
Payloads start 16-aligned so a raw stream can be viewed as its dtype where it lies (the hit path writes from
that view: no extra pass).

Everything little-endian. Parsing rejects a bad magic or version, unknown codec/axis/dtype, a body of the wrong
size for its records, and either checksum failing, with an error that says which.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from torch import Tensor

from engram.codec.base import Codec, CodecId, codec_by_id, codec_by_name
from engram.errors import InvalidArgument
from engram.layout import MAX_STREAMS, Axis, DType, StreamSpec

MAGIC = b"EGKV"
VERSION = 2
ALIGN = 16
_FIXED = struct.Struct("<4sBBHIIQQ")  # 32 bytes
_RECORD = struct.Struct("<8sBBBBII3I")  # 32 bytes
_CHECK = struct.Struct("<Q")
BODY_CHECKSUM_AT = 24


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def checksum_at(streams: int) -> int:
    """Where the header checksum lies: after the fixed fields and the stream records."""
    return _FIXED.size + _RECORD.size * streams


@dataclass(frozen=True)
class Part:
    """One stream's place and form in a v2 block."""

    name: str
    codec: Codec
    axis: Axis
    dtype: DType
    layers: int
    entries: int
    shape: tuple[int, ...]
    at: int  # byte offset of its payload from the block's start
    nbytes: int

    @property
    def width(self) -> int:
        return math.prod(self.shape)

    @property
    def quantized(self) -> bool:
        return self.codec.codec_id != CodecId.RAW

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return (self.layers, self.entries, *self.shape)

    @property
    def matrix(self) -> tuple[int, int]:
        """The (rows, cols) matrix the codec sees, cols unpadded (raw: the elements in their own order)."""
        if self.quantized and self.axis == Axis.CHANNEL:
            return (self.layers * self.width, self.entries)
        return (self.layers * self.entries * self.width // self.shape[-1], self.shape[-1])


@dataclass(frozen=True)
class StreamsFormat:
    """The parsed (or planned) header of a v2 block."""

    tokens: int
    parts: tuple[Part, ...]
    body_len: int
    body_checksum: int = 0

    @property
    def body_at(self) -> int:
        return _align(checksum_at(len(self.parts)) + _CHECK.size)

    @property
    def nbytes(self) -> int:
        return self.body_at + self.body_len

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)


def _part_nbytes(codec: Codec, axis: Axis, dtype: DType, layers: int, entries: int, shape: tuple[int, ...]) -> int:
    probe = Part("", codec, axis, dtype, layers, entries, shape, 0, 0)
    rows, cols = probe.matrix
    if rows * cols == 0:
        return 0
    return codec.matrix_nbytes((rows, cols), dtype.torch_dtype)


def _layout(tokens: int, items: Sequence[tuple[str, Codec, Axis, DType, int, int, tuple[int, ...]]],
            body_checksum: int = 0) -> StreamsFormat:
    if not 1 <= len(items) <= MAX_STREAMS:
        raise InvalidArgument(f"a v2 block holds 1..{MAX_STREAMS} streams, got {len(items)}")
    at = _align(checksum_at(len(items)) + _CHECK.size)
    body_at = at
    parts = []
    for name, codec, axis, dtype, layers, entries, shape in items:
        at = _align(at)
        n = _part_nbytes(codec, axis, dtype, layers, entries, shape)
        parts.append(Part(name, codec, axis, dtype, layers, entries, shape, at, n))
        at += n
    return StreamsFormat(tokens, tuple(parts), at - body_at, body_checksum)


def plan(streams: Sequence[StreamSpec], layers: int, tokens: int) -> StreamsFormat:
    """The v2 block of `tokens` tokens of these streams (codecs resolved: engram.layout.StreamSpec.resolved)."""
    return _layout(tokens, [(s.name, codec_by_name(s.codec), s.axis, s.dtype, layers, s.entries(tokens), s.shape)
                            for s in streams])


def raw_streams(streams: Sequence[StreamSpec]) -> tuple[StreamSpec, ...]:
    """The same streams, each raw: the form a worker may send them in for the daemon to encode."""
    return tuple(StreamSpec(s.name, s.shape, s.dtype, "raw", s.axis, s.compress) for s in streams)


def _header(fmt: StreamsFormat, body_checksum: int, *, sealed: bool) -> bytes:
    head = bytearray(_FIXED.pack(MAGIC, VERSION, len(fmt.parts), 0, fmt.tokens, 0, fmt.body_len, body_checksum))
    for p in fmt.parts:
        dims = list(p.shape) + [0] * (3 - len(p.shape))
        head += _RECORD.pack(p.name.encode(), int(p.codec.codec_id), int(p.axis), int(p.dtype), len(p.shape),
                             p.layers, p.entries, *dims)
    head += _CHECK.pack(xxhash.xxh3_64_intdigest(bytes(head)) if sealed else 0)
    return bytes(head) + bytes(fmt.body_at - len(head))


def unsealed_header(fmt: StreamsFormat) -> bytes:
    """The header (padded to the body) with both checksums zero: a worker writes it in place, and the daemon
    computes the checksums from the bytes as they lie in its pool (engram/sealing.py)."""
    return _header(fmt, 0, sealed=False)


def assemble(fmt: StreamsFormat, payloads: Sequence[bytes | memoryview]) -> bytes:
    """A sealed v2 block from its planned header and each stream's payload."""
    body = bytearray(fmt.body_len)
    for p, payload in zip(fmt.parts, payloads, strict=True):
        if len(payload) != p.nbytes:
            raise InvalidArgument(f"stream {p.name}: payload of {len(payload)} bytes, its format needs {p.nbytes}")
        start = p.at - fmt.body_at
        body[start : start + p.nbytes] = payload
    return _header(fmt, xxhash.xxh3_64_intdigest(body), sealed=True) + bytes(body)


def assembled(fmt: StreamsFormat, payloads: Sequence[bytes | memoryview]) -> memoryview:
    """`assemble` for a worker thread, as a view of a fresh array: each stream copied in by numpy, which lets go of
    the GIL (a bytearray's slice assignment and bytes(), one memcpy each, hold it: a decoding Get's thread held the
    daemon's event loop for each of its streams and for the block twice over: benchmarks/RESULTS.md, put_get,
    session 53). Byte for byte `assemble`'s block."""
    out = np.zeros(fmt.nbytes, np.uint8)  # zeros: the gaps between streams, and the pages only as they are written
    for p, payload in zip(fmt.parts, payloads, strict=True):
        n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if n != p.nbytes:
            raise InvalidArgument(f"stream {p.name}: payload of {n} bytes, its format needs {p.nbytes}")
        if n:
            np.copyto(out[p.at : p.at + n], np.frombuffer(payload, np.uint8))
    view = memoryview(out)  # type: ignore[arg-type]
    out[: fmt.body_at] = np.frombuffer(_header(fmt, xxhash.xxh3_64_intdigest(view[fmt.body_at :]), sealed=True),
                                       np.uint8)
    return view


def to_matrix(x: Tensor, part: Part) -> Tensor:
    """A stream's tensor (layers, entries, *shape) as the matrix its codec sees (a view where it can be)."""
    rows, cols = part.matrix
    if part.quantized and part.axis == Axis.CHANNEL:
        return x.reshape(part.layers, part.entries, part.width).permute(0, 2, 1).reshape(rows, cols)
    return x.reshape(rows, cols)


def from_matrix(m: Tensor, part: Part) -> Tensor:
    """The inverse of to_matrix: (layers, entries, *shape)."""
    if part.quantized and part.axis == Axis.CHANNEL:
        return m.reshape(part.layers, part.width, part.entries).permute(0, 2, 1).reshape(part.tensor_shape)
    return m.reshape(part.tensor_shape)


def check_data(data: Mapping[str, Tensor], fmt: StreamsFormat, where: str = "block") -> None:
    """Every stream present, of its shape and dtype, and no other."""
    names = [p.name for p in fmt.parts]
    if set(data) != set(names):
        raise InvalidArgument(f"{where}: streams {sorted(data)} given; the layout has {names}")
    for p in fmt.parts:
        t = data[p.name]
        if tuple(t.shape) != p.tensor_shape or t.dtype != p.dtype.torch_dtype:
            raise InvalidArgument(f"{where}: stream {p.name} is {tuple(t.shape)} {t.dtype}; the layout needs "
                                  f"(layers, entries, *shape) = {p.tensor_shape} {p.dtype.torch_dtype}")


def encode(data: Mapping[str, Tensor], streams: Sequence[StreamSpec], tokens: int, *,
           backend: str = "reference", where: str = "block") -> bytes:
    """A block's streams (name -> (layers, entries, *shape)) as a v2 block in the streams' codecs."""
    layers = next(iter(data.values())).shape[0] if data else 0
    fmt = plan(streams, int(layers), tokens)
    check_data(data, fmt, where)
    payloads = []
    for p in fmt.parts:
        if p.nbytes == 0:
            payloads.append(b"")
            continue
        payloads.append(p.codec.encode_matrix(to_matrix(data[p.name], p), backend, f"stream {p.name}"))
    return assemble(fmt, payloads)


def parse_header(blob: bytes | memoryview, where: str = "block") -> StreamsFormat:
    """Parse and verify a v2 block's header (its own checksum, known version, codecs and fields); the body is
    not read. InvalidArgument says what is wrong."""
    if len(blob) < _FIXED.size:
        raise InvalidArgument(f"{where}: {len(blob)} bytes is shorter than a v2 block header")
    magic, version, count, _, tokens, _, body_len, body_ck = _FIXED.unpack_from(blob)
    if magic != MAGIC:
        raise InvalidArgument(f"{where}: bad magic {bytes(magic)!r}; not an Engram block")
    if version != VERSION:
        raise InvalidArgument(f"{where}: block format version {version}, where a stream layout's blocks are "
                              f"version {VERSION}")
    if not 1 <= count <= MAX_STREAMS or len(blob) < checksum_at(count) + _CHECK.size:
        raise InvalidArgument(f"{where}: header of {count} streams does not fit in {len(blob)} bytes")
    (head_ck,) = _CHECK.unpack_from(blob, checksum_at(count))
    if xxhash.xxh3_64_intdigest(bytes(blob[: checksum_at(count)])) != head_ck:
        raise InvalidArgument(f"{where}: header checksum mismatch")
    items = []
    for i in range(count):
        name, codec_id, axis, dtype, ndim, layers, entries, *dims = _RECORD.unpack_from(blob, _FIXED.size + i * 32)
        try:
            if not 1 <= ndim <= 3 or any(dims[ndim:]) or not all(dims[:ndim]):
                raise ValueError(f"entry shape {dims} of ndim {ndim}")
            items.append((name.rstrip(b"\0").decode("ascii"), codec_by_id(codec_id), Axis(axis), DType(dtype),
                          layers, entries, tuple(dims[:ndim])))
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{where}: stream record {i}: bad field: {exc}") from None
    fmt = _layout(tokens, items, body_ck)
    if fmt.body_len != body_len:
        raise InvalidArgument(f"{where}: header says a body of {body_len} bytes; its streams make {fmt.body_len}")
    return fmt


def parse(blob: bytes | memoryview, where: str = "block") -> StreamsFormat:
    """Parse and verify a v2 block: its header, then its body's size and checksum."""
    fmt = parse_header(blob, where)
    if len(blob) != fmt.nbytes:
        raise InvalidArgument(f"{where}: {len(blob)} bytes; its header describes a block of {fmt.nbytes}")
    if xxhash.xxh3_64_intdigest(memoryview(blob)[fmt.body_at :]) != fmt.body_checksum:
        raise InvalidArgument(f"{where}: body checksum mismatch")
    return fmt


def payload(blob: bytes | memoryview, part: Part) -> memoryview:
    return memoryview(blob)[part.at : part.at + part.nbytes]


def check_scales(blob: bytes | memoryview, fmt: StreamsFormat, where: str = "block") -> None:
    """Raise InvalidArgument unless every quantized stream's payload decodes (valid scales), read in place
    without decoding: what a daemon asks of a block a worker encoded, at put time."""
    for p in fmt.parts:
        if p.quantized and p.nbytes:
            p.codec.check_matrix(payload(blob, p), p.matrix, f"{where}: stream {p.name}", p.dtype.torch_dtype)


def decode_part(blob: bytes | memoryview, part: Part, *, backend: str = "reference",
                device: torch.device | str = "cpu", where: str = "block") -> Tensor:
    """One stream of a parsed block: (layers, entries, *shape) in its dtype."""
    if part.nbytes == 0:
        return torch.empty(part.tensor_shape, dtype=part.dtype.torch_dtype, device=device)
    try:
        m = part.codec.decode_matrix(payload(blob, part), part.matrix, part.dtype.torch_dtype, backend, device)
    except ValueError as exc:  # impossible scale bytes
        raise InvalidArgument(f"{where}: stream {part.name}: {exc}") from None
    return from_matrix(m, part)


def decode(blob: bytes | memoryview, *, backend: str = "reference", device: torch.device | str = "cpu",
           where: str = "block") -> dict[str, Tensor]:
    """A v2 block back to its streams, name -> (layers, entries, *shape), each in its recorded dtype."""
    fmt = parse(blob, where)
    return {p.name: decode_part(blob, p, backend=backend, device=device, where=where) for p in fmt.parts}


def matches(fmt: StreamsFormat, streams: Sequence[StreamSpec], layers: int, tokens: int) -> bool:
    """Whether a parsed block is exactly the block these (resolved) streams plan."""
    return fmt.tokens == tokens and fmt.parts == plan(streams, layers, tokens).parts

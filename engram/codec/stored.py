"""A KV block in its stored form and back: the one set of functions every path (client put and get, the
store's encoding of raw puts, Resume, the daemon-side decode) goes through, so "is this raw?" and "is this a
stream layout's block?" are asked in one place.

The stored form of a K/V layout's block (L, 2, T, H, D) is its element bytes for the raw codec, and a v1 block
(engram/codec/blockformat.py: header, checksums, codec body) for every quantizing codec. A stream layout's block
(name -> (layers, entries, *shape)) is always a v2 block (engram/codec/streamformat.py), BlockHeader.codec
"streams", each stream in its own codec; a worker may also send it with every stream raw, and the daemon
encodes it as stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from engram.block import copied
from engram.codec import blockformat, streamformat
from engram.codec.base import Axis, codec_by_name
from engram.errors import InvalidArgument
from engram.layout import STREAMS_CODEC, DType, StreamSpec

RAW = "raw"
STREAMS = STREAMS_CODEC
BlockKV = Tensor | dict[str, Tensor]  # a K/V layout's block tensor, or a stream layout's streams


def is_raw(codec: str) -> bool:
    return codec in ("", RAW)


def is_streams(codec: str) -> bool:
    return codec == STREAMS


def stored_nbytes(codec: str, shape: tuple[int, ...], dtype: DType, streams: Sequence[StreamSpec] = ()) -> int:
    """Payload bytes of a block of this shape in this codec (a stream layout's: its resolved streams')."""
    if is_streams(codec):
        layers, _, tokens = shape
        return streamformat.plan(streams, layers, tokens).nbytes
    if is_raw(codec):
        n = dtype.itemsize
        for d in shape:
            n *= d
        return n
    return blockformat.encoded_nbytes(codec_by_name(codec), shape, dtype)  # type: ignore[arg-type]


def encode(kv: Tensor, codec: str, *, backend: str = "reference") -> bytes:
    """The stored form of a K/V layout's block (on any device; the Triton backend encodes on the GPU)."""
    if is_raw(codec):
        return kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return blockformat.encode(kv, codec_by_name(codec), backend=backend)


def encode_lossless(kv: Tensor) -> bytes:
    """A K/V block kept bit-exact in a quantizing model's stored form: a v1 block of the raw codec (codec id 0).
    v1 is self-describing, so every decode of the model's blocks reads it; the lossless fallback stores it
    (engram/store/quality.py)."""
    return blockformat.encode(kv, codec_by_name(RAW))


def lossless_nbytes(shape: tuple[int, ...], dtype: DType) -> int:
    """Payload bytes of `encode_lossless` for a block of this shape."""
    return blockformat.encoded_nbytes(codec_by_name(RAW), shape, dtype)  # type: ignore[arg-type]


def encode_streams(data: Mapping[str, Tensor], streams: Sequence[StreamSpec], tokens: int, *,
                   backend: str = "reference", where: str = "block") -> bytes:
    """A stream layout's block as a v2 block, each stream in its codec (streams resolved)."""
    return streamformat.encode(data, streams, tokens, backend=backend, where=where)


def decode(payload: bytes | memoryview | Tensor, codec: str, dtype: DType, shape: tuple[int, ...], *,
           backend: str = "reference", device: torch.device | str = "cpu", where: str = "block") -> Tensor:
    """A K/V layout's stored block back to its KV tensor on `device`. A uint8 tensor payload (a zero-copy
    Get's copy) is used as it is; bytes are copied once (torch.frombuffer needs a writable buffer)."""
    if is_streams(codec):
        raise InvalidArgument(f"{where} is a stream layout's block; decode it with decode_block")
    if is_raw(codec):
        buf = payload if isinstance(payload, Tensor) else byte_tensor(payload)
        return buf.view(dtype.torch_dtype).reshape(tuple(shape)).to(device)
    return blockformat.decode(_host_bytes(payload), backend=backend, device=device, where=where)


def byte_tensor(data: bytes | memoryview) -> Tensor:
    """Bytes as a writable uint8 tensor: one copy, block.copied's, which lets go of the GIL (a copy into a
    bytearray, one memcpy too, holds it: a raw put's 16 MiB copy in the daemon's encoding thread held its event
    loop all the same). No bytes is an empty tensor (a window of 0 rows: a model whose sliding window is 1, or
    with no sliding layer)."""
    return torch.from_numpy(np.asarray(copied(memoryview(data))))


def decode_block(payload: bytes | memoryview | Tensor, codec: str, dtype: DType, shape: tuple[int, ...], *,
                 backend: str = "reference", device: torch.device | str = "cpu", where: str = "block") -> BlockKV:
    """Any stored block back to what it holds: a K/V tensor, or a stream layout's streams."""
    if is_streams(codec):
        return streamformat.decode(_host_bytes(payload), backend=backend, device=device, where=where)
    return decode(payload, codec, dtype, shape, backend=backend, device=device, where=where)


def as_raw(payload: bytes | memoryview, codec: str, dtype: DType, shape: tuple[int, ...], *,
           backend: str = "reference", where: str = "block") -> bytes | memoryview:
    """A stored block decoded, in the form a raw put sends (raw elements; a v2 block of raw streams). A K/V
    layout's block is a view of the decoded tensor's bytes, not a copy into bytes: `tobytes` is one memcpy that
    holds the GIL throughout (32 MiB: the daemon's event loop waited for it beside the decoding thread). A stream
    layout's is assembled from views of each decoded stream by numpy's copies (streamformat.assembled), for the same
    reason."""
    if is_streams(codec):
        fmt = streamformat.parse(payload, where)
        raw = streamformat._layout(fmt.tokens, [(p.name, codec_by_name(RAW), p.axis, p.dtype, p.layers, p.entries,
                                                 p.shape) for p in fmt.parts])
        payloads = [memoryview(payload)[p.at : p.at + p.nbytes] if not p.quantized else
                    # flattened first: a permuted view whose last dim has size 1 counts as contiguous to torch yet keeps
                    # a stride other than 1 there, which view(uint8) refuses (an entry shape ending in 1)
                    element_bytes(streamformat.decode_part(payload, p, backend=backend, where=where))
                    for p in fmt.parts]
        return streamformat.assembled(raw, payloads)
    return element_bytes(decode(payload, codec, dtype, shape, backend=backend, where=where))


def element_bytes(kv: Tensor) -> memoryview:
    """A tensor's elements as a flat byte view, `encode(kv, RAW)` without its copy (one only where kv is not
    contiguous on the host, made by torch, which lets go of the GIL); the view keeps the tensor's storage alive."""
    return memoryview(kv.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _host_bytes(payload: bytes | memoryview | Tensor) -> bytes | memoryview:
    return memoryview(payload.cpu().numpy().data) if isinstance(payload, Tensor) else payload


def check_encoded(payload: bytes | memoryview, codec: str, dtype: DType, shape: tuple[int, ...], where: str) -> None:
    """A block a worker encoded itself must parse, verify, decode (valid scales), and describe the block
    its header announces."""
    if is_raw(codec):
        return
    fmt = blockformat.check(payload, where)
    if fmt.shape != tuple(shape) or fmt.dtype != dtype:
        raise InvalidArgument(f"{where}: its v1 header says shape {fmt.shape} {fmt.dtype.name}, its BlockHeader "
                              f"{tuple(shape)} {dtype.name}")
    # The hit path decodes runs of blocks as one batch, K per channel and V per token, without their headers:
    # a block quantized along other axes (the same size when T and D are multiples of the group) would decode
    # to other values there.
    if fmt.codec.name != codec or fmt.k_axis != Axis.CHANNEL or fmt.v_axis != Axis.TOKEN:
        raise InvalidArgument(f"{where}: its v1 body is {fmt.codec.name} with K along {fmt.k_axis.name.lower()} and V "
                              f"along {fmt.v_axis.name.lower()}; this model stores {codec} with K per channel and V "
                              "per token (encode it with engram's codec defaults)")


def stored_streams(payload: bytes | memoryview, streams: Sequence[StreamSpec], shape: tuple[int, ...], *,
                   backend: str = "reference", where: str = "block") -> bytes:
    """A stream layout's block as the daemon stores it: the v2 block must hold exactly the layout's streams
    (names, shapes, dtypes, axes, layers, entries); a stream sent raw whose codec is another is encoded here,
    one sent in its own codec is kept as it is. Returns the stored bytes (the payload itself when nothing
    changed)."""
    fmt = streamformat.parse(payload, where)
    layers, _, tokens = shape
    want = streamformat.plan(streams, layers, tokens)
    if fmt.tokens != tokens or len(fmt.parts) != len(want.parts):
        raise InvalidArgument(f"{where}: its v2 header holds {len(fmt.parts)} streams of {fmt.tokens} tokens; the "
                              f"block is {tokens} tokens of {[p.name for p in want.parts]}")
    encoded: list[bytes | memoryview] = []
    changed = False
    for got, need in zip(fmt.parts, want.parts, strict=True):
        same_form = (got.name, got.axis, got.dtype, got.layers, got.entries, got.shape) == \
                    (need.name, need.axis, need.dtype, need.layers, need.entries, need.shape)
        if not same_form:
            raise InvalidArgument(f"{where}: stream {got.name} is {got.tensor_shape} {got.dtype.name} axis "
                                  f"{got.axis.name}; the layout's {need.name} is {need.tensor_shape} "
                                  f"{need.dtype.name} axis {need.axis.name}")
        if got.codec == need.codec:
            if got.quantized and got.nbytes:  # a worker's own encoding must decode, or every later Get fails
                got.codec.check_matrix(streamformat.payload(payload, got), got.matrix, f"{where}: stream {got.name}",
                                       got.dtype.torch_dtype)
            encoded.append(streamformat.payload(payload, got))
        elif not got.quantized:
            x = streamformat.decode_part(payload, got, where=where)
            encoded.append(b"" if need.nbytes == 0 else
                           need.codec.encode_matrix(streamformat.to_matrix(x, need), backend, f"stream {need.name}"))
            changed = True
        else:
            raise InvalidArgument(f"{where}: stream {got.name} is {got.codec.name}; this model stores it as "
                                  f"{need.codec.name} (send it so, or raw)")
    if not changed:
        return bytes(payload)
    return streamformat.assemble(want, encoded)

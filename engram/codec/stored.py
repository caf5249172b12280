"""A KV block in its stored form and back: the one pair of functions every path (client put and get, the
store's encoding of raw puts, Resume, the daemon-side decode) goes through, so "is this raw?" is asked in
one place.

The stored form of a block (L, 2, T, H, D) is its element bytes for the raw codec, and a v1 block
(engram/codec/blockformat.py: header, checksums, codec body) for every quantizing codec.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engram.codec import blockformat
from engram.codec.base import codec_by_name
from engram.errors import InvalidArgument
from engram.layout import DType

RAW = "raw"


def is_raw(codec: str) -> bool:
    return codec in ("", RAW)


def stored_nbytes(codec: str, shape: tuple[int, ...], dtype: DType) -> int:
    """Payload bytes of a block of this shape in this codec."""
    if is_raw(codec):
        n = dtype.itemsize
        for d in shape:
            n *= d
        return n
    return blockformat.encoded_nbytes(codec_by_name(codec), shape, dtype)  # type: ignore[arg-type]


def encode(kv: Tensor, codec: str, *, backend: str = "reference") -> bytes:
    """The stored form of a block (on any device; the Triton backend encodes on the GPU)."""
    if is_raw(codec):
        return kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return blockformat.encode(kv, codec_by_name(codec), backend=backend)


def decode(payload: bytes | memoryview | Tensor, codec: str, dtype: DType, shape: tuple[int, ...], *,
           backend: str = "reference", device: torch.device | str = "cpu", where: str = "block") -> Tensor:
    """A stored block back to its KV tensor on `device`. A uint8 tensor payload (a zero-copy Get's copy) is
    used as it is; bytes are copied once (torch.frombuffer needs a writable buffer)."""
    if is_raw(codec):
        if isinstance(payload, Tensor):
            buf = payload
        else:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buf.view(dtype.torch_dtype).reshape(tuple(shape)).to(device)
    blob = memoryview(payload.numpy()) if isinstance(payload, Tensor) else payload  # type: ignore[arg-type]
    return blockformat.decode(blob, backend=backend, device=device, where=where)


def check_encoded(payload: bytes | memoryview, codec: str, dtype: DType, shape: tuple[int, ...], where: str) -> None:
    """A block a worker encoded itself must parse, verify, decode (valid scales), and describe the block
    its header announces."""
    if is_raw(codec):
        return
    fmt = blockformat.check(payload, where)
    if fmt.shape != tuple(shape) or fmt.dtype != dtype:
        raise InvalidArgument(f"{where}: its v1 header says shape {fmt.shape} {fmt.dtype.name}, its BlockHeader "
                              f"{tuple(shape)} {dtype.name}")

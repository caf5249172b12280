"""Payloads as chunks under the message limit, and chunks back into payloads: the one chunker and the one
reassembler that Put, Get, Resume and FetchBlocks streams use on both sides."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from engram.errors import DataLoss, InvalidArgument

H = TypeVar("H")

FRAME_BYTES = 64  # a chunk's message less its payload and its other fields' bytes: tags, lengths, the last flag


def payload_step(chunk_bytes: int, max_message_bytes: int, fixed: int) -> int:
    """Payload bytes each of a block's chunks may carry so that every message stays under max_message_bytes, the
    first's other fields (`fixed` bytes: the block's header with its tokens, its key, a peer's MAC...) included: a
    header of a few thousand tokens passes the 4 KiB that chunk_bytes leaves under the limit. At least 1."""
    return max(1, min(chunk_bytes, max_message_bytes - fixed - FRAME_BYTES))


def pieces(payload: bytes | memoryview, step: int) -> Iterator[tuple[bytes, bool]]:
    """(piece, last) for consecutive pieces of at most `step` bytes; an empty payload is one empty piece,
    so every block has a first chunk to carry its header."""
    if step < 1:
        raise ValueError(f"chunk size must be positive, got {step}")
    n = len(payload)
    if n <= step:  # the common case: no slicing copy at all
        yield (payload if isinstance(payload, bytes) else bytes(payload)), True
        return
    view = memoryview(payload)
    for off in range(0, n, step):
        yield bytes(view[off : off + step]), off + step >= n


class Reassembler(Generic[H]):
    """Collects one block at a time from chunks: the first chunk carries the header (announcing the payload
    size), the last one is flagged. `expected_size(header)` gives the announced size, so an oversized block
    is refused before it is buffered; `check(header)` may refuse a header before any payload is kept.

    `damaged` is the error class for a malformed stream: InvalidArgument on the server (bad client input),
    DataLoss on the client (a daemon sent a broken stream)."""

    def __init__(self, expected_size: Callable[[H], int], *, check: Callable[[H], None] | None = None,
                 damaged: type[Exception] = InvalidArgument, what: str = "block") -> None:
        self._size = expected_size
        self._check = check
        self._damaged = damaged
        self._what = what
        self.header: H | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def open(self) -> bool:
        """Inside a block: its header arrived, its last chunk not yet."""
        return self.header is not None

    @property
    def received(self) -> int:
        return self._received

    def add(self, header: H | None, data: bytes, last: bool, index: int) -> tuple[H, bytes] | None:
        """Feed one chunk of block `index`; returns (header, payload) once the block is complete."""
        if self.header is None:
            if header is None:
                raise self._damaged(f"{self._what} {index}: its first chunk must carry the BlockHeader")
            if self._check is not None:
                self._check(header)
            self.header = header
        elif header is not None:
            raise self._damaged(f"{self._what} {index}: a second BlockHeader arrived before the block's last chunk")
        self._received += len(data)
        want = self._size(self.header)
        if self._received > want:
            raise self._damaged(f"{self._what} {index}: received more payload bytes than the {want} announced")
        self._parts.append(data)
        if not last:
            return None
        done = self.header
        payload = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self.header, self._parts, self._received = None, [], 0
        return done, payload


def client_reassembler(expected_size: Callable[[H], int], what: str = "block") -> Reassembler[H]:
    """A reassembler for what a daemon streams: a malformed stream is DataLoss."""
    return Reassembler(expected_size, damaged=DataLoss, what=what)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, data: bytes | memoryview) -> list[bytes | memoryview]:
    """A length-delimited protobuf field, as parts to join."""
    return [_varint(number << 3 | 2), _varint(len(data)), data]


def chunk_frames(field: int, key: bytes, header: bytes, payload: bytes | memoryview, step: int) -> Iterator[bytes]:
    """A block as serialized messages whose field `field` is a BlockChunk{header, key, data, last} (GetResponse's
    chunk is field 1, PutRequest's field 2), each built with one copy of its piece of the payload: building the
    messages (BlockChunk(data=...), the wrapper, SerializeToString) copied it three times. `header` is a
    serialized BlockHeader, `key` may be empty; parsing a frame gives exactly the message protobuf would have
    built (tests/test_wire_frames.py)."""
    view = memoryview(payload)
    n = len(view)
    offsets = range(0, n, step) if n else range(1)
    for i, off in enumerate(offsets):
        piece = view[off : off + step]
        last = off + step >= n
        chunk = (_field(1, header) + (_field(4, key) if key else []) if i == 0 else []) + _field(2, piece)
        if last:
            chunk.append(b"\x18\x01")  # field 3 (last), varint 1
        size = sum(len(p) for p in chunk)
        yield b"".join([_varint(field << 3 | 2), _varint(size), *chunk])


def bytes_frames(field: int, payload: bytes | memoryview, step: int) -> Iterator[bytes]:
    """`payload` in pieces of at most `step` bytes, as serialized messages whose bytes field `field` holds a piece
    (ResumeResponse's window_chunk is field 2, its global_kv_chunk field 3), each with one copy of its piece: a
    message built and serialized copied it three times. An empty payload is one message of an empty piece, as
    `pieces` gives."""
    view = memoryview(payload)
    n = len(view)
    for off in range(0, n, step) if n else range(1):
        piece = view[off : off + step]
        yield b"".join([_varint(field << 3 | 2), _varint(len(piece)), piece])


async def answered(result: Any, context: Any) -> Any:
    """What a gRPC handler's call returned, as grpc.aio takes it from a coroutine: awaited, or, for a generator
    (a streaming handler behind a wrapper that is a coroutine), its items written with context.write."""
    if inspect.isasyncgen(result):
        async for item in result:
            await context.write(item)
        return None
    return await result

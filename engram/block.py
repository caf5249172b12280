"""One block as it travels: its header (tokens, dtype, shape, size, checksum) and the checks a payload
must pass before the store accepts it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from engram.borrowed import in_thread
from engram.errors import InvalidArgument, brief
from engram.layout import DType, KVLayout

# A block's bytes as a put hands them over: bytes (or gRPC's chunks joined in a bytearray), or a view of the data
# channel's receive buffer, which is reused after the put (a tier that keeps bytes in memory copies a view:
# DramTier.write). Said exactly because compiled modules (engram/compiled.py) check argument types at run time.
Payload = bytes | memoryview


def checksum(payload: bytes | memoryview) -> int:
    """xxh3_64 of a payload: an integrity check against torn writes and bit flips, not an adversary
    (block keys, which an adversary could target, use BLAKE2b: engram/keys.py)."""
    return xxhash.xxh3_64_intdigest(payload)


def checksums(payloads: Iterable[bytes | memoryview]) -> list[int]:
    """`checksum` of each payload, with no Python run between two of them: xxh3 lets go of the GIL while it
    hashes, so a thread hashing many blocks takes the GIL back only to start the next, never to run bytecode
    that other threads (the event loop, a batch's booking) would wait for."""
    return list(map(xxhash.xxh3_64_intdigest, payloads))


# A payload at least this big is hashed in a worker thread (xxhash lets go of the GIL while it hashes), not on the
# event loop. Below it the thread's round trip (0.1-0.25 ms on a 2-core host) costs the call more than it spares the
# loop: a freshly received 4 MiB hashes in 0.09 ms, 8 MiB 0.15, 16 MiB 0.6 (2-3 ms under load), against 0.04-0.1
# of the loop's time to hand it over. Measured: benchmarks/RESULTS.md, put_get, session 50.
CHECKSUM_OFF_LOOP_BYTES = 8 * 2**20


# A copy of at least this many bytes into or out of a memory tier (a put's copy into the pool, a demotion's copy out
# of it) is made in a worker thread (a memcpy lets go of the GIL), awaited to its end even by a cancelled caller
# (engram/borrowed.py). Below it the copy stays in the cache and costs less than the thread's round trip: on the dev
# host, into a pool slot 4 MiB 0.10 ms, 8 MiB 0.31-0.44, 16 MiB 1.0 (2-4 under load); out of one into new bytes
# 0.12, 0.5, 1.2-1.3 (and the fresh pages' faults). Measured: benchmarks/RESULTS.md, put_get, session 51.
COPY_OFF_LOOP_BYTES = 8 * 2**20


async def checksum_off_loop(payload: bytes | memoryview) -> int:
    """checksum() of a payload, in a worker thread when it is large, so that the event loop's other calls (a
    worker's other requests, the other clients sharing its loop, the daemon's other connections) do not wait for
    it: 16 MiB is 2-3 ms of hashing. The hash has ended when this returns, cancelled or not (engram/borrowed.py):
    the payload may be a buffer its caller reuses next (the data channel's receive buffer)."""
    if (payload.nbytes if isinstance(payload, memoryview) else len(payload)) < CHECKSUM_OFF_LOOP_BYTES:
        return checksum(payload)
    return await in_thread(checksum, payload)


def copied(view: memoryview) -> memoryview:
    """A copy of a buffer's bytes (a pool slot's), made letting go of the GIL: numpy's copy into a fresh array
    (bytes(view), one memcpy too, holds it; a thread's copy held the event loop all the same)."""
    out = np.empty(view.nbytes, np.uint8)
    np.copyto(out, np.frombuffer(view, np.uint8))
    return memoryview(out)  # type: ignore[arg-type]


async def copy_off_loop(view: memoryview) -> bytes | memoryview:
    """A copy of a buffer's bytes (a pool slot's): bytes(view) on the loop when small, `copied` in a worker thread
    when large (COPY_OFF_LOOP_BYTES). The copy has ended when this returns, cancelled or not (engram/borrowed.py):
    the slot's block must be held until then."""
    if view.nbytes < COPY_OFF_LOOP_BYTES:
        return bytes(view)
    return await in_thread(copied, view)


@dataclass(frozen=True)
class BlockHeader:
    tokens: np.ndarray  # (num_tokens,) int32
    dtype: DType
    shape: tuple[int, ...]
    payload_nbytes: int
    checksum: int
    codec: str = "raw"  # "raw": the elements as they are; "streams": a v2 block; otherwise a v1 block in this codec

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def validate(self, layout: KVLayout, *, index: int, model_codec: str = "") -> None:
        """Raise InvalidArgument, saying what to change, when the header does not fit the layout.
        (That only a chain's last block may be partial is checked by the store: a partial block has
        no children.) model_codec: the model's codec, which a stream layout's streams default to."""
        where = f"block {index}"
        n = self.num_tokens
        if n == 0:
            raise InvalidArgument(f"{where}: a block needs at least one token")
        if n > layout.block_tokens:
            raise InvalidArgument(f"{where}: {n} tokens exceed the layout's block_tokens={layout.block_tokens}")
        if self.dtype != layout.dtype:
            raise InvalidArgument(f"{where}: dtype {self.dtype.name} does not match the layout's {layout.dtype.name}")
        want = layout.block_shape(n)
        if tuple(self.shape) != want:
            what = "(persisted_layers, streams, tokens)" if layout.has_streams else \
                "(persisted_layers, 2, tokens, kv_heads, head_dim)"
            raise InvalidArgument(f"{where}: shape {tuple(self.shape)} does not match the layout's {what} = {want}")
        from engram.codec import stored  # the codec stack (torch numerics) only where used

        if layout.has_streams:
            if not stored.is_streams(self.codec):
                raise InvalidArgument(f"{where}: a stream layout's blocks are v2 blocks with codec "
                                      f"{stored.STREAMS!r}, not {brief(self.codec)!r}")
            from engram.codec.streamformat import raw_streams

            streams = layout.resolved_streams(model_codec)
            sizes = {stored.stored_nbytes(self.codec, want, layout.dtype, streams),
                     stored.stored_nbytes(self.codec, want, layout.dtype, raw_streams(streams))}
            if self.payload_nbytes not in sizes:
                raise InvalidArgument(f"{where}: payload_nbytes {self.payload_nbytes} is neither the block as stored "
                                      f"nor with every stream raw ({sorted(sizes)} bytes for {n} tokens)")
            return
        if stored.is_streams(self.codec):
            raise InvalidArgument(f"{where}: codec {brief(self.codec)!r} is a stream layout's; this model has the K/V layout")
        expected = stored.stored_nbytes(self.codec, want, layout.dtype)
        # a quantizing model's block may also be kept lossless, a v1 block of the raw codec (the fallback of
        # engram/store/quality.py): a peer serves it so, and it is sent so on Get
        if self.payload_nbytes != expected and (stored.is_raw(self.codec)
                                                or self.payload_nbytes != stored.lossless_nbytes(want, layout.dtype)):
            raise InvalidArgument(
                f"{where}: payload_nbytes {self.payload_nbytes} != {expected} for shape {want} in codec {brief(self.codec)}"
            )

    async def verify_payload(self, payload: bytes | memoryview, *, index: int) -> None:
        """The payload is the one the header describes: its size, and its checksum (a large one hashed off the
        event loop: checksum_off_loop)."""
        if len(payload) != self.payload_nbytes:
            raise InvalidArgument(
                f"block {index}: received {len(payload)} payload bytes, header announced {self.payload_nbytes}"
            )
        got = await checksum_off_loop(payload)
        if got != self.checksum:
            raise InvalidArgument(
                f"block {index}: payload checksum {got:#018x} != header checksum {self.checksum:#018x} "
                "(corrupted in transit, or the checksum was computed over other bytes)"
            )


class BlockRecord(NamedTuple):
    """A stored block's identity and description: what the index needs to serve it, and what a tier
    that outlives the process (NVMe) writes beside the payload so the index can be rebuilt. A named tuple,
    not a frozen dataclass: every copy a tier takes builds one, and a frozen dataclass took 1.2 us to build
    (a tuple 0.35), a tenth of a put's whole cost in the compiled store."""

    key: bytes
    parent: bytes
    model_fingerprint: bytes
    namespace: str
    dtype: DType
    full: bool
    shape: tuple[int, ...]
    tokens: bytes  # int32 little-endian
    nbytes: int  # payload bytes
    checksum: int  # xxh3_64 of the payload

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

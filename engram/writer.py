"""The worker side of the put path: a sequence's KV, encoded where it lies, written straight into the slots the
daemon reserved in its shared DRAM pool (ReservePut), before CommitPut publishes it. On the same host, KV never
travels through gRPC messages.

On a GPU the blocks go in runs of up to `chunk_bytes` of stored bytes: the current stream encodes run i into a
staging buffer (engram/codec/batched.py: a few launches for the whole run, whatever the codec), and a side stream
copies it into the pool slots (device -> pinned host: the worker registered the mapping with CUDA) while run
i+1 is encoded. On the CPU each block is encoded (or, raw, copied) straight into its slot.

Blocks are written as stored, in the model's codec: raw elements, v1 blocks, or a stream layout's v2 blocks (each
stream in its codec), their checksums left zero;
the daemon computes every checksum from the bytes as they lie in its pool (engram/store/inplace.py), so what it
certifies is what it will serve.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engram.codec import batched, blockformat, stored
from engram.codec.base import codec_by_name
from engram.errors import InvalidArgument
from engram.layout import DType, ModelSpec, StreamSpec
from engram.loader import DEFAULT_CHUNK_BYTES, MappedSegment
from engram.loadgate import LoadGate

_STAGES = 2
_ALIGN = 256


@dataclass(frozen=True)
class Slot:
    """Where block `index` of the sequence goes: a reserved slot of a mapped (writable) pool."""

    index: int
    segment: MappedSegment
    offset: int
    nbytes: int


def _copy_out(chunk: Sequence[Slot], buf: Tensor, size: int, compute: torch.cuda.Stream, copy: torch.cuda.Stream,
              free: torch.cuda.Event) -> int:
    """Queue the copies of a chunk's encoded blocks (block i at buf[i * size]) into their pool slots on the side
    stream `copy`, once `compute` has made them; `free` is recorded after them (the stage's buffer may be
    reused). Returns the bytes queued."""
    ready = torch.cuda.Event()
    ready.record(compute)
    copy.wait_event(ready)
    with torch.cuda.stream(copy):
        for i, s in enumerate(chunk):
            s.segment.data[s.offset : s.offset + s.nbytes].copy_(buf[i * size : i * size + s.nbytes],
                                                                 non_blocking=True)
        free.record(copy)
    buf.record_stream(copy)
    return sum(s.nbytes for s in chunk)


def _block(kv: Tensor, index: int, block_tokens: int) -> Tensor:
    return kv[:, :, index * block_tokens : (index + 1) * block_tokens]


def stream_block(data: Mapping[str, Tensor], streams: Sequence[StreamSpec], index: int, block_tokens: int,
                 tokens: int) -> dict[str, Tensor]:
    """Block `index` of a stream layout's sequence of `tokens` tokens: each stream's entries of its tokens (a
    compressed stream's entry belongs to the block holding its last token; blocks hold whole entries)."""
    start = index * block_tokens
    n = min(block_tokens, tokens - start)
    return {s.name: data[s.name][:, start // s.compress : (start + n) // s.compress] for s in streams}


class PutWriter:
    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.gate: LoadGate | None = None  # loads this writer gives way to, before each run of blocks
        self._staging: dict[torch.device, list[Tensor]] = {}
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        # Puts of one client run in threads of their own and share the staging buffers: one put's encode into a
        # buffer could land before another's copy of it into the pool had run (that block stored the other's KV).
        self._staging_lock = threading.Lock()

    def write(self, kv: Tensor | Mapping[str, Tensor], spec: ModelSpec, slots: Sequence[Slot],
              stream: torch.cuda.Stream | None = None, *, tokens: int = 0) -> int:
        """Encode the blocks of kv (L, 2, T, H, D) that `slots` name and write each into its slot; returns the
        stored bytes written. Returns once every byte is in the pool (a GPU's copies have completed). A stream
        layout's kv is its streams, name -> (L, T // compress, *shape), for `tokens` tokens."""
        if isinstance(kv, Mapping):
            return self._write_streams(kv, tokens, spec, slots, stream)
        codec = spec.codec or stored.RAW
        bt = spec.layout.block_tokens
        if kv.is_cuda:
            stream = stream or torch.cuda.current_stream(kv.device)
            with self._staging_lock, torch.cuda.device(kv.device), torch.cuda.stream(stream):
                return self._write_cuda(kv, codec, bt, slots, stream)
        written = 0
        for s in slots:
            self._give_way()
            block = _block(kv, s.index, bt)
            target = s.segment.data[s.offset : s.offset + s.nbytes]
            if stored.is_raw(codec):
                target.view(block.dtype).view(block.shape).copy_(block)
            else:
                blob = blockformat.encode(block, codec_by_name(codec))
                target.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            written += s.nbytes
        return written

    def _stages(self, device: torch.device) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
        """The device's side stream for the copies into the pool, and one event per staging buffer, recorded on it
        (each buffer free to start with)."""
        copy = self._copy_streams.get(device)
        if copy is None:
            copy = self._copy_streams[device] = torch.cuda.Stream(device)
        free = [torch.cuda.Event() for _ in range(_STAGES)]
        for e in free:
            e.record(copy)
        return copy, free

    def _write_cuda(self, kv: Tensor, codec: str, bt: int, slots: Sequence[Slot], compute: torch.cuda.Stream) -> int:
        device = kv.device
        copy, free = self._stages(device)
        full = [s for s in slots if _block(kv, s.index, bt).shape[2] == bt]
        partial = [s for s in slots if s not in full]
        written = 0
        stage = 0
        bad = torch.zeros((), dtype=torch.bool, device=device)  # NaN/Inf in any block: checked once, at the end
        plan = None
        if full and not stored.is_raw(codec):
            try:
                plan = batched.plan(codec, DType.from_torch(kv.dtype), tuple(_block(kv, full[0].index, bt).shape))
            except ValueError:  # groups that do not tile the block: one block at a time, as a partial one
                partial, full = list(slots), []
        for chunk in self._chunks(full):
            n = len(chunk)
            size = -(-chunk[0].nbytes // _ALIGN) * _ALIGN
            self._give_way()
            compute.wait_event(free[stage])  # the copies that last read this stage's buffer are done
            blocks = torch.stack([_block(kv, s.index, bt) for s in chunk])  # (n, L, 2, bt, H, D), one copy
            if plan is None:  # raw: the contiguous block is the stored form
                buf = blocks.view(n, -1).view(torch.uint8).view(-1)
                size = chunk[0].nbytes
            else:
                buf = self._buffer(device, stage, n * size)
                offsets = torch.arange(n, dtype=torch.int64, device=device) * size
                bad |= batched.encode_blocks(blocks, plan, buf, offsets, backend="triton")
            written += _copy_out(chunk, buf, size, compute, copy, free[stage])
            stage = (stage + 1) % _STAGES
        for s in partial:  # the chain's partial tail: encoded on its own, written from the host
            block = _block(kv, s.index, bt)
            blob = stored.encode(block, codec, backend="triton")
            s.segment.data[s.offset : s.offset + s.nbytes].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            written += s.nbytes
        copy.synchronize()
        if bool(bad):
            raise InvalidArgument(f"the KV holds NaN or Inf values: it cannot be stored as {codec}")
        return written

    def _write_streams(self, data: Mapping[str, Tensor], tokens: int, spec: ModelSpec, slots: Sequence[Slot],
                       stream: torch.cuda.Stream | None) -> int:
        streams = spec.streams
        bt = spec.layout.block_tokens
        device = next(iter(data.values())).device
        if device.type == "cuda":
            stream = stream or torch.cuda.current_stream(device)
            with self._staging_lock, torch.cuda.device(device), torch.cuda.stream(stream):
                return self._write_streams_cuda(data, tokens, spec, slots, stream)
        written = 0
        for s in slots:
            self._give_way()
            n = min(bt, tokens - s.index * bt)
            blob = stored.encode_streams(stream_block(data, streams, s.index, bt, tokens), streams, n,
                                         where=f"block {s.index}")
            s.segment.data[s.offset : s.offset + s.nbytes].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            written += s.nbytes
        return written

    def _write_streams_cuda(self, data: Mapping[str, Tensor], tokens: int, spec: ModelSpec, slots: Sequence[Slot],
                            compute: torch.cuda.Stream) -> int:
        """As _write_cuda, stream by stream: per run one stacking copy, one amax and one encode launch per
        quantized stream (a raw stream: one strided copy), then the copies into the pool on a side stream."""
        streams = spec.streams
        bt = spec.layout.block_tokens
        device = next(iter(data.values())).device
        copy, free = self._stages(device)
        full = [s for s in slots if tokens - s.index * bt >= bt]
        partial = [s for s in slots if s not in full]
        plan = None
        if full:
            try:
                plan = batched.streams_plan(streams, spec.layout.persisted_layers, bt)
            except ValueError:  # groups that do not tile a stream: one block at a time, as a partial one
                partial, full = list(slots), []
        written = 0
        stage = 0
        bad = torch.zeros((), dtype=torch.bool, device=device)  # NaN/Inf in any block: checked once, at the end
        for chunk in self._chunks(full):
            assert plan is not None
            n = len(chunk)
            size = -(-plan.nbytes // _ALIGN) * _ALIGN
            self._give_way()
            compute.wait_event(free[stage])  # the copies that last read this stage's buffer are done
            parts = [torch.stack([stream_block(data, (st,), s.index, bt, tokens)[st.name] for s in chunk])
                     for st in streams]  # per stream (n, L, entries, *shape): one copy
            buf = self._buffer(device, stage, n * size)
            offsets = torch.arange(n, dtype=torch.int64, device=device) * size
            bad |= batched.encode_streams(parts, plan, buf, offsets, backend="triton")
            written += _copy_out(chunk, buf, size, compute, copy, free[stage])
            stage = (stage + 1) % _STAGES
        for s in partial:  # the chain's partial tail: encoded on its own, written from the host
            n = min(bt, tokens - s.index * bt)
            blob = stored.encode_streams(stream_block(data, streams, s.index, bt, tokens), streams, n,
                                         backend="triton", where=f"block {s.index}")
            s.segment.data[s.offset : s.offset + s.nbytes].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
            written += s.nbytes
        copy.synchronize()
        if bool(bad):
            raise InvalidArgument("the KV holds NaN or Inf values: it cannot be stored in its streams' codecs")
        return written

    def _give_way(self) -> None:
        if self.gate is not None:
            self.gate.give_way()

    def _chunks(self, slots: Sequence[Slot]) -> list[list[Slot]]:
        chunks: list[list[Slot]] = [[]]
        size = 0
        for s in slots:
            if chunks[-1] and size + s.nbytes > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(s)
            size += s.nbytes
        return [c for c in chunks if c]

    def _buffer(self, device: torch.device, stage: int, nbytes: int) -> Tensor:
        bufs = self._staging.setdefault(device, [torch.empty(0, dtype=torch.uint8, device=device)] * _STAGES)
        if bufs[stage].numel() < nbytes:
            bufs[stage] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return bufs[stage]

    def close(self) -> None:
        self._staging.clear()
        with contextlib.suppress(Exception):
            for s in self._copy_streams.values():
                s.synchronize()
        self._copy_streams.clear()



"""The worker side of the hit path: a prefix's blocks, wherever the daemon described them, into the worker's own
KV memory (engram/destinations.py) with the fewest passes over the bytes.

Sources of a block, as a GetPrefix answer gives them:
- a slot of the daemon's shared DRAM pool: the worker maps the segment once and registers the mapping with
  CUDA in its own process, so a copy out of it is a DMA at PCIe speed (pinned memory), not a staged copy;
- a slot of the daemon's HBM pool, opened by CUDA IPC on the same GPU: decoded where it lies;
- bytes that came over the socket (a block on NVMe only, or another host).

On a GPU the blocks go in runs of up to `chunk_bytes`: the copy engine moves run i+1 into a staging buffer (on
a side stream) while the current stream decodes run i (engram/codec/batched.py: one launch per payload and
run) and writes it into the destination; a ring of staging buffers and events keeps the two in step, with no
host synchronisation until the end. Raw blocks need no decode: the staged run is viewed as (blocks, L, 2, T,
H, D) and written. On the CPU the same writes read straight from the mapping, one pass. A stream layout's v2
blocks go stream by stream: one launch per quantized stream and run, a raw stream written from a view of the
staged bytes, and each stream handed to the destination (engram/codec/batched.py decode_streams).

Integrity: the daemon verified each block's checksum when it was stored and leases the described slots
against reuse; the loader checks each pool slot's page generations before it copies and again once the DMA of
its run has completed, and returns the blocks whose slot was reused meanwhile (the caller fetches those as
bytes and writes them again). Checksums are not recomputed here: that would read every byte back to the host.
A pool block whose bytes do not decode (a v1 header or body that fails its checksum, or an FP4 group scale
that is negative or NaN, where the codec checks them: on the host) is returned the same way: fetched as bytes,
the daemon verifies it, drops the damaged copy and serves another, or DATA_LOSS. It raised the codec's
ValueError out of every load of the prefix, the daemon never told (an audit, session 43). The GPU's batched
kernels check no scales, so there a damaged pool copy is decoded as it is (docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engram import codec as kvcodec
from engram.codec import batched, stored
from engram.destinations import KVDestination
from engram.errors import DataLoss, InvalidArgument
from engram.layout import DType, StreamSpec
from engram.segment import SegmentReader

log = logging.getLogger("engram.loader")

DEFAULT_CHUNK_BYTES = 64 * 2**20  # stored bytes staged per run: large enough for few launches, small on the GPU
_STAGES = 2  # staging buffers in the ring: one filling while the other is decoded
_ALIGN = 256
# What decoding bytes that are not a valid block raises: the codecs' checks (ValueError) and a v1 or v2 header's
# (InvalidArgument: bad magic, a checksum mismatch).
UNDECODABLE = (ValueError, InvalidArgument)


@dataclass(frozen=True)
class BlockSource:
    """One block of the prefix and where its stored bytes are."""

    index: int  # its position in the prefix
    codec: str
    dtype: DType
    shape: tuple[int, ...]  # (L, 2, T, H, D); a stream layout's: (L, streams, T)
    nbytes: int
    segment: MappedSegment | None = None  # a slot of a shared pool...
    offset: int = 0
    generation: int = 0
    device_pool: Tensor | None = None  # ... or of an HBM pool opened by CUDA IPC ...
    payload: bytes | Tensor | None = None  # ... or its bytes
    streams: tuple[StreamSpec, ...] = ()  # a stream layout's block (codec "streams"): its streams, codecs resolved

    @property
    def tokens(self) -> int:
        return int(self.shape[2])


class MappedSegment:
    """A daemon's shared segment mapped in this process, its data area registered with CUDA (when there is a
    GPU) so that copies from it are DMAs. Registration pins nothing new (the daemon's pages are pinned
    already) but costs time once per process, like mapping. It lasts as long as the object: unregistered when
    the last holder (a cache, a load or put in flight) lets go, then unmapped with the last tensor viewing it
    (unregistering or unmapping under a copy in flight would fail it, or turn a read into a segfault)."""

    def __init__(self, path: str, segment_id: bytes, *, register: bool, writable: bool = False) -> None:
        self.reader = SegmentReader(path, segment_id, writable=writable)
        self.data = self.reader.data()
        self.registered = False
        if register and self.data.numel():
            cudart = torch.cuda.cudart()
            # Portable (1): any CUDA context may DMA; ReadOnly (8) for a read-only mapping.
            err = cudart.cudaHostRegister(self.data.data_ptr(), self.data.numel(), 1 if writable else 8 | 1)
            self.registered = int(err) == 0
            if not self.registered:
                log.warning("could not register %s with CUDA (%s): hits from it are staged copies", path, err)
            else:
                # Called as this object goes, before its attributes (the mapping) do; not at interpreter exit.
                weakref.finalize(self, _unregister, self.data.data_ptr()).atexit = False

    @property
    def segment_id(self) -> bytes:
        return self.reader.layout.segment_id

    def current(self, offset: int, length: int, generation: int) -> bool:
        return self.reader.current(offset, length, generation)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass
class LoadReport:
    blocks: int = 0
    tokens: int = 0
    # prefix positions of pool blocks to fetch as bytes: their slot was reused, or their bytes do not decode
    stale: list[int] = field(default_factory=list)
    staged_bytes: int = 0  # stored bytes moved host -> device


def _host_view(src: BlockSource) -> Tensor:
    """The block's stored bytes on the host, as a uint8 tensor (a view of the mapping, or of its payload)."""
    if src.segment is not None and src.device_pool is None:
        return src.segment.data[src.offset : src.offset + src.nbytes]
    if isinstance(src.payload, Tensor):
        return src.payload
    assert src.payload is not None
    return torch.frombuffer(bytearray(src.payload), dtype=torch.uint8)


def _raw_view(buf: Tensor, n: int, shape: tuple[int, ...], dtype: DType) -> Tensor:
    """n raw blocks back to back in buf: (n, L, 2, T, H, D)."""
    return buf.view(dtype.torch_dtype)[: n * _numel(shape)].view(n, *shape)


def _one_buffer(run: list[BlockSource], bufs: list[Tensor] | None, staged: Tensor | None,
                offsets: list[int] | None) -> tuple[Tensor, list[int]]:
    """A run's blocks in one buffer, with their byte offsets in it: the staging buffer as it is, or the blocks'
    own buffers concatenated (back to back)."""
    if staged is None:
        assert bufs is not None
        staged = torch.cat(bufs) if len(bufs) > 1 else bufs[0]
        offsets = [i * run[0].nbytes for i in range(len(run))]
    assert offsets is not None
    return staged, offsets


def _device_offsets(offsets: list[int], device: torch.device) -> Tensor:
    """Offsets as an int64 tensor on the device without a synchronising copy: evenly spaced ones (a staged
    run) are made there; others go through pinned memory (a copy from pageable memory would wait for the
    stream, stalling the pipeline)."""
    if device.type != "cuda":
        return torch.tensor(offsets, dtype=torch.int64)
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    if all(o == offsets[0] + i * step for i, o in enumerate(offsets)):
        return torch.arange(len(offsets), dtype=torch.int64, device=device) * step + offsets[0]
    return torch.tensor(offsets, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


class PrefixLoader:
    def __init__(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._staging: dict[torch.device, list[Tensor]] = {}
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        # Loads of one client run in threads of their own and share the staging buffers: one load's copy into a
        # buffer could land before another's decode of it had run (that load's destination got this one's KV).
        self._staging_lock = threading.Lock()

    def load(self, sources: Sequence[BlockSource], dest: KVDestination, *, block_tokens: int, n_tokens: int,
             stream: torch.cuda.Stream | None = None) -> LoadReport:
        """Write tokens [0, n_tokens) of the prefix whose blocks are `sources` (in prefix order, block i
        holding tokens [i * block_tokens, ...)) into dest. On a GPU, writes are queued on `stream` (default:
        the current stream) and the call returns once the host copies have completed (the pool slots may
        be reused from then on); the writes themselves complete in stream order."""
        with torch.inference_mode():  # the destination may hold inference tensors (a model's cache under it)
            return self._load(sources, dest, block_tokens, n_tokens, stream)

    def _load(self, sources: Sequence[BlockSource], dest: KVDestination, block_tokens: int, n_tokens: int,
              stream: torch.cuda.Stream | None) -> LoadReport:
        report = LoadReport(tokens=n_tokens)
        todo = [s for s in sources if s.index * block_tokens < n_tokens]
        report.blocks = len(todo)
        for s in todo:  # generations before: a slot reused already is not worth copying
            if s.segment is not None and not s.segment.current(s.offset, s.nbytes, s.generation):
                report.stale.append(s.index)
        todo = [s for s in todo if s.index not in report.stale]
        if dest.device.type == "cuda":
            stream = stream or torch.cuda.current_stream(dest.device)
            with self._staging_lock, torch.cuda.device(dest.device), torch.cuda.stream(stream):
                self._load_cuda(todo, dest, block_tokens, n_tokens, stream, report)
        else:
            for run in self._runs(todo, block_tokens):
                self._write_each(run, [_host_view(s) for s in run], dest, block_tokens, n_tokens, report,
                                 backend=kvcodec.host_backend())
        undecodable = set(report.stale)
        for s in todo:  # generations after: a slot reused while we copied is fetched again
            if (s.segment is not None and s.index not in undecodable
                    and not s.segment.current(s.offset, s.nbytes, s.generation)):
                report.stale.append(s.index)
        report.stale.sort()
        return report

    # ---- runs ---------------------------------------------------------------------------------------

    @staticmethod
    def _runs(sources: Sequence[BlockSource], block_tokens: int) -> list[list[BlockSource]]:
        """Consecutive blocks of one kind (host or device pool), codec and full shape, in prefix order; a
        partial block is a run of its own."""
        runs: list[list[BlockSource]] = []
        for s in sorted(sources, key=lambda s: s.index):
            last = runs[-1][-1] if runs else None
            if (last is not None and last.index + 1 == s.index and last.codec == s.codec
                    and last.shape == s.shape and last.nbytes == s.nbytes and s.tokens == block_tokens
                    and (last.device_pool is None) == (s.device_pool is None)):
                runs[-1].append(s)
            else:
                runs.append([s])
        return runs

    def _write_each(self, run: list[BlockSource], bufs: list[Tensor] | None, dest: KVDestination,
                    block_tokens: int, n_tokens: int, report: LoadReport, *, backend: str,
                    staged: Tensor | None = None, offsets: list[int] | None = None) -> None:
        """`_write`; a run that does not decode is written block by block (a run is decoded whole before any of
        it is written), and a block of it that does not decode is, when it lies in a pool, reported stale (the
        caller fetches it as bytes, which the daemon verifies); one that came as bytes verified on arrival
        and still does not decode is DataLoss."""
        try:
            self._write(run, bufs, dest, block_tokens, n_tokens, backend=backend, staged=staged, offsets=offsets)
            return
        except UNDECODABLE as exc:
            if len(run) == 1:
                src = run[0]
                if src.segment is None:
                    raise DataLoss(f"block {src.index} arrived intact but does not decode ({exc})") from exc
                log.warning("block %d of the prefix does not decode where it lies in the daemon's pool (%s); "
                            "fetching it as bytes", src.index, exc)
                report.stale.append(src.index)
                return
        for i, src in enumerate(run):
            self._write_each([src], None if bufs is None else [bufs[i]], dest, block_tokens, n_tokens, report,
                             backend=backend, staged=staged, offsets=None if offsets is None else [offsets[i]])

    def _write(self, run: list[BlockSource], bufs: list[Tensor] | None, dest: KVDestination, block_tokens: int,
               n_tokens: int, *, backend: str, staged: Tensor | None = None, offsets: list[int] | None = None
               ) -> None:
        """Decode a run (its blocks' bytes as `bufs`, or at `offsets` of one `staged` buffer) and write it."""
        first = run[0]
        start = first.index * block_tokens
        count = min(n_tokens, start + len(run) * first.tokens) - start
        if stored.is_streams(first.codec):
            parts = self._decode_streams(run, bufs, backend, staged, offsets)
            for i, (st, data) in enumerate(zip(first.streams, parts, strict=True)):
                e0, e1 = start // st.compress, (start + count) // st.compress
                if e1 > e0:
                    dest.write(i, data, e0, e1 - e0)
            return
        if stored.is_raw(first.codec):
            if bufs is None:
                assert staged is not None and offsets is not None
                if offsets == [offsets[0] + i * first.nbytes for i in range(len(run))]:  # back to back: one view
                    kv = _raw_view(staged.narrow(0, offsets[0], len(run) * first.nbytes), len(run), first.shape,
                                   first.dtype)
                    dest.write(0, kv[:, :, 0], start, count)
                    dest.write(1, kv[:, :, 1], start, count)
                    return
                bufs = [staged.narrow(0, o, s.nbytes) for o, s in zip(offsets, run, strict=True)]
            for s, buf in zip(run, bufs, strict=True):  # scattered: each block is written from where it lies
                kv = _raw_view(buf, 1, s.shape, s.dtype)
                at = s.index * block_tokens
                n = min(n_tokens - at, s.tokens)
                dest.write(0, kv[:, :, 0], at, n)
                dest.write(1, kv[:, :, 1], at, n)
            return
        k, v = self._decode(run, bufs, backend, staged, offsets)
        dest.write(0, k, start, count)
        dest.write(1, v, start, count)

    @staticmethod
    def _decode(run: list[BlockSource], bufs: list[Tensor] | None, backend: str, staged: Tensor | None,
                offsets: list[int] | None) -> tuple[Tensor, Tensor]:
        first = run[0]
        try:
            plan = batched.plan(first.codec, first.dtype, first.shape)
        except ValueError:
            plan = None  # a partial block, or groups that do not tile it: one block at a time
        if plan is not None and first.nbytes != plan.nbytes:
            plan = None  # a block kept lossless (v1, raw codec: engram/store/quality.py): its own header says so
        if plan is not None:
            staged, offsets = _one_buffer(run, bufs, staged, offsets)
            return batched.decode_blocks(staged, _device_offsets(offsets, staged.device), plan, backend=backend)
        if bufs is None:
            assert staged is not None and offsets is not None
            bufs = [staged.narrow(0, o, s.nbytes) for o, s in zip(offsets, run, strict=True)]
        device = bufs[0].device
        # v1 headers are parsed on the host: a partial block's bytes (a few MiB at most) go there first.
        kv = torch.stack([stored.decode(b.cpu(), s.codec, s.dtype, s.shape, backend=backend, device=device,
                                        where=f"block {s.index}") for b, s in zip(bufs, run, strict=True)])
        return kv[:, :, 0], kv[:, :, 1]

    @staticmethod
    def _decode_streams(run: list[BlockSource], bufs: list[Tensor] | None, backend: str, staged: Tensor | None,
                        offsets: list[int] | None) -> list[Tensor]:
        """Each stream of a run of v2 blocks: (blocks, L, entries, *shape), in the layout's stream order."""
        first = run[0]
        try:
            plan = batched.streams_plan(first.streams, first.shape[0], first.tokens)
        except ValueError:
            plan = None  # groups that do not tile a stream: one block at a time
        if plan is not None:
            staged, offsets = _one_buffer(run, bufs, staged, offsets)
            return batched.decode_streams(staged, offsets, _device_offsets(offsets, staged.device), plan,
                                          backend=backend)
        if bufs is None:
            assert staged is not None and offsets is not None
            bufs = [staged.narrow(0, o, s.nbytes) for o, s in zip(offsets, run, strict=True)]
        device = bufs[0].device
        # v2 headers are parsed on the host: a partial block's bytes (a few MiB at most) go there first.
        blocks = [stored.decode_block(b.cpu(), s.codec, s.dtype, s.shape, backend=backend, device=device,
                                      where=f"block {s.index}") for b, s in zip(bufs, run, strict=True)]
        return [torch.stack([b[s.name] for b in blocks]) for s in first.streams]  # type: ignore[index]

    # ---- the GPU pipeline -------------------------------------------------------------------------------

    def _load_cuda(self, sources: list[BlockSource], dest: KVDestination, block_tokens: int, n_tokens: int,
                   compute: torch.cuda.Stream, report: LoadReport) -> None:
        device = dest.device
        backend = "triton"
        copy = self._copy_streams.get(device)
        if copy is None:
            copy = self._copy_streams[device] = torch.cuda.Stream(device)
        free = [torch.cuda.Event() for _ in range(_STAGES)]
        for e in free:
            e.record(compute)
        stage = 0
        last_copy: torch.cuda.Event | None = None
        last_read: torch.cuda.Event | None = None  # the last decode that read the HBM pool in place
        for run in self._runs(sources, block_tokens):
            if run[0].device_pool is not None:  # the daemon's HBM pool: decode where it lies
                pool = run[0].device_pool
                for chunk in self._chunks(run):
                    self._write_each(chunk, None, dest, block_tokens, n_tokens, report, backend=backend,
                                     staged=pool, offsets=[s.offset for s in chunk])
                last_read = torch.cuda.Event()
                last_read.record(compute)
                continue
            for chunk in self._chunks(run):
                nbytes = sum(-(-s.nbytes // _ALIGN) * _ALIGN for s in chunk)
                buf = self._buffer(device, stage, nbytes)
                offsets = []
                copy.wait_event(free[stage])  # the decode that last read this buffer is done
                with torch.cuda.stream(copy):
                    at = 0
                    for s in chunk:
                        buf[at : at + s.nbytes].copy_(_host_view(s), non_blocking=True)
                        offsets.append(at)
                        at += -(-s.nbytes // _ALIGN) * _ALIGN
                    ready = torch.cuda.Event()
                    ready.record(copy)
                compute.wait_event(ready)
                self._write_each(chunk, None, dest, block_tokens, n_tokens, report, backend=backend, staged=buf,
                                 offsets=offsets)
                buf.record_stream(compute)
                free[stage].record(compute)
                report.staged_bytes += at
                last_copy = ready
                stage = (stage + 1) % _STAGES
        for event in (last_copy, last_read):
            if event is not None:
                event.synchronize()  # every read of a pool slot has completed: the generations are final

    def _chunks(self, run: list[BlockSource]) -> list[list[BlockSource]]:
        chunks: list[list[BlockSource]] = [[]]
        size = 0
        for s in run:
            if chunks[-1] and size + s.nbytes > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(s)
            size += s.nbytes
        return chunks

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

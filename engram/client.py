"""Client library for inference workers: put, look up and get KV blocks as torch tensors.

`EngramClient` is asyncio-native; `SyncEngramClient` runs one on a private event loop thread for
callers that are not async. A token (tenancy on) travels as `authorization: Bearer <token>` metadata on
every call; with a root certificate the channel is TLS. Every method returns engram.api dataclasses or
tensors, never protobuf; gRPC errors come back as the domain errors of engram.errors, with the server's
message (engram/wire/status.py maps them).

This module imports the wire, the codecs and the segment reader, and none of the daemon: a worker process
does not load the store, the tiers, redis or prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from engram import clientuse, errors
from engram import codec as kvcodec
from engram.api import (
    BlockRef,
    LoadResult,
    LookupResult,
    PutReply,
    PutResult,
    ResumeResult,
    SessionInfo,
    SessionMode,
)
from engram.block import checksum, checksum_off_loop
from engram.codec import stored
from engram.codec.streamformat import raw_streams
from engram.control import ControlClient
from engram.destinations import ContiguousKV, KVDestination, StreamsKV, check_fits
from engram.layout import DType, ModelSpec, StreamSpec
from engram.loader import BlockSource, MappedSegment, PrefixLoader
from engram.loadgate import LoadGate
from engram.mapped_pools import MappedPools
from engram.reregister import registering_again, say_registering_again
from engram.segment import SegmentReader
from engram.v1 import engram_pb2 as pb
from engram.wire import convert, deadline
from engram.wire import data as wire
from engram.wire.channel import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    same_host,
)
from engram.wire.data import Conn, DataChannel, Endpoint
from engram.wire.deadline import DEFAULT_TIMEOUT_S
from engram.wire.putstatus import DaemonStatus
from engram.wire.stream import Reassembler, chunk_frames, client_reassembler, payload_step
from engram.writer import PutWriter, Slot, stream_block

__all__ = ["EngramClient", "SyncEngramClient", "same_host"]

RELEASE_AFTER_S = 0.25  # a finished load's lease ends with the next load, or this long after it
# The least a granting call whose caller left is let run on for its answer, and a give-back waits for its own (a
# caller's timeout_s may be far below a loaded daemon's answers: a scheduler's 50 ms); close() cuts both sooner
FINISH_S = 30.0
IN_PLACE_MIN_BYTES = 16 * 2**20  # host-memory puts smaller than this take the data channel (_in_place_pays)

T = TypeVar("T")
WireRequest = tuple[bytes, Sequence[bytes | memoryview]]  # a data-channel request: its metadata and its payloads
log = logging.getLogger("engram.client")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor (bf16 included, which numpy cannot hold)."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _raw_view(kv: torch.Tensor) -> memoryview:
    """A raw block's payload as it lies: the bytes of a contiguous CPU tensor, not copied (others are copied
    once, to the host or into order)."""
    t = kv.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy().reshape(-1))  # type: ignore[arg-type]


def _backend_for(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" else kvcodec.host_backend()


def _device_of(kv: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.device:
    return kv.device if isinstance(kv, torch.Tensor) else next(iter(kv.values())).device


def _refuse_meta(device: torch.device | str, what: str) -> None:
    """InvalidArgument for KV on the meta device, which has shapes and no data: a put of it raised torch's
    NotImplementedError "Cannot copy out of meta tensor", a load into it answered its tokens loaded having
    written nothing (an audit, session 48)."""
    if torch.device(device).type == "meta":
        raise errors.InvalidArgument(f"{what} is on the meta device, which holds shapes and no data: use a tensor "
                                     "on the CPU or a GPU")


def _check_streams(spec: ModelSpec, kv: torch.Tensor | Mapping[str, torch.Tensor], tokens: int) -> None:
    """A stream layout's KV for `tokens` tokens: every stream, (layers, tokens // compress, *shape), its dtype."""
    lay = spec.layout
    if not isinstance(kv, Mapping):
        raise errors.InvalidArgument(f"{spec.name} has a stream layout: pass its streams as a dict, name -> "
                                     f"(layers, entries, *shape), for {[s.name for s in lay.stream_specs]}")
    names = [s.name for s in lay.stream_specs]
    if set(kv) != set(names):
        raise errors.InvalidArgument(f"kv has streams {sorted(kv)}; the layout's are {names}")
    devices = {t.device for t in kv.values()}
    if len(devices) != 1:
        raise errors.InvalidArgument(f"every stream must be on one device, got {sorted(map(str, devices))}")
    for s in lay.stream_specs:
        t, want = kv[s.name], lay.stream_shape(s, tokens)
        if tuple(t.shape) != want or t.dtype != s.dtype.torch_dtype:
            raise errors.InvalidArgument(f"stream {s.name} is {tuple(t.shape)} {t.dtype}; {tokens} tokens need "
                                         f"(layers, tokens // {s.compress}, *shape) = {want} {s.dtype.torch_dtype}")


def _in_chain(exc: errors.EngramError, start: int) -> errors.EngramError:
    """A part's error of a Put sent in parts, its `block N` counted in the whole chain (each part's Put counts
    from 0: a failure at block 5 of a chain said block 1)."""
    if not start:
        return exc
    msg, n = re.subn(r"\bblock (\d+)\b", lambda m: f"block {int(m.group(1)) + start}", str(exc), count=1)
    return type(exc)(msg if n else f"the part of the chain from block {start}: {exc}")


def _skippable(cached: Sequence[BlockRef], keys: Sequence[bytes], block_tokens: int) -> int:
    """How many leading blocks of a put its skip-cached Lookup lets it leave out: the whole cached blocks of its
    chain (a cached partial tail is superseded by what is sent) up to the first the daemon marks not_durable
    (write-through, no NVMe copy yet). That one and those after it are sent: the daemon's dedupe makes it durable
    again, or counts it not durable (degrade) or refuses the put (fail), and copies the ones before it to NVMe
    first if they lost their copy meanwhile. Skipped, it was acknowledged durable, and a SIGKILL lost it (an
    audit, session 46). A daemon from before marks none: every cached block is skipped, as then."""
    n = 0
    for ref, key in zip(cached, keys, strict=False):
        if ref.num_tokens != block_tokens or ref.key != key or ref.not_durable:
            break
        n += 1
    return n


@clientuse.given_up_on_close
class EngramClient(ControlClient):
    """The worker's client: the control calls of ControlClient (stats, listings, pin, ...) and the data path."""

    def __init__(
        self,
        address: str,
        *,
        namespace: str = "default",
        token: str = "",
        root_cert: bytes | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        zero_copy: bool | None = None,
        data_channel: bool = True,
        in_place_min_bytes: int = IN_PLACE_MIN_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """token: the tenant's bearer token (tenancy on); root_cert: PEM root certificate, for a daemon
        serving TLS. namespace: the default of every call; with a token, "" means the token's first.
        zero_copy: the same-host paths (hits copied out of the daemon's mapped pools, puts written into
        them in place); None: whenever the daemon is on this host; False: bytes over the socket only.
        data_channel: payloads that travel as bytes take the daemon's data channel (raw bytes on a socket
        beside gRPC, engram/wire/data.py) when it announces one; False: gRPC streams only.
        in_place_min_bytes: on the daemon's host, a put from host memory smaller than this goes over the data
        channel instead of in place (0: always in place). chunk_bytes: a gRPC Put's payload bytes per message, less
        where max_message_bytes or the daemon's own limit (said at register_model) leaves less room; this client
        receives messages of any size the daemon sends.
        timeout_s: the longest any call waits on the daemon (30 s): a unary call's deadline, and for a stream
        (Get, Put, Resume, the data channel) the longest wait for its next message or bytes, however long it
        runs; past it the call fails DeadlineExceeded, an Unavailable (engram/wire/deadline.py)."""
        if chunk_bytes + 4096 > max_message_bytes:
            raise ValueError("chunk_bytes must leave room for headers under max_message_bytes")
        super().__init__(address, namespace=namespace, token=token, root_cert=root_cert,
                         max_message_bytes=max_message_bytes, timeout_s=timeout_s)
        self.chunk_bytes = chunk_bytes
        self._token, self._root_cert = token, root_cert
        # Put over gRPC with requests serialized by chunk_frames (bytes pass through a None serializer)
        put = self._channel.stream_unary("/engram.v1.Engram/Put", request_serializer=None,
                                         response_deserializer=pb.PutResponse.FromString)
        self._put_frames = (functools.partial(put, metadata=(("authorization", f"Bearer {token}"),)) if token
                            else put)
        self._data_wanted = data_channel
        self.in_place_min_bytes = in_place_min_bytes
        # What one request may carry, as the daemon says when a model is registered (until then: no bound but ours):
        self._max_blocks = 1 << 62  # blocks (or keys) it may name
        self._max_tokens = 1 << 62  # tokens a Lookup may name
        self._max_message = max_message_bytes  # bytes of one gRPC message sent: ours, or the daemon's if less
        self._data: DataChannel | None = None
        self._data_asked: asyncio.Task[DataChannel | None] | None = None  # the DataEndpoint call in flight, shared
        self._data_replaced: set[DataChannel] = set()  # channels replaced with requests still in flight (_exchange)
        self._layouts: dict[bytes, ModelSpec] = {}
        # The daemon's pools this process maps, for zero-copy Gets, loads, in-place puts and CUDA IPC (each let go
        # once a daemon restart removed it)
        self._pools = MappedPools()
        self._zero_copy_ok = zero_copy is not False and same_host(address)
        self._releasing: set[asyncio.Task[None]] = set()  # lease releases (and cut grants' give-backs) in flight
        self._finishing: set[asyncio.Future[Any]] = set()  # granting calls whose caller left, let finish (_granting)
        self._salts: dict[str, tuple[str, bytes]] = {}  # name -> (namespace, key salt), from DescribeNamespace
        self._loader = PrefixLoader()  # the hit path (engram/loader.py)
        self._writer = PutWriter()  # the put path on the daemon's host (engram/writer.py)
        self._gate: LoadGate | None = None  # loads this client's puts give way to (give_way_to)
        self._in_place_ok = True
        self._said_unmapped: set[str] = set()  # "hits", "puts": the fallbacks to bytes already logged
        self._held: dict[str, list[int]] = {}  # finished loads' leases, by namespace: ended with the next load
        self._flush: asyncio.TimerHandle | None = None

    async def close(self) -> None:
        """End held leases, let go of the daemon's pools (each unmapped once no load or put holds it) and close
        the channel (the context manager does it). A later call raises ClientClosed, and so do the calls other
        tasks have in flight, given up (engram/clientuse.py)."""
        self._closing = True
        if self._flush is not None:
            self._flush.cancel()
        self._flush_held()
        if self._finishing:  # given timeout_s to answer (their grants then given back), then cut
            _, cut = await asyncio.wait(self._finishing, timeout=self.timeout_s)
            for answer in cut:  # what they grant is the daemon's to end (_answer_may_land)
                answer.cancel()
            await asyncio.gather(*self._finishing, return_exceptions=True)
        if self._releasing:  # within timeout_s, as every call: a give-back may wait FINISH_S while the client is open
            _, late = await asyncio.wait(self._releasing, timeout=self.timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*self._releasing, return_exceptions=True)
        self._loader.close()
        self._writer.close()
        self._pools.clear()
        if self._data_asked is not None:
            self._data_asked.cancel()  # a channel it made now would outlive the client
        for data in [*self._data_replaced, *([self._data] if self._data is not None else [])]:
            await data.aclose()
        self._data_replaced.clear()
        await super().close()

    # ---- models --------------------------------------------------------------------------------

    async def register_model(self, spec: ModelSpec) -> bytes:
        """Register a model; returns its fingerprint. Its codec, if left empty, is the daemon's default. The client
        remembers it: a call naming the fingerprint that the daemon answers UnknownModel (it restarted without a
        model registry, dropped the registration for room, an admin forgot the model) registers it again and is
        made once more, whole (lookup, put, put_blocks, get, get_prefix, load_prefix_into, open_session, pin:
        calls that can be repeated); a second UnknownModel is raised (engram/reregister.py)."""
        req = pb.RegisterModelRequest(model=convert.model_to_pb(spec))
        resp = await self._call(self._stub.RegisterModel, req)
        self._layouts[resp.model_fingerprint] = dataclasses.replace(spec, codec=resp.codec)
        # 0: an older daemon's silence
        if resp.max_blocks_per_request:  # requests naming more blocks go in parts
            self._max_blocks = resp.max_blocks_per_request
        if resp.max_tokens_per_request:
            self._max_tokens = resp.max_tokens_per_request
        if resp.max_message_bytes:  # a Put's chunks stay under it (it refused a larger one as INTERNAL, unlogged)
            self._max_message = min(self._max_message, resp.max_message_bytes)
        return resp.model_fingerprint

    def knows_model(self, fingerprint: bytes) -> bool:
        """Whether this client registered the model (and so registers it again when the daemon forgets it)."""
        return fingerprint in self._layouts

    async def register_again(self, fingerprint: bytes, cause: errors.UnknownModel) -> bool:
        """Register again a model this client registered and the daemon answered `cause` for (reregister.py);
        False when this client never registered it."""
        spec = self._layouts.get(fingerprint)  # its codec the one resolved then: the same fingerprint
        if spec is None:
            return False
        say_registering_again(spec.name, cause)
        if await self.register_model(spec) != fingerprint:
            raise cause
        return True

    def codec_of(self, fingerprint: bytes) -> str:
        """The codec the daemon stores this model's blocks in (register_model through this client first)."""
        return self._spec(fingerprint).codec

    def _spec(self, fingerprint: bytes) -> ModelSpec:
        try:
            return self._layouts[fingerprint]
        except KeyError:
            raise errors.UnknownModel("register the model through this client first (register_model)") from None

    # ---- lookup / put / get --------------------------------------------------------------------

    @registering_again
    async def lookup(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *, namespace: str | None = None,
                     probe: bool = False) -> LookupResult:
        """How many leading tokens are cached, and the blocks holding them (no KV moves), among the first
        server.max_tokens_per_request (the most one request may name). A lookup is a use of each block, which
        the daemon's eviction order learns from; probe: only the answer (no use counted, no age restarted), for
        a caller whose read of the blocks follows (GetPrefix counts it) or who only checks what it need not send."""
        req = pb.LookupRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint,
                               tokens=convert.tokens_to_pb(tokens[: self._max_tokens]), probe=probe)
        return convert.from_pb(LookupResult, await self._call(self._stub.Lookup, req))

    def give_way_to(self, gate: LoadGate | None) -> None:
        """Make this client's puts wait for the loads `gate` counts (engram/loadgate.py): before each put and,
        on the daemon's host, before each run of blocks written into the pool. For a client that saves in the
        background beside another that loads (the vLLM connector's); None: puts never wait."""
        self._gate = gate
        self._writer.gate = gate

    @registering_again
    async def put(
        self,
        fingerprint: bytes,
        tokens: Sequence[int] | np.ndarray,
        kv: torch.Tensor | Mapping[str, torch.Tensor],
        *,
        namespace: str | None = None,
        pin: bool = False,
        skip_cached: bool = True,
        encode: bool = False,
    ) -> PutResult:
        """Store the KV of a token sequence. kv: (persisted_layers, 2, len(tokens), kv_heads, head_dim); for a
        stream layout, its streams: name -> (persisted_layers, len(tokens) // compress, *shape), each in its dtype.

        On the daemon's host (and a daemon with a shared DRAM pool) the blocks are encoded here in the
        model's codec (the Triton kernels when kv is on a GPU, a few launches for all blocks) and written
        straight into pool slots the daemon reserved (ReservePut, CommitPut): no KV crosses the socket, and
        blocks already stored are skipped; from host memory only for 16 MiB or more (below, one message on
        the data channel is faster than two RPCs). Elsewhere they travel as bytes (the data channel): with
        skip_cached (the default) a Lookup first finds the cached prefix (within the first
        server.max_tokens_per_request tokens; under write-through, up to its first block with no NVMe copy
        yet, which the put then makes durable or reports) and only the blocks after it are sent (not with
        pin: the cached blocks would stay unpinned; every block is sent, and the daemon pins those it holds);
        with encode they are encoded here and travel 3.5-4x smaller, otherwise the daemon encodes them.
        """
        spec = self._spec(fingerprint)
        ns = self._ns(namespace)
        arr = convert.tokens_array(tokens)
        bt = spec.layout.block_tokens
        if spec.layout.has_streams:
            _check_streams(spec, kv, len(arr))
        elif not isinstance(kv, torch.Tensor) or tuple(kv.shape) != spec.layout.block_shape(len(arr)):
            # The whole shape, before a path is chosen: the in-place path lays bytes out by the layout, so a
            # (.., head_dim, kv_heads) tensor was stored as the model's KV there while the bytes path refused it.
            if not isinstance(kv, torch.Tensor | Mapping):  # sorted() of a numpy array raised "truth value ... ambiguous"
                raise errors.InvalidArgument(f"kv is a {type(kv).__module__}.{type(kv).__qualname__}, not a "
                                             "torch.Tensor: torch.from_numpy(kv) makes one of a numpy array")
            got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else f"streams {sorted(kv)}"
            raise errors.InvalidArgument(
                f"kv must be (persisted layers, 2, tokens, kv_heads, head_dim) = {spec.layout.block_shape(len(arr))} "
                f"for {len(arr)} tokens of {spec.name}, got {got}"
            )
        _refuse_meta(_device_of(kv), "kv")
        if self._gate is not None and self._gate.loads:
            await asyncio.to_thread(self._gate.give_way)
        in_place = None  # the blocks put in place before the put went on as bytes (if it did), and what it did
        if self._in_place_ok and self._zero_copy_ok and same_host(self.address) and await self._in_place_pays(kv):
            in_place = await self._put_in_place(fingerprint, spec, arr, kv, ns, pin)
            if in_place is not None and len(in_place.keys) * bt >= len(arr):
                return in_place
        # The rounds put in place are stored (with pin, pinned): sent again, they would be pinned twice
        placed = 0 if in_place is None else len(in_place.keys)
        all_keys = await self._chain_keys(ns, fingerprint, arr, bt)
        first = placed
        if skip_cached and not pin:  # with pin every block is sent: the daemon pins the ones it holds as it dedupes
            # Not a read: counts no use. Of the first server.max_tokens_per_request tokens (lookup): the cached blocks
            # among them are skipped and any after them sent (a longer prompt's whole Lookup was refused: never put).
            hit = await self.lookup(fingerprint, arr, namespace=ns, probe=True)
            if any(b.num_tokens == bt and b.key != k for b, k in zip(hit.blocks, all_keys, strict=False)):
                all_keys = await self._chain_keys(ns, fingerprint, arr, bt, again=True)
            first = max(placed, _skippable(hit.blocks, all_keys, bt))
        if in_place is not None and list(in_place.keys) != all_keys[:placed]:
            raise errors.DataLoss("the daemon stored the blocks put in place under other keys than this client "
                                  "computes (versions differ?)")
        before = in_place or PutResult((), 0, 0, 0)
        if first == len(all_keys):
            return dataclasses.replace(before, keys=tuple(all_keys), skipped=before.skipped + first - placed)
        try:
            reply = await self._put_from(fingerprint, arr, kv, all_keys, first, bt, ns, pin, encode)
        except errors.FailedPrecondition:
            if first == placed:
                raise
            # The cached prefix was evicted between our Lookup and the Put: send the chain after what went in place.
            first = placed
            reply = await self._put_from(fingerprint, arr, kv, all_keys, first, bt, ns, pin, encode)
        if list(reply.keys) != all_keys[first:]:
            all_keys = await self._chain_keys(ns, fingerprint, arr, bt, again=True)
        if list(reply.keys) != all_keys[first:]:
            raise errors.DataLoss("the daemon stored the blocks under other keys than this client computes with the "
                                  "namespace's salt and name it gives (asked again): the two key chains differently "
                                  "(versions differ?)")
        return dataclasses.replace(before, keys=tuple(all_keys), stored=before.stored + reply.stored,
                                   deduplicated=before.deduplicated + reply.deduplicated,
                                   skipped=before.skipped + first - placed,
                                   not_durable=before.not_durable + reply.not_durable)

    async def _in_place_pays(self, kv: torch.Tensor | Mapping[str, torch.Tensor]) -> bool:
        """Whether a put on the daemon's host goes in place: always from a GPU (encoded there, DMA'd into the
        pool); from host memory only for chains of in_place_min_bytes or more when the daemon has a data
        channel, because two RPCs and a seal cost more than moving a few MiB once over the socket
        (benchmarks/RESULTS.md, put_get: 1 MiB took 2.4 ms in place, 0.7 ms on the data channel)."""
        if _device_of(kv).type == "cuda":
            return True
        tensors = kv.values() if isinstance(kv, Mapping) else (kv,)
        if sum(t.numel() * t.element_size() for t in tensors) >= self.in_place_min_bytes:
            return True
        return await self._data_channel() is None

    async def _put_in_place(self, fingerprint: bytes, spec: ModelSpec, arr: np.ndarray,
                            kv: torch.Tensor | Mapping[str, torch.Tensor], ns: str, pin: bool) -> PutResult | None:
        """The put path on the daemon's host; None when this daemon or process cannot take it (the caller
        puts as bytes, and so do later puts of this client). A round refused for room after others were put
        returns what those did, fewer keys than blocks: the caller puts the rest as bytes."""
        bt = spec.layout.block_tokens
        codec = spec.stored_codec
        dtype = spec.layout.dtype if isinstance(kv, Mapping) else DType.from_torch(kv.dtype)
        device = _device_of(kv)
        headers = []
        for start in range(0, len(arr), bt):
            shape = spec.layout.block_shape(min(bt, len(arr) - start))
            nbytes = stored.stored_nbytes(codec, shape, dtype, spec.streams)
            headers.append(pb.BlockHeader(tokens=convert.tokens_to_pb(arr[start : start + bt]), dtype=int(dtype),  # type: ignore[arg-type]
                                          shape=list(shape), payload_nbytes=nbytes, codec=codec))
        keys: list[bytes] = []
        stored_count = deduplicated = skipped = not_durable = 0
        ms = [0.0, 0.0, 0.0]  # reserve, write, commit
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        while len(keys) < len(headers):  # in rounds, when the chain is longer than the pool takes at once
            first = len(keys)
            req = pb.ReservePutRequest(namespace=ns, model_fingerprint=fingerprint, pin=pin,
                                       blocks=headers[first : first + self._max_blocks],
                                       parent_key=keys[-1] if keys else b"")
            t0 = time.perf_counter()
            try:
                res = await self._granting(self._stub.ReservePut, req,
                                           functools.partial(self._give_back_reservation, ns))
            except errors.FailedPrecondition:
                if keys:
                    raise
                self._in_place_ok = False  # no shared pool there
                return None
            except errors.ResourceExhausted:
                # The reservations open now hold their share of the pool (or it is full of what may not go): the rest
                # of this put travels as bytes, which the daemon places as any put. Not the rounds stored so far:
                # with pin they were pinned, and sent again they were pinned twice (an unpin left them pinned)
                if not keys:
                    return None
                break
            slots: list[Slot] = []
            try:
                for i, (d, cached) in enumerate(zip(res.slots, res.cached, strict=True)):
                    if not cached:
                        seg = self._writable(d.segment_path, d.segment_id, device.type == "cuda")
                        slots.append(Slot(first + i, seg, d.offset, headers[first + i].payload_nbytes))
            except (OSError, RuntimeError, errors.FailedPrecondition) as exc:
                if keys:
                    raise
                self._in_place_ok = False  # this process cannot map the pool: the reservation expires unused
                self._cannot_map("puts", res.slots[0].segment_path if res.slots else "", exc)
                return None
            t1 = time.perf_counter()
            # A run is written only while the reservation has time left (a margin for the write itself): the
            # daemon frees an expired reservation's slots a term later, and this writer must be done by then.
            deadline = time.monotonic() + res.expires_in_s - min(1.0, res.expires_in_s / 10)
            late = False
            # In runs: while the daemon seals and publishes run i, this process writes run i + 1.
            commits: list[asyncio.Task[Any]] = []
            for first_block, run in self._commit_runs(slots, first, len(res.keys)):
                if time.monotonic() > deadline:
                    late = True
                    break
                # a plain executor future, not a Task: one left pending at a sync client's close is no pending Task
                write = asyncio.get_running_loop().run_in_executor(None, functools.partial(
                    self._writer.write, kv, spec, run, stream, tokens=len(arr)))
                try:
                    await asyncio.shield(write)
                except BaseException:  # the caller left (or the write failed): the slots go once no write is in them
                    self._later(self._give_up_once_written([write, *commits], ns, res.reservation_id))
                    raise
                commits.append(asyncio.ensure_future(self._commit_after(
                    commits[-1] if commits else None, ns, res.reservation_id, first_block,
                    sum(s.nbytes for s in run), len(run))))
            t2 = time.perf_counter()
            if not commits and not late:  # every block was cached: the commit closes the reservation
                commits.append(asyncio.ensure_future(self._commit_after(None, ns, res.reservation_id, 0)))
            gathered = asyncio.gather(*commits, return_exceptions=True)
            try:  # not cut with its caller: a commit sent runs on, then what is left of the reservation is given up
                outcomes = await asyncio.shield(gathered)
            except BaseException:
                self._later(self._give_up_once_written([gathered], ns, res.reservation_id))
                raise
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            if late:
                raise errors.Unavailable(f"the in-place put's reservation ({res.expires_in_s:g}s: the daemon's "
                                         "server.lease_s) ran out before its blocks were written; the runs written "
                                         f"before were committed ({len(commits)}), the rest not: put again")
            replies: list[pb.PutResponse] = outcomes  # type: ignore[assignment]
            reply = pb.PutResponse(stored=sum(r.stored for r in replies),
                                   deduplicated=sum(r.deduplicated for r in replies),
                                   not_durable=sum(r.not_durable for r in replies))
            for i, dt in enumerate((t1 - t0, t2 - t1, time.perf_counter() - t2)):
                ms[i] += dt * 1e3
            keys += list(res.keys)
            stored_count += reply.stored
            deduplicated += reply.deduplicated
            not_durable += reply.not_durable
            skipped += sum(res.cached)
            if not res.keys:  # nothing reserved and no error: the daemon says why
                raise errors.ResourceExhausted(res.refused or "the daemon reserved none of the blocks")
            # Stopped early (room, or the quota): the next round makes room, or fails saying why.
        return PutResult(tuple(keys), stored_count, deduplicated, skipped, reserve_ms=ms[0], write_ms=ms[1],
                         commit_ms=ms[2], not_durable=not_durable)

    async def _give_up_once_written(self, pending: list[asyncio.Future[Any]], ns: str, reservation_id: int) -> None:
        """An in-place put left while it wrote a run (its caller's cancel, or the write failed): once the write's
        thread, which a cancel does not stop, and the commits already sent have ended, what is left of the
        reservation is given up (ReleaseLeases naming it; the runs committed stay stored). It held its slots two
        terms of server.lease_s. Cut by close() before then, it lapses as before (a write may still be in them)."""
        await asyncio.wait(pending)  # not cancelled with this task: a commit cut frees slots being written
        for done in pending:
            if not done.cancelled():
                done.exception()  # seen: its caller has gone
        await self._release({reservation_id}, ns)

    @staticmethod
    def _commit_runs(slots: list[Slot], first: int, n_blocks: int) -> list[tuple[int, list[Slot]]]:
        """The slots in runs of about a quarter of the bytes (at least 64 MiB), each with the number of the
        reservation's blocks a commit after it covers (cached blocks between slots count too); the last run
        covers every block that remains."""
        total = sum(s.nbytes for s in slots)
        target = max(64 * 2**20, total // 4)
        runs: list[tuple[int, list[Slot]]] = []
        done = first  # reservation blocks are numbered from `first` in the sequence
        size = 0
        current: list[Slot] = []
        for s in slots:
            current.append(s)
            size += s.nbytes
            if size >= target:
                runs.append((s.index + 1 - done, current))
                done, size, current = s.index + 1, 0, []
        if current or not runs:
            runs.append((0, current))  # 0: all that remain
        else:
            runs[-1] = (0, runs[-1][1])
        return runs

    async def _commit_after(self, previous: asyncio.Task[Any] | None, ns: str, reservation_id: int, blocks: int,
                            nbytes: int = 0, written: int = 0) -> pb.PutResponse:
        if previous is not None:
            await previous  # commits go in chain order
        # Bounded by its bytes and its `written` blocks too: under write-through the daemon writes each to NVMe
        # before it answers (4,000 blocks of 4 KiB failed DeadlineExceeded at timeout_s = 5 s, the daemon at work)
        return await self._call(self._stub.CommitPut, pb.CommitPutRequest(
            namespace=ns, reservation_id=reservation_id, blocks=blocks), work_bytes=nbytes, work_blocks=written)

    def _cannot_map(self, what: str, path: str, exc: BaseException) -> None:
        """Say once (a WARNING per kind) that this process cannot map a pool of the daemon's and that its hits or
        puts travel as bytes from now on: slower, and nothing else said so (a worker outside the segment's group,
        a container without the daemon's /dev/shm)."""
        if what in self._said_unmapped:
            return
        self._said_unmapped.add(what)
        log.warning("cannot map the daemon's shared pool %s (%s): %s travel as bytes from now on. A worker maps it "
                    "from the daemon's host as the daemon's user or a member of its server.unix_socket_group, seeing "
                    "its tiers.dram.shm_dir (a container: the host's /dev/shm)", path or "(no path)", exc, what)

    def _writable(self, path: str, segment_id: bytes, register: bool) -> MappedSegment:
        return self._pools.get("write", path, segment_id,
                               lambda: MappedSegment(path, segment_id, register=register, writable=True))

    async def _put_from(self, fingerprint: bytes, arr: np.ndarray, kv: torch.Tensor | Mapping[str, torch.Tensor],
                        all_keys: list[bytes], first: int, bt: int, ns: str, pin: bool, encode: bool) -> PutReply:
        parent = all_keys[first - 1] if first else b""
        blocks: list[tuple[np.ndarray, torch.Tensor | Mapping[str, torch.Tensor]]]
        if isinstance(kv, Mapping):
            streams = self._spec(fingerprint).streams
            blocks = [(arr[i * bt : (i + 1) * bt], stream_block(kv, streams, i, bt, len(arr)))
                      for i in range(first, len(all_keys))]
        else:
            blocks = [(arr[i * bt : (i + 1) * bt], kv[:, :, i * bt : (i + 1) * bt]) for i in range(first, len(all_keys))]
        codec = self.codec_of(fingerprint) if encode else stored.RAW
        return await self.put_blocks(fingerprint, blocks, parent_key=parent, namespace=ns, pin=pin, codec=codec)

    @registering_again
    async def put_blocks(
        self,
        fingerprint: bytes,
        blocks: Sequence[tuple[np.ndarray | Sequence[int], torch.Tensor | Mapping[str, torch.Tensor]]],
        *,
        parent_key: bytes = b"",
        namespace: str | None = None,
        pin: bool = False,
        codec: str = stored.RAW,
    ) -> PutReply:
        """Send a chain of (tokens, kv) blocks after `parent_key` (empty: the chain's start), as raw
        elements or encoded here in `codec` (which must be the model's). A stream layout's block is its streams
        (name -> (layers, entries, *shape)), sent as a v2 block: every stream raw, or with a codec given, each
        in the model's codec for it."""
        ns = self._ns(namespace)
        spec = self._layouts.get(fingerprint)

        def encoded(toks: np.ndarray | Sequence[int], kv: torch.Tensor | Mapping[str, torch.Tensor]
                    ) -> tuple[pb.BlockHeader, bytes | memoryview]:
            _refuse_meta(_device_of(kv), "a block's kv")
            if isinstance(kv, Mapping):
                if spec is None or not spec.layout.has_streams:
                    raise errors.InvalidArgument("streams are a stream layout's block: register the model "
                                                 "through this client first, with its streams")
                streams = spec.streams if not stored.is_raw(codec) else raw_streams(spec.streams)
                payload: bytes | memoryview = stored.encode_streams(kv, streams, len(toks),
                                                                    backend=_backend_for(_device_of(kv)))
                dtype, shape, block_codec = spec.layout.dtype, spec.layout.block_shape(len(toks)), stored.STREAMS
            else:
                payload = _raw_view(kv) if stored.is_raw(codec) else stored.encode(kv, codec,
                                                                                   backend=_backend_for(kv.device))
                dtype, shape, block_codec = DType.from_torch(kv.dtype), tuple(kv.shape), codec
            return pb.BlockHeader(
                tokens=convert.tokens_to_pb(toks), dtype=int(dtype),  # type: ignore[arg-type]
                shape=list(shape), payload_nbytes=len(payload), codec=block_codec,
            ), payload

        put = pb.PutHeader(namespace=ns, model_fingerprint=fingerprint, parent_key=parent_key, pin=pin)
        # Every block is encoded (and so checked) before anything is sent: a block that cannot be raised its error
        # inside gRPC's request iterator, which cancels the call (a bare CancelledError, earlier blocks stored).
        items = [encoded(toks, kv) for toks, kv in blocks]
        for header, payload in items:
            header.checksum = await checksum_off_loop(payload)
        reply = pb.PutResponse()  # what the daemon stored, from every part, over the data channel then gRPC
        data = await self._data_channel()
        if data is not None:
            # Its connections are all taken, or a block exceeds its limit: gRPC takes the chain from the first
            # block the channel did not store (those it stored are counted as it counted them, not sent again).
            with contextlib.suppress(wire.ChannelFull):
                await self._put_data(data, put, items, reply)
                return convert.from_pb(PutReply, reply)

        async def requests(head: pb.PutHeader, part: list[tuple[pb.BlockHeader, bytes | memoryview]],
                           progress: deadline.Progress) -> AsyncIterator[bytes]:
            """Serialized PutRequests (chunk_frames: one copy each); gRPC asks for each once it sent the last."""
            yield pb.PutRequest(header=head).SerializeToString()
            for header, payload in part:
                serialized = header.SerializeToString()
                # Each message under the smaller of the two limits, its block's header (first chunk) included
                step = payload_step(self.chunk_bytes, self._max_message, len(serialized))
                for frame in chunk_frames(2, b"", serialized, payload, step):  # PutRequest.chunk
                    progress.moved()
                    yield frame
            progress.moved()  # the last one sent: the answer is due within timeout_s

        # A chain longer than the daemon's server.max_blocks_per_request goes in several Puts, each after the last
        # key of the one before.
        for start in range(len(reply.keys), max(len(items), 1), self._max_blocks):
            head = pb.PutHeader()
            head.CopyFrom(put)
            if reply.keys:
                head.parent_key = reply.keys[-1]
            progress = deadline.Progress(self.timeout_s)  # a stall bound: a long Put is not cut while it moves
            call = self._put_frames(requests(head, items[start : start + self._max_blocks], progress))
            status = DaemonStatus(call)  # the daemon's refusal, where grpc.aio's failed send replaced it
            try:
                got = await progress.wait(call, self.address, "a Put stream")
            except grpc.aio.AioRpcError as exc:
                raise _in_chain(await self._failed(status.error(exc)), start) from exc
            except errors.EngramError as exc:
                raise _in_chain(exc, start) from exc
            reply.keys.extend(got.keys)
            reply.stored += got.stored
            reply.deduplicated += got.deduplicated
            reply.not_durable += got.not_durable
        return convert.from_pb(PutReply, reply)

    # ---- the data channel (engram/wire/data.py) ----------------------------------------------

    async def _data_channel(self) -> DataChannel | None:
        """The daemon's data channel, asked for once; None when this client or the daemon has none (an
        older daemon answers UNIMPLEMENTED), and the call goes over gRPC. Calls that come while it is being
        asked for wait for that answer: concurrent first calls each asked DataEndpoint and made a channel of
        their own, and those left behind kept their connections open, counted against the tenant's data
        connections until server.data_idle_s (an audit, session 47)."""
        self._check_open()
        if not self._data_wanted:
            return None
        if self._data is not None:
            return self._data
        if self._data_asked is None:
            self._data_asked = asyncio.ensure_future(self._ask_data_channel())
            self._data_asked.add_done_callback(self._data_answered)
        # shielded: a caller cancelled (its own timeout) does not cancel the others' answer
        return await asyncio.shield(self._data_asked)

    def _data_answered(self, task: asyncio.Task[DataChannel | None]) -> None:
        """The ask is over: a later call asks again if it failed (or reuses the channel it made)."""
        self._data_asked = None
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone (cancelled) before it failed

    async def _ask_data_channel(self) -> DataChannel | None:
        try:
            ep = await deadline.answer(self._stub.DataEndpoint(pb.DataEndpointRequest()), self.timeout_s,
                                       self.address)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._data_wanted = False
                return None
            raise await self._failed(exc) from exc
        unix = self.address.startswith("unix:") and ep.unix_path
        if not unix and not ep.tcp_port:
            self._data_wanted = False
            return None
        host = "" if unix else self.address.rsplit(":", 1)[0].strip("[]")
        endpoint = Endpoint(unix_path=ep.unix_path if unix else "", host=host, port=ep.tcp_port, tls=ep.tls,
                            max_request_bytes=ep.max_request_bytes)
        self._data = DataChannel(endpoint, self._token, self._root_cert, stall_s=self.timeout_s)
        return self._data

    async def _exchange(self, data: DataChannel, kind: int, request: Callable[[DataChannel], WireRequest],
                        answer: Callable[[Conn], Coroutine[Any, Any, T]]) -> T:
        """One request and its answer. After the daemon's refusal (an ERROR frame, wire.Refused) the connection
        is closed here too: after some refusals the daemon closes it, and a pooled dead one failed the next call
        (over a unix socket as a broken pipe, and the request went twice). A connection that breaks before any
        answer (the daemon restarted since it was opened) is retried once on a new one, of the channel another
        call found meanwhile where this one retired (the old address may answer again, its limit no longer
        true), and a daemon not found at its announced address is asked for it again, or, where another call
        already did (this channel retired), the request goes on on the channel that call found: Put and Get are
        both idempotent. The request is `request(channel)`, made again for each channel it goes on: a Put's part
        is sized by that channel's limit (a part made for the old one could exceed the new one's and be
        refused), and made again when a new connection of the channel is told a limit the request exceeds
        (wire.LimitChanged: the daemon came back on the same address taking less, and no other call had asked for
        the endpoint again). A daemon that stops taking or sending bytes for timeout_s (wire.Stalled) is not tried
        again: DeadlineExceeded."""
        retried = refreshed = False
        made_for: tuple[DataChannel, int] | None = None  # the channel and limit the request was made for
        while True:
            if made_for != (data, data.max_request_bytes):
                meta, body = request(data)
                made_for = (data, data.max_request_bytes)
            try:
                return await data.exchange(kind, meta, body, answer)
            except wire.LimitChanged:
                if made_for == (data, data.max_request_bytes):  # made for that limit already: not split further
                    raise errors.ResourceExhausted(f"a data-channel request exceeds the daemon's limit of "
                                                   f"{data.max_request_bytes} bytes") from None
                continue
            except wire.Refused as refused:
                refusal = refused.error
                break
            except wire.Stalled:
                raise deadline.expired(self.address, "go on with the data channel's bytes (a connection, a request "
                                       "or its answer)", self.timeout_s) from None
            except ConnectionError as exc:  # an idle connection the daemon closed meanwhile
                if retried:
                    raise errors.Unavailable(f"the data channel to {self.address} broke: {exc}") from exc
                retried = True
                data.drop_idle()  # its other idle connections went the same way
                if self._data is not None and self._data is not data:  # retired meanwhile: where the daemon is now
                    data = self._data
                continue
            except errors.Unavailable as exc:
                if refreshed or isinstance(exc, errors.DeadlineExceeded):
                    raise
                refreshed = True  # a restarted daemon may listen elsewhere (data_port 0): ask again
                if self._data is data:
                    self._replace(data)
                fresh = await self._data_channel()  # or the one another call asked for meanwhile
                if fresh is None or fresh is data:
                    raise
                data = fresh
                continue
        raise refusal

    def _replace(self, data: DataChannel) -> None:
        """The data channel is asked for again: the old one retires (its requests in flight finish, their
        connections closed, not pooled) and is kept until they end, so that close() still cuts them."""
        self._data = None
        data.retire()
        self._data_replaced = {d for d in self._data_replaced if d.busy()}
        if data.busy():
            self._data_replaced.add(data)

    @property
    def _answer_within_ms(self) -> int:
        """How long a Get waits for its answer to begin, and a GetPrefix for its answer (timeout_s), told to the
        daemon: its copying of blocks from the cluster's peers ends in time to answer (a Get's DEADLINE_EXCEEDED
        saying so, a GetPrefix's shorter match), not cut by this client as a daemon that seems hung."""
        return min(max(1, int(self.timeout_s * 1000)), 2**32 - 1)

    @property
    def _progress_every_ms(self) -> int:
        """How often the daemon is asked to say it is still at work before it answers (a Resume, a data-channel
        Put): three times within timeout_s, so that one message late does not cut the call."""
        return min(max(1, int(self.timeout_s * 1000 / 3)), 2**32 - 1)

    async def _put_data(self, data: DataChannel, put: pb.PutHeader,
                        blocks: list[tuple[pb.BlockHeader, bytes | memoryview]], reply: pb.PutResponse) -> None:
        """A chain as data-channel Puts: the blocks' headers, then their payloads as they lie (a raw CPU
        tensor is sent from its own memory). A chain over the daemon's request limit goes in several Puts,
        each after the last key of the one before, each sized by the limit of the channel it goes on: a part
        that moves to another channel, between parts or midway (_exchange), is sized again for it. Each part's
        answer is added to `reply` (keys and counts) as it comes: where a part cannot go on the channel
        (ChannelFull), the caller goes on after the blocks the channel stored."""
        keys = reply.keys
        start = end = fits = 0  # fits: a limit every block from `start` on was found within

        def part_for(channel: DataChannel) -> WireRequest:
            """The part from `start` as the channel takes it (its end in `end`): as many blocks as its limit and
            the daemon's server.max_blocks_per_request allow. That channel's daemon (restarted) may take less than
            the one before: a part sized by the old limit was refused."""
            nonlocal end, fits
            limit = channel.max_request_bytes or 1 << 62
            if limit != fits:
                if any(h.payload_nbytes > limit for h, _ in blocks[start:]):  # one refused whole: gRPC chunks it
                    raise wire.ChannelFull(f"a block exceeds the data channel's request limit of {limit} bytes")
                fits = limit
            end, size = start, 0
            while end < len(blocks) and end - start < self._max_blocks and (
                    end == start or size + blocks[end][0].payload_nbytes <= limit):
                size += blocks[end][0].payload_nbytes
                end += 1
            part = blocks[start:end]
            head = pb.PutHeader()
            head.CopyFrom(put)
            if keys:
                head.parent_key = keys[-1]
            # PROGRESS frames while the daemon stores the blocks: each is bytes moving, so a put the daemon is
            # storing from its kernel buffers (a slow disk under write-through) is not cut at timeout_s.
            meta = pb.DataPut(header=head, blocks=[h for h, _ in part], progress_every_ms=self._progress_every_ms
                              ).SerializeToString()
            return meta, [p for _, p in part]

        async def answer(conn: Conn) -> pb.PutResponse:
            kind, meta, body = await conn.read_frame()
            while kind == wire.PROGRESS and not body:
                kind, meta, body = await conn.read_frame()
            if kind == wire.ERROR and not body:
                raise wire.Refused(wire.error_of(meta))
            if kind != wire.PUT_OK or body:
                raise errors.DataLoss(f"data channel: a Put answered with frame kind {kind:#x}")
            return pb.PutResponse.FromString(bytes(meta))

        while start < len(blocks) or (not keys and start == 0):
            if self._data is not None:  # another call replaced the channel since the last part: its successor
                data = self._data
            try:
                got = await self._exchange(data, wire.PUT, part_for, answer)
            except errors.EngramError as exc:
                raise _in_chain(exc, start) from exc
            keys.extend(got.keys)
            reply.stored += got.stored
            reply.deduplicated += got.deduplicated
            reply.not_durable += got.not_durable
            start = end
            if not blocks:
                break

    async def _get_data(self, data: DataChannel, req: pb.GetRequest) -> list[tuple[pb.BlockHeader, torch.Tensor]]:
        """Blocks over the data channel as (header, payload), each payload read straight into a uint8 tensor
        of its own (not yet checked: the caller verifies as it decodes)."""

        async def answer(conn: Conn) -> list[tuple[pb.BlockHeader, torch.Tensor]]:
            out: list[tuple[pb.BlockHeader, torch.Tensor]] = []
            while True:
                kind, meta, body = await conn.read_frame()
                if kind == wire.END and not body:
                    return out
                if kind == wire.ERROR and not body:
                    raise wire.Refused(wire.error_of(meta))
                if kind != wire.BLOCK:
                    raise errors.DataLoss(f"data channel: a Get answered with frame kind {kind:#x}")
                header = pb.BlockChunk.FromString(bytes(meta)).header
                if body != header.payload_nbytes:
                    raise errors.DataLoss(f"block {len(out)}: {body} bytes sent, its header says "
                                          f"{header.payload_nbytes}")
                payload = torch.empty(body, dtype=torch.uint8)
                if body:
                    await conn.recv_into(memoryview(payload.numpy()))  # type: ignore[arg-type]
                out.append((header, payload))

        meta = req.SerializeToString()
        got = await self._exchange(data, wire.GET, lambda _: (meta, ()), answer)
        if len(got) != len(req.keys):
            raise errors.DataLoss(f"Get returned {len(got)} of {len(req.keys)} blocks")
        return got

    @registering_again
    async def get(self, fingerprint: bytes, keys: Sequence[bytes], *, namespace: str | None = None,
                  decode_on_server: bool = False, device: torch.device | str = "cpu",
                  zero_copy: bool | None = None) -> list[Any]:
        """Blocks by key, in order, each (persisted_layers, 2, tokens, kv_heads, head_dim) on `device` (a stream
        layout's: a dict of its streams, name -> (persisted_layers, entries, *shape));
        every payload's checksum is verified again on arrival. Encoded blocks travel as stored and are
        decoded here (the Triton kernels on a GPU device), unless decode_on_server.

        zero_copy (None: whenever the daemon is on this host, over a unix socket or loopback): blocks in
        the daemon's shared DRAM pool come as descriptors and are copied straight out of the mapped
        segment; a descriptor whose slot was reused meanwhile, or a segment this process cannot map, falls
        back to bytes for those blocks. Either way the tensors are the same.
        """
        _refuse_meta(device, "device")
        if len(keys) > self._max_blocks:  # more than one Get may name: in parts, in order
            out: list[Any] = []
            for start in range(0, len(keys), self._max_blocks):
                out += await self.get(fingerprint, keys[start : start + self._max_blocks], namespace=namespace,
                                      decode_on_server=decode_on_server, device=device, zero_copy=zero_copy)
            return out
        if zero_copy is None:
            zero_copy = self._zero_copy_ok and same_host(self.address)
        cuda_ipc = zero_copy and torch.device(device).type == "cuda"
        req = pb.GetRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint, keys=list(keys),
                            decode=decode_on_server, zero_copy=zero_copy, cuda_ipc=cuda_ipc,
                            answer_within_ms=self._answer_within_ms)
        if not zero_copy and (data := await self._data_channel()) is not None:
            with contextlib.suppress(wire.ChannelFull):  # its connections are all taken: gRPC may take the call
                return [await self._block(h, p, i, device) for i, (h, p) in enumerate(await self._get_data(data, req))]
        out = []
        descriptors: list[tuple[int, pb.BlockDescriptor]] = []
        blocks: Reassembler[pb.BlockHeader] = client_reassembler(lambda h: h.payload_nbytes)
        try:
            async for resp in deadline.messages(self._stub.Get(req), self.timeout_s, self.address, "a Get"):
                if resp.HasField("descriptor"):
                    descriptors.append((len(out), resp.descriptor))
                    out.append(None)
                    continue
                c = resp.chunk
                done = blocks.add(c.header if c.HasField("header") else None, c.data, c.last, len(out))
                if done is not None:
                    out.append(await self._block(done[0], done[1], len(out), device))
        except grpc.aio.AioRpcError as exc:
            await self._release({d.lease_id for _, d in descriptors}, namespace)
            raise await self._failed(exc) from exc
        except BaseException:
            # Cancelled (a caller's timeout) or failed after some descriptors came: their leases would hold
            # those blocks from eviction until they expire. End them without waiting (a cancelled task may not).
            self._release_later({d.lease_id for _, d in descriptors}, namespace)
            raise
        if descriptors:
            try:
                stale = await self._copy_out(descriptors, out, device)
            finally:
                # The copies are done (or failed): end the leases in the background (no round trip to wait).
                self._release_later({d.lease_id for _, d in descriptors}, namespace)
            if stale:
                again = await self.get(fingerprint, [keys[i] for i in stale], namespace=namespace,
                                       decode_on_server=decode_on_server, device=device, zero_copy=False)
                for i, t in zip(stale, again, strict=True):
                    out[i] = t
        if len(out) != len(keys):
            raise errors.DataLoss(f"Get returned {len(out)} of {len(keys)} blocks")
        return out  # type: ignore[return-value]

    async def _block(self, header: pb.BlockHeader, data: bytes | torch.Tensor, i: int, device: torch.device | str
                     ) -> stored.BlockKV:
        view = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)  # type: ignore[arg-type]
        if view.nbytes != header.payload_nbytes or await checksum_off_loop(view) != header.checksum:
            raise errors.DataLoss(f"block {i} arrived damaged (size or checksum mismatch)")
        where = f"block {i}"
        return stored.decode_block(data, header.codec, convert.dtype_from_pb(header.dtype, where),
                                   tuple(header.shape), backend=_backend_for(device), device=device, where=where)

    async def _copy_out(self, descriptors: list[tuple[int, pb.BlockDescriptor]], out: list[Any],
                        device: torch.device | str) -> list[int]:
        """Copy described blocks out of the mapped segment into `out`; returns the indices that must be
        fetched as bytes (a reused slot, a damaged copy, or a segment this process cannot map)."""
        stale = []
        for i, d in descriptors:
            data = None
            try:
                reader = self._segment(d.segment_path, d.segment_id)
                if d.HasField("cuda"):
                    data = self._ipc_copy(reader, d)
                else:
                    data = reader.copy(d.offset, d.header.payload_nbytes, d.generation)
            except (OSError, RuntimeError, errors.FailedPrecondition) as exc:
                self._zero_copy_ok = False  # another host, container or GPU: bytes from now on
                self._cannot_map("hits", d.segment_path, exc)
            try:
                if data is None:
                    raise errors.DataLoss("the slot was reused")
                if data.is_cuda and stored.is_raw(d.header.codec):
                    # Device to device, no host round trip: the checksum is not recomputed here (that
                    # would read the block back to the host); the generation check guards reuse.
                    dtype = convert.dtype_from_pb(d.header.dtype, f"block {i}")
                    out[i] = stored.decode(data, stored.RAW, dtype, tuple(d.header.shape), device=device)
                else:
                    out[i] = await self._block(d.header, data.cpu(), i, device)  # checks size and checksum
            except errors.DataLoss:
                stale.append(i)
        return stale

    def _ipc_copy(self, reader: SegmentReader, d: pb.BlockDescriptor) -> torch.Tensor | None:
        """A block of the daemon's HBM pool, opened through CUDA IPC, cloned on the device; None when its
        slot was reused (the pool's generation table, in `reader`, is checked before and after)."""
        n = d.header.payload_nbytes
        if not reader.current(d.offset, n, d.generation):
            return None
        pool = self._ipc_pool(d)
        if d.offset + n > pool.numel():
            return None
        out = pool[d.offset : d.offset + n].clone()
        torch.cuda.current_stream(pool.device).synchronize()  # the copy is done before the second check
        return out if reader.current(d.offset, n, d.generation) else None

    def _segment(self, path: str, segment_id: bytes) -> SegmentReader:
        return self._pools.get("read", path, segment_id, lambda: SegmentReader(path, segment_id))

    async def _granting(self, method: Callable[..., Any], request: Any,
                        give_back: Callable[[asyncio.Future[T]], None], *, work_bytes: int = 0) -> T:
        """A call whose answer grants what only the answer names (ReservePut's reservation, GetPrefix's lease, a
        session whose id the daemon picks), made so that its caller leaving does not leave the grant to nobody:
        "cancel by completion". Its caller's cancel, or its bound (timeout_s and the work's time, deadline.answer:
        the same DeadlineExceeded as any call's) ends the caller's wait and not the call, which runs on to its
        answer, bounded by a gRPC deadline (timeout_s or FINISH_S, the longer, past the caller's bound), never
        cancelled: a call past its deadline is given back by the daemon itself (server/service.py,
        `_answer_may_land`). Then `give_back(answer)` lets go of what it granted.
        Cut, the call reached the daemon's handler with a cancel that a busy daemon's loop passed on only after
        the handler had answered: the grant outlived the call (a review, session 51: 3 of 9 cut ReservePuts kept
        their slots; 29 sessions stayed open for server.session_idle_s). `give_back` is called however the call
        ends once its caller has left (or failed: the answer is its exception), and close() cuts the calls still
        running (ClientClosed for their callers; the daemon's own cut handling is all that is left then)."""
        bound = deadline.grpc_timeout(self.timeout_s + deadline.work_s(work_bytes) + self._finish_s)
        answer = asyncio.ensure_future(self._finish(method(request, timeout=bound)))
        try:
            return await deadline.answer(asyncio.shield(answer), self.timeout_s, self.address, work_bytes)  # type: ignore[no-any-return]
        except BaseException:
            if answer.done():
                give_back(answer)
            else:
                self._finishing.add(answer)
                answer.add_done_callback(self._finishing.discard)
                answer.add_done_callback(give_back)
            raise

    @property
    def _finish_s(self) -> float:
        return max(self.timeout_s, FINISH_S)

    async def _finish(self, call: Any) -> Any:
        """A call bounded by its own gRPC deadline alone (not cancelled by the client: see `_granting`)."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from exc

    def _give_back_reservation(self, namespace: str, answer: asyncio.Future[pb.ReservePutResponse]) -> None:
        """A ReservePut whose caller left has ended: its reservation, answered, is given up (ReleaseLeases naming
        it: no slot of it was written)."""
        if not answer.cancelled() and answer.exception() is None and answer.result().reservation_id:
            self._release_later({answer.result().reservation_id}, namespace)

    def _close_unread(self, namespace: str, answer: asyncio.Future[pb.SessionInfo]) -> None:
        """An OpenSession or ForkSession whose caller left has ended: the session the daemon opened under an id of
        its choosing, named to nobody else, is closed."""
        if answer.cancelled() or answer.exception() is not None:
            return
        ref = self._ref(answer.result().session_id, answer.result().namespace or namespace)
        self._later(self._close_quietly(ref))

    async def _close_quietly(self, ref: pb.SessionRef) -> None:
        # Closed meanwhile (NotFound), the daemon gone, or this client closed first: the daemon's idle close ends it
        with contextlib.suppress(errors.NotFound, errors.Unavailable, errors.ClientClosed, grpc.aio.UsageError):
            await self._call(self._stub.CloseSession, ref, timeout_s=self._finish_s)

    def _end_unread(self, namespace: str, held: list[int], call: asyncio.Future[pb.PrefixHeader]) -> None:
        """A GetPrefix whose caller left (or that failed) has ended: release what no one will."""
        if call.cancelled() or call.exception() is not None:
            self._release_later(set(held), namespace)
        elif call.result().lease_id:
            self._release_later({call.result().lease_id}, namespace)

    def _hold(self, namespace: str, lease_id: int) -> None:
        """Keep a finished load's lease to end with the next load (no extra round trip), or, if none comes
        within RELEASE_AFTER_S, with a ReleaseLeases of its own."""
        self._held.setdefault(namespace, []).append(lease_id)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELEASE_AFTER_S, self._flush_held)

    def _flush_held(self) -> None:
        self._flush = None
        held, self._held = self._held, {}
        for ns, ids in held.items():
            self._release_later(set(ids), ns)

    def _release_later(self, lease_ids: set[int], namespace: str | None) -> None:
        self._later(self._release(lease_ids, namespace))

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        """A release made in the background, kept until done (close() waits for it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, lease_ids: set[int], namespace: str | None) -> None:
        ids = sorted(lease_ids)
        for start in range(0, len(ids), self._max_blocks):  # as many as one request may name, each
            req = pb.ReleaseLeasesRequest(namespace=self._ns(namespace), lease_ids=ids[start : start + self._max_blocks])
            # Expired meanwhile (NotFound), the daemon is gone, or this client was closed before a background
            # release ran (ClientClosed, or grpc's UsageError in a race with it): either way the leases end by expiry.
            with contextlib.suppress(errors.NotFound, errors.Unavailable, errors.ClientClosed, grpc.aio.UsageError):
                await self._call(self._stub.ReleaseLeases, req, timeout_s=self._finish_s)  # close() waits timeout_s

    async def release_leases(self, lease_ids: Sequence[int], *, namespace: str | None = None) -> int:
        """End zero-copy leases explicitly (get does this itself); NotFound when one is not held here."""
        req = pb.ReleaseLeasesRequest(namespace=self._ns(namespace), lease_ids=list(lease_ids))
        return (await self._call(self._stub.ReleaseLeases, req)).released

    @registering_again
    async def get_prefix(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *,
                         namespace: str | None = None, device: torch.device | str = "cpu"
                         ) -> tuple[int, Any]:
        """The longest cached prefix of `tokens` (as load_prefix_into finds it) and its KV, (persisted_layers, 2,
        matched, kv_heads, head_dim) on `device` (matched = 0 on a miss: an empty tensor of that shape); a stream
        layout's: a dict of its streams, name -> (persisted_layers, matched // compress, *shape). One round trip;
        on a GPU the blocks are decoded there (load_prefix_into into new tensors)."""
        _refuse_meta(device, "device")
        spec = self._spec(fingerprint)
        lay = spec.layout

        made: list[KVDestination] = []

        def make(n: int) -> KVDestination:
            if lay.has_streams:
                made.append(StreamsKV(lay.stream_specs, {
                    s.name: torch.empty(lay.stream_shape(s, n), dtype=s.dtype.torch_dtype, device=device)
                    for s in lay.stream_specs}))
            else:
                made.append(ContiguousKV(torch.empty(lay.block_shape(n), dtype=lay.dtype.torch_dtype, device=device)))
            return made[-1]

        result = await self._load_prefix(fingerprint, tokens, make, torch.device(device), namespace, hold=False)
        dest = made[0]
        if isinstance(dest, StreamsKV):
            return result.matched_tokens, {s.name: t for s, t in zip(dest.streams, dest.tensors, strict=True)}
        assert isinstance(dest, ContiguousKV)
        return result.matched_tokens, dest.kv

    @registering_again
    async def load_prefix_into(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray,
                               dest: KVDestination | torch.Tensor | Mapping[str, torch.Tensor], *,
                               namespace: str | None = None) -> LoadResult:
        """The hit path: write the KV of the longest cached prefix of `tokens` (among its first
        server.max_tokens_per_request, the most one request may name) into the worker's own KV memory
        `dest` (engram/destinations.py: ContiguousKV, LayerKV, PagedKV, and for a stream layout StreamsKV or
        PagedStreamsKV; a (L, 2, T, H, D) tensor is taken as ContiguousKV, a mapping of stream name to tensor as
        StreamsKV), up to its capacity. One round trip (GetPrefix): blocks in the daemon's shared pools are
        copied straight out of them (DMA into a GPU, FP4 decoded there), the rest come as bytes. On a GPU the
        writes are queued on the current stream; the call returns once every copy out of the daemon's pools
        has completed. The blocks' lease ends with this client's next load (no extra round trip), or
        RELEASE_AFTER_S after this one. A destination the model's KV does not fit (dtype, shape), or one on the
        meta device, is refused before the request (InvalidArgument), on a miss as on a hit."""
        layout = self._spec(fingerprint).layout
        if isinstance(dest, torch.Tensor):
            target: KVDestination = ContiguousKV(dest)
        elif isinstance(dest, Mapping):
            target = StreamsKV(layout.stream_specs, dest)
        else:
            target = dest
        check_fits(target, layout)
        _refuse_meta(target.device, "the destination")
        return await self._load_prefix(fingerprint, tokens, lambda n: target, target.device, namespace)

    async def _load_prefix(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray,
                           make_dest: Callable[[int], KVDestination], device: torch.device,
                           namespace: str | None, *, hold: bool = True) -> LoadResult:
        spec = self._spec(fingerprint)
        bt = spec.layout.block_tokens
        zero_copy = self._zero_copy_ok and same_host(self.address)
        ns = self._ns(namespace)
        held = self._held.pop(ns, [])  # the last loads' leases: ended by this call, before it starts
        if len(held) > self._max_blocks:  # more than one request may name (many loads ended since the last)
            held, rest = held[: self._max_blocks], held[self._max_blocks :]
            self._release_later(set(rest), ns)
        req = pb.GetPrefixRequest(namespace=ns, model_fingerprint=fingerprint,  # as many tokens as a request may name
                                  tokens=convert.tokens_to_pb(tokens[: self._max_tokens]), zero_copy=zero_copy,
                                  cuda_ipc=zero_copy and device.type == "cuda", release_lease_ids=held,
                                  hold_for_get=True, answer_within_ms=self._answer_within_ms)
        t0 = time.perf_counter()
        # Bounded by the bytes it may bring up from NVMe into the pool before it answers, too (at most the raw KV)
        work = len(req.tokens) * spec.layout.bytes_per_token()
        # Its caller gone (a cancel, the bound), the call runs on: its answer's lease (or, if it fails, the leases it
        # was to end) is released when it comes; failed, the leases it was to end are released now, not at expiry.
        # Its gRPC deadline is the lease's, past timeout_s: answer_within_ms tells the daemon when to stop copying
        # from the cluster's peers and answer what it holds (before, it copied on past the client's wait)
        header: pb.PrefixHeader = await self._granting(self._stub.GetPrefix, req,
                                                       functools.partial(self._end_unread, ns, held), work_bytes=work)
        sources: list[BlockSource] = []
        unmapped: list[int] = []  # blocks not described, or in a pool this process cannot map: fetched as bytes
        for i in range(len(header.blocks)):
            d = header.descriptors[i] if i < len(header.descriptors) else None
            src = self._mapped_source(i, d, device, spec.streams) if d is not None and d.segment_path else None
            if src is None:
                unmapped.append(i)
            else:
                sources.append(src)
        dest = make_dest(header.matched_tokens)
        n_tokens = min(header.matched_tokens, dest.capacity_tokens)
        blocks = tuple(BlockRef(b.key, b.num_tokens, b.tier, b.nbytes, b.not_durable) for b in header.blocks)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        t1 = time.perf_counter()
        ended = False  # the lease was ended by the daemon, with the Get that fetched the rest
        try:
            report = await asyncio.to_thread(self._loader.load, sources, dest, block_tokens=bt, n_tokens=n_tokens,
                                             stream=stream)
            again = sorted(set(unmapped) | set(report.stale))
            again = [i for i in again if i * bt < n_tokens]
            if again:  # slots reused during the copy, or a pool this process cannot map: those blocks as bytes
                # Held for a next load, the lease ends with it; else the Get ends it once answered (no round trip
                # of its own, and before this call returns, as a store replaying the same requests would).
                ends = [header.lease_id] if header.lease_id and not hold else []
                got = await self._fetch_bytes(fingerprint, [blocks[i].key for i in again], namespace, release=ends)
                ended = bool(ends)
                refetch = [await self._bytes_source(i, h, p, spec.streams)
                           for i, (h, p) in zip(again, got, strict=True)]
                await asyncio.to_thread(self._loader.load, refetch, dest, block_tokens=bt, n_tokens=n_tokens,
                                        stream=stream)
        finally:  # every copy out of a pool has completed (or failed), and the bytes came: the lease may end
            if header.lease_id and hold:
                self._hold(ns, header.lease_id)
            elif header.lease_id and not ended:
                self._release_later({header.lease_id}, ns)
        t2 = time.perf_counter()
        mapped = sum(1 for s in sources if s.payload is None and s.index * bt < n_tokens)
        return LoadResult(header.matched_tokens, n_tokens, blocks, mapped - len(report.stale),
                          len(sources) - mapped + len(again), len(again), (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    async def _fetch_bytes(self, fingerprint: bytes, keys: Sequence[bytes], namespace: str | None,
                           release: Sequence[int] = ()) -> Sequence[tuple[pb.BlockHeader, bytes | torch.Tensor]]:
        """Blocks as stored, over the socket (the data channel when there is one): (header, payload) each, not
        decoded; the daemon ends the leases `release` names once it has answered."""
        if len(keys) > self._max_blocks:  # more than one Get may name: in parts, in order (the last ends them)
            parts: list[tuple[pb.BlockHeader, bytes | torch.Tensor]] = []
            for start in range(0, len(keys), self._max_blocks):
                last = start + self._max_blocks >= len(keys)
                parts += await self._fetch_bytes(fingerprint, keys[start : start + self._max_blocks], namespace,
                                                 release if last else ())
            return parts
        req = pb.GetRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint, keys=list(keys),
                            release_lease_ids=list(release), answer_within_ms=self._answer_within_ms)
        if (data := await self._data_channel()) is not None:
            with contextlib.suppress(wire.ChannelFull):  # its connections are all taken: gRPC may take the call
                return await self._get_data(data, req)
        out: list[tuple[pb.BlockHeader, bytes | torch.Tensor]] = []
        blocks: Reassembler[pb.BlockHeader] = client_reassembler(lambda h: h.payload_nbytes)
        try:
            async for resp in deadline.messages(self._stub.Get(req), self.timeout_s, self.address, "a Get"):
                c = resp.chunk
                done = blocks.add(c.header if c.HasField("header") else None, c.data, c.last, len(out))
                if done is not None:
                    out.append(done)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from exc
        if len(out) != len(keys):
            raise errors.DataLoss(f"Get returned {len(out)} of {len(keys)} blocks")
        return out

    def _mapped_source(self, index: int, d: pb.BlockDescriptor, device: torch.device,
                       streams: tuple[StreamSpec, ...]) -> BlockSource | None:
        """A descriptor as a loader source: its segment mapped (and registered with CUDA) once per process;
        None when this process cannot map it (another host, container or GPU)."""
        h = d.header
        dtype = convert.dtype_from_pb(h.dtype, f"block {index}")
        try:
            seg = self._pools.get("load", d.segment_path, d.segment_id, lambda: MappedSegment(
                d.segment_path, d.segment_id, register=device.type == "cuda"))
            pool = self._ipc_pool(d) if d.HasField("cuda") else None
        except (OSError, RuntimeError, errors.FailedPrecondition) as exc:
            self._zero_copy_ok = False  # bytes from now on
            self._cannot_map("hits", d.segment_path, exc)
            return None
        return BlockSource(index, h.codec or stored.RAW, dtype, tuple(h.shape), h.payload_nbytes, segment=seg,
                           offset=d.offset, generation=d.generation, device_pool=pool,
                           streams=streams if stored.is_streams(h.codec) else ())

    async def _bytes_source(self, index: int, h: pb.BlockHeader, payload: bytes | torch.Tensor,
                            streams: tuple[StreamSpec, ...]) -> BlockSource:
        view = memoryview(payload.numpy()) if isinstance(payload, torch.Tensor) else payload  # type: ignore[arg-type]
        if len(payload) != h.payload_nbytes or await checksum_off_loop(view) != h.checksum:
            raise errors.DataLoss(f"block {index} arrived damaged (size or checksum mismatch)")
        dtype = convert.dtype_from_pb(h.dtype, f"block {index}")
        return BlockSource(index, h.codec or stored.RAW, dtype, tuple(h.shape), len(payload), payload=payload,
                           streams=streams if stored.is_streams(h.codec) else ())

    def _ipc_pool(self, d: pb.BlockDescriptor) -> torch.Tensor:
        """The daemon's HBM pool, opened by CUDA IPC once per process (and daemon: its generation table's file,
        which the descriptor names, goes with the daemon)."""
        c = d.cuda

        def open_pool() -> torch.Tensor:
            # CUDA must be initialised first: in a process that has not touched the GPU yet, opening the
            # handle dereferences the caching allocator's unbuilt per-device state (a segfault, torch 2.11).
            torch.cuda.init()
            storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                c.device, c.handle, c.storage_bytes, c.storage_offset, c.ref_counter_handle,
                c.ref_counter_offset, c.event_handle or None, c.event_sync_required)
            pool = torch.empty(0, dtype=torch.uint8, device=storage.device)
            pool.set_(storage, 0, (storage.nbytes(),), (1,))
            return pool

        return self._pools.get("hbm", d.segment_path, c.handle, open_pool)

    @registering_again
    async def pin(self, fingerprint: bytes, keys: Sequence[bytes], *, unpin: bool = False,
                  namespace: str | None = None) -> int:
        """ControlClient.pin, the model registered again and the call made once more when the daemon has
        forgotten it (register_model)."""
        return await super().pin(fingerprint, keys, unpin=unpin, namespace=namespace)

    # ---- sessions ----------------------------------------------------------------------------------

    def _ref(self, session_id: str, namespace: str | None, owner: str = "") -> pb.SessionRef:
        return pb.SessionRef(namespace=self._ns(namespace), session_id=session_id, owner=owner)

    async def _session_call(self, method: Callable[..., Awaitable[pb.SessionInfo]], req: Any) -> SessionInfo:
        return convert.from_pb(SessionInfo, await self._call(method, req))

    @registering_again
    async def open_session(self, fingerprint: bytes, *, mode: str | SessionMode = SessionMode.EXACT,
                           approx_k: float = 0.0, session_id: str = "", tokens: Sequence[int] | np.ndarray = (),
                           namespace: str | None = None) -> SessionInfo:
        """Open a session (docs/REPLAY.md): mode exact (the daemon replays the sliding-window KV bit-exactly from
        the stored global KV: the uninterrupted run's with the raw codec, not with a quantizing one),
        approx (replays approx_k windows) or persist (the worker uploads windows); tokens it already has."""
        req = pb.OpenSessionRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint,
                                    session_id=session_id, mode=convert.scalar_to_pb(SessionMode.parse(mode)),
                                    approx_k=approx_k, tokens=convert.tokens_to_pb(tokens))
        return await self._new_session(self._stub.OpenSession, req, session_id, req.namespace)

    async def append_session(self, session_id: str, tokens: Sequence[int] | np.ndarray, *,
                             window: torch.Tensor | None = None, window_start: int = 0,
                             expect_back_ms: int = 0, namespace: str | None = None) -> SessionInfo:
        """Append tokens (their global KV goes with put). In persist mode, also send the SWA window for the
        new end: (sliding layers, 2, rows, kv heads, head dim) starting at window_start. expect_back_ms: when
        the session's next turn is expected (an agent's tool call: that tool's usual duration); eviction gives
        up the blocks of sessions due back last first. 0: no hint (each append says it again)."""
        req = pb.AppendSessionRequest(session=self._ref(session_id, namespace), tokens=convert.tokens_to_pb(tokens),
                                      expect_back_ms=expect_back_ms)
        if window is not None:
            data = _tensor_bytes(window)
            req.window.CopyFrom(pb.SwaWindowData(
                prefix_len=window_start + window.shape[2], start=window_start,
                dtype=int(DType.from_torch(window.dtype)), shape=list(window.shape),  # type: ignore[arg-type]
                checksum=checksum(data), data=data))
        return await self._session_call(self._stub.AppendSession, req)

    async def fork_session(self, parent_id: str, *, session_id: str = "", position: int = 0,
                           namespace: str | None = None) -> SessionInfo:
        """A new session sharing the parent's first `position` tokens (0: all of them) and their blocks."""
        req = pb.ForkSessionRequest(parent=self._ref(parent_id, namespace), session_id=session_id, position=position)
        return await self._new_session(self._stub.ForkSession, req, session_id, req.parent.namespace)

    async def _new_session(self, method: Callable[..., Any], req: Any, session_id: str, namespace: str) -> SessionInfo:
        """An OpenSession or ForkSession. With no `session_id` the daemon picks one, named by the answer alone:
        a caller that leaves before it (a cancel, the bound) leaves the call to finish and the session to be
        closed (_granting). A session whose id the caller chose is the caller's to use or close, as the daemon
        keeps it when such a call is cut."""
        if session_id:
            return await self._session_call(method, req)
        return convert.from_pb(SessionInfo, await self._granting(method, req,
                                                                 functools.partial(self._close_unread, namespace)))

    async def suspend_session(self, session_id: str, *, namespace: str | None = None) -> SessionInfo:
        """The session goes cold: a rebuilt window is dropped; a persisted one stays."""
        return await self._session_call(self._stub.SuspendSession, self._ref(session_id, namespace))

    async def close_session(self, session_id: str, *, namespace: str | None = None, owner: str = "") -> SessionInfo:
        """End the session: its window goes and its blocks lose the session's reference. `owner`: an admin's, the
        tenant whose session it is (ids are per tenant; needed when two tenants of the namespace hold the id)."""
        return await self._session_call(self._stub.CloseSession, self._ref(session_id, namespace, owner))

    async def resume(self, session_id: str, *, position: int = 0, namespace: str | None = None,
                     with_global_kv: bool = False) -> ResumeResult:
        """The session's state at `position` (0: its end): the global KV blocks to fetch, and the sliding-window
        KV, replayed by the daemon, held hot, or persisted. With `with_global_kv` the daemon also sends the global
        KV of [0, position), decoded block by block as it sends them (`ResumeResult.global_kv`)."""
        # Progress messages while the daemon waits for a turn, reads and replays: a replay longer than timeout_s
        # is not cut, since each message is progress (the daemon sends none to a client that does not ask).
        req = pb.ResumeRequest(session=self._ref(session_id, namespace), position=position,
                               with_global_kv=with_global_kv, global_kv_by_block=with_global_kv,
                               progress_every_ms=self._progress_every_ms)
        header: pb.ResumeHeader | None = None
        parts: list[bytes] = []
        kv: _GlobalKV | None = None
        try:
            async for resp in deadline.messages(self._stub.Resume(req), self.timeout_s, self.address, "a Resume"):
                item = resp.WhichOneof("item")
                if item == "progress":
                    continue
                if item == "header":
                    header = resp.header
                    if header.HasField("global_kv"):
                        kv = _GlobalKV(header.global_kv)
                elif item in ("global_kv_block", "global_kv_chunk"):
                    if kv is None:
                        raise errors.DataLoss("Resume sent global KV before a header announcing it")
                    kv.add(resp)
                else:
                    parts.append(resp.window_chunk)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from exc
        if header is None:
            raise errors.DataLoss("Resume stream carried no header")
        w = header.window
        if w.prefix_len != header.position:
            raise errors.DataLoss(f"Resume answered position {header.position} with the window of position "
                                  f"{w.prefix_len}")
        tensor = _raw_tensor(parts, w.checksum, w.dtype, tuple(w.shape), "window", "the SWA window")
        blocks = tuple(convert.from_pb(BlockRef, b) for b in header.blocks)
        global_kv = None
        if kv is not None:
            global_kv = kv.tensor()
        elif with_global_kv:
            raise errors.DataLoss("Resume was asked for the global KV and sent none")
        return ResumeResult(header.position, blocks, tensor, w.start, header.source, header.replayed_tokens,
                            header.replay_s, global_kv)

    async def resume_kv(self, fingerprint: bytes, session_id: str, *, position: int = 0,
                        namespace: str | None = None, device: torch.device | str = "cpu"
                        ) -> tuple[ResumeResult, torch.Tensor]:
        """Resume with the global KV: (stored_layers, 2, position, kv heads, head dim). The daemon sends it
        decoded in the Resume, block by block over gRPC in the layout's dtype (after a replay, which read them
        too, it decodes them again as it sends them rather than hold the prefix decoded for a slow reader). A
        worker on the daemon's host with FP4 blocks and a long prefix may do better with resume() then get() into
        its GPU (zero-copy, FP4 decoded there): `fingerprint` is for that caller's symmetry; this call does not
        need it."""
        _refuse_meta(device, "device")
        r = await self.resume(session_id, position=position, namespace=namespace, with_global_kv=True)
        assert r.global_kv is not None
        return r, r.global_kv.to(device)

    async def _chain_keys(self, namespace: str, fingerprint: bytes, arr: np.ndarray, block_tokens: int, *,
                          again: bool = False) -> list[bytes]:
        """The keys of a chain's blocks as the daemon computes them. again: with the namespace's salt asked for
        anew, when the daemon's keys differed from those made with the salt it gave before (it restarted with
        another auth.salt_secret: every later put failed DataLoss and no cached block was ever skipped)."""
        from engram.keys import chain_keys

        if again:
            self._salts.pop(namespace, None)
        key_ns, salt = await self._keying(namespace)
        return [k for k, _, _ in chain_keys(key_ns, fingerprint, arr, block_tokens, salt)]

    async def _keying(self, namespace: str) -> tuple[str, bytes]:
        """What the daemon computes this namespace's keys with: the namespace it resolves the name to (a
        token's first when empty) and its salt. A daemon from before tenancy has no DescribeNamespace (it answers
        UNIMPLEMENTED): it keys the namespace as named, with no salt, and so does the client."""
        if namespace not in self._salts:
            req = pb.DescribeNamespaceRequest(namespace=namespace)
            try:
                info = await deadline.unary(self._stub.DescribeNamespace, req, self.timeout_s, self.address)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise await self._failed(exc) from exc
                self._salts[namespace] = (namespace, b"")
            else:
                self._salts[namespace] = (info.namespace, info.key_salt)
        return self._salts[namespace]


class _GlobalKV:
    """A Resume's global KV as it arrives: each GlobalKVBlock, then its chunks, checked and copied into its place
    in the tensor the header announced (stored layers, 2, position, kv heads, head dim). A daemon from before
    ResumeRequest.global_kv_by_block sends chunks alone: the whole tensor, under the header's checksum."""

    def __init__(self, g: pb.GlobalKVData) -> None:
        self.header = g
        self.dtype = convert.dtype_from_pb(g.dtype, "global KV")
        self.shape = tuple(g.shape)
        if len(self.shape) != 5:
            raise errors.DataLoss(f"Resume announced global KV of shape {self.shape}, not (layers, 2, tokens, "
                                  "kv heads, head dim)")
        self.out = torch.empty(self.shape, dtype=self.dtype.torch_dtype)
        self.filled = 0  # tokens placed
        self.block: pb.GlobalKVBlock | None = None  # the block whose chunks arrive
        self.parts: list[bytes] = []
        self.whole = False  # an older daemon's one tensor

    def add(self, resp: pb.ResumeResponse) -> None:
        if resp.WhichOneof("item") == "global_kv_block":
            if self.whole:
                raise errors.DataLoss("Resume sent a global KV block after the global KV's bytes")
            self._place()
            self.block = resp.global_kv_block
            return
        if self.block is None:  # bytes before any block: the whole tensor
            self.whole = True
        self.parts.append(resp.global_kv_chunk)

    def _place(self) -> None:
        if self.block is None:
            return
        layers, _, tokens, heads, dim = self.shape
        t = self.block.tokens
        if self.filled + t > tokens:
            raise errors.DataLoss(f"Resume sent global KV blocks past its {tokens} tokens")
        where = f"block at token {self.filled}"
        kv = _raw_tensor(self.parts, self.block.checksum, self.header.dtype, (layers, 2, t, heads, dim),
                         "global KV", f"the global KV's {where}")
        self.out[:, :, self.filled : self.filled + t] = kv
        self.filled += t
        self.block, self.parts = None, []

    def tensor(self) -> torch.Tensor:
        if self.whole:
            return _raw_tensor(self.parts, self.header.checksum, self.header.dtype, self.shape, "global KV",
                               "the global KV")
        self._place()
        if self.filled != self.shape[2]:
            raise errors.DataLoss(f"Resume sent {self.filled} of the global KV's {self.shape[2]} tokens")
        return self.out


def _raw_tensor(parts: list[bytes], expected: int, dtype_pb: int, shape: tuple[int, ...], where: str,
                what: str) -> torch.Tensor:
    """A tensor sent raw in chunks (a Resume's window or global KV), checked against its checksum and shape."""
    data = b"".join(parts)
    if checksum(data) != expected:
        raise errors.DataLoss(f"{what} arrived damaged (checksum mismatch)")
    dtype = convert.dtype_from_pb(dtype_pb, where)
    if len(data) != stored.stored_nbytes(stored.RAW, shape, dtype):
        raise errors.DataLoss(f"{what} has {len(data)} bytes, its shape {shape} needs more")
    return stored.decode(data, stored.RAW, dtype, shape)


class SyncEngramClient:
    """Blocking facade over EngramClient, for workers that are not asyncio programs. Takes EngramClient's keywords
    (timeout_s among them). Each method waits for the asyncio call, whose every wait on the daemon is bounded by
    timeout_s, and so returns within those bounds whatever the daemon does; close too (its lease releases are
    calls). Threads may share one client. close() ends the calls other threads have in flight: each raises
    ClientClosed (an EngramError and a RuntimeError), as does any call after it. A forked child cannot use it
    (nor make a client of its own): ClientForked; make clients after the fork, or use the spawn start method."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        clientuse.starting()  # before the loop thread: a forked child's ClientForked, not a thread left running
        self._made_in = os.getpid()
        self._closed = False
        self._lock = threading.Lock()  # a call is submitted before close() begins, or sees it closed
        self._calls: set[asyncio.Task[Any]] = set()  # in flight on the loop: close() cancels them
        self._waiting: set[Future[Any]] = set()  # what callers wait on: close() ends any left once the loop stops
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engram-client", daemon=True)
        self._thread.start()
        try:
            self._client: EngramClient = self._run(self._make(address, kwargs))
        except BaseException:  # a refused argument: no loop thread is left running
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
            raise

    @staticmethod
    async def _make(address: str, kwargs: dict[str, Any]) -> EngramClient:
        return EngramClient(address, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            clientuse.check_process(self._made_in)  # a fork's copy of the lock may be held: checked before it
        except errors.ClientForked:
            coro.close()
            raise
        with self._lock:
            if self._closed:
                coro.close()  # never started: no "coroutine was never awaited" warning
                raise clientuse.closed()
            fut: Future[T] = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
            self._waiting.add(fut)
        try:
            return fut.result()
        except CancelledError:
            if self._closed:
                raise clientuse.closed_while_running() from None
            raise
        finally:
            with self._lock:
                self._waiting.discard(fut)

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        """The call, known to close() while it runs; cancelled by close(), it raises ClientClosed."""
        if self._closed:  # close() began after this call was submitted, before it started
            coro.close()
            raise clientuse.closed()
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            return await coro
        except asyncio.CancelledError:
            if self._closed:
                raise clientuse.closed_while_running() from None
            raise
        finally:
            self._calls.discard(task)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *a, **kw: self._run(attr(*a, **kw))

    def close(self) -> None:
        """Close the client and stop its event loop thread (the context manager does it). Calls other threads
        have in flight are given up first, each raising ClientClosed; so does every later call. Again: nothing.
        In a forked child: nothing (the client is its parent's, whose loop thread the child does not have)."""
        if os.getpid() != self._made_in:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
            with self._lock:
                left = list(self._waiting)
            for fut in left:  # a call that did not end when cancelled (its loop is gone now): its caller goes on
                fut.cancel()
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        """Cancel the calls in flight, wait (at most timeout_s) for them to end, then close the client."""
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls, timeout=self._client.timeout_s)
        await self._client.close()

    def __enter__(self) -> SyncEngramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

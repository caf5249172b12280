"""Client library for inference workers: put, look up and get KV blocks as torch tensors.

`EngramClient` is asyncio-native; `SyncEngramClient` runs one on a private event loop thread for
callers that are not async. gRPC errors come back as the domain errors of engram.errors (mapped in one
place, engram/server/errors.py), with the server's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from engram import errors
from engram.block import checksum
from engram.codec import blockformat
from engram.codec.base import codec_by_name
from engram.keys import chain_keys
from engram.layout import DType, ModelSpec
from engram.server.convert import dtype_from_pb, model_to_pb
from engram.server.errors import ERROR_OF
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 8 * 2**20
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class BlockInfo:
    key: bytes
    num_tokens: int
    tier: str
    nbytes: int


@dataclass(frozen=True)
class LookupResult:
    matched_tokens: int
    blocks: tuple[BlockInfo, ...]


@dataclass(frozen=True)
class PutResult:
    keys: tuple[bytes, ...]  # every block of the sequence, cached ones included
    stored: int
    deduplicated: int
    skipped: int  # blocks not sent because a Lookup showed them cached


@dataclass(frozen=True)
class ResumeResult:
    """What Resume returns: the global KV blocks of [0, position) (fetch them with get) and the SWA window,
    (sliding layers, 2, position - window_start, kv heads, head dim), for a query at `position`."""

    position: int
    blocks: tuple[BlockInfo, ...]
    window: torch.Tensor
    window_start: int
    source: str  # "replay", "hot" or "persisted"
    replayed_tokens: int
    replay_s: float


MODES = {"exact": pb.REPLAY_MODE_EXACT, "approx": pb.REPLAY_MODE_APPROX, "persist": pb.REPLAY_MODE_PERSIST}


def _map_error(exc: grpc.aio.AioRpcError) -> Exception:
    cls = ERROR_OF.get(exc.code())
    if cls is None:
        return errors.Unavailable(f"{exc.code().name}: {exc.details()}")
    return cls(exc.details() or exc.code().name)


T = TypeVar("T")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor (bf16 included, which numpy cannot hold)."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    # bytearray: torch.frombuffer needs a writable buffer; this is the one copy on the receive path.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(tuple(shape))


class EngramClient:
    def __init__(
        self,
        address: str,
        *,
        namespace: str = "default",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if chunk_bytes + 4096 > max_message_bytes:
            raise ValueError("chunk_bytes must leave room for headers under max_message_bytes")
        self.address = address
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.EngramStub(self._channel)
        self._layouts: dict[bytes, ModelSpec] = {}

    async def __aenter__(self) -> EngramClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return await coro
        except grpc.aio.AioRpcError as exc:
            raise _map_error(exc) from exc

    # ---- models --------------------------------------------------------------------------------

    async def register_model(self, spec: ModelSpec) -> bytes:
        """Register a model; returns its fingerprint. Its codec, if left empty, is the daemon's default."""
        resp = await self._call(self._stub.RegisterModel(pb.RegisterModelRequest(model=model_to_pb(spec))))
        self._layouts[resp.model_fingerprint] = dataclasses.replace(spec, codec=resp.codec)
        return resp.model_fingerprint

    def codec_of(self, fingerprint: bytes) -> str:
        return self._spec(fingerprint).codec

    def _spec(self, fingerprint: bytes) -> ModelSpec:
        try:
            return self._layouts[fingerprint]
        except KeyError:
            raise errors.NotFound("register the model through this client first (register_model)") from None

    # ---- lookup / put / get --------------------------------------------------------------------

    async def lookup(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *, namespace: str | None = None
                     ) -> LookupResult:
        req = pb.LookupRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint,
                               tokens=np.asarray(tokens, dtype=np.int32).tolist())
        resp = await self._call(self._stub.Lookup(req))
        return LookupResult(
            resp.matched_tokens, tuple(BlockInfo(b.key, b.num_tokens, b.tier, b.nbytes) for b in resp.blocks)
        )

    async def put(
        self,
        fingerprint: bytes,
        tokens: Sequence[int] | np.ndarray,
        kv: torch.Tensor,
        *,
        namespace: str | None = None,
        pin: bool = False,
        skip_cached: bool = True,
        encode: bool = False,
    ) -> PutResult:
        """Store the KV of a token sequence. kv: (persisted_layers, 2, len(tokens), kv_heads, head_dim).

        With skip_cached (the default) a Lookup first finds the cached prefix and only the blocks after
        it are sent: agents re-read far more than they write, so most of a long prefix is usually there.
        With encode, blocks are encoded here in the model's codec (with the Triton kernels when kv is on a
        GPU) and travel 3.5-4x smaller; otherwise the daemon encodes them.
        """
        spec = self._spec(fingerprint)
        ns = self._ns(namespace)
        arr = np.asarray(tokens, dtype=np.int32)
        bt = spec.layout.block_tokens
        if kv.dim() != 5 or kv.shape[2] != len(arr):
            raise errors.InvalidArgument(
                f"kv must be (layers, 2, tokens, kv_heads, head_dim) with tokens={len(arr)}, got {tuple(kv.shape)}"
            )
        all_keys = [k for k, _, _ in chain_keys(ns, fingerprint, arr, bt)]
        first = 0
        if skip_cached:
            hit = await self.lookup(fingerprint, arr, namespace=ns)
            # Only whole cached blocks can be skipped: a cached partial tail is superseded by what we send.
            first = sum(1 for b in hit.blocks if b.num_tokens == bt and b.key in all_keys)
        if first == len(all_keys):
            return PutResult(tuple(all_keys), 0, 0, skipped=first)
        try:
            resp = await self._put_from(fingerprint, arr, kv, all_keys, first, bt, ns, pin, encode)
        except errors.FailedPrecondition:
            if first == 0:
                raise
            # The cached prefix was evicted between our Lookup and the Put: send the whole chain.
            first = 0
            resp = await self._put_from(fingerprint, arr, kv, all_keys, first, bt, ns, pin, encode)
        if list(resp.keys) != all_keys[first:]:
            raise errors.DataLoss("the daemon computed other block keys than this client; key versions differ?")
        return PutResult(tuple(all_keys), resp.stored, resp.deduplicated, skipped=first)

    async def _put_from(self, fingerprint: bytes, arr: np.ndarray, kv: torch.Tensor, all_keys: list[bytes],
                        first: int, bt: int, ns: str, pin: bool, encode: bool) -> pb.PutResponse:
        parent = all_keys[first - 1] if first else b""
        blocks = [(arr[i * bt : (i + 1) * bt], kv[:, :, i * bt : (i + 1) * bt]) for i in range(first, len(all_keys))]
        codec = self.codec_of(fingerprint) if encode else "raw"
        return await self.put_blocks(fingerprint, blocks, parent_key=parent, namespace=ns, pin=pin, codec=codec)

    async def put_blocks(
        self,
        fingerprint: bytes,
        blocks: Sequence[tuple[np.ndarray | Sequence[int], torch.Tensor]],
        *,
        parent_key: bytes = b"",
        namespace: str | None = None,
        pin: bool = False,
        codec: str = "raw",
    ) -> pb.PutResponse:
        """Send a chain of (tokens, kv) blocks after `parent_key` (empty: the chain's start), as raw
        elements or encoded here in `codec` (which must be the model's)."""
        ns = self._ns(namespace)
        step = self.chunk_bytes
        enc = None if codec == "raw" else codec_by_name(codec)

        async def requests() -> AsyncIterator[pb.PutRequest]:
            yield pb.PutRequest(header=pb.PutHeader(namespace=ns, model_fingerprint=fingerprint,
                                                    parent_key=parent_key, pin=pin))
            for toks, kv in blocks:
                if enc is None:
                    payload = tensor_bytes(kv)
                else:
                    payload = blockformat.encode(kv, enc, backend="triton" if kv.is_cuda else "reference")
                header = pb.BlockHeader(
                    tokens=np.asarray(toks, dtype=np.int32).tolist(),
                    dtype=int(DType.from_torch(kv.dtype)),  # type: ignore[arg-type]
                    shape=list(kv.shape), payload_nbytes=len(payload), checksum=checksum(payload), codec=codec,
                )
                if len(payload) <= step:
                    yield pb.PutRequest(chunk=pb.BlockChunk(header=header, data=payload, last=True))
                    continue
                view = memoryview(payload)
                for off in range(0, len(payload), step):
                    chunk = pb.BlockChunk(data=bytes(view[off : off + step]), last=off + step >= len(payload))
                    if off == 0:
                        chunk.header.CopyFrom(header)
                    yield pb.PutRequest(chunk=chunk)

        return await self._call(self._stub.Put(requests()))

    async def get(self, fingerprint: bytes, keys: Sequence[bytes], *, namespace: str | None = None,
                  decode_on_server: bool = False, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Blocks by key, in order, each (persisted_layers, 2, tokens, kv_heads, head_dim) on `device`;
        every payload's checksum is verified again on arrival. Encoded blocks travel as stored and are
        decoded here (the Triton kernels on a GPU device), unless decode_on_server."""
        req = pb.GetRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint, keys=list(keys),
                            decode=decode_on_server)
        out: list[torch.Tensor] = []
        parts: list[bytes] = []
        header: pb.BlockHeader | None = None
        try:
            async for resp in self._stub.Get(req):
                chunk = resp.chunk
                if chunk.HasField("header"):
                    header = chunk.header
                    parts = []
                parts.append(chunk.data)
                if chunk.last:
                    if header is None:
                        raise errors.DataLoss("Get stream sent a block's bytes without its header")
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    if len(data) != header.payload_nbytes or checksum(data) != header.checksum:
                        raise errors.DataLoss(f"block {len(out)} arrived damaged (size or checksum mismatch)")
                    where = f"block {len(out)}"
                    if header.codec in ("", "raw"):
                        dtype = dtype_from_pb(header.dtype, where).torch_dtype
                        out.append(tensor_from_bytes(data, dtype, header.shape).to(device))
                    else:
                        backend = "triton" if torch.device(device).type == "cuda" else "reference"
                        out.append(blockformat.decode(data, backend=backend, device=device, where=where))
                    header = None
        except grpc.aio.AioRpcError as exc:
            raise _map_error(exc) from exc
        if len(out) != len(keys):
            raise errors.DataLoss(f"Get returned {len(out)} of {len(keys)} blocks")
        return out

    async def get_prefix(self, fingerprint: bytes, tokens: Sequence[int] | np.ndarray, *,
                         namespace: str | None = None, decode_on_server: bool = False,
                         device: torch.device | str = "cpu") -> tuple[int, torch.Tensor | None]:
        """The longest cached prefix of `tokens` and its KV, concatenated along the token axis."""
        hit = await self.lookup(fingerprint, tokens, namespace=namespace)
        if not hit.blocks:
            return 0, None
        blocks = await self.get(fingerprint, [b.key for b in hit.blocks], namespace=namespace,
                                decode_on_server=decode_on_server, device=device)
        # The last block may serve only its first tokens (the query diverges inside it): slice.
        return hit.matched_tokens, torch.cat(blocks, dim=2)[:, :, : hit.matched_tokens]

    async def pin(self, fingerprint: bytes, keys: Sequence[bytes], *, unpin: bool = False,
                  namespace: str | None = None) -> int:
        req = pb.PinRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint, keys=list(keys), unpin=unpin)
        return (await self._call(self._stub.Pin(req))).changed

    # ---- sessions ----------------------------------------------------------------------------------

    def _ref(self, session_id: str, namespace: str | None) -> pb.SessionRef:
        return pb.SessionRef(namespace=self._ns(namespace), session_id=session_id)

    async def open_session(self, fingerprint: bytes, *, mode: str = "exact", approx_k: float = 0.0,
                           session_id: str = "", tokens: Sequence[int] | np.ndarray = (),
                           namespace: str | None = None) -> pb.SessionInfo:
        if mode not in MODES:
            raise errors.InvalidArgument(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        req = pb.OpenSessionRequest(namespace=self._ns(namespace), model_fingerprint=fingerprint,
                                    session_id=session_id, mode=MODES[mode], approx_k=approx_k,  # type: ignore[arg-type]
                                    tokens=np.asarray(tokens, dtype=np.int32).tolist())
        return await self._call(self._stub.OpenSession(req))

    async def append_session(self, session_id: str, tokens: Sequence[int] | np.ndarray, *,
                             window: torch.Tensor | None = None, window_start: int = 0,
                             namespace: str | None = None) -> pb.SessionInfo:
        """Append tokens (their global KV goes with put). In persist mode, also send the SWA window for the
        new end: (sliding layers, 2, rows, kv heads, head dim) starting at window_start."""
        req = pb.AppendSessionRequest(session=self._ref(session_id, namespace),
                                      tokens=np.asarray(tokens, dtype=np.int32).tolist())
        if window is not None:
            data = tensor_bytes(window)
            req.window.CopyFrom(pb.SwaWindowData(
                prefix_len=window_start + window.shape[2], start=window_start,
                dtype=int(DType.from_torch(window.dtype)), shape=list(window.shape),  # type: ignore[arg-type]
                checksum=checksum(data), data=data))
        return await self._call(self._stub.AppendSession(req))

    async def fork_session(self, parent_id: str, *, session_id: str = "", position: int = 0,
                           namespace: str | None = None) -> pb.SessionInfo:
        req = pb.ForkSessionRequest(parent=self._ref(parent_id, namespace), session_id=session_id, position=position)
        return await self._call(self._stub.ForkSession(req))

    async def suspend_session(self, session_id: str, *, namespace: str | None = None) -> pb.SessionInfo:
        return await self._call(self._stub.SuspendSession(self._ref(session_id, namespace)))

    async def close_session(self, session_id: str, *, namespace: str | None = None) -> pb.SessionInfo:
        return await self._call(self._stub.CloseSession(self._ref(session_id, namespace)))

    async def resume(self, session_id: str, *, position: int = 0, namespace: str | None = None) -> ResumeResult:
        req = pb.ResumeRequest(session=self._ref(session_id, namespace), position=position)
        header: pb.ResumeHeader | None = None
        parts: list[bytes] = []
        try:
            async for resp in self._stub.Resume(req):
                if resp.WhichOneof("item") == "header":
                    header = resp.header
                else:
                    parts.append(resp.window_chunk)
        except grpc.aio.AioRpcError as exc:
            raise _map_error(exc) from exc
        if header is None:
            raise errors.DataLoss("Resume stream carried no header")
        w = header.window
        data = b"".join(parts)
        if checksum(data) != w.checksum:
            raise errors.DataLoss("the SWA window arrived damaged (checksum mismatch)")
        window = tensor_from_bytes(data, dtype_from_pb(w.dtype, "window").torch_dtype, w.shape)
        blocks = tuple(BlockInfo(b.key, b.num_tokens, b.tier, b.nbytes) for b in header.blocks)
        return ResumeResult(header.position, blocks, window, w.start, header.source, header.replayed_tokens,
                            header.replay_s)

    async def resume_kv(self, fingerprint: bytes, session_id: str, *, position: int = 0,
                        namespace: str | None = None, device: torch.device | str = "cpu"
                        ) -> tuple[ResumeResult, torch.Tensor]:
        """Resume, then fetch the global KV: (stored_layers, 2, position, kv heads, head dim)."""
        r = await self.resume(session_id, position=position, namespace=namespace)
        blocks = await self.get(fingerprint, [b.key for b in r.blocks], namespace=namespace, device=device)
        return r, torch.cat(blocks, dim=2)[:, :, : r.position]

    async def stats(self) -> pb.StatsResponse:
        return await self._call(self._stub.Stats(pb.StatsRequest()))

    async def check(self, *, fix: bool = False) -> pb.CheckResponse:
        return await self._call(self._stub.Check(pb.CheckRequest(fix=fix)))

    # ---- inspection (engram ls / show / evict) --------------------------------------------------

    async def list_namespaces(self) -> pb.ListNamespacesResponse:
        return await self._call(self._stub.ListNamespaces(pb.ListNamespacesRequest()))

    async def list_sessions(self, *, namespace: str | None = None, all_namespaces: bool = False
                            ) -> pb.ListSessionsResponse:
        req = pb.ListSessionsRequest(namespace=self._ns(namespace), all_namespaces=all_namespaces)
        return await self._call(self._stub.ListSessions(req))

    async def describe_blocks(self, *, session_id: str = "", key_prefixes: Sequence[str] = (),
                              namespace: str | None = None, all_namespaces: bool = False
                              ) -> pb.DescribeBlocksResponse:
        req = pb.DescribeBlocksRequest(namespace=self._ns(namespace), all_namespaces=all_namespaces,
                                       session_id=session_id, key_prefixes=list(key_prefixes))
        return await self._call(self._stub.DescribeBlocks(req))

    async def evict(self, *, key_prefixes: Sequence[str] = (), session_id: str = "", whole_namespace: bool = False,
                    force: bool = False, namespace: str | None = None, all_namespaces: bool = False
                    ) -> pb.EvictResponse:
        req = pb.EvictRequest(namespace=self._ns(namespace), all_namespaces=all_namespaces,
                              key_prefixes=list(key_prefixes), session_id=session_id,
                              whole_namespace=whole_namespace, force=force)
        return await self._call(self._stub.Evict(req))

    def _ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace


class SyncEngramClient:
    """Blocking facade over EngramClient, for workers that are not asyncio programs."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engram-client", daemon=True)
        self._thread.start()
        self._client: EngramClient = self._run(self._make(address, kwargs))

    @staticmethod
    async def _make(address: str, kwargs: dict[str, Any]) -> EngramClient:
        return EngramClient(address, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr
        return lambda *a, **kw: self._run(attr(*a, **kw))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncEngramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

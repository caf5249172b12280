"""The daemon's end of the data channel (framing and the why: engram/wire/data.py): Put and Get payloads as raw
bytes on a TCP port and a unix socket beside gRPC's.

A connection authenticates once (HELLO carries the bearer token, checked by the same Tenancy as gRPC's metadata)
and then runs the same service code as the gRPC Put and Get (EngramService.chain_put, blocks_to_get,
serve_bytes) as that principal, so quotas, namespaces, limits and checksums hold exactly as on gRPC. A payload
is received into its own buffer, which the store keeps (no join, no second copy), and sent from where it lies
(a pool slot is written to the socket from the slot). Errors answer an ERROR frame with the gRPC status code;
only a connection whose framing cannot be trusted any more is closed, and one that stalls in the middle of a
frame (server.data_stall_s): its buffers hold only what it sent, but its slot and those bytes are not kept. So is
one whose client takes nothing of an answer for as long (a GET never read held its slot and the block being
sent, with the blocks' read hold, for ever), and one that sends no request for server.data_idle_s. An idle
connection keeps its receive buffer for REUSE_IDLE_S only (a pool of idle connections held up to 64 MiB each).
Every connection's buffers together stay under server.receive_buffer_bytes (server/recvbudget.py, the daemon's one
budget, gRPC Put streams' too): a request's metadata and a block's buffer are taken from it before they are read,
waiting (the socket not read) while it is spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, TypeVar

from engram import errors
from engram.config import ServerConfig
from engram.logbudget import LogBudget
from engram.private import remove_stale_socket
from engram.server.auth import _principal
from engram.server.recvbudget import Holding
from engram.server.requests import (
    CONTROL_BYTES,
    TOP_LEVEL_SLACK,
    block_request_bytes,
    check_limit,
    key_request_bytes,
    top_level_fields,
)
from engram.server.service import EngramService
from engram.tenancy import OPEN, Principal, Tenancy
from engram.v1 import engram_pb2 as pb
from engram.wire import convert
from engram.wire import data as wire
from engram.wire.status import status_of

log = logging.getLogger("engram.server")


_OPS = {wire.PUT: "put", wire.GET: "get"}
REUSE_MAX = 64 * 2**20  # the largest receive buffer a connection keeps between blocks
# How long a connection idle between requests keeps that buffer: back-to-back puts reuse it (a fresh one per block
# cost its zeroing and page faults: 32 MiB puts ran at 0.3 GB/s, 2 reused), while a client's pooled connections
# each held theirs as long as they stayed open (an audit, session 45: 24 connections, +800 MiB for good).
REUSE_IDLE_S = 1.0
SWEEP_S = 0.5  # how often idle connections are looked at (their buffers dropped, those past data_idle_s closed)
HELLO_TIMEOUT_S = 10.0  # a connection that sends no HELLO by then is closed
# Connections that have not said HELLO yet (no token known): one more closes the oldest of them. They do not count
# against server.max_concurrent_rpcs, which bounds connections past HELLO: sockets that never spoke (no token
# needed) held every slot, and every tenant's client fell back to gRPC (an audit).
GREETING_MAX = 64
PROGRESS_MIN_S = 0.01  # the most often a Put sends PROGRESS frames, whatever its client asks
T = TypeVar("T")


class Progress:
    """A data-channel Put's PROGRESS frames (DataPut.progress_every_ms): a timer, each time it fires while the
    daemon stores one of the put's blocks, sends one. The connection is idle then (its request's task is in the
    store, and only that task reads or sends), and that task waits for the frame to be sent before it uses the
    connection again. A task per stored block instead cost 60 us a block (a micro-benchmark on the loaded dev
    machine; the timer under 1 us)."""

    def __init__(self, conn: wire.Conn, every_ms: int) -> None:
        self.conn = conn
        self.every = max(every_ms / 1000, PROGRESS_MIN_S) if every_ms else 0.0
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(self.every, self._tick) if self.every else None
        self._storing = False
        self._sending: asyncio.Future[None] | None = None

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self.every, self._tick)
        sent = self._sending
        # a frame each tick for as long as one block's store lasts (one a block let a long store be cut); none
        # while the last is still being sent, nor after one failed (`during` raises it)
        if self._storing and (sent is None or (sent.done() and not sent.cancelled() and sent.exception() is None)):
            self._sending = asyncio.ensure_future(self.conn.send_frame(wire.PROGRESS))

    async def during(self, work: Coroutine[Any, Any, T]) -> T:
        if self._timer is None:
            return await work
        self._storing = True
        try:
            return await work
        finally:
            self._storing = False
            if self._sending is not None:
                sending, self._sending = self._sending, None
                if not sending.done() and _cancelling():
                    sending.cancel()  # the connection is going: a frame half sent does not matter
                await asyncio.wait({sending})
                if not sending.cancelled() and sending.exception() is not None:
                    raise sending.exception()  # type: ignore[misc]

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Idle(NamedTuple):
    """A connection waiting for its next request: its task, since when (loop time), and its bytes received then
    (more since: a frame has begun, which the stall watch judges)."""

    task: asyncio.Task[Any]
    since: float
    received: int


class _Desync(Exception):
    """The byte stream can no longer be framed (an unknown request, a body over the limit): `error` is answered,
    then the connection is closed."""

    def __init__(self, error: errors.EngramError) -> None:
        super().__init__(str(error))
        self.error = error


def _ended_as(exc: BaseException) -> str:
    """The status a request that ended its connection is counted under (the daemon's /metrics)."""
    if isinstance(exc, _Desync):
        return status_of(exc.error).name
    if isinstance(exc, wire.Stalled):
        return "DEADLINE_EXCEEDED"
    if isinstance(exc, ConnectionError | asyncio.CancelledError):
        return "CANCELLED"  # the client went mid-request, or the daemon stopped
    return "INTERNAL"


def _parse(message_cls: Any, meta: bytes | bytearray, what: str) -> Any:
    try:
        return message_cls.FromString(bytes(meta))
    except Exception as exc:
        raise errors.InvalidArgument(f"data channel: {what} is not a valid {message_cls.DESCRIPTOR.full_name}: "
                                     f"{exc}") from None


class DataPort:
    """Listens for data-channel connections and serves each in a task of its own."""

    def __init__(self, service: EngramService, config: ServerConfig, tenancy: Tenancy | None,
                 observe: Callable[[str, str, float], None] | None = None) -> None:
        """observe(op, status code name, seconds): told of every request (the daemon's /metrics)."""
        self.service, self.config, self.tenancy, self.observe = service, config, tenancy, observe
        self.tcp_port = 0
        self.unix_path = ""
        self.tls = False
        self._listeners: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_request: set[asyncio.Task[Any]] = set()  # connections answering a request right now
        self._conns: set[wire.Conn] = set()  # connections being served (their buffers: buffered_bytes)
        self._greeting: dict[asyncio.Task[Any], None] = {}  # connections waiting for their HELLO, oldest first
        self._evicted: set[asyncio.Task[Any]] = set()  # of those, closed to make room for a newer one
        self._greeted = 0  # connections past HELLO (server.max_concurrent_rpcs bounds them)
        self._full_said = LogBudget()  # a client retrying a full channel refused at every connect: lines bounded
        self._idle: dict[wire.Conn, _Idle] = {}  # connections between requests (the sweep looks at them)
        self._idled_out: set[wire.Conn] = set()  # of those, closed for server.data_idle_s
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        self._accepting: list[asyncio.Task[None]] = []
        self.served = {"put": 0, "get": 0, "refused": 0}  # requests answered, by kind (tests, logs)
        self.budget = service.receive_budget  # one for the daemon: Put streams take from it too
        self.budget.reclaim = self._reclaim
        self._holding: dict[wire.Conn, Holding] = {}  # what each connection past HELLO holds of the budget

    @property
    def max_request_bytes(self) -> int:
        return int(self.config.data_max_request_bytes)

    def buffered_bytes(self) -> int:
        """Bytes held in receive buffers: frames being received and each connection's reused payload buffer
        (kept REUSE_IDLE_S after its request)."""
        return sum(len(c.scratch) + c.receiving for c in self._conns)

    def endpoint(self) -> pb.DataEndpointResponse:
        return pb.DataEndpointResponse(tcp_port=self.tcp_port, unix_path=self.unix_path, tls=self.tls,
                                       max_request_bytes=self.max_request_bytes)

    async def start_unix(self, path: str) -> None:
        remove_stale_socket(path, "server.unix_socket's data channel")  # an earlier run's (its lock is ours now)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        self.unix_path = path
        self._listen(sock)

    async def start_tcp(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if tls is not None:
            server = await asyncio.start_server(self._serve_streams, host, port, ssl=tls,
                                                family=family, reuse_address=True)
            self._servers.append(server)
            self.tcp_port = server.sockets[0].getsockname()[1]
            self.tls = True
            self._start_sweep()
            return
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            sock.close()
            raise errors.AddressInUse(f"cannot listen on the data port {host}:{port}: {exc.strerror}; set "
                                      "server.data_port to a free port (0 picks one) or server.data_channel = "
                                      "off") from None
        self.tcp_port = sock.getsockname()[1]
        self._listen(sock)

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(128)
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepting.append(asyncio.get_running_loop().create_task(self._accept(sock)))
        self._start_sweep()

    def _start_sweep(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Every SWEEP_S: connections idle REUSE_IDLE_S give their receive buffer back, those idle
        server.data_idle_s are closed (their task ends as its client's end would). A sweep, not a timer per
        request: back-to-back requests pay only the dict entry that says they wait."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            now, idle_s = loop.time(), self.config.data_idle_s
            for conn, idle in list(self._idle.items()):
                if conn.received != idle.received:
                    continue  # a frame has begun: not idle
                if conn.scratch and now - idle.since >= REUSE_IDLE_S:
                    self._let_go(conn)  # its task waits for a frame header: no view of it is in use
                if idle_s and now - idle.since >= idle_s and conn not in self._idled_out:
                    self._idled_out.add(conn)
                    idle.task.cancel()

    def _reclaim(self) -> None:
        """A request waits for buffer room: every connection idle between requests gives its kept buffer back now,
        not REUSE_IDLE_S after its last request."""
        for conn, idle in list(self._idle.items()):
            if conn.scratch and conn.received == idle.received:  # no frame begun: its task waits for a header
                self._let_go(conn)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() < 0:
                    return
                log.warning("data channel: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            wire.tune(sock)
            self._spawn(wire.Conn(sock, stall_s=self.config.data_stall_s))

    async def _serve_streams(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = wire.Conn(reader=reader, writer=writer, stall_s=self.config.data_stall_s)
        self._tasks.add(task)  # asyncio's server runs this in a task of its own: stop() must end it too
        try:
            wire.tune(writer.get_extra_info("socket"))
            await self._serve(conn)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # stop() ended it: returned, not cancelled, since Python 3.11's streams ask the finished task for its
            # exception, which a cancelled task raises, logged as an error at every stop with a client connected
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _spawn(self, conn: wire.Conn) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _full(self) -> bool:
        if self._greeted < self.config.max_concurrent_rpcs:  # the same bound as gRPC's concurrent calls
            return False
        if (held := self._full_said.take()) is not None:
            log.warning("data channel: %d connections open (server.max_concurrent_rpcs); one more was refused%s",
                        self._greeted, f" ({held} more since the last such line)" if held else "")
        return True

    async def _refuse(self, conn: wire.Conn) -> None:
        """Say why, as the answer to its HELLO (RESOURCE_EXHAUSTED, which the client takes as its cue to use gRPC
        instead), within a second: a peer that reads nothing is not waited for. The caller closes it."""
        busy = errors.ResourceExhausted(
            f"the daemon's data channel has server.max_concurrent_rpcs = {self.config.max_concurrent_rpcs} "
            "connections open")
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it drops a cancel landing as the send ends
                await conn.send_error(busy)

    def _greet(self, task: asyncio.Task[Any]) -> None:
        """Room for one more connection waiting for its HELLO: past GREETING_MAX the oldest is closed (it had
        its chance: a client's HELLO follows its connect at once)."""
        if len(self._greeting) >= GREETING_MAX:
            oldest = next(iter(self._greeting))
            del self._greeting[oldest]
            self._evicted.add(oldest)
            oldest.cancel()
        self._greeting[task] = None

    async def _serve(self, conn: wire.Conn) -> None:
        """One connection: HELLO, then requests until the client leaves, the framing breaks, a frame stalls or
        none comes for server.data_idle_s. Between requests it may stay idle (clients keep connections pooled;
        max_concurrent_rpcs bounds them)."""
        self._conns.add(conn)
        principal = None
        try:
            principal = await self._hello(conn)
            if principal is None:
                return
            tenant = principal.name if self.tenancy is not None and not principal.admin else None
            held = self._holding[conn] = self.budget.holding(tenant)
            me = asyncio.current_task()
            assert me is not None
            while not self._stopping:
                try:
                    head = await self._next_head(conn, me)
                except asyncio.IncompleteReadError:
                    return
                except wire.Stalled:
                    # A request begun (a byte of its frame header came) whose kind is not known yet: counted too,
                    # as "other" (what an unknown kind is counted as), for the stall it waited
                    if self.observe is not None:
                        self.observe("other", "DEADLINE_EXCEEDED", self.config.data_stall_s)
                    raise
                if head is None:
                    log.debug("data channel: a connection idle for server.data_idle_s = %gs was closed",
                              self.config.data_idle_s)
                    return
                kind, meta_len, body = head
                # A request from its header on: its metadata stalled, cut or over-long is counted too.
                t0, code = time.perf_counter(), "OK"
                self._in_request.add(me)  # a stop lets it finish within the shutdown grace
                try:
                    try:
                        if (most := self._max_meta(kind)) < meta_len <= wire.MAX_META_BYTES:
                            raise _Desync(errors.ResourceExhausted(
                                f"data channel: a {_OPS.get(kind, 'request')}'s metadata of {meta_len} bytes exceeds "
                                f"the {most} it may take (server.max_blocks_per_request, "
                                "server.max_tokens_per_request); split the request"))
                        wire.check_meta_len(meta_len)
                    except errors.InvalidArgument as exc:  # a wild metadata length: the stream cannot be framed
                        raise _Desync(exc) from None
                    await self._take_meta(conn, held, meta_len, body)
                    try:
                        await self._request(conn, kind, await conn.read_meta(meta_len), body)
                    finally:  # the request's metadata is dropped with it: its bytes go back
                        self.budget.give(held, held.meta, meta=True)
                        if len(conn.scratch) > REUSE_MAX:
                            self._let_go(conn)  # a block too large to keep: its buffer goes with its request
                except errors.EngramError as exc:
                    self.served["refused"] += 1
                    code = status_of(exc).name
                    await conn.send_error(exc, exc.told(principal.admin))  # (a tenant is not told the daemon's figures)
                except _Desync as exc:
                    self.served["refused"] += 1
                    code = _ended_as(exc)
                    await conn.send_error(exc.error)
                    raise
                except BaseException as exc:
                    code = _ended_as(exc)
                    raise
                finally:
                    self._in_request.discard(me)
                    if self.observe is not None:
                        self.observe(_OPS.get(kind, "other"), code, time.perf_counter() - t0)
        except wire.Stalled as exc:
            log.warning("%s (server.data_stall_s); the connection was closed", exc)
            conn.reset()
        except (ConnectionError, asyncio.IncompleteReadError, _Desync, errors.InvalidArgument):
            pass  # a client gone, or a stream that cannot be framed: the connection ends, the daemon goes on
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error on a data-channel connection; it was closed")
        finally:
            self._conns.discard(conn)
            if (holding := self._holding.pop(conn, None)) is not None:
                self.budget.give_all(holding)
            conn.close()
            if principal is not None:
                self._greeted -= 1
                if self.tenancy is not None:
                    self.tenancy.leave(principal, "data")

    async def _next_head(self, conn: wire.Conn, me: asyncio.Task[Any]) -> tuple[int, int, int] | None:
        """The next request's frame header, waited for as long as the client likes up to server.data_idle_s
        (the sweep cancels the wait); None: idle that long, the connection is to be closed."""
        self._idle[conn] = _Idle(me, asyncio.get_running_loop().time(), conn.received)
        try:
            return await conn.read_head(idle=True)
        except asyncio.CancelledError:
            if conn in self._idled_out and me.uncancel() == 0:  # the sweep's cancel, no other
                return None
            raise
        finally:
            self._idle.pop(conn, None)
            self._idled_out.discard(conn)

    async def _hello(self, conn: wire.Conn) -> Principal | None:
        """The connection's principal once its HELLO is answered (its connection counted against
        server.max_concurrent_rpcs and its tenant's share of data-channel connections: one tenant's idle
        connections took every slot, an audit); None: refused."""
        me = asyncio.current_task()
        assert me is not None
        self._greet(me)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):  # not wait_for: a cancel landing as the HELLO comes is kept
                kind, meta, body = await conn.read_frame(wire.MAX_HELLO_BYTES)
        except TimeoutError:
            return None  # a socket that says nothing: closed
        except errors.InvalidArgument as exc:
            await conn.send_error(exc)
            return None
        except asyncio.CancelledError:
            if me in self._evicted and me.uncancel() == 0:  # closed for a newer connection (`_greet`), no other
                return None
            raise
        finally:
            self._greeting.pop(me, None)
            self._evicted.discard(me)
        if kind != wire.HELLO or body:
            await conn.send_error(errors.InvalidArgument("data channel: a connection starts with HELLO"))
            return None
        return await self._admit(conn, meta)

    async def _admit(self, conn: wire.Conn, meta: bytearray) -> Principal | None:
        """A HELLO's token checked, then the bounds, and answered (HELLO_OK, or the error); None: refused. The
        token first: the connection bound was checked before it, so a peer without one was told how many
        connections were open, and logged a warning at each connect (500 HELLOs, 500 lines: an audit, session 48)."""
        if self.tenancy is None:
            principal = OPEN
        else:
            token = bytes(meta).decode(errors="replace")
            try:
                principal = self.tenancy.authenticate((("authorization", f"Bearer {token}"),) if token else ())
            except errors.EngramError as exc:
                await conn.send_error(exc)
                return None
        if self._full():
            await self._refuse(conn)
            return None
        # Taken before any await: connections saying HELLO at once cannot pass the bound together
        self._greeted += 1
        try:
            if self.tenancy is not None:
                self.tenancy.enter(principal, "data")  # RESOURCE_EXHAUSTED: the client takes gRPC instead
        except errors.EngramError as exc:
            self._greeted -= 1
            await conn.send_error(exc)
            return None
        _principal.set(principal)  # this connection's task: the service's namespace checks read it
        try:
            # Its limit said at every connection: a client whose daemon came back on the same address (a restart)
            # sizes its requests by it, where one sized by the limit DataEndpoint told before was refused
            await conn.send_frame(wire.HELLO_OK, wire.LIMIT.pack(self.max_request_bytes))
        except BaseException:
            self._greeted -= 1
            if self.tenancy is not None:
                self.tenancy.leave(principal, "data")
            raise
        return principal

    async def _request(self, conn: wire.Conn, kind: int, meta: bytearray, body: int) -> None:
        if kind == wire.PUT:
            await self._put(conn, meta, body)
        elif kind == wire.GET:
            if body:
                raise _Desync(errors.InvalidArgument(f"data channel: a GET frame carries no body, this one "
                                                     f"announces {body} bytes"))
            await self._get(conn, meta)
        else:
            raise _Desync(errors.InvalidArgument(f"data channel: unknown request kind {kind}"))

    def _max_meta(self, kind: int) -> int:
        """The metadata a request of this kind may carry: a PUT's block headers with their tokens, a GET's
        keys (server/requests.py), under wire.MAX_META_BYTES. A 60 MB PUT of 30 M empty headers took the
        daemon 2.4 GB up and held the event loop 6 s parsing and summing them (an audit)."""
        cfg = self.config
        if kind == wire.PUT:
            most = block_request_bytes(cfg.max_tokens_per_request, cfg.max_blocks_per_request)
        elif kind == wire.GET:
            most = key_request_bytes(cfg.max_blocks_per_request)
        else:
            most = CONTROL_BYTES
        return min(most, wire.MAX_META_BYTES)

    async def _put(self, conn: wire.Conn, meta: bytearray, body: int) -> None:
        """Read each block's payload into a buffer of its own and store it as it completes; on a refusal the
        rest of the body is read and dropped, so the connection stays framed."""
        if body > self.max_request_bytes:
            raise _Desync(errors.ResourceExhausted(
                f"data channel: a Put of {body} bytes exceeds the server's limit of {self.max_request_bytes}; "
                "split the chain"))
        left = body
        try:
            most = self.config.max_blocks_per_request + TOP_LEVEL_SLACK  # headers counted before they are parsed
            if top_level_fields(meta, most) > most:
                raise errors.ResourceExhausted(f"data channel: a PUT's metadata holds more than {most} entries; "
                                               "a Put takes at most server.max_blocks_per_request = "
                                               f"{self.config.max_blocks_per_request} blocks: split the chain")
            req = _parse(pb.DataPut, meta, "a PUT's metadata")
            check_limit("Put blocks", len(req.blocks), self.config.max_blocks_per_request)
            announced = sum(b.payload_nbytes for b in req.blocks)
            if announced != body:
                raise errors.InvalidArgument(f"data channel: the blocks announce {announced} payload bytes, the "
                                             f"frame carries {body}")
            chain = self.service.chain_put(req.header)
            progress = Progress(conn, req.progress_every_ms)
            try:
                for block in req.blocks:
                    header = convert.header_from_pb(block, chain.index)
                    chain.check_not_after_tail()
                    chain.check(header)
                    payload = await self._receive(conn, header.payload_nbytes)
                    left -= header.payload_nbytes
                    # The store copies what it keeps (a pool slot, the private tier's bytes), so the buffer is
                    # reused for the next block; a partial tail is committed by finish() before any further read.
                    await progress.during(chain.add(header, payload))
                reply = await progress.during(chain.finish())
            finally:
                progress.close()
                chain.release()  # quota held for blocks received and never stored
        except errors.EngramError:
            await conn.skip(left)
            raise
        await conn.send_frame(wire.PUT_OK, reply.SerializeToString())
        self.served["put"] += 1

    async def _receive(self, conn: wire.Conn, n: int) -> memoryview:
        """A block's n payload bytes, received into the connection's own buffer, reused from block to block so
        that a put does not allocate (and fault in) fresh memory for every payload. One too small is replaced by a
        buffer whose pages come as the bytes arrive (Conn.recv_payload: a block announced and not sent is not held
        whole), once its n bytes
        are taken from the budget (the old one given back first: a connection waits holding no buffer); one above
        REUSE_MAX goes when its request ends."""
        if n <= len(conn.scratch):
            payload = memoryview(conn.scratch)[:n]
            await conn.recv_into(payload)
            return payload
        held = self._holding[conn]
        self._let_go(conn)  # the old one goes before the new one grows
        await self.budget.take(held, n, meta=False)
        try:
            conn.scratch = await conn.recv_payload(n)
        except BaseException:
            self.budget.give(held, n, meta=False)
            raise
        return memoryview(conn.scratch)

    def _let_go(self, conn: wire.Conn) -> None:
        """Drop the connection's payload buffer and give its bytes back to the budget."""
        conn.scratch = bytearray()
        if (held := self._holding.get(conn)) is not None:
            self.budget.give(held, held.payload, meta=False)

    async def _take_meta(self, conn: wire.Conn, held: Holding, meta_len: int, body: int) -> None:
        """Take a request's metadata bytes from the budget before they are read. A connection that must wait gives
        its payload buffer back first (nothing is waited for while holding one). Refused after
        server.receive_buffer_wait_s: the request is read and dropped, so the connection stays framed."""
        if self.budget.try_take(held, meta_len, meta=True):
            return
        self._let_go(conn)
        try:
            await self.budget.take(held, meta_len, meta=True)
        except errors.ResourceExhausted:
            await conn.skip(meta_len + body)
            raise

    async def _get(self, conn: wire.Conn, meta: bytearray) -> None:
        req = _parse(pb.GetRequest, meta, "a GET's metadata")
        try:
            ns, metas = await self.service.blocks_to_get(req, client_gone=conn.closed_by_peer)
            # Closed here, not when collected, if a send fails or stalls: the blocks it holds go with the request.
            async with contextlib.aclosing(self.service.serve_bytes(ns, req.model_fingerprint, metas,
                                                                    decode=req.decode)) as blocks:
                async for key, header, payload in blocks:
                    chunk = pb.BlockChunk(header=header, key=key, last=True)
                    await conn.send_frame(wire.BLOCK, chunk.SerializeToString(), payload)
            await conn.send_frame(wire.END)
        finally:
            self.service.release_after_get(req)
        self.served["get"] += 1

    async def stop(self, grace_s: float = 0.0) -> None:
        """Take no new connection; end idle ones at once; give those answering a request up to grace_s to finish
        it (server.shutdown_grace_s, as gRPC's in-flight calls get: the data channel carries most puts), then
        end them too."""
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in self._accepting:
            task.cancel()
        for sock in self._listeners:
            sock.close()
        for server in self._servers:
            server.close()  # new connections; the open ones end with their tasks below
        busy = set(self._in_request)
        for task in list(self._tasks):
            if task not in busy:
                task.cancel()
        if busy and grace_s > 0:
            await asyncio.wait(busy, timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        for task in [*self._accepting, *self._tasks, *([self._sweeper] if self._sweeper else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)

"""The data channel: Put and Get payloads as raw bytes on a plain socket beside the gRPC port.

Why a second channel: gRPC's Python stack copies a payload several times (protobuf bytes field, HTTP/2 frames,
the core's slices) and tops out near 0.5 GB/s per connection on a 2-core host, below what a redis-server
client gets for the same bytes. Here a payload is written to the socket from where it lies (the sender's
buffer, the daemon's pool slot) and read into where it will live (a fresh block buffer, the caller's
tensor): the kernel's copy is the only one. The control RPCs, and every client in another language, stay on
gRPC; a Python client uses this channel when the daemon announces one (DataEndpoint) and gRPC otherwise.

Framing: every message is a 16-byte frame header `<B3xIQ` (kind, meta length,
body length), then `meta` (a protobuf message, or for an error a 4-byte status code and a UTF-8 message), then
`body` (payload bytes). A connection opens with HELLO (meta: the bearer token, possibly empty), answered
HELLO_OK (meta: the daemon's server.data_max_request_bytes as LIMIT, `<Q`; empty from a daemon before session 54)
or ERROR. Then requests one at a time:
- PUT: meta DataPut (PutHeader + the blocks' BlockHeaders), body the payloads back to back; answered PUT_OK
  (meta PutResponse) or ERROR. The daemon reads the whole body even when it refuses, so the connection stays
  usable. With DataPut.progress_every_ms the daemon sends empty PROGRESS frames before the answer, one whenever
  that long passed without a frame while it stores the blocks: over TCP a request lies acknowledged in the
  daemon's kernel buffers long before the daemon has stored it (a write-through put of small blocks to a slow
  disk), and the client, seeing no bytes move, would cut it at its timeout_s (a gap of session 45).
- GET: meta GetRequest, no body; answered by one BLOCK frame per block (meta a BlockChunk holding header and
  key, body the payload), then END; or ERROR at any point (the blocks before it were whole).
A connection may stay idle between requests (a client keeps its connections pooled) up to the daemon's
server.data_idle_s, after which the daemon closes it and the client dials anew; TCP keepalive (`tune`) ends one
whose peer vanished without a word (a host down, a link cut) within a minute and a half of silence. Once a frame
has begun, the daemon closes a connection that sends nothing for server.data_stall_s, and it grows
its buffers as bytes arrive, so what a request announces and does not send costs the daemon next to nothing.
The same bound holds for what the daemon sends: a connection whose peer takes none of it for data_stall_s (a GET
never read) is closed. Taking is judged by the kernel, not by the daemon's writes: those wait while the socket's
buffer (megabytes) is full, so a peer reading slowly but steadily looks stalled to the writer alone. A client
bounds its side the same way with its timeout_s (engram/wire/deadline.py): a connection and its HELLO, a request
the daemon takes nothing of, an answer that does not begin or go on, where the daemon still reading the request
is progress too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import mmap
import socket
import ssl
import struct
import termios
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engram import errors
from engram.wire import status

FRAME = struct.Struct("<B3xIQ")
CODE = struct.Struct("<I")
LIMIT = struct.Struct("<Q")  # HELLO_OK's meta: the payload bytes one request may carry on this connection

HELLO, PUT, GET = 1, 2, 3
HELLO_OK, PUT_OK, BLOCK, END, PROGRESS, ERROR = 0x81, 0x82, 0x83, 0x84, 0x85, 0xFF

MAX_META_BYTES = 64 * 2**20  # a DataPut for thousands of blocks fits; a wild length is refused before reading
MAX_HELLO_BYTES = 4096  # a bearer token: what a connection not yet authenticated may make the daemon buffer
SOCKET_BUFFER_BYTES = 4 * 2**20  # kernel buffers large enough that one MiB moves in a few system calls
CLOSED_POLL_S = 0.2  # how often closed_by_peer looks under TLS (asyncio's streams have no wait for the end)
GROW_BYTES = 2**20  # a receive buffer is grown at most this far ahead of the bytes that arrived
# The most a connection sends or receives before its task gives the event loop a turn: a peer on another core keeps
# the socket ready, so a 16 MiB payload went in one step of the daemon's loop (20-60 ms under load, session 49),
# every other client's small call waiting behind it. Each system call moves at most this much, too.
STEP_BYTES = 2**20
SKIP_BYTES = 64 * 2**10  # the buffer a refused request's bytes are read into and dropped
_ZEROS = memoryview(bytes(GROW_BYTES))  # what a buffer grows by (its pages are only ever read)
# TCP keepalive: a connection silent this long is probed, every interval, and reset after that many go unanswered.
# A peer that vanished without a FIN (its host down, the link cut) held its connection, and with it a slot of its
# tenant's share of data connections, for ever (an audit, session 45): now about 90 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 3
# Errors a receive gets from a peer gone without a word (keepalive's probes unanswered, its network unreachable):
# the peer left, as a reset says, so they end the connection as ConnectionError does, not as an internal error.
_GONE = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


def tune(sock: socket.socket) -> None:
    """Non-blocking, large kernel buffers, and on TCP no Nagle delay (a frame header waits for nothing) and
    keepalive (KEEPALIVE_*: a peer gone without a FIN is found; a unix socket's peer is on this host, its end
    seen by the kernel)."""
    sock.setblocking(False)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # the kernel's limit applies; buffers only tune speed
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
            if hasattr(socket, name):  # Linux and macOS have them; elsewhere the system's keepalive timing
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


_OUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # Linux's SIOCOUTQ
_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64, Linux 4.1+) in struct tcp_info


def unsent_bytes(sock: Any) -> int | None:
    """What the kernel still holds of what was written to the socket (SIOCOUTQ): on TCP the bytes the peer has
    not acknowledged, on a unix socket those its peer has not read. None where the kernel does not say."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return None


def acked_bytes(sock: Any) -> int | None:
    """Bytes a TCP peer has acknowledged since the connection opened (TCP_INFO); None elsewhere. Under TLS the
    daemon's writes go through asyncio's buffers, which refill the kernel's unseen: this count still moves."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    return int(struct.unpack_from("<Q", info, _TCPI_BYTES_ACKED)[0]) if len(info) >= _TCPI_BYTES_ACKED + 8 else None


def check_meta_len(meta_len: int, max_meta: int = MAX_META_BYTES) -> None:
    """InvalidArgument for a frame announcing more than max_meta bytes of metadata (a wild length: the stream cannot
    be framed)."""
    if meta_len > max_meta:
        raise errors.InvalidArgument(f"data channel: a frame announces {meta_len} bytes of metadata, more "
                                     f"than the {max_meta} allowed")


class Stalled(ConnectionError):
    """The peer sent nothing for the connection's stall_s in the middle of a frame, or took nothing of what this
    side was sending for that long."""


class Conn:
    """One byte stream: a plain socket (the kernel copies straight into the caller's buffer) or, under TLS,
    asyncio streams (one copy more, from the TLS record buffer)."""

    def __init__(self, sock: socket.socket | None = None, *, reader: asyncio.StreamReader | None = None,
                 writer: asyncio.StreamWriter | None = None, stall_s: float | None = None,
                 reading_counts: bool = False) -> None:
        """stall_s: the longest a frame begun may go without a byte, or a send without the peer taking any (the
        daemon's server.data_stall_s, a client's timeout_s: an answer must begin within it too); None: no limit.
        reading_counts: while this side waits for bytes, the peer taking more of what this side sent is progress
        too (a client awaiting the answer to a Put whose blocks the daemon reads and stores one by one, all of
        them already in the kernel's buffers)."""
        self._sock, self._reader, self._writer = sock, reader, writer
        self._loop = asyncio.get_running_loop()
        self.stall_s = stall_s
        self.reading_counts = reading_counts
        # a receiver's buffer, reused from message to message (the daemon's puts: recv_payload's)
        self.scratch: bytearray | mmap.mmap = bytearray()
        self.receiving = 0  # bytes of the buffer `recv` is growing now (the daemon's engram_data_buffered_bytes)
        self.received = 0  # bytes received so far: whether a frame has begun since the daemon last looked (idle)
        # The stall watch: one timer a connection, due stall_s after the last byte, moved on when it finds bytes came
        # meanwhile (a timer per read, or per wait, cost a sixth of the receive rate). A send is watched by the same
        # timer: each time it fires it asks the kernel whether the peer took bytes since it last looked.
        self._last = 0.0  # loop time of the last byte received, of a send begun, or of the last look that saw one taken
        self._busy: asyncio.Task[object] | None = None  # the task inside a frame's recv_into or a send, watched
        self._sending = False  # _busy is sending
        self._watch: asyncio.TimerHandle | None = None
        self._stalled = False
        self._socket = sock if sock is not None else writer.get_extra_info("socket") if writer is not None else None
        self._sent = 0  # bytes the kernel (or, under TLS, asyncio's transport) took from send
        self._unyielded = 0  # bytes moved since this connection's task last gave the loop a turn (STEP_BYTES)
        self._mark: tuple[int, int | None, int | None] | None = None  # (_sent, unsent, acked) at the last look

    async def recv_into(self, buf: memoryview, *, idle: bool = False) -> None:
        """Fill `buf` exactly; ConnectionError if the peer closes first, Stalled if stall_s passes without a byte
        (idle: the first byte may take any time, as the next frame of a connection kept open may)."""
        if self.stall_s is None:
            while buf:
                buf = buf[await self._recv_some(buf):]
            return
        loop, task = self._loop, asyncio.current_task()
        assert task is not None
        try:
            while buf:
                if not idle and self._busy is None:
                    self._arm(task, sending=False)
                n = await self._recv_some(buf)
                self._last = loop.time()
                buf, idle = buf[n:], False
        except asyncio.CancelledError:
            self._raise_if_stalled(task, "sent nothing for {}s in the middle of a frame")
            raise
        finally:
            self._busy = None

    def _arm(self, task: asyncio.Task[object], *, sending: bool) -> None:
        self._busy, self._sending, self._last = task, sending, self._loop.time()
        if not sending and self.reading_counts and self._socket is not None:
            self._mark = self._look()  # what the peer has taken so far: the first look compares with it
        if self._watch is None:
            assert self.stall_s is not None
            self._watch = self._loop.call_at(self._last + self.stall_s, self._check_stall)

    def _raise_if_stalled(self, task: asyncio.Task[object], what: str) -> None:
        if self._stalled and task.uncancel() == 0:  # the watch's cancel, no other
            self._stalled = False
            raise Stalled(f"data channel: the peer {what.format(f'{self.stall_s:g}')}") from None

    def _check_stall(self) -> None:
        self._watch = None
        if self._busy is None or self.stall_s is None:
            return  # between frames: the next frame arms it again
        now = self._loop.time()
        # a send's progress is the peer taking its bytes; a receive's, with reading_counts, also the peer reading on
        watched = self._sending or self.reading_counts
        if watched and self._taken_since_last_look(first=self._sending):
            self._last = now
        due = self._last + self.stall_s
        if now >= due:
            self._stalled = True
            self._busy.cancel()
        else:
            self._watch = self._loop.call_at(due, self._check_stall)

    def _look(self) -> tuple[int, int | None, int | None]:
        return self._sent, unsent_bytes(self._socket), acked_bytes(self._socket)

    def _taken_since_last_look(self, *, first: bool = True) -> bool:
        """Whether the peer took bytes since the watch last looked: the kernel accepted more of a send (it had
        room: the peer read), or what it holds unsent shrank, or a TCP peer acknowledged more. With no write in
        between the kernel's queue only shrinks as the peer takes it, so a look that sees none of these means
        nothing was taken since the one before. The first look has nothing to compare with, nor a look where the
        kernel does not say: `first` (taken, for a send; not, for a receive: reading_counts)."""
        if self._socket is None:
            return first
        mark = self._look()
        last, self._mark = self._mark, mark
        if last is None:
            return first
        if mark[0] != last[0]:
            return True
        if mark[1] is None and mark[2] is None:
            return first  # the kernel does not say: a send is never judged stalled
        return ((mark[1] is not None and last[1] is not None and mark[1] < last[1])
                or (mark[2] is not None and last[2] is not None and mark[2] > last[2]))

    async def _recv_some(self, buf: memoryview) -> int:
        """Some of buf's bytes (STEP_BYTES at most), received; a turn of the loop given every STEP_BYTES."""
        step = buf[:STEP_BYTES]
        try:
            if self._reader is not None:
                data = await self._reader.read(len(step))
                n = len(data)
                step[:n] = data
            else:
                assert self._sock is not None
                n = await self._loop.sock_recv_into(self._sock, step)
        except OSError as exc:
            if isinstance(exc, ConnectionError) or exc.errno not in _GONE:
                raise
            raise ConnectionError(f"the data channel's peer is gone: {exc.strerror}") from exc
        if n == 0:
            raise ConnectionError("the peer closed the data channel mid-message")
        self.received += n
        await self._moved(n)
        return n

    async def _moved(self, n: int) -> None:
        """n more bytes sent or received: past STEP_BYTES since the last turn, the loop gets one. The socket calls
        return at once while the peer keeps up, so nothing else would give it one before the whole payload moved."""
        self._unyielded += n
        if self._unyielded >= STEP_BYTES:
            self._unyielded = 0
            await asyncio.sleep(0)

    async def recv(self, n: int, *, idle: bool = False) -> bytearray:
        """n bytes, in a buffer grown as they arrive (GROW_BYTES at a time): a peer that announces more than it
        sends makes this side hold about what it sent, not what it announced."""
        out = bytearray()
        try:
            while len(out) < n:
                have = len(out)
                out += _ZEROS[:min(n - have, GROW_BYTES)]  # a resize in place: no view of `out` is left
                self.receiving = len(out)
                with memoryview(out) as whole, whole[have:] as fresh:
                    await self.recv_into(fresh, idle=idle and not have)
        finally:
            self.receiving = 0
        return out

    async def recv_payload(self, n: int) -> mmap.mmap:
        """n bytes (n > 0) into a private anonymous mapping of n bytes, received GROW_BYTES at a time: its pages
        are the kernel's to give only as the bytes land in them, so a peer that announces more than it sends makes
        this side hold about what it sent, as `recv`'s growing buffer does, but the bytes received never move. That
        bytearray's growth was a realloc, which now and then moved every byte received so far: one memcpy holding
        the GIL, a step of 7-8 ms of the daemon's loop at the 15th MiB of a 16 MiB block (benchmarks/RESULTS.md,
        put_get, session 52)."""
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)  # unmapped once no one holds it (or a view of it)
        try:
            with memoryview(buf) as whole:
                for have in range(0, n, GROW_BYTES):
                    self.receiving = min(n, have + GROW_BYTES)
                    with whole[have : have + GROW_BYTES] as fresh:
                        await self.recv_into(fresh)
        finally:
            self.receiving = 0
        return buf

    async def skip(self, n: int) -> None:
        """Read and drop n bytes (the rest of a refused request's body), through a small buffer: a refusal for want
        of buffer room (the daemon's server.receive_buffer_bytes) must not take much more."""
        scratch = memoryview(bytearray(min(n, SKIP_BYTES)))
        while n > 0:
            step = min(n, len(scratch))
            await self.recv_into(scratch[:step])
            n -= step

    async def send(self, *parts: Buffer) -> None:
        """Write parts whole; with stall_s, Stalled if the peer takes none of them for stall_s."""
        if self.stall_s is None:
            await self._send(parts)
            return
        task = asyncio.current_task()
        assert task is not None
        self._arm(task, sending=True)
        try:
            await self._send(parts)
        except asyncio.CancelledError:
            self._raise_if_stalled(task, "took nothing the daemon sent for {}s")
            raise
        finally:
            self._busy, self._sending = None, False

    async def _send(self, parts: Sequence[Buffer]) -> None:
        """Each part written whole, STEP_BYTES at most a step (`_moved`)."""
        if self._writer is not None:
            await self._send_streamed(parts)
            return
        assert self._sock is not None
        for p in parts:
            if not len(p):
                continue
            with memoryview(p) as whole:  # as loop.sock_sendall, counting what the kernel takes
                view = whole
                while view:
                    try:
                        n = self._sock.send(view[:STEP_BYTES])
                    except (BlockingIOError, InterruptedError):
                        await self._writable()
                        self._unyielded = 0  # the loop had its turn
                        continue
                    self._sent += n
                    view = view[n:]
                    await self._moved(n)

    async def _send_streamed(self, parts: Sequence[Buffer]) -> None:
        """Under TLS: written to asyncio's transport STEP_BYTES at a time, each drained (a write encrypts all it is
        given at once)."""
        assert self._writer is not None
        for p in parts:
            with memoryview(p) as whole:
                for start in range(0, len(whole), STEP_BYTES):
                    piece = whole[start:start + STEP_BYTES]
                    self._writer.write(piece)
                    await self._writer.drain()
                    self._sent += len(piece)
                    await self._moved(len(piece))

    async def _writable(self) -> None:
        assert self._sock is not None
        fd, ready = self._sock.fileno(), self._loop.create_future()
        self._loop.add_writer(fd, _wake, ready)
        try:
            await ready
        finally:
            self._loop.remove_writer(fd)

    def ended(self) -> bool:
        """Whether a connection between requests can carry no more: its peer closed or reset it (the daemon
        closes one idle past server.data_idle_s), or sent bytes nobody asked for. A look, no wait: a client
        takes a pooled connection only if it has not ended (a request sent on one the daemon closed fails)."""
        if self._reader is not None:
            return self._reader.at_eof() or self._reader.exception() is not None
        assert self._sock is not None
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: open
        except OSError:
            return True  # reset
        return True  # its end, or bytes between requests: the stream is not where a request starts

    async def closed_by_peer(self) -> None:
        """Return once the peer has closed (or reset) its end; for a side that waits on something else between
        frames (the daemon copying a Get's blocks from peers). One request at a time: a client sends nothing
        more before its answer, so nothing is read here, only an end is seen."""
        if self._reader is not None:  # TLS: asyncio's transport reads the socket and says when it ended
            while not self._reader.at_eof() and self._reader.exception() is None:
                await asyncio.sleep(CLOSED_POLL_S)
            return
        assert self._sock is not None
        fd = self._sock.fileno()
        while True:
            ready = self._loop.create_future()
            self._loop.add_reader(fd, _wake, ready)
            try:
                await ready
            finally:
                self._loop.remove_reader(fd)
            try:
                if not self._sock.recv(1, socket.MSG_PEEK):
                    return
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return  # reset
            await asyncio.Future()  # bytes came before the answer: left for the next read; no end to see until then

    async def read_frame(self, max_meta: int = MAX_META_BYTES, *, idle: bool = False) -> tuple[int, bytearray, int]:
        """(kind, meta, body length) of the next frame; its body is left for the caller to read. A frame
        announcing more than max_meta bytes of metadata is refused before any of it is buffered. idle: the
        frame may take any time to begin (not to go on: stall_s)."""
        kind, meta_len, body_len = await self.read_head(idle=idle)
        return kind, await self.read_meta(meta_len, max_meta), body_len

    async def read_head(self, *, idle: bool = False) -> tuple[int, int, int]:
        """(kind, meta length, body length) of the next frame's header."""
        kind, meta_len, body_len = FRAME.unpack(await self.recv(FRAME.size, idle=idle))
        return kind, meta_len, body_len

    async def read_meta(self, meta_len: int, max_meta: int = MAX_META_BYTES) -> bytearray:
        """A frame's metadata, read_head's meta length; InvalidArgument, before any of it is buffered, if it is
        over max_meta."""
        check_meta_len(meta_len, max_meta)
        return await self.recv(meta_len)

    async def send_frame(self, kind: int, meta: bytes = b"", *body: Buffer) -> None:
        await self.send(FRAME.pack(kind, len(meta), sum(len(b) for b in body)) + meta, *body)

    async def send_error(self, exc: errors.EngramError, message: str | None = None) -> None:
        """The error's status and `message` (its own message when None: the daemon passes what its caller may be
        told, errors.EngramError.told)."""
        code = status.status_of(exc).value[0]
        await self.send_frame(ERROR, CODE.pack(code) + (str(exc) if message is None else message).encode())

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._writer is not None:
            self._writer.close()
        elif self._sock is not None:
            self._sock.close()

    def reset(self) -> None:
        """Close at once, dropping what the kernel (and, under TLS, asyncio) holds unsent: on TCP an RST (SO_LINGER
        0), where a close kept those bytes, up to megabytes, for a peer that takes none until the kernel gave up."""
        if self._socket is not None and self._socket.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if self._writer is not None:
            self._writer.transport.abort()
        self.close()

    async def aclose(self) -> None:
        self.close()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class Refused(Exception):
    """The daemon answered a request with an ERROR frame: the request failed, the connection is still framed."""

    def __init__(self, error: errors.EngramError) -> None:
        super().__init__(str(error))
        self.error = error


def error_of(meta: bytes | bytearray) -> errors.EngramError:
    """The domain error an ERROR frame's meta stands for (the same classes gRPC statuses map to)."""
    if len(meta) < CODE.size:
        return errors.DataLoss("data channel: a malformed ERROR frame")
    (code,) = CODE.unpack_from(meta)
    message = bytes(meta[CODE.size:]).decode(errors="replace")
    by_code = {c.value[0]: c for c in status.ERROR_OF}
    cls = status.ERROR_OF.get(by_code[code]) if code in by_code else None
    return status.domain_error(cls or errors.Unavailable, message or f"status {code}")


class LimitChanged(Exception):
    """The daemon told a new connection a request limit the request at hand exceeds (it restarted on the same
    address with a smaller server.data_max_request_bytes): nothing was sent; make the request again for the channel's
    `max_request_bytes`, which is that limit now."""


class ChannelFull(errors.ResourceExhausted):
    """The daemon's data channel already has server.max_concurrent_rpcs connections open and refused another;
    the same call over gRPC may still be taken (the client falls back to it)."""


@dataclass(frozen=True)
class Endpoint:
    """Where to dial a daemon's data channel, from its DataEndpoint answer and the gRPC address."""

    unix_path: str = ""
    host: str = ""
    port: int = 0
    tls: bool = False
    max_request_bytes: int = 0


class DataChannel:
    """A client's connections to one daemon's data channel: idle ones are reused, one request per connection
    at a time, so concurrent calls of one client each get their own. A connection that fails mid-request is
    closed, never reused. Closing the channel cuts the requests in flight too (their tasks raise ClientClosed):
    they ran on to their end, up to timeout_s on a daemon that had stopped answering, while the client's other
    calls were cut at once (an audit, session 49), and each put its connection back into the closed channel's
    pool, left open."""

    def __init__(self, endpoint: Endpoint, token: str = "", root_cert: bytes | None = None,
                 server_name: str = "", *, stall_s: float | None = None) -> None:
        """stall_s: the longest a connection waits for the daemon to connect, to begin an answer or go on with
        it, or to take more of a request (Conn's stall_s); Stalled past it. None: as long as the daemon takes."""
        self.endpoint = endpoint
        self.stall_s = stall_s
        self._token = token.encode()
        self._ssl: ssl.SSLContext | None = None
        if endpoint.tls:
            self._ssl = ssl.create_default_context(cadata=root_cert.decode() if root_cert else None)
        self._server_name = server_name or endpoint.host
        # The most payload bytes a request may carry: the endpoint's, then what the daemon said at each new
        # connection's HELLO (a daemon back on the same address after a restart may take less, or more); 0: unbounded
        self.max_request_bytes = endpoint.max_request_bytes
        self._idle: list[Conn] = []
        self._busy: set[asyncio.Task[Any]] = set()  # the tasks of the requests in flight
        self._cut: set[asyncio.Task[Any]] = set()  # of those, cancelled by aclose
        self._closed = False
        self._retired = False  # replaced (`retire`): no connection goes back to the pool

    async def _dial(self) -> Conn:
        where = self.endpoint.unix_path or f"{self.endpoint.host}:{self.endpoint.port}"
        bound = asyncio.timeout(self.stall_s)
        try:
            async with bound:  # a connect a stopped daemon's full backlog holds, a TLS handshake it never answers
                return await self._open()
        except TimeoutError:
            if not bound.expired():
                raise
            raise Stalled(f"data channel: no connection to {where} within {self.stall_s:g}s") from None
        except Stalled:
            raise
        except OSError as exc:
            raise errors.Unavailable(f"cannot reach the daemon's data channel at {where}: {exc}") from exc

    async def _open(self) -> Conn:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        if self._ssl is not None:
            reader, writer = await asyncio.open_connection(ep.host, ep.port, ssl=self._ssl,
                                                           server_hostname=self._server_name)
            tune(writer.get_extra_info("socket"))
            conn = Conn(reader=reader, writer=writer, stall_s=self.stall_s, reading_counts=True)
        else:
            if ep.unix_path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                target: object = ep.unix_path
            else:
                info = socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(info[0], socket.SOCK_STREAM)
                target = info[4]
            try:
                tune(sock)
                await loop.sock_connect(sock, target)  # type: ignore[arg-type]
            except BaseException:
                sock.close()
                raise
            conn = Conn(sock, stall_s=self.stall_s, reading_counts=True)
        try:
            await conn.send_frame(HELLO, self._token)
            kind, meta, body = await conn.read_frame()
            if kind == ERROR:
                refusal = error_of(meta)
                raise ChannelFull(str(refusal)) if isinstance(refusal, errors.ResourceExhausted) else refusal
            if kind != HELLO_OK or body:
                raise errors.DataLoss(f"data channel: expected HELLO_OK, got frame kind {kind:#x}")
            if len(meta) >= LIMIT.size:  # a daemon from before says none: the endpoint's stays
                (self.max_request_bytes,) = LIMIT.unpack_from(meta)
        except BaseException:
            conn.close()
            raise
        return conn

    def _pooled(self) -> Conn | None:
        """The newest idle connection still open; those the daemon closed meanwhile (idle too long, or it
        restarted) are closed here too."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.ended():
                return conn
            conn.close()
        return None

    async def exchange(self, kind: int, meta: bytes, body: Sequence[Buffer],
                       answer: Callable[[Conn], Awaitable[T]]) -> T:
        """Send one request on an idle (or new) connection and read its answer with `answer(conn)`; the connection
        goes back to the pool once answered, and is closed on any failure (Refused too). ClientClosed if the
        channel is closed before or while it runs (aclose, from another task). LimitChanged, nothing sent, where
        the request's payload exceeds the limit a new connection was just told (the connection is pooled)."""
        if self._closed:
            raise errors.ClientClosed("the data channel is closed")
        task = asyncio.current_task()
        assert task is not None
        self._busy.add(task)
        conn: Conn | None = None
        try:
            conn = self._pooled() or await self._dial()
            if self.max_request_bytes and sum(memoryview(b).nbytes for b in body) > self.max_request_bytes:
                if not self._retired:
                    self._idle.append(conn)  # unused: still framed
                    conn = None
                raise LimitChanged(f"the daemon takes {self.max_request_bytes} payload bytes a request now")
            await conn.send_frame(kind, meta, *body)
            result = await answer(conn)
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, asyncio.CancelledError) and task in self._cut and task.uncancel() == 0:
                raise errors.ClientClosed("the data channel was closed while this request ran") from None
            raise
        finally:
            self._busy.discard(task)
            self._cut.discard(task)
        if self._retired:
            conn.close()
        else:
            self._idle.append(conn)
        return result

    def retire(self) -> None:
        """The channel is replaced (the daemon moved: another channel reaches it now): its idle connections are
        closed, and each request in flight closes its connection as it ends, however it ends; none is cut (aclose
        still cuts them). A replaced channel dropped as it was took back the connections of the requests still
        running on it, left open, and its owner's close no longer reached them."""
        self._retired = True
        self.drop_idle()

    def busy(self) -> bool:
        """Whether a request is in flight on the channel."""
        return bool(self._busy)

    def drop_idle(self) -> None:
        """Close the idle connections (the daemon closed them, or went away)."""
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def aclose(self) -> None:
        """Close the channel: the requests in flight are cut (cancelled: each raises ClientClosed), the idle
        connections closed, TLS ones waited for to finish closing (so none is left to the garbage collector), each
        at most stall_s (a TLS close waits for a daemon that may not answer). Again: nothing."""
        self._closed = True
        me = asyncio.current_task()
        for task in self._busy - self._cut:
            if task is not me:
                self._cut.add(task)
                task.cancel()
        conns, self._idle = self._idle, []
        for conn in conns:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.stall_s):
                    await conn.aclose()

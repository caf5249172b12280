"""A gRPC call over raw HTTP/2 that sends exactly the bytes it is told: a message's 5-byte prefix announcing its
size, then as much of it as the daemon's flow-control windows let through, then nothing. grpc's own clients frame
whole messages, so they cannot show what the daemon lets a sender push into a message it has not finished (tests
of the receive bound: test_grpc_put_buffer_budget.py). Plain TCP, no TLS; it answers the daemon's SETTINGS and
PINGs, so the connection stays up while it stalls."""

from __future__ import annotations

import asyncio
import contextlib
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
STREAM = 1  # the one call of the connection
DEFAULT_WINDOW = 65535  # HTTP/2's initial windows
END_HEADERS, ACK = 0x4, 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _header(name: str, value: str) -> bytes:
    """HPACK: a literal field without indexing, its name new, neither Huffman-coded (each under 127 bytes)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


class RawCall:
    """One call (`path`, e.g. /engram.v1.Engram/Put) on a TCP connection of its own."""

    def __init__(self, address: str, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.path, self.metadata = host, int(port), path, metadata
        self.conn_window = self.stream_window = DEFAULT_WINDOW
        self.max_frame = 16384
        self.sent = 0  # DATA bytes sent on the call: what the daemon's windows let in
        self.ended = False  # the daemon reset the call or the connection
        self._moved = asyncio.Event()  # a window grew, or the call ended
        self._settled = asyncio.Event()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(PREFACE + _frame(SETTINGS, 0, 0, b""))
        self._reading = asyncio.create_task(self._read())
        await asyncio.wait_for(self._settled.wait(), 20)  # the daemon's SETTINGS: its windows and frame size
        fields = ((":method", "POST"), (":scheme", "http"), (":path", self.path),
                  (":authority", f"{self.host}:{self.port}"), ("content-type", "application/grpc"),
                  ("te", "trailers"), *self.metadata)
        self.writer.write(_frame(HEADERS, END_HEADERS, STREAM, b"".join(_header(k, v) for k, v in fields)))
        await self.writer.drain()

    async def _read(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(9)
                kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = await self.reader.readexactly(int.from_bytes(head[:3], "big"))
                if kind == SETTINGS and not flags & ACK:
                    for i in range(0, len(payload), 6):
                        key, value = struct.unpack(">HI", payload[i:i + 6])
                        if key == 0x4:  # SETTINGS_INITIAL_WINDOW_SIZE
                            self.stream_window += value - DEFAULT_WINDOW
                        elif key == 0x5:  # SETTINGS_MAX_FRAME_SIZE
                            self.max_frame = value
                    self.writer.write(_frame(SETTINGS, ACK, 0, b""))
                    self._settled.set()
                elif kind == PING and not flags & ACK:
                    self.writer.write(_frame(PING, ACK, 0, payload))
                elif kind == WINDOW_UPDATE:
                    grown = int.from_bytes(payload, "big") & 0x7FFFFFFF
                    if stream == 0:
                        self.conn_window += grown
                    else:
                        self.stream_window += grown
                elif kind in (RST_STREAM, GOAWAY):
                    self.ended = True
                self._moved.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.ended = True
            self._moved.set()

    async def push_message(self, size: int, upto: int, quiet_s: float = 2.0) -> int:
        """Announce a message of `size` bytes and send up to `upto` of them (zeros) as the windows allow; returns
        the DATA bytes sent once `upto` are, or once the daemon has let no more through for quiet_s."""
        prefix = b"\x00" + size.to_bytes(4, "big")
        todo = len(prefix) + upto
        while self.sent < todo and not self.ended:
            room = min(self.conn_window, self.stream_window, self.max_frame, todo - self.sent)
            if room <= 0:
                self._moved.clear()
                try:
                    await asyncio.wait_for(self._moved.wait(), quiet_s)
                except TimeoutError:
                    break
                continue
            piece = prefix[self.sent:self.sent + room] if self.sent < len(prefix) else b""
            piece += bytes(room - len(piece))
            self.writer.write(_frame(DATA, 0, STREAM, piece))
            self.sent += room
            self.conn_window -= room
            self.stream_window -= room
            await self.writer.drain()
        return self.sent

    async def close(self) -> None:
        """The connection closed: the daemon sees its client gone."""
        self._reading.cancel()
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

"""Channels to a daemon (or, for the cluster tier, to a peer): message limits, TLS, bearer tokens, keepalive."""

from __future__ import annotations

import functools
import os
import urllib.parse
from typing import Any

import grpc

from engram.errors import InvalidArgument
from engram.v1 import engram_pb2_grpc as pb_grpc

DEFAULT_CHUNK_BYTES = 8 * 2**20
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
MAX_SOCKET_PATH = 107  # bytes of a unix socket's path (sun_path is 108 with its NUL), an abstract name's too


def message_options(max_message_bytes: int, max_receive_bytes: int | None = None) -> list[tuple[str, Any]]:
    """The send and receive limits, the same on channels and servers unless max_receive_bytes is given (-1:
    any size)."""
    receive = max_message_bytes if max_receive_bytes is None else max_receive_bytes
    return [("grpc.max_send_message_length", int(max_message_bytes)),
            ("grpc.max_receive_message_length", int(receive))]


def same_host(address: str) -> bool:
    """Whether a daemon address is on this host (a unix socket or loopback), where its shared DRAM
    segment can be mapped."""
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in {"localhost", "::1"} or host.startswith("127.")


def check_socket_path(address: str) -> None:
    """InvalidArgument where a unix: or unix-abstract: address names a path longer than a unix socket holds: gRPC
    fails every call on such a channel UNKNOWN "Failed to create channel", which was blamed on the daemon
    (DaemonError; the CLI's exit 10, "its log says more"). Counted in bytes, as gRPC does; unix:///path is /path."""
    scheme, _, path = address.partition(":")
    if scheme not in ("unix", "unix-abstract"):
        return
    if scheme == "unix" and path.startswith("//"):
        path = path[2:]
    if scheme == "unix":  # gRPC percent-decodes a unix: path (counted escaped, a path that fits was refused)
        path = urllib.parse.unquote(path)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        raise InvalidArgument(f"the address {address!r} names a path of {size} bytes, which does not fit a unix "
                              f"socket's {MAX_SOCKET_PATH}; use a shorter path")


class _Authorized:
    """A stub whose every call carries `authorization: Bearer <token>` metadata (and `extra`)."""

    def __init__(self, stub: Any, token: str, extra: tuple[tuple[str, str], ...] = ()) -> None:
        self._stub = stub
        self._md = (("authorization", f"Bearer {token}"), *extra)

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._stub, name), metadata=self._md)


def header_safe(token: str) -> bool:
    """Whether a bearer token can travel in a gRPC header: printable ASCII, no spaces (a token read from a file
    with its CRLF, or pasted with a non-ASCII character, failed deep in gRPC)."""
    return all("!" <= c <= "~" for c in token)


def stub_for(channel: grpc.aio.Channel, token: str = "", extra: tuple[tuple[str, str], ...] = ()) -> Any:
    stub = pb_grpc.EngramStub(channel)
    return _Authorized(stub, token, extra) if token else stub


# A daemon that restarts (an upgrade, a crash) is back within seconds: reconnect attempts back off from 0.1 s
# to at most 2 s (gRPC's default grows to 120 s, so a worker could fail for two minutes after a restart), and
# each channel keeps its own connections, so a new client does not inherit another one's backoff. Not
# grpc.min_reconnect_backoff_ms: grpc also takes it as each connection attempt's minimum time (20 s by default),
# and at 100 ms a daemon that paused that long before answering a new connection failed the call UNAVAILABLE.
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1)]


# Keepalive: a connection that has carried nothing for KEEPALIVE_S is pinged, and closed when the ping is not
# answered within KEEPALIVE_S / 2, with or without calls on it. A peer gone without a reset (a host powered off,
# a network partition) is then noticed in seconds, where TCP took its retransmission timeout (about 15 min):
# a call's deadline alone ends that call, and the next one went out on the same dead connection. Idle workers
# ping too, so their next call does not find a dead connection first. A daemon answers such pings at any rate
# down to half that interval (server_keepalive_options); grpc's defaults on a server (one ping in 5 min while a
# call is open, 2 h without) answered the third early one with GOAWAY too_many_pings, closing the connection.
KEEPALIVE_S = 20.0


def keepalive_options() -> list[tuple[str, Any]]:
    """A channel's keepalive (clients, and a daemon's channels to its cluster peers)."""
    return [("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_S * 500)),
            # what grpc 1.85 waits for a ping's answer, the keepalive's too (its own timeout is not armed): 60 s
            ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_S * 500)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # 0: no cap (grpc's 2 stopped an idle channel's pings)


def server_keepalive_options() -> list[tuple[str, Any]]:
    """What a daemon accepts of clients' keepalive: pings without calls, as often as every KEEPALIVE_S / 2."""
    return [("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_S * 500))]


def server_receive_window_options(window_bytes: int) -> list[tuple[str, Any]]:
    """A daemon's HTTP/2 receive window per stream, fixed at window_bytes (0: grpc's default, BDP probing). grpc
    grows a stream's window from its estimate of the link's bandwidth-delay product whether or not the handler
    reads, so a stalled Put stream's sender could push a whole block into grpc unread (the estimate reached tens of
    MiB over loopback on a loaded machine); with probing off the window stays grpc.http2.lookahead_bytes. The
    largest frame a client may send is raised with it, as probing would (to its window; HTTP/2's least is 16 KiB).
    Only what clients send the daemon: what it sends them follows their windows."""
    if not window_bytes:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", int(window_bytes)),
            ("grpc.http2.max_frame_size", min(int(window_bytes), 2**24 - 1))]


def open_channel(address: str, *, root_cert: bytes | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_receive_bytes: int | None = None,
                 server_name: str = "") -> grpc.aio.Channel:
    """A channel to a daemon: TLS when root_cert (PEM) is given. max_receive_bytes: None, max_message_bytes;
    -1, any size."""
    options = message_options(max_message_bytes, max_receive_bytes) + RECONNECT_OPTIONS + keepalive_options()
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if root_cert is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
        return grpc.aio.secure_channel(address, creds, options=options)
    return grpc.aio.insecure_channel(address, options=options)

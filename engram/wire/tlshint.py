"""Why a daemon closed a client's new connection at once: whether it serves TLS to a client that connects in plain
text.

Why: a client made without root_cert for a daemon serving TLS failed every call Unavailable "failed to connect to
all addresses; ... Socket closed" (an audit, session 48): gRPC sends its plain HTTP/2 preface, the daemon's TLS
handshake fails on it and closes the socket, and gRPC says no more. Any peer that closes a new connection at once
gets the same words, so the client does not guess from them: on that failure it opens one TLS connection to the
address (the certificate not checked: only whether a TLS handshake completes) and, where one does, says that the
daemon serves TLS and to pass root_cert. A unix socket never serves TLS (server.tls_cert is the TCP port's).
"""

from __future__ import annotations

import asyncio
import ssl

import grpc

from engram import errors

SERVES_TLS = "serves TLS and this client connects in plain text"  # the CLI's test for this case
_CLOSED_AT_ONCE = "Socket closed"  # gRPC's words for a connection the peer closed before HTTP/2 began
_PROBE_S = 5.0  # the longest the probe's connection and handshake may take (then it is aborted)


async def explained(err: errors.EngramError, exc: grpc.aio.AioRpcError, address: str, tls: bool,
                    timeout_s: float) -> errors.EngramError:
    """`err` (the domain error of the failed call `exc`), or where the call was refused because the daemon at
    `address` serves TLS and this client (`tls` off) does not, an Unavailable that says so."""
    if tls or exc.code() != grpc.StatusCode.UNAVAILABLE or _CLOSED_AT_ONCE not in (exc.details() or ""):
        return err
    if not await serves_tls(address, min(timeout_s, _PROBE_S)):
        return err
    return errors.Unavailable(
        f"the daemon at {address} {SERVES_TLS}: pass the PEM certificate that signed the daemon's as root_cert "
        f"(EngramClient(root_cert=...), or 'root_cert' in the vLLM connector's kv_connector_extra_config) ({err})")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a TCP address (host:port, [v6]:port, dns:///host:port); None for a unix socket or a form
    this does not read."""
    if address.startswith("unix:"):
        return None
    host, _, port = address.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


async def serves_tls(address: str, timeout_s: float) -> bool:
    """Whether a TLS handshake with the peer at `address` completes (its certificate is not checked)."""
    where = _host_port(address)
    if where is None:
        return False
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # what gRPC offers: a server that insists on it still completes
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(*where, ssl=context, server_hostname=where[0])
    except (OSError, TimeoutError):  # ssl.SSLError is an OSError: the peer does not speak TLS
        return False
    # Aborted, not closed: a clean close waits for the peer's, and a peer that never sends it held the failed
    # call another timeout_s (a review, session 49)
    writer.transport.abort()
    return True

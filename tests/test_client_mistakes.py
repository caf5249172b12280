"""A caller's mistake is refused as that, naming it, before anything reaches the daemon: not a numpy error from
inside the client, nor a DaemonError blaming the daemon (an audit, session 48)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engram import errors
from engram.client import EngramClient, SyncEngramClient
from engram.control import ControlClient

from helpers import random_kv, tiny_model, tokens


async def test_a_put_of_a_numpy_array_says_to_pass_a_torch_tensor(server_factory: Any) -> None:
    """put(kv=numpy array) raised ValueError "The truth value of an array ... is ambiguous" (the message was built
    with sorted(kv))."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        kv = random_kv(spec, 32).float().numpy()
        with pytest.raises(errors.InvalidArgument, match=r"numpy\.ndarray.*torch\.Tensor"):
            await client.put(fp, tokens(32), kv)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [ControlClient, EngramClient, SyncEngramClient],
                         ids=["control", "async", "sync"])
@pytest.mark.parametrize("address", ["", "  "], ids=["empty", "blank"])
async def test_an_empty_address_is_refused_invalid_argument(make: Any, address: str) -> None:
    """An empty address failed at the first call as DaemonError, the daemon blamed for the caller's mistake."""
    with pytest.raises(errors.InvalidArgument, match="address"):
        make(address)


async def test_kv_on_the_meta_device_is_refused_invalid_argument(server_factory: Any) -> None:
    """A meta tensor has a shape and no data: put(kv on meta) raised torch's NotImplementedError "Cannot copy out
    of meta tensor", and load_prefix_into a meta destination answered loaded_tokens=40 having written nothing."""
    srv = await server_factory()
    spec = tiny_model()
    async with EngramClient(srv.address) as client:
        fp = await client.register_model(spec)
        toks = tokens(48)
        meta = torch.empty(spec.layout.block_shape(48), dtype=spec.layout.dtype.torch_dtype, device="meta")
        with pytest.raises(errors.InvalidArgument, match="meta device"):
            await client.put(fp, toks, meta)
        with pytest.raises(errors.InvalidArgument, match="meta device"):
            await client.put_blocks(fp, [(toks[:16], meta[:, :, :16])])
        await client.put(fp, toks, random_kv(spec, 48))
        with pytest.raises(errors.InvalidArgument, match="meta device"):
            await client.load_prefix_into(fp, toks, meta)
        with pytest.raises(errors.InvalidArgument, match="meta device"):
            await client.get_prefix(fp, toks, device="meta")
        keys = (await client.lookup(fp, toks)).blocks
        with pytest.raises(errors.InvalidArgument, match="meta device"):
            await client.get(fp, [b.key for b in keys], device="meta")


LONG_SOCKET = "/tmp/" + "s" * 120  # 125 bytes: past a unix socket's 107 (sun_path is 108 with its NUL)


@pytest.mark.parametrize("make", [ControlClient, EngramClient, SyncEngramClient],
                         ids=["control", "async", "sync"])
@pytest.mark.parametrize("address", [f"unix:{LONG_SOCKET}", f"unix://{LONG_SOCKET}", "unix-abstract:" + "s" * 108],
                         ids=["unix", "unix-uri", "abstract"])
async def test_a_unix_socket_path_too_long_is_refused_invalid_argument(make: Any, address: str) -> None:
    """A path no unix socket can hold made a client whose every call failed UNKNOWN "Failed to create channel":
    DaemonError, the daemon blamed (a fuzz audit, session 49). Refused at construction, naming the bound."""
    with pytest.raises(errors.InvalidArgument, match=r"bytes, which does not fit a unix socket's 107"):
        make(address)


async def test_a_unix_socket_path_of_107_bytes_is_taken(tmp_path: Any) -> None:
    """The bound is gRPC's own: 107 bytes of path (counted in bytes, a two-byte character as two) still make a
    channel; no daemon there is Unavailable, not a refused address."""
    path = "/tmp/é" + "s" * (107 - len("/tmp/é".encode()))
    assert len(path.encode()) == 107
    async with ControlClient(f"unix:{path}", timeout_s=2) as client:
        with pytest.raises(errors.Unavailable) as raised:
            await client.stats()
    assert not isinstance(raised.value, errors.DaemonError)


async def test_a_unix_socket_path_written_with_percent_escapes_is_counted_as_grpc_reads_it() -> None:
    """gRPC percent-decodes a unix: address's path: 107 bytes of path written as 123 characters are taken (the
    check counted the escapes and refused a path that fits, a review, session 49); 108 bytes, escaped, are not."""
    path = "/tmp/" + "%41" * 8 + "s" * (107 - len("/tmp/") - 8)
    assert len(path) == 123
    async with ControlClient(f"unix:{path}", timeout_s=2) as client:
        with pytest.raises(errors.Unavailable):  # no daemon there: the channel was made
            await client.stats()
    with pytest.raises(errors.InvalidArgument, match="108 bytes"):
        ControlClient(f"unix:{path}s")

async def test_an_address_grpc_cannot_open_a_channel_to_is_invalid_argument_not_the_daemons_failure() -> None:
    """gRPC fails every call on a channel it could not make (here an ipv4: target whose address is not one)
    UNKNOWN "Failed to create channel", which was DaemonError: no daemon was reached, the address is the caller's."""
    async with ControlClient("ipv4:1.2.3:4", timeout_s=5) as client:
        with pytest.raises(errors.InvalidArgument, match="Failed to create channel") as raised:
            await client.stats()
    assert not isinstance(raised.value, errors.Unavailable)


async def test_the_tls_probe_does_not_wait_for_a_peer_that_never_closes(tmp_path: Any) -> None:
    """The client's probe of whether a daemon serves TLS (engram/wire/tlshint.py) ends once its handshake completes:
    it waited for the peer's close too, and a peer that completes a handshake and then neither reads nor closes
    held every failed call the probe's whole 5 s more (a review, session 49). Bounded at half that, against a local
    handshake's milliseconds. The peer: a thread's blocking TLS socket, left as the handshake leaves it."""
    import socket
    import ssl
    import threading
    import time

    from engram.wire.tlshint import serves_tls

    from helpers import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        held.append(context.wrap_socket(conn, server_side=True))  # the handshake completes; then nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        assert await serves_tls(f"127.0.0.1:{listener.getsockname()[1]}", 5.0)
        assert time.monotonic() - start < 2.5
    finally:
        thread.join(5)
        for sock in held:
            sock.close()
        listener.close()

"""A caller's mistake is refused as that, naming it, before anything reaches the daemon: not a numpy error from
inside the client, nor a DaemonError blaming the daemon (an audit, session 48)."""

from __future__ import annotations

from typing import Any

import pytest

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

"""Today's client against a daemon of an earlier release, which lacks the RPCs added since.

The earlier daemon is a real grpc.aio server on loopback serving Engram's own handlers (a real store behind
them) except the methods an older release did not have: DescribeNamespace (added with tenancy, after git
731822f) and DataEndpoint (the data channel). An `engram serve` of the tree exported at 731822f would be truer
but too heavy for every test run; /work/scratch/s44/upgrade/hc731.py ran that one by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import torch

from engram.client import EngramClient
from engram.server import RunningServer

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

OLDER_LACKS = {"DescribeNamespace", "DataEndpoint"}


class _Without(grpc.GenericRpcHandler):
    """A service's handlers less some methods: the daemon answers those UNIMPLEMENTED, as an older one does."""

    def __init__(self, inner: grpc.GenericRpcHandler, lacks: set[str]) -> None:
        self.inner, self.lacks = inner, lacks

    def service(self, details: Any) -> Any:
        if details.method.rsplit("/", 1)[-1] in self.lacks:
            return None
        return self.inner.service(details)


@pytest.fixture
async def older_daemon(server_factory: Any) -> AsyncIterator[str]:
    srv: RunningServer = await server_factory()
    assert srv.service is not None
    older = grpc.aio.server()
    older.add_generic_rpc_handlers((_Without(srv.service.generic_handler(), OLDER_LACKS),))
    port = older.add_insecure_port("127.0.0.1:0")
    await older.start()
    yield f"127.0.0.1:{port}"
    await older.stop(0)


@pytest.mark.parametrize("transport", ["tcp"])
async def test_a_put_to_a_daemon_from_before_tenancy_keys_the_namespace_without_a_salt(older_daemon: str) -> None:
    """A daemon from before tenancy has no DescribeNamespace: the client's put failed 'DaemonError
    UNIMPLEMENTED: Method not found!' naming neither the method nor the daemon's age (an audit, session 44).
    Such a daemon keys every namespace as named with no salt; the client now does the same, so its put lands
    under the keys the daemon computes, and a get of them returns the KV."""
    spec = tiny_model()
    toks = tokens(2 * BLOCK_TOKENS + 3, seed=5)
    kv = random_kv(spec, len(toks), seed=5)
    async with EngramClient(older_daemon, namespace="tenant-a", zero_copy=False) as c:
        fp = await c.register_model(spec)
        put = await c.put(fp, toks, kv)
        assert len(put.keys) == 3
        hit = await c.lookup(fp, toks)
        assert hit.matched_tokens == len(toks) and [b.key for b in hit.blocks] == list(put.keys)
        got = await c.get(fp, list(put.keys))
        assert torch.equal(torch.cat(got, dim=2), kv)

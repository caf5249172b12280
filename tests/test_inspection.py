"""Inspection RPCs on an in-process daemon: eviction skips blocks being read (and their ancestors) instead
of deleting them under a reader, and malformed requests get INVALID_ARGUMENT with what to change."""

from __future__ import annotations

import pytest

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer

from helpers import random_kv, tiny_model, tokens


async def test_evict_skips_leased_blocks_and_their_ancestors(server: RunningServer, client: EngramClient) -> None:
    spec = tiny_model()
    fp = await client.register_model(spec)
    keys = (await client.put(fp, tokens(48), random_kv(spec, 48))).keys
    metas = server.store.find("tenant-a", fp, [keys[1]])
    server.store.acquire(metas)  # a reader streams block 1 right now
    try:
        out = await client.evict(key_prefixes=[keys[0].hex()])
    finally:
        server.store.release(metas)
    assert list(out.evicted) == [keys[2]]
    assert set(out.skipped) == {keys[0], keys[1]}
    assert len(server.store.index) == 2
    again = await client.evict(key_prefixes=[keys[0].hex()])
    assert list(again.evicted) == [keys[1], keys[0]] and not again.skipped
    assert len(server.store.index) == 0
    assert (await client.lookup(fp, tokens(48))).matched_tokens == 0


async def test_malformed_inspection_requests(server: RunningServer, client: EngramClient) -> None:
    with pytest.raises(errors.InvalidArgument, match="exactly one of"):
        await client.evict()
    with pytest.raises(errors.InvalidArgument, match="exactly one of"):
        await client.evict(key_prefixes=["ab"], whole_namespace=True)
    with pytest.raises(errors.InvalidArgument, match="exactly one of"):
        await client.describe_blocks()
    with pytest.raises(errors.InvalidArgument, match="name it"):
        await client.evict(whole_namespace=True, all_namespaces=True)
    with pytest.raises(errors.NotFound, match="no session"):
        await client.describe_blocks(session_id="nope")
    stats = await client.stats()  # the daemon still serves
    assert stats.blocks_evicted_on_request == 0

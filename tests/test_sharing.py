"""Prefix sharing through a real daemon: sessions reference the blocks of their prefix, forks share them
without copies, eviction keeps prefix closure and takes unreferenced blocks first, and Stats reports
logical against physical bytes per namespace."""

from __future__ import annotations

from typing import Any

import numpy as np

from engram.client import EngramClient
from engram.server import RunningServer

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

NS = "tenant-a"


def usage(stats: Any, ns: str = NS) -> Any:
    return next(n for n in stats.namespaces if n.namespace == ns)


def assert_prefix_closed(srv: RunningServer) -> None:
    index = srv.store.index
    for meta in index:
        assert meta.parent == srv.store.root(meta.namespace, meta.model_fingerprint) or meta.parent in index, (
            f"block {meta.key.hex()} outlived its parent")


async def test_forked_sessions_share_blocks_and_free_them(server: RunningServer, client: EngramClient) -> None:
    spec = tiny_model()
    fp = await client.register_model(spec)
    prefix = tokens(4 * BLOCK_TOKENS, seed=1)
    await client.put(fp, prefix, random_kv(spec, len(prefix)))
    block = spec.layout.block_nbytes(BLOCK_TOKENS)

    parent = await client.open_session(fp, mode="persist", tokens=prefix)
    child = await client.fork_session(parent.session_id)
    u = usage(await client.stats())
    assert (u.blocks, u.physical_bytes, u.referenced_blocks, u.sessions) == (4, 4 * block, 4, 2)
    assert u.logical_bytes == 2 * 4 * block  # two sessions see the prefix; it is stored once
    assert all(m.refs == 2 for m in server.store.index)

    # The sub-agent grows its own history on top of the shared prefix.
    own = np.concatenate([prefix, tokens(2 * BLOCK_TOKENS, seed=2)])
    await client.put(fp, own, random_kv(spec, len(own), seed=3))
    await client.append_session(child.session_id, own[len(prefix):])
    u = usage(await client.stats())
    assert (u.blocks, u.referenced_blocks) == (6, 6)
    assert u.logical_bytes == (2 * 4 + 2) * block

    await client.close_session(parent.session_id)
    u = usage(await client.stats())
    assert u.logical_bytes == 6 * block and u.sessions == 1  # the child still holds all six, once
    await client.close_session(child.session_id)
    u = usage(await client.stats())
    assert (u.referenced_blocks, u.logical_bytes, u.physical_bytes) == (0, 6 * block, 6 * block)
    assert all(m.refs == 0 for m in server.store.index)


async def fill(client: EngramClient, fp: bytes, spec: Any, *, keep_session: bool) -> tuple[np.ndarray, int]:
    """A 4-block prefix (in a live session, or not), then 8 newer unreferenced blocks in a DRAM tier of 10."""
    held = tokens(4 * BLOCK_TOKENS, seed=10)
    await client.put(fp, held, random_kv(spec, len(held)))
    if keep_session:
        await client.open_session(fp, mode="persist", tokens=held)
    for s in range(4):
        other = tokens(2 * BLOCK_TOKENS, seed=20 + s)
        await client.put(fp, other, random_kv(spec, len(other), seed=s))
    return held, (await client.lookup(fp, held)).matched_tokens


async def test_eviction_keeps_what_live_sessions_reference(server_factory: Any) -> None:
    spec = tiny_model()
    capacity = 10 * spec.layout.block_nbytes(BLOCK_TOKENS)
    for keep_session in (True, False):
        srv = await server_factory(**{"tiers.dram.capacity": capacity})
        async with EngramClient(srv.address, namespace=NS) as client:
            fp = await client.register_model(spec)
            held, matched = await fill(client, fp, spec, keep_session=keep_session)
            stats = await client.stats()
            assert stats.tiers[0].evictions >= 2
            assert_prefix_closed(srv)
            if keep_session:
                assert matched == len(held)  # the session's prefix survived; unreferenced blocks went
            else:
                assert matched < len(held)  # control: plain recency takes the oldest chain's tail first


async def test_referenced_blocks_still_go_when_nothing_else_is_left(server_factory: Any) -> None:
    spec = tiny_model()
    srv = await server_factory(**{"tiers.dram.capacity": 6 * spec.layout.block_nbytes(BLOCK_TOKENS)})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(spec)
        for s in range(3):  # three live sessions of 4 blocks each cannot all fit in 6 blocks
            toks = tokens(4 * BLOCK_TOKENS, seed=40 + s)
            await client.put(fp, toks, random_kv(spec, len(toks), seed=s))
            await client.open_session(fp, mode="persist", tokens=toks)
        assert (await client.stats()).tiers[0].blocks <= 6
        assert_prefix_closed(srv)
        last = tokens(4 * BLOCK_TOKENS, seed=42)
        assert (await client.lookup(fp, last)).matched_tokens == len(last)  # the newest session kept its prefix

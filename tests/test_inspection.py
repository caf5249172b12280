"""Inspection RPCs on an in-process daemon: eviction skips blocks being read (and their ancestors) instead
of deleting them under a reader, also a reader that comes while the evict waits on the disk, and malformed
requests get INVALID_ARGUMENT with what to change."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

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


async def test_a_block_read_while_a_forced_evict_waits_on_the_disk_is_skipped_and_keeps_its_pin(
        server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Evict removes a chain deepest first, waiting on each NVMe unlink; a reader that leases a block of the chain
    meanwhile makes it held (skipped, with its ancestors), not a failed RPC, and a forced evict lifts the pin only
    of a block it removes."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": "private"})
    spec = tiny_model()
    unlinking = threading.Event()

    def slow_unlink(op: str, path: Path) -> None:
        if op == "delete":
            unlinking.set()
            time.sleep(0.3)

    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(spec)
        toks = tokens(48)
        keys = (await c.put(fp, toks, random_kv(spec, 48), pin=True)).keys
        srv.store.tiers[-1].fault_hook = slow_unlink
        evict = asyncio.create_task(c.evict(key_prefixes=[keys[0].hex()], force=True))
        await asyncio.to_thread(unlinking.wait, 30)  # the deepest block's file is being unlinked
        first = srv.store.find("ns", fp, [keys[0]])
        srv.store.acquire(first)  # a reader loads the first block meanwhile
        try:
            out = await evict
        finally:
            srv.store.release(first)
        assert list(out.evicted) == [keys[2], keys[1]] and list(out.skipped) == [keys[0]]
        assert first[0].pins == 1 and srv.store.index.get(keys[0]) is first[0]


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


async def test_describing_and_evicting_by_session_do_not_rematch_every_live_session(
        server: RunningServer, client: EngramClient) -> None:
    """A block's session count is what the session manager keeps (the references eviction reads), not a fresh match
    of every live session's tokens: one DescribeBlocks re-matched all of them on the event loop, 0.4 s behind 64
    sessions of 4,096 blocks (an audit), a stall any tenant could cause for every other."""
    spec = tiny_model()
    fp = await client.register_model(spec)
    toks = tokens(48)
    keys = (await client.put(fp, toks, random_kv(spec, 48))).keys
    for i in range(3):  # three sessions through blocks 0 and 1, one of them through block 2 as well
        await client.open_session(fp, session_id=f"s{i}", tokens=toks if i == 0 else toks[:32], mode="persist")
    matched = []
    real = server.store.match
    server.store.match = lambda *a, **k: matched.append(a) or real(*a, **k)  # type: ignore[method-assign]
    try:
        details = (await client.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks
        assert [d.sessions for d in details] == [3, 3, 1]
        assert not matched  # describing blocks matched no session's tokens
        out = await client.evict(session_id="s0")
        assert list(out.evicted) == [keys[2]]  # the block only s0 runs through
        assert len(matched) == 1  # s0's own chain, once
    finally:
        del server.store.match


async def test_describing_a_long_chain_walks_it_once_and_short_prefixes_sort_the_namespace_once(
        server: RunningServer, client: EngramClient) -> None:
    """Each block's start position walked its parents to the root (a 32k-block session's DescribeBlocks took a
    minute with the daemon stalled), and each key prefix scanned the namespace's every block: now one walk of
    the chain and one sort per call, with the same answers (start positions, unique and ambiguous prefixes)."""
    spec = tiny_model()
    fp = await client.register_model(spec)
    toks = tokens(64 * 16)
    keys = (await client.put(fp, toks, random_kv(spec, len(toks)))).keys
    await client.open_session(fp, session_id="long", tokens=toks, mode="persist")
    calls = {"block": 0, "blocks": 0}
    store = server.store
    real_block, real_blocks = store.block, store.blocks

    def counted_block(key: bytes):  # type: ignore[no-untyped-def]
        calls["block"] += 1
        return real_block(key)

    def counted_blocks(*a):  # type: ignore[no-untyped-def]
        calls["blocks"] += 1
        return real_blocks(*a)

    store.block, store.blocks = counted_block, counted_blocks  # type: ignore[method-assign]
    try:
        details = (await client.describe_blocks(session_id="long")).blocks
        assert [d.start_token for d in details] == [16 * i for i in range(64)]
        assert calls["block"] <= 2 * 64  # not 64 * 63 / 2
        short = [k.hex()[:10] for k in keys]
        calls["blocks"] = 0
        got = (await client.describe_blocks(key_prefixes=short)).blocks
        assert [d.key for d in got] == list(keys) and calls["blocks"] == 1
        assert [d.start_token for d in got] == [16 * i for i in range(64)]
    finally:
        del store.block, store.blocks
    firsts = [k.hex()[0] for k in keys]
    common = max(set(firsts), key=firsts.count)  # a first digit several of the 64 keys share
    with pytest.raises(errors.InvalidArgument, match=f"matches {firsts.count(common)} blocks"):
        await client.describe_blocks(key_prefixes=[common])
    with pytest.raises(errors.NotFound):
        await client.describe_blocks(key_prefixes=["0" * 32])


async def test_listing_many_sessions_lets_other_calls_run_between_them(server: RunningServer, client: EngramClient,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each listed session's chain is a match of its tokens (up to 2^21 of them): a listing of many long sessions
    held the event loop for all of them at once, every other tenant's call waiting. Here each chain is slowed
    (a stand-in for a long session) and a Stats issued meanwhile is answered before the listing ends."""
    from engram.inspection import Inspector

    spec = tiny_model()
    fp = await client.register_model(spec)
    for i in range(40):
        await client.open_session(fp, session_id=f"s{i}", tokens=tokens(32, seed=i), mode="persist")
    real_chain, order = Inspector.chain, []

    def slowed(self, s, tenant=""):  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        return real_chain(self, s, tenant)

    monkeypatch.setattr(Inspector, "chain", slowed)

    async def listing() -> None:
        assert len(await client.list_sessions()) == 40
        order.append("listing")

    async def stats() -> None:
        await asyncio.sleep(0.05)  # the listing is under way
        await client.stats()
        order.append("stats")

    await asyncio.gather(listing(), stats())
    assert order == ["stats", "listing"]

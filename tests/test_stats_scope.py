"""A tenant's Stats through a real daemon tell nothing of another tenant's calls (an audit, session 44): Bob read
the exact length of Alice's prompt from two of his own Stats around her put (the tiers' used bytes grew by her
stored bytes, and her last block is partial, so its size grows with its token count: divided by the model's public
bytes per token, or inverted through the codec's public stored size, it is her token count) or around her hit
(bytes served); blocks put, served and deduplicated, tier hits, write-back pending and the codec error samples moved
with her calls too. Now every figure of his Stats is his namespaces' or fixed; the admin still sees the daemon's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from engram import errors
from engram.api import Stats
from engram.client import EngramClient
from engram.server import RunningServer

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.admin_tokens": ADMIN,
        "auth.salt_secret": "test-secret"}


def figures(stats: Stats) -> dict[str, Any]:
    """Every field of a Stats but the clock."""
    d = dataclasses.asdict(stats)
    d.pop("uptime_s")
    return d


@pytest.mark.parametrize("codec", ["raw", "nvfp4"])
async def test_bobs_stats_do_not_move_with_alices_put_hit_or_dedupe(server_factory: Any, tmp_path: Path,
                                                                    codec: str) -> None:
    srv: RunningServer = await server_factory(**AUTH, **{
        "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.nvme.fsync": False, "codec.default": codec,
        "codec.quality_sample": 1})
    spec = tiny_model(codec="")  # the daemon's default codec: public, as is the layout
    secret = 3 * BLOCK_TOKENS + 5  # Alice's prompt length: its last block is partial
    async with EngramClient(srv.address, token=BOB, namespace="bob") as b, \
            EngramClient(srv.address, token=ALICE, namespace="alice") as a:
        fp = await b.register_model(spec)
        mine = tokens(2 * BLOCK_TOKENS + 3, seed=1)
        assert (await b.put(fp, mine, random_kv(spec, len(mine), seed=1))).stored == 3
        await srv.store.quality.drain()
        before = await b.stats()
        assert before.scoped and before.blocks_put == 3

        await a.register_model(spec)
        theirs, kv = tokens(secret, seed=2), random_kv(spec, secret, seed=2)
        assert (await a.put(fp, theirs, kv)).stored == 4
        assert (await a.lookup(fp, theirs)).matched_tokens == secret
        assert (await a.get_prefix(fp, theirs))[0] == secret  # her hit
        assert (await a.put(fp, theirs, kv)).stored == 0  # deduplicated
        await srv.store.quality.drain()
        after = await b.stats()
        assert figures(after) == figures(before)

        # His own figures are his: his hit counts, his tiers hold his copies.
        assert (await b.get_prefix(fp, mine))[0] == len(mine)
        own = await b.stats()
        stored = sum(m.stored_bytes for m in own.models)
        assert (own.blocks_served, own.bytes_served) == (3, stored)
        assert own.tier("dram").used_bytes == stored and own.tier("dram").blocks == 3

    async with EngramClient(srv.address, token=ADMIN) as admin:  # the daemon's figures stay the admin's
        every = await admin.stats()
    assert not every.scoped
    assert every.blocks_put == 7 and every.blocks_deduplicated >= 1 and every.blocks_served == 7
    assert every.tier("dram").used_bytes > stored and every.tier("dram").hits >= 7
    assert every.lookups >= 1 and every.codec_error_blocks + every.codec_error_skipped >= (codec != "raw")


@pytest.mark.parametrize("tenancy", [False, True])
async def test_per_namespace_counters_are_kept_only_for_namespaces_a_tenant_is_given(
        server_factory: Any, tenancy: bool) -> None:
    """They exist for a tenant's Stats. Namespaces are the callers' to make up (tenancy off: anyone's; on: the
    admin's), and one counter entry a namespace that was ever written or read, kept for good, grew the daemon with
    every namespace a caller invented (a namespace per session: without bound)."""
    srv: RunningServer = await server_factory(**(AUTH if tenancy else {}))
    spec = tiny_model()
    async with EngramClient(srv.address, token=ADMIN if tenancy else "") as c:
        fp = await c.register_model(spec)
        for i in range(20):
            t = tokens(BLOCK_TOKENS, seed=i)
            ns = f"session-{i}"
            assert (await c.put(fp, t, random_kv(spec, len(t), seed=i), namespace=ns)).stored == 1
            assert (await c.get_prefix(fp, t, namespace=ns))[0] == len(t)
        every = await c.stats()
    assert every.blocks_put == 20 and every.blocks_served == 20  # the daemon's own counts still count
    assert set(srv.store.counters.namespaces) == set()
    if tenancy:
        async with EngramClient(srv.address, token=ALICE, namespace="alice") as a:
            t = tokens(BLOCK_TOKENS, seed=99)
            await a.register_model(spec)
            assert (await a.put(fp, t, random_kv(spec, len(t), seed=99))).stored == 1
            assert (await a.stats()).blocks_put == 1
        assert set(srv.store.counters.namespaces) == {"alice"}


@pytest.mark.parametrize("zero_copy", [False, True])  # gRPC streams, and the data channel where it connects
async def test_a_tenants_put_refused_by_a_full_tier_does_not_tell_the_tiers_use_of_other_tenants_blocks(
        server_factory: Any, zero_copy: bool) -> None:
    """A DRAM-only pool of four blocks, Alice's chain of two in it. Bob's chain of six cannot fit (with no tier
    below only leaves are evicted): RESOURCE_EXHAUSTED said 'the dram tier is full (12288 of 16384 bytes ...)',
    the bytes Alice's blocks hold among them, which moves with her puts. Bob is told the tier is full and why,
    not its use; an admin's same refusal keeps the figures."""
    block = tiny_model().layout.block_nbytes(BLOCK_TOKENS)
    srv: RunningServer = await server_factory(**AUTH, **{"tiers.dram.capacity": 4 * block,
                                                         "tiers.dram.page_bytes": 256})
    spec = tiny_model()
    long = tokens(6 * BLOCK_TOKENS, seed=4)
    async with EngramClient(srv.address, token=ALICE, namespace="alice") as a, \
            EngramClient(srv.address, token=BOB, namespace="bob", zero_copy=zero_copy) as b, \
            EngramClient(srv.address, token=ADMIN, namespace="ops", zero_copy=zero_copy) as admin:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        theirs = tokens(2 * BLOCK_TOKENS, seed=3)
        assert (await a.put(fp, theirs, random_kv(spec, len(theirs), seed=3))).stored == 2
        with pytest.raises(errors.ResourceExhausted, match="the dram tier is full") as told:
            await b.put(fp, long, random_kv(spec, len(long), seed=4))
        assert not re.search(r"\d+ of \d+ bytes", str(told.value)), str(told.value)
        with pytest.raises(errors.ResourceExhausted, match=rf"the dram tier is full \(\d+ of {4 * block} bytes"):
            await admin.put(fp, long, random_kv(spec, len(long), seed=4))

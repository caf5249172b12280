"""A block whose last copy a read finds damaged leaves the index before the tier deletes that copy: a Lookup or a
GetPrefix meanwhile (an NVMe unlink is awaited in the tier's I/O threads) found it indexed with no copy and failed
INTERNAL (IndexError in BlockMeta.tier). A real daemon, both copies damaged (a byte flipped in the shared pool and in
the NVMe file), the unlink held in the tier's own fault hook."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engram import errors
from engram.client import EngramClient

from helpers import (
    BLOCK_TOKENS,
    FirstIoHeld,
    damage_pool_and_file,
    random_kv,
    rpcs_answered,
    tiny_model,
    tokens,
    until,
)

SPEC = tiny_model()


async def test_a_lookup_while_a_blocks_last_damaged_copy_is_deleted_does_not_find_it(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    held = FirstIoHeld("delete")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        keys = (await c.put(fp, toks, random_kv(SPEC, len(toks), seed=5))).keys
        assert srv.store.block(keys[1]).locations == ["dram", "nvme"]  # type: ignore[union-attr]
        damage_pool_and_file(pool, nvme, keys[1])
        nvme.fault_hook = held
        get = asyncio.create_task(c.get(fp, [keys[1]]))  # both copies fail: the block goes, its file unlinked
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "the damaged file was never unlinked"
            looked = await other.lookup(fp, toks)  # while the unlink is held
            assert looked.matched_tokens == BLOCK_TOKENS  # the first block only
            n, got = await other.get_prefix(fp, toks)
            assert n == BLOCK_TOKENS
        finally:
            held.go.set()
        with pytest.raises(errors.DataLoss):
            await get
    assert srv.store.block(keys[1]) is None and srv.store.block(keys[0]) is not None


@pytest.mark.parametrize("gone", ["file-deleted", "tier-forgot"])
async def test_a_get_of_a_block_whose_only_copy_its_tier_no_longer_holds_is_data_loss_and_drops_it(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, gone: str) -> None:
    """A block held on NVMe alone whose copy is gone behind the index's back: its file deleted from the disk, or
    the tier's own record of it dropped (as a check that removed a broken file does before the index drops the
    copy). A Get answers DATA_LOSS and the block leaves the index (counted corrupt), as for a damaged copy. The
    tier's NotFound reached the client as NOT_FOUND in the tier's words ("not in the NVMe tier"), the block kept
    indexed with a copy no read could serve."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    if srv.store.flusher is not None:
        await srv.store.flusher.close()  # nothing writes the NVMe copy again but the test
    nvme = srv.store.tiers[-1]
    toks = tokens(2 * BLOCK_TOKENS, seed=6)
    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        keys = (await c.put(fp, toks, random_kv(SPEC, len(toks), seed=6))).keys
        meta = srv.store.block(keys[1])
        await srv.store.drop_copy(meta, "dram")  # on NVMe alone
        assert meta.locations == ["nvme"]
        nvme.path_of(keys[1]).unlink()
        if gone == "tier-forgot":
            nvme.forget(keys[1])
        corrupt = (await c.stats()).corrupt_blocks
        with pytest.raises(errors.DataLoss, match="no tier holds a valid copy"):
            await c.get(fp, [keys[1]])
        assert srv.store.block(keys[1]) is None and srv.store.block(keys[0]) is not None
        assert (await c.stats()).corrupt_blocks == corrupt + 1
        assert (await c.lookup(fp, toks)).matched_tokens == BLOCK_TOKENS
    assert (await srv.store.check(fix=False)).ok


async def test_a_read_cancelled_while_a_blocks_last_damaged_copy_is_deleted_still_drops_what_extends_it(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """A chain of three, the middle block's copies both damaged: a Get of it drops the pool copy, then the NVMe one,
    its last, and the block leaves the index; the Get's caller goes while the file's unlink is held. The blocks
    that extend it (the third) were dropped only after the unlink, so the cancel left them indexed under a parent
    the index no longer holds: unreachable, holding room until evicted or a restart (a review, session 52). Now
    they go all the same."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "server.metrics_port": -1})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    toks = tokens(3 * BLOCK_TOKENS, seed=6)
    held = FirstIoHeld("delete")  # in the tier's I/O thread
    async with EngramClient(srv.address, namespace="d", zero_copy=False, data_channel=False) as c:
        fp = await c.register_model(SPEC)
        keys = (await c.put(fp, toks, random_kv(SPEC, len(toks), seed=6))).keys
        damage_pool_and_file(pool, nvme, keys[1])
        nvme.fault_hook = held
        get = asyncio.create_task(c.get(fp, [keys[1]]))
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "the damaged file was never unlinked"
            assert srv.store.block(keys[1]) is None  # out of the index as its last copy's delete began
            get.cancel()
            with pytest.raises(asyncio.CancelledError):
                await get

            async def cut() -> bool:
                return rpcs_answered(srv, "Get", "CANCELLED") == 1

            await until(cut, "the daemon's Get cut while the unlink is held")
        finally:
            held.go.set()

        async def dropped() -> bool:  # and the held unlink finished (in the tier's thread, after the drop)
            return srv.store.block(keys[2]) is None and not nvme.path_of(keys[1]).exists()

        await until(dropped, "the block extending the lost one dropped and the damaged file unlinked")
    assert srv.store.block(keys[0]) is not None
    assert (await srv.store.check(fix=False)).ok


async def test_a_demotion_of_a_block_whose_pool_copy_its_tier_no_longer_holds_drops_it_and_makes_the_room(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """A pool of two blocks, write-back (blocks held in the pool alone, not yet flushed), NVMe below. A's slot is
    freed behind the index's back (the mismatch a stale move that deletes by key leaves), and B and C fill the
    pool. A put of D must make room, and A, the oldest, is demoted: no copy to write down. The pool's NotFound went
    through make_room to D's put, which failed NOT_FOUND in the pool's words about A ("not in the dram tier"), as
    every later put that needed room; now A's copy is lost as a read finds it (counted corrupt, A leaves the
    store) and D is stored."""
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": 2 * block,
                                  "tiers.dram.page_bytes": 256, "tiers.write_back_window_s": 3600})
    pool = srv.store.tiers[0]
    a, b, c3, d = (tokens(BLOCK_TOKENS, seed=s) for s in (1, 2, 3, 4))
    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        key = (await c.put(fp, a, random_kv(SPEC, BLOCK_TOKENS, seed=1))).keys[0]
        pool.delete_now(key)  # the index still lists the copy
        assert srv.store.block(key).locations == ["dram"]  # type: ignore[union-attr]
        await c.put(fp, b, random_kv(SPEC, BLOCK_TOKENS, seed=2))  # in A's room
        await c.put(fp, c3, random_kv(SPEC, BLOCK_TOKENS, seed=3))  # the pool is full
        corrupt = (await c.stats()).corrupt_blocks
        kv_d = random_kv(SPEC, BLOCK_TOKENS, seed=4)
        put = await c.put(fp, d, kv_d)
        assert put.stored == 1
        assert srv.store.block(key) is None
        assert (await c.stats()).corrupt_blocks == corrupt + 1
        assert (await c.lookup(fp, a)).matched_tokens == 0
        assert torch.equal((await c.get(fp, list(put.keys)))[0], kv_d)
    assert (await srv.store.check(fix=False)).ok

"""A move of a block (a demotion) that outlives the block: dropped meanwhile as damaged, and put again under its key
by a later put, the block the index holds now is another one. The tiers keep copies by key, so the move, ending,
must leave alone the copies of the block put again. Real daemons (loopback TCP and a unix socket), the NVMe write
held in the tier's own fault hook, a byte flipped in the shared pool as a stray writer would."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from engram import errors
from engram.client import EngramClient

from helpers import BLOCK_TOKENS, FirstIoHeld, damage_pool_and_file, random_kv, tiny_model, tokens, until

SPEC = tiny_model()


async def dropped_while_its_demotion_writes(srv: Any, c: EngramClient, fp: bytes, key: bytes, held: FirstIoHeld) -> None:
    """Block `key` (A) is demoted, its write to NVMe held (`held`): A's one copy, in the pool, is damaged while it
    moves, and a Get drops it (DataLoss): A leaves the store while its demotion is under way."""
    assert await asyncio.to_thread(held.entered.wait, 30), "A's demotion never wrote to NVMe"
    moving = srv.store.block(key)
    assert moving is not None and moving.moving and moving.locations == ["dram"]
    srv.store.tiers[0].view(key)[-1] ^= 0x40  # A's one copy damaged while it is moving
    with pytest.raises(errors.DataLoss):
        await c.get(fp, [key])  # dropped: A leaves the store
    assert srv.store.block(key) is None


async def test_a_demotion_of_a_block_dropped_meanwhile_leaves_the_block_put_again_under_its_key(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """A pool of one block, write-back, NVMe below. Block A is demoted to make room for B, its NVMe write held; its
    pool copy is damaged meanwhile, and a Get drops it (no copy left: A leaves the store) and a put of the same
    tokens stores A again, in the slot the drop freed. The demotion then ended by dropping "its" pool copy by key:
    the new block's slot, which B's put then took. The put acknowledged A stored; its Gets failed NOT_FOUND ("not
    in the dram tier") and the shutdown's flush raised on it."""
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": block,
                                  "tiers.dram.page_bytes": 256, "tiers.write_back_window_s": 0})
    nvme = srv.store.tiers[-1]
    a, b = tokens(BLOCK_TOKENS, seed=1), tokens(BLOCK_TOKENS, seed=2)
    kv_a, kv_b = random_kv(SPEC, BLOCK_TOKENS, seed=1), random_kv(SPEC, BLOCK_TOKENS, seed=2)
    held = FirstIoHeld("write")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        key = (await c.put(fp, a, kv_a)).keys[0]
        nvme.fault_hook = held
        putting_b = asyncio.create_task(other.put(fp, b, kv_b))  # room for B: A is demoted
        try:
            await dropped_while_its_demotion_writes(srv, c, fp, key, held)
            again = await c.put(fp, a, kv_a)  # A anew, in the slot the drop freed
            assert again.stored == 1 and again.keys[0] == key
        finally:
            held.go.set()
        assert (await putting_b).stored == 1
        got = await c.get(fp, [key])  # acknowledged stored: served
        assert torch.equal(got[0], kv_a)
        assert torch.equal((await c.get(fp, [(await c.lookup(fp, b)).blocks[0].key]))[0], kv_b)
    assert (await srv.store.check(fix=False)).ok  # every copy the index lists is there and verifies


async def test_a_read_that_outlives_its_block_leaves_the_block_put_again_and_its_children(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """Write-through: block A in the pool and on NVMe, both copies damaged. A first Get drops the pool copy and
    reads the file (held in the tier's fault hook); a second Get reads the file too, fails it, and A leaves the
    store. A chain of A (another worker's KV) and a child C is put: acknowledged, durable. The first Get's read then
    fails (the file is the new A's now, not its block's bytes), and it dropped "its" NVMe copy by key, the new A's
    file, and A's lost chain by key, the new child C: both acknowledged, a durable one gone from disk."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    chain = tokens(2 * BLOCK_TOKENS, seed=1)
    a = chain[:BLOCK_TOKENS]
    kv_a, kv_again = random_kv(SPEC, BLOCK_TOKENS, seed=1), random_kv(SPEC, 2 * BLOCK_TOKENS, seed=3)
    held = FirstIoHeld("read")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        key = (await c.put(fp, a, kv_a)).keys[0]
        assert srv.store.block(key).locations == ["dram", "nvme"]  # type: ignore[union-attr]
        damage_pool_and_file(pool, nvme, key)
        nvme.fault_hook = held
        first = asyncio.create_task(c.get(fp, [key]))  # drops the pool copy, then its file read is held
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "the first Get never read the NVMe file"
            with pytest.raises(errors.DataLoss):
                await other.get(fp, [key])  # the file fails: A leaves the store
            assert srv.store.block(key) is None
            again = await other.put(fp, chain, kv_again)  # A anew, and a child
            assert again.stored == 2 and again.not_durable == 0 and again.keys[0] == key
        finally:
            held.go.set()
        with pytest.raises(errors.DataLoss):
            await first  # its block's bytes are nowhere now
        got = await other.get(fp, list(again.keys))  # both acknowledged: served
        assert torch.equal(torch.cat(got, dim=2), kv_again)
    assert (await srv.store.check(fix=False)).ok  # every copy the index lists is there and verifies: A's file too


async def test_a_demotion_that_outlives_its_block_leaves_the_nvme_file_of_the_block_put_again(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """As the first test, but the block put again is demoted to NVMe itself (a third put makes room) while the
    stale demotion's NVMe write is still held. That write, ending last, took the key's file, and the stale
    demotion then unlinked it as a copy no block holds: the new block's one copy, acknowledged."""
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": block,
                                  "tiers.dram.page_bytes": 256, "tiers.write_back_window_s": 0})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    a, b, c3 = (tokens(BLOCK_TOKENS, seed=s) for s in (1, 2, 3))
    kv_a, kv_b, kv_c = (random_kv(SPEC, BLOCK_TOKENS, seed=s) for s in (1, 2, 3))
    held = FirstIoHeld("write")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as third:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        await third.register_model(SPEC)
        key = (await c.put(fp, a, kv_a)).keys[0]
        nvme.fault_hook = held
        putting_b = asyncio.create_task(other.put(fp, b, kv_b))  # room for B: A is demoted, its write held
        putting_c = None
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "A's demotion never wrote to NVMe"
            pool.view(key)[-1] ^= 0x40
            with pytest.raises(errors.DataLoss):
                await c.get(fp, [key])  # dropped: A leaves the store
            again = await c.put(fp, a, kv_a)  # A anew (the same bytes), in the slot the drop freed
            assert again.stored == 1
            putting_c = asyncio.create_task(third.put(fp, c3, kv_c))  # room for C: the new A is demoted to NVMe

            async def demoted_or_demoting() -> bool:  # its write done, or waiting for the held one's to end
                meta = srv.store.block(key)
                return meta is not None and (meta.moving or "nvme" in meta.locations)

            await until(demoted_or_demoting, "the block put again demoted to NVMe (or its demotion begun)")
        finally:
            held.go.set()
        assert (await putting_b).stored == 1
        assert putting_c is not None and (await putting_c).stored == 1
        got = await c.get(fp, [key])  # acknowledged stored: served
        assert torch.equal(got[0], kv_a)
    assert (await srv.store.check(fix=False)).ok


async def pool_of_two_over_nvme(server_factory: Any, tmp_path: Path) -> Any:
    """A daemon whose DRAM pool holds two blocks, write-back (a flush only when evicted) to an NVMe tier below."""
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    return await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": 2 * block,
                                   "tiers.dram.page_bytes": 256, "tiers.write_back_window_s": 3600})


async def on_nvme_alone_under_a_full_pool(srv: Any, client: EngramClient, fp: bytes, k: list[int],
                                          kv: torch.Tensor) -> tuple[bytes, Any]:
    """K put, flushed to NVMe and dropped from the pool; then two blocks (V1, V2) put, pending a flush, fill the pool:
    K's key and block."""
    key = (await client.put(fp, k, kv)).keys[0]
    meta = srv.store.block(key)
    assert srv.store.flusher is not None and await srv.store.flusher.flush_now(meta)
    await srv.store.drop_copy(meta, "dram")
    assert meta.locations == ["nvme"]
    for seed in (2, 3):
        await client.put(fp, tokens(BLOCK_TOKENS, seed=seed), random_kv(SPEC, BLOCK_TOKENS, seed=seed))
    return key, meta


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


async def test_a_get_whose_promotion_outlives_its_block_is_served_and_leaves_the_block_put_again(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, caplog) -> None:
    """A pool of two blocks, write-back, NVMe below. A Get of K (on NVMe alone) reads it and promotes it into the
    pool, which must make room: the oldest pool block's demotion to NVMe is held. Meanwhile K's file is damaged and
    another Get drops K (no copy left), and a put stores K again, into the pool. The promotion, going on, wrote K's
    old bytes into the pool under the key the new K holds: the pool refused ('write of a key already in the tier'),
    and the first Get, whose bytes were read and verified, failed with an internal error (its data channel closed;
    the client, asking again, got the new K's bytes). Now a copy whose block left the index
    while room was made is not written: the first Get is served, the new K keeps its copy."""
    srv = await pool_of_two_over_nvme(server_factory, tmp_path)
    nvme = srv.store.tiers[-1]
    k = tokens(BLOCK_TOKENS, seed=1)
    kv_k, kv_again = random_kv(SPEC, BLOCK_TOKENS, seed=1), random_kv(SPEC, BLOCK_TOKENS, seed=4)
    held = FirstIoHeld("write")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        key, meta = await on_nvme_alone_under_a_full_pool(srv, c, fp, k, kv_k)
        nvme.fault_hook = held
        first = asyncio.create_task(c.get(fp, [key]))  # read from NVMe, then promoted: V1's demotion is held
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "the promotion never demoted a block to NVMe"
            assert meta.moving  # type: ignore[union-attr]
            flip_last_byte(nvme.path_of(key))
            with pytest.raises(errors.DataLoss):
                await other.get(fp, [key])  # K leaves the store
            assert srv.store.block(key) is None
            again = await other.put(fp, k, kv_again)  # K anew, into the pool (V2 demoted for it)
            assert again.stored == 1 and again.keys[0] == key
        finally:
            held.go.set()
        # read and verified before K was dropped; not the new K's after a reconnect
        assert torch.equal((await first)[0], kv_k)
        assert torch.equal((await c.get(fp, [key]))[0], kv_again)
        assert "dram" in srv.store.block(key).locations  # type: ignore[union-attr]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no internal error closed a connection
    assert (await srv.store.check(fix=False)).ok


async def test_a_zero_copy_prefix_whose_copy_up_outlives_its_block_counts_no_promotion(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """As the test before, but the copy up into the shared pool is a zero-copy GetPrefix's (BlockStore.copy_up): K,
    on NVMe alone, is read and placed in the pool, whose room waits on a demotion held at its NVMe write; K is
    dropped meanwhile (its file damaged, another Get) and put again. The copy up writes nothing (f062b9b), yet it
    counted a promotion into the pool, and said one copy landed. Now it counts what landed only."""
    srv = await pool_of_two_over_nvme(server_factory, tmp_path)
    nvme = srv.store.tiers[-1]
    k = tokens(BLOCK_TOKENS, seed=1)
    kv_k, kv_again = random_kv(SPEC, BLOCK_TOKENS, seed=1), random_kv(SPEC, BLOCK_TOKENS, seed=4)
    held = FirstIoHeld("write")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=True) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        key, meta = await on_nvme_alone_under_a_full_pool(srv, other, fp, k, kv_k)
        dram = srv.store.counters.tiers["dram"]
        promotions, promoted_bytes = dram.promotions, dram.promoted_bytes
        nvme.fault_hook = held
        prefix = asyncio.create_task(c.get_prefix(fp, k))  # K copied up into the pool: V1's demotion is held
        try:
            assert await asyncio.to_thread(held.entered.wait, 30), "the copy up never demoted a block to NVMe"
            assert meta.moving  # type: ignore[union-attr]
            flip_last_byte(nvme.path_of(key))
            with pytest.raises(errors.DataLoss):
                await other.get(fp, [key])  # K leaves the store
            assert srv.store.block(key) is None
            again = await other.put(fp, k, kv_again)  # K anew, into the pool (V2 demoted for it)
            assert again.stored == 1 and again.keys[0] == key
        finally:
            held.go.set()
        await prefix  # (what it answers depends on when it looks again: the K it walked left)
        assert (dram.promotions, dram.promoted_bytes) == (promotions, promoted_bytes)
        assert torch.equal((await other.get(fp, [key]))[0], kv_again)
    assert (await srv.store.check(fix=False)).ok


async def test_a_demotion_whose_block_is_dropped_while_its_copy_is_written_below_counts_no_demotion(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    """A pool of one block, NVMe below. Block A is demoted to make room for B, its NVMe write held; its pool copy is
    damaged meanwhile, and a Get drops it (no copy left: A leaves the store, the room with it). The demotion, ending,
    writes nothing below (the file is discarded: no block holds it), yet it counted a demotion out of the pool, A's
    bytes as demoted, and an eviction for the room. Now it counts none of them: B lands in the room the drop made,
    and every tier's bytes are those of the copies the index lists."""
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.capacity": block,
                                  "tiers.dram.page_bytes": 256, "tiers.write_back_window_s": 0})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    dram = srv.store.counters.tiers["dram"]
    a, b = tokens(BLOCK_TOKENS, seed=1), tokens(BLOCK_TOKENS, seed=2)
    kv_a, kv_b = random_kv(SPEC, BLOCK_TOKENS, seed=1), random_kv(SPEC, BLOCK_TOKENS, seed=2)
    held = FirstIoHeld("write")  # in the tier's I/O thread

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        key = (await c.put(fp, a, kv_a)).keys[0]
        before = (dram.demotions, dram.demoted_bytes, dram.evictions)
        nvme.fault_hook = held
        putting_b = asyncio.create_task(c.put(fp, b, kv_b))  # room for B: A is demoted
        try:
            await dropped_while_its_demotion_writes(srv, c, fp, key, held)
        finally:
            held.go.set()
        put_b = await putting_b
        assert put_b.stored == 1
        assert (dram.demotions, dram.demoted_bytes, dram.evictions) == before  # nothing went below, nothing evicted
        b_meta = srv.store.block(put_b.keys[0])
        assert b_meta is not None and b_meta.locations == ["dram"]
        assert key not in nvme and nvme.used_bytes == 0  # the demotion's file went with its block
        assert pool.used_bytes == b_meta.nbytes
        assert torch.equal((await c.get(fp, list(put_b.keys)))[0], kv_b)
    assert (await srv.store.check(fix=False)).ok

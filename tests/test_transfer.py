"""Batched transfers on the CPU path (the semantics the CUDA stream path must match; test_gpu_data_path.py
compares them on the H200): gather into a worker's pages, scatter back into pool slots, bad pairs refused,
and the store's batched DRAM -> HBM promotion keeping its two-phase protocol."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from engram.block import BlockHeader, checksum
from engram.config import load_config
from engram.errors import InvalidArgument
from engram.keys import root_key
from engram.layout import DType
from engram.server.app import build_store
from engram.tiers.hbm import hbm_tier
from engram.tiers.pool import PoolTier
from engram.transfer import (
    SUBMIT_EVERY,
    Done,
    Move,
    TransferEngine,
    coalesce,
    copy_blocks,
    gather,
    promote,
    scatter,
)

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)


async def filled_pool(n: int, sizes: list[int]) -> tuple[PoolTier, dict[bytes, bytes]]:
    from engram.block import BlockRecord

    pool = hbm_tier(n, "cpu", 256)
    blocks = {}
    for i, size in enumerate(sizes):
        key, payload = bytes([i]) * 8, os.urandom(size)
        rec = BlockRecord(key, b"p", b"fp", "ns", DType.BF16, True, (size,), b"", size, 0)
        need = pool.space_for(rec)
        assert pool.reserve(need)
        await pool.write(rec, payload, need)
        blocks[key] = payload
    return pool, blocks


def test_coalesce_merges_only_ranges_that_continue_in_both_buffers() -> None:
    moves = [Move(0, 100, 10), Move(10, 110, 5), Move(15, 200, 5), Move(40, 205, 1)]
    assert coalesce(moves) == [Move(0, 100, 15), Move(15, 200, 5), Move(40, 205, 1)]


@pytest.mark.parametrize("page_bytes", [1024, 1000])  # a multiple of the pool's 256-byte pages, and not
async def test_gather_then_scatter_round_trips_every_block(page_bytes: int) -> None:
    pool, blocks = await filled_pool(16 * 1024, [1000, 700, 256, 513, 1])
    engine = TransferEngine()
    pages = torch.zeros(8, page_bytes, dtype=torch.uint8)
    pairs = [(k, p) for k, p in zip(blocks, [6, 0, 3, 7, 2], strict=True)]
    done = gather(engine, pool, pairs, pages)
    await done.wait()
    assert done.ready()
    for key, page in pairs:
        assert bytes(pages[page, : len(blocks[key])].numpy()) == blocks[key]
    # Scatter the pages back as new blocks into another pool.
    other, _ = await filled_pool(16 * 1024, [])
    triples = [(b"new" + k[:5], p, len(blocks[k])) for k, p in pairs]
    reserved = []
    for _, _, length in triples:
        need = other.pages_for(length) * other.page_bytes
        assert other.reserve(need)
        reserved.append(need)
    scatter(engine, pages, triples, other, reserved).synchronize()
    for (new_key, _, _), (key, _) in zip(triples, pairs, strict=True):
        assert await other.read(new_key) == blocks[key]


async def test_bad_pairs_are_refused_with_what_to_change() -> None:
    pool, blocks = await filled_pool(8 * 1024, [1000, 300])
    engine = TransferEngine()
    pages = torch.zeros(2, 512, dtype=torch.uint8)
    k0, k1 = list(blocks)
    with pytest.raises(InvalidArgument, match="does not fit a 512-byte page"):
        gather(engine, pool, [(k0, 0)], pages)
    with pytest.raises(InvalidArgument, match="outside the layout's 2 pages"):
        gather(engine, pool, [(k1, 5)], pages)
    with pytest.raises(InvalidArgument, match="named twice"):
        gather(engine, pool, [(k1, 1), (k1, 1)], pages)
    with pytest.raises(InvalidArgument, match="outside its buffers"):
        engine.copy(pool.buffer, pages.view(-1), [Move(0, 1020, 10)])


class HeldEngine(TransferEngine):
    """The real CPU copy, whose completion the test releases: so it can look at the store mid-move.
    (A wrapper, not a mock: the bytes are really copied.)"""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    def copy(self, src, dst, moves, *, page_bytes=0):  # type: ignore[no-untyped-def]
        super().copy(src, dst, moves, page_bytes=page_bytes)
        engine = self

        class Held(Done):
            async def wait(self) -> None:
                engine.started.set()
                await engine.release.wait()

        return Held(None)


async def _hbm_over_dram(tmp_path, hbm_blocks: int, device: str = "cpu", dram_blocks: int = 16):  # type: ignore[no-untyped-def]
    """A store of an HBM tier (on the CPU unless told) of hbm_blocks blocks over a shared DRAM pool of dram_blocks (a
    file in tmp_path, which cannot be pinned)."""
    return await build_store(load_config(env={}, overrides={
        "tiers.hbm.capacity": hbm_blocks * BLOCK, "tiers.hbm.device": device, "tiers.dram.capacity": dram_blocks * BLOCK,
        "tiers.dram.shm_dir": str(tmp_path), "tiers.dram.pin": False}))


async def _put_chain(store, fp: bytes, n: int) -> tuple[list, list[bytes]]:  # type: ignore[no-untyped-def]
    """A chain of n full blocks put into `store` (namespace "ns"): their metas and payloads, in order."""
    parent, metas, payloads = root_key("ns", fp), [], []
    for s in range(n):
        toks = tokens(BLOCK_TOKENS, seed=s)
        payload = random_kv(SPEC, BLOCK_TOKENS, seed=s).view(torch.uint8).numpy().tobytes()
        header = BlockHeader(toks, SPEC.layout.dtype, SPEC.layout.block_shape(BLOCK_TOKENS), len(payload),
                             checksum(payload))
        parent = (await store.put("ns", fp, parent, header, payload)).key
        metas.append(store.index.get(parent))
        payloads.append(payload)
    return metas, payloads


async def test_batched_promotion_keeps_the_two_phase_protocol(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, payloads = await _put_chain(store, fp, 8)  # 8 blocks into 4 of HBM: the first demoted to DRAM
        in_dram = [m for m in metas if m.locations == ["dram"]]
        assert len(in_dram) == 4
        engine = HeldEngine()
        task = asyncio.create_task(promote(store, in_dram[:2], engine))
        await engine.started.wait()
        # Mid-move: the HBM copies are written but not published; reads go to DRAM. (HBM made room by
        # demoting its own blocks to DRAM.)
        assert all(m.moving and "hbm" not in m.locations for m in in_dram[:2])
        assert await store.read(in_dram[0], promote=False) == payloads[metas.index(in_dram[0])]
        engine.release.set()
        assert await task == 2
        for m in in_dram[:2]:
            assert not m.moving and m.locations == ["hbm", "dram"]
            assert await store.tiers[0].read(m.key) == payloads[metas.index(m)]
        assert store.counters.tiers["hbm"].promotions >= 2
    finally:
        await store.close()


async def test_a_block_whose_source_copy_goes_while_room_is_made_is_skipped_and_its_room_given_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A batched promotion reserves room in HBM (a demotion to a slow NVMe makes it); meanwhile a reader finds the
    block's only DRAM copy corrupt and drops it. The promotion skips the block and gives its HBM room back (the
    reservation stayed held for good: HBM shrank by a block per such race)."""
    import time

    from engram.errors import DataLoss

    cfg = load_config(env={}, overrides={"tiers.hbm.capacity": 2 * BLOCK, "tiers.hbm.device": "cpu",
                                         "tiers.dram.capacity": 2 * BLOCK, "tiers.dram.shm_dir": str(tmp_path),
                                         "tiers.dram.pin": False, "tiers.nvme.path": str(tmp_path / "nvme"),
                                         "tiers.write_back_window_s": 3600})
    store = await build_store(cfg)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _put_chain(store, fp, 6)
        k = metas[3]
        assert k.locations == ["dram"]
        dram, hbm = store.tiers[1], store.tiers[0]
        dram.buffer[dram.slot(k.key).offset] ^= 0xFF  # its only copy goes bad
        store.tiers[-1].fault_hook = lambda op, path: time.sleep(0.1) if op == "write" else None

        async def reader() -> None:
            await asyncio.sleep(0.02)  # while the promotion makes room
            with store.reading([k]), pytest.raises(DataLoss):
                await store.read(k)

        promoted, _ = await asyncio.gather(promote(store, [k], TransferEngine()), reader())
        assert promoted == 0 and store.index.get(k.key) is None
        assert hbm._reserved_bytes == 0  # the room it reserved was given back
        assert hbm.used_bytes == sum(hbm.space_for(m.record()) for m in store.index if "hbm" in m.locations)
    finally:
        await store.close()


async def test_a_promotion_cancelled_mid_copy_waits_for_its_copies_before_freeing_their_slots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A batched DRAM -> HBM promotion cancelled while its copies run (a reader's timeout): the HBM slots it
    booked were freed at once, while the copy engine could still be writing into them (on a GPU a put reusing a
    slot would then get this copy's bytes over its own). The copies are waited for first. The engine is the
    real CPU copy whose completion the test holds; it records when the cancelled promotion waits for it."""
    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _put_chain(store, fp, 8)
        in_dram = [m for m in metas if m.locations == ["dram"]][:2]
        engine = HeldEngine()
        hbm = store.tiers[0]
        held_when_waited: list[int] = []
        real_copy = engine.copy

        def copy_that_records(src, dst, moves, *, page_bytes=0):  # type: ignore[no-untyped-def]
            done = real_copy(src, dst, moves, page_bytes=page_bytes)
            done.synchronize = lambda: held_when_waited.append(hbm.usage().blocks)  # type: ignore[method-assign]
            return done

        engine.copy = copy_that_records  # type: ignore[method-assign]
        task = asyncio.create_task(promote(store, in_dram, engine))
        await engine.started.wait()
        booked = hbm.usage().blocks  # the two copies' slots among them (room was made by demoting)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert held_when_waited == [booked]  # waited for, while its slots were still held
        assert all(not m.moving and "hbm" not in m.locations for m in in_dram)
    finally:
        await store.close()


async def test_a_copy_into_the_pool_from_hbm_is_not_counted_as_a_promotion(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """copy_up brings a hit's blocks into the shared DRAM pool before describing them; from NVMe that is a
    promotion into DRAM, but from HBM (faster) it is a copy down, counted as the HBM tier's demotion (it was a
    DRAM promotion, so `engram stats` showed blocks promoted that had come down)."""
    store = await _hbm_over_dram(tmp_path, 8)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _put_chain(store, fp, 3)
        assert all(m.locations == ["hbm"] for m in metas)
        before = store.counters.tiers["dram"].promotions, store.counters.tiers["hbm"].demotions
        assert await store.copy_up(metas, "dram") == 3
        assert all(m.locations == ["hbm", "dram"] for m in metas)
        assert store.counters.tiers["dram"].promotions == before[0]
        assert store.counters.tiers["hbm"].demotions == before[1] + 3
    finally:
        await store.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("direction", ["up", "down"])
async def test_a_batched_copy_never_copies_a_damaged_source_copy(tmp_path, direction: str, device: str) -> None:  # type: ignore[no-untyped-def]
    """A batched copy between the pools (promote: DRAM -> HBM, a hit's blocks; or HBM -> DRAM) of two blocks whose
    second one's source copy a stray writer damaged: the sound one lands; the damaged one is not copied but
    dropped, counted corrupt in its tier, as a read drops it (the block with it: it had no other copy). It was
    copied under the block's checksum and listed as an HBM copy, which a CUDA IPC hit copies device to device
    without a checksum. On a GPU the check reads the host side: the DRAM source going up, the DRAM copy going
    down."""
    store = await _hbm_over_dram(tmp_path, 8 if direction == "down" else 4, device=device)
    try:
        fp = store.registry.register(SPEC)
        metas, payloads = await _put_chain(store, fp, 8 if direction == "up" else 3)
        src, dst = ("dram", "hbm") if direction == "up" else ("hbm", "dram")
        pair = [m for m in metas if m.locations == [src]][-2:]
        assert len(pair) == 2
        source = store.tiers[store.tier_rank(src)]
        source.buffer[source.slot(pair[1].key).offset + 5] ^= 0x40  # its only copy goes bad
        engine = TransferEngine(device if device == "cuda" else None)
        assert await copy_blocks(store, pair, engine, src=src, dst=dst) == 1
        assert sorted(pair[0].locations) == sorted([src, dst]) and not pair[0].moving
        assert await store.tiers[store.tier_rank(dst)].read(pair[0].key) == payloads[metas.index(pair[0])]
        assert store.block(pair[1].key) is None
        assert pair[1].key not in store.tiers[store.tier_rank(dst)] and pair[1].key not in source
        assert store.counters.tiers[src].corrupt_blocks == 1
        assert (await store.check(fix=False)).ok
    finally:
        await store.close()


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_a_batched_copy_of_several_submissions_drops_exactly_its_damaged_source_copies(  # type: ignore[no-untyped-def]
        tmp_path, direction: str) -> None:
    """A copy of more blocks than one submission holds (SUBMIT_EVERY): two damaged source copies, in the first and
    the last submission, are the two not made (dropped, counted corrupt); every other copy lands and reads back
    as put, each checked against its own block's checksum."""
    n = SUBMIT_EVERY + 4
    store = await _hbm_over_dram(tmp_path, n + 2, dram_blocks=n + 2)
    try:
        fp = store.registry.register(SPEC)
        metas, payloads = [], []
        for s in range(n):  # one-block chains: dropping a damaged block drops no other
            payload = random_kv(SPEC, BLOCK_TOKENS, seed=s).view(torch.uint8).numpy().tobytes()
            header = BlockHeader(tokens(BLOCK_TOKENS, seed=s), SPEC.layout.dtype,
                                 SPEC.layout.block_shape(BLOCK_TOKENS), len(payload), checksum(payload))
            metas.append(store.index.get((await store.put("ns", fp, root_key("ns", fp), header, payload)).key))
            payloads.append(payload)
        engine = TransferEngine(None)
        if direction == "up":  # every block in DRAM alone first
            assert await copy_blocks(store, metas, engine, src="hbm", dst="dram") == n
            for m in metas:
                await store.drop_copy(m, "hbm")
        src, dst = ("dram", "hbm") if direction == "up" else ("hbm", "dram")
        assert all(m.locations == [src] for m in metas)
        source = store.tiers[store.tier_rank(src)]
        bad = {1, n - 2}
        for i in bad:
            source.buffer[source.slot(metas[i].key).offset + 3] ^= 0x10
        assert await copy_blocks(store, metas, engine, src=src, dst=dst) == n - len(bad)
        for i, m in enumerate(metas):
            if i in bad:
                assert store.block(m.key) is None
            else:
                assert sorted(m.locations) == sorted([src, dst]) and not m.moving
                assert await store.tiers[store.tier_rank(dst)].read(m.key) == payloads[i]
        assert store.counters.tiers[src].corrupt_blocks == len(bad)
    finally:
        await store.close()


async def _one_block_chains(store, fp: bytes, n: int) -> tuple[list, list[bytes]]:  # type: ignore[no-untyped-def]
    """n one-block chains (dropping one drops no other): their metas and payloads."""
    metas, payloads = [], []
    for s in range(n):
        payload = random_kv(SPEC, BLOCK_TOKENS, seed=s).view(torch.uint8).numpy().tobytes()
        header = BlockHeader(tokens(BLOCK_TOKENS, seed=s), SPEC.layout.dtype, SPEC.layout.block_shape(BLOCK_TOKENS),
                             len(payload), checksum(payload))
        metas.append(store.index.get((await store.put("ns", fp, root_key("ns", fp), header, payload)).key))
        payloads.append(payload)
    return metas, payloads


def _hbm_books_what_it_lists(store) -> None:  # type: ignore[no-untyped-def]
    """No reservation is left in the HBM pool, and what it holds is exactly the copies blocks list there."""
    hbm = store.tiers[0]
    listed = [m for m in store.index if "hbm" in m.locations]
    assert hbm._reserved_bytes == 0
    assert hbm.used_bytes == sum(hbm.space_for(m.record()) for m in listed) and len(hbm) == len(listed)
    assert store.placement.busy == 0


async def test_a_group_of_which_only_some_blocks_fit_books_those_at_once_makes_room_for_the_rest_and_lands_all(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A promotion's group is booked in one store call (begin_copies_now), which reserves room for the blocks
    that fit; the others get room made one by one (HBM's own blocks demoted). While the copies are held none of
    them is listed in HBM and reads are served from DRAM; then every one lands, reads back as put, and the
    pool books nothing beyond the copies listed."""
    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, payloads = await _one_block_chains(store, fp, 8)  # the first 4 demoted to DRAM when HBM filled
        in_dram = [m for m in metas if m.locations == ["dram"]]
        in_hbm = [m for m in metas if m.locations == ["hbm"]]
        assert len(in_dram) == 4 and len(in_hbm) == 4
        assert await copy_blocks(store, in_hbm[:2], TransferEngine(), src="hbm", dst="dram") == 2
        for m in in_hbm[:2]:
            await store.drop_copy(m, "hbm")  # room for two in HBM; the other two need room made
        engine = HeldEngine()
        task = asyncio.create_task(promote(store, in_dram, engine))
        await engine.started.wait()
        assert all(m.moving and "hbm" not in m.locations for m in in_dram)
        assert await store.read(in_dram[3], promote=False) == payloads[metas.index(in_dram[3])]
        engine.release.set()
        assert await task == 4
        for m in in_dram:
            assert not m.moving and m.locations == ["hbm", "dram"]
            assert await store.tiers[0].read(m.key) == payloads[metas.index(m)]
        _hbm_books_what_it_lists(store)
    finally:
        await store.close()


async def test_a_promotion_of_several_groups_cancelled_mid_copy_gives_back_every_booking(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Cancelled while the copies of more than one group (SUBMIT_EVERY blocks each) are held: no block stays
    moving or is listed in HBM, and every HBM slot and reservation booked for them is given back."""
    n = SUBMIT_EVERY + 4
    store = await _hbm_over_dram(tmp_path, n + 2, dram_blocks=n + 2)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _one_block_chains(store, fp, n)
        assert await copy_blocks(store, metas, TransferEngine(), src="hbm", dst="dram") == n
        for m in metas:
            await store.drop_copy(m, "hbm")
        engine = HeldEngine()
        task = asyncio.create_task(promote(store, metas, engine))
        await engine.started.wait()
        assert len(store.tiers[0]) == n  # every group booked and placed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(not m.moving and m.locations == ["dram"] for m in metas)
        _hbm_books_what_it_lists(store)
        assert len(store.tiers[0]) == 0
    finally:
        await store.close()


async def test_a_block_named_twice_in_one_batch_is_copied_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A group books each block once: booked twice, one HBM slot would be lost to a key placed over itself."""
    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, payloads = await _one_block_chains(store, fp, 2)
        assert await copy_blocks(store, metas, TransferEngine(), src="hbm", dst="dram") == 2
        for m in metas:
            await store.drop_copy(m, "hbm")  # HBM has room for both: the group is booked at once
        in_dram = metas
        assert await promote(store, [in_dram[0], in_dram[1], in_dram[0]], TransferEngine()) == 2
        for m in in_dram:
            assert m.locations == ["hbm", "dram"] and await store.tiers[0].read(m.key) == payloads[metas.index(m)]
        _hbm_books_what_it_lists(store)
    finally:
        await store.close()


async def test_a_batch_booked_on_a_tier_without_batched_reservations_is_booked_block_by_block(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """begin_copies_now on a tier that is not a pool (NVMe: no reserve_payloads) reserves block by block, marks
    each booked block moving, and end_copies(ok=False) ends every move with nothing listed there."""
    store = await build_store(load_config(env={}, overrides={
        "tiers.hbm.capacity": 0, "tiers.dram.capacity": 8 * BLOCK, "tiers.dram.shm_dir": str(tmp_path),
        "tiers.dram.pin": False, "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_back_window_s": 3600}))
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _one_block_chains(store, fp, 3)
        assert all(m.locations == ["dram"] for m in metas)
        nvme = store.tiers[-1]
        before = nvme.used_bytes
        needs = store.begin_copies_now(metas, "nvme")
        assert needs == [nvme.space_for(m.record()) for m in metas]
        assert all(m.moving for m in metas) and nvme.used_bytes == before + sum(n for n in needs if n)
        for need in needs:
            assert need is not None
            nvme.unreserve(need)
        store.end_copies(metas, "nvme", [False] * 3)
        assert all(not m.moving and m.locations == ["dram"] for m in metas) and store.placement.busy == 0
    finally:
        await store.close()


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_a_batched_copy_cancelled_while_its_threads_hash_the_host_pools_slots_waits_for_them(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch, direction: str) -> None:
    """A batched copy between the pools verifies each copy by hashing the DRAM pool's slots in worker threads: the
    sources going up (DRAM -> HBM), the copies landed going down. Cancelled meanwhile (a reader's timeout), it gave
    back its bookings at once (the copies' slots freed, the sources no longer moving, so evictable) while the
    threads still read those slots, which another block could take. It waits for them now. The hash is the real
    `checksums`, gated by a wrapper that waits for the test."""
    import threading

    from engram import transfer

    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _put_chain(store, fp, 8)  # 8 blocks into 4 of HBM: 4 demoted to DRAM
        src, dst = ("dram", "hbm") if direction == "up" else ("hbm", "dram")
        todo = [m for m in metas if m.locations == [src]][:2]
        assert len(todo) == 2
        entered, go, done = threading.Event(), threading.Event(), []
        real = transfer.checksums

        def gated(views):  # type: ignore[no-untyped-def]
            entered.set()
            go.wait(60)
            done.append(real(views))
            return done[-1]

        monkeypatch.setattr(transfer, "checksums", gated)
        task = asyncio.create_task(copy_blocks(store, todo, TransferEngine(), src=src, dst=dst))
        try:
            assert await asyncio.to_thread(entered.wait, 10)
            assert all(m.moving for m in todo)
            task.cancel()
            for _ in range(20):  # turns of the loop: a cancel that does not wait for the threads has landed by now
                await asyncio.sleep(0)
            assert not task.done() and all(m.moving for m in todo), "the copy let go while its threads hashed"
        finally:
            go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(done) == min(2, os.cpu_count() or 1)  # every thread ended before the copy did
        assert all(not m.moving and m.locations == [src] for m in todo)
        _hbm_books_what_it_lists(store)
    finally:
        await store.close()


async def test_a_block_put_again_while_a_promotion_of_its_dropped_predecessor_copies_keeps_its_hbm_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A batched DRAM -> HBM promotion of block K runs (the real CPU copy, its completion held); a reader finds K's
    only copy damaged and drops it; a put stores K again (other bytes) under the same key, into HBM. The
    promotion's slot held K's key in the HBM pool from its booking on, so that put failed (the pool's 'write of a
    key already in the tier', INTERNAL to a client). Now the copy's slot has a name of its own until it lands: the
    put stores K, and the stale copy, ending, neither lands as K's copy nor deletes the new one."""
    from engram.errors import DataLoss

    store = await _hbm_over_dram(tmp_path, 4)
    try:
        fp = store.registry.register(SPEC)
        metas, _ = await _put_chain(store, fp, 8)
        k = [m for m in metas if m.locations == ["dram"]][-1]
        i = metas.index(k)
        engine = HeldEngine()
        task = asyncio.create_task(promote(store, [k], engine))
        await engine.started.wait()
        assert k.moving and "hbm" not in k.locations
        dram, hbm = store.tiers[1], store.tiers[0]
        dram.buffer[dram.slot(k.key).offset] ^= 0xFF  # its only copy goes bad
        with store.reading([k]), pytest.raises(DataLoss):
            await store.read(k)
        assert store.index.get(k.key) is None
        payload = random_kv(SPEC, BLOCK_TOKENS, seed=100).view(torch.uint8).numpy().tobytes()
        header = BlockHeader(tokens(BLOCK_TOKENS, seed=i), SPEC.layout.dtype, SPEC.layout.block_shape(BLOCK_TOKENS),
                             len(payload), checksum(payload))
        again = await store.put("ns", fp, metas[i - 1].key, header, payload)
        assert again.stored and again.key == k.key
        new = store.index.get(k.key)
        assert new is not None and new is not k and "hbm" in new.locations
        engine.release.set()
        assert await task == 0  # its block is gone: nothing landed
        assert store.index.get(k.key) is new and "hbm" in new.locations
        assert await store.read(new, promote=False) == payload
        assert await hbm.read(k.key) == payload
        _hbm_books_what_it_lists(store)
    finally:
        await store.close()

"""Write-through means acknowledged = durable (docs/RELIABILITY.md), through a real daemon over gRPC.

Expected behaviour, per fault of the NVMe copy (ENOSPC, EIO, a degraded tier):
- tiers.on_nvme_failure = fail (default): the put fails with UNAVAILABLE naming the cause and the setting;
  nothing of the failed block is acknowledged or kept (a Lookup misses it, so a retry sends it again); the
  daemon keeps serving, and puts succeed again once the disk does.
- tiers.on_nvme_failure = degrade: the put is acknowledged with PutResult.not_durable counting the blocks
  that have no NVMe copy, Stats.blocks_not_durable counts them, the activity log warns.
- With an HBM tier, the second copy of a write-through put goes to NVMe, not to DRAM.
Both put paths are covered: Put streams (a private DRAM pool) and in-place puts (the shared pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import threading
from pathlib import Path

import pytest
import torch

from engram import errors
from engram.client import EngramClient

from helpers import BLOCK_TOKENS, random_kv, rpcs_answered, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)
NS = "durable"


def fault(kind: int):  # type: ignore[no-untyped-def]
    state = {"on": True, "hits": 0}

    def hook(op: str, path: Path) -> None:
        if op == "write" and state["on"]:
            state["hits"] += 1
            raise OSError(kind, "No space left on device" if kind == errno.ENOSPC else "Input/output error")

    return hook, state


@pytest.mark.parametrize("pool", ["private", "shared"])
@pytest.mark.parametrize("kind", [errno.ENOSPC, errno.EIO], ids=["enospc", "eio"])
async def test_write_through_refuses_a_put_it_cannot_make_durable(server_factory, tmp_path: Path, pool: str,  # type: ignore[no-untyped-def]
                                                                  kind: int) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": pool, "tiers.dram.capacity": 64 * BLOCK, "tiers.retry_s": 0.05})
    hook, state = fault(kind)
    nvme = srv.store.tiers[-1]
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        good = tokens(2 * BLOCK_TOKENS, seed=1)
        await client.put(fp, good, random_kv(SPEC, len(good), seed=1))
        nvme.fault_hook = hook
        bad = tokens(3 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.Unavailable, match=r"write-through.*tiers\.on_nvme_failure = degrade"):
            await client.put(fp, bad, random_kv(SPEC, len(bad), seed=2))
        assert state["hits"] >= 1
        assert (await client.lookup(fp, bad)).matched_tokens == 0  # nothing of it kept: a retry sends it all
        n, got = await client.get_prefix(fp, good)  # the daemon serves on
        assert n == len(good) and got is not None
        stats = await client.stats()
        assert stats.blocks_not_durable == 0
        assert stats.tier("nvme").enospc >= 1 if kind == errno.ENOSPC else stats.tier("nvme").io_errors >= 1
        state["on"] = False  # the disk is back
        await asyncio.sleep(0.1)  # past tiers.retry_s
        result = await client.put(fp, bad, random_kv(SPEC, len(bad), seed=2))
        assert result.not_durable == 0 and result.stored == 3
    assert all("nvme" in m.locations for m in srv.store.blocks())
    assert len(nvme) == 5  # type: ignore[arg-type]


async def test_a_put_refused_while_the_tier_waits_for_its_retry_says_so_not_that_the_disk_is_full(
        server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """After a full disk, puts are refused until tiers.retry_s has passed, without a try: that refusal said "no
    space left on the filesystem" though the disk may have room again by then (an audit, session 47). It says
    the tier is marked unavailable after a failure and is tried again at most every tiers.retry_s."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": "private", "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.retry_s": 60})
    hook, state = fault(errno.ENOSPC)
    srv.store.tiers[-1].fault_hook = hook
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(2 * BLOCK_TOKENS, seed=4)
        with pytest.raises(errors.Unavailable, match="no space left on the filesystem") as first:
            await client.put(fp, toks, random_kv(SPEC, len(toks), seed=4))
        assert "marked unavailable" not in str(first.value)  # the failure itself
        state["on"] = False  # room again, within tiers.retry_s
        with pytest.raises(errors.Unavailable) as waiting:
            await client.put(fp, toks, random_kv(SPEC, len(toks), seed=4))
        why = str(waiting.value)
        assert "marked unavailable after a failure" in why and "tiers.retry_s (60 s)" in why, why
        assert state["hits"] == 1  # not tried


@pytest.mark.parametrize("pool", ["private", "shared"])
async def test_degrade_acknowledges_puts_as_not_durable_counts_and_warns(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                        pool: str, caplog: pytest.LogCaptureFixture
                                                                        ) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.on_nvme_failure": "degrade", "tiers.dram.pool": pool,
                                  "tiers.dram.capacity": 64 * BLOCK, "logging.summary_s": 0.05,
                                  "tiers.write_back_window_s": 0})
    hook, _ = fault(errno.ENOSPC)
    srv.store.tiers[-1].fault_hook = hook
    caplog.set_level(logging.WARNING, logger="engram.activity")
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS + 5, seed=3)
        kv = random_kv(SPEC, len(toks), seed=3)
        result = await client.put(fp, toks, kv)
        assert result.stored == 4 and result.not_durable == 4
        n, got = await client.get_prefix(fp, toks)
        assert n == len(toks) and got is not None
        stats = await client.stats()
        assert stats.blocks_not_durable == 4 and stats.tier("nvme").state == "degraded"
        for _ in range(100):
            if "acknowledged without a durable copy" in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert "4 write-through blocks acknowledged without a durable copy" in caplog.text


# A put's two bytes paths; neither goes in place (zero_copy off), so every put below is a skip-cached Lookup and a Put.
BYTES_PATHS = {"data channel": {"zero_copy": False}, "grpc": {"data_channel": False, "zero_copy": False}}


def _put_counters(srv) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The daemon's count of blocks put and deduplicated: unchanged when a put sent it nothing."""
    return srv.store.counters.blocks_put, srv.store.counters.blocks_deduplicated


async def _all_on_nvme(srv) -> None:  # type: ignore[no-untyped-def]
    """Wait until every block has an NVMe copy (the flusher, or a put that deduplicated it)."""
    for _ in range(200):
        if all("nvme" in m.locations for m in srv.store.blocks()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks without an NVMe copy: {[m.locations for m in srv.store.blocks()]}")


@pytest.mark.parametrize("path", list(BYTES_PATHS))
async def test_a_put_of_cached_blocks_without_a_durable_copy_reports_them_not_durable(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, path: str) -> None:
    """Under degrade, a second client's put of a chain another put left without NVMe copies is not acknowledged
    durable: its skip-cached Lookup finds the blocks cached but marked not_durable, so it sends them, and the
    daemon's dedupe counts them not durable (it returned at once, skipped = 2, not_durable = 0, and a SIGKILL
    lost them: an audit, session 46). Once they are on NVMe, a put of them sends nothing, as before."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.on_nvme_failure": "degrade", "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.retry_s": 0.05})
    hook, state = fault(errno.ENOSPC)
    srv.store.tiers[-1].fault_hook = hook
    toks = tokens(2 * BLOCK_TOKENS, seed=31)
    kv = random_kv(SPEC, len(toks), seed=31)
    async with EngramClient(srv.address, namespace=NS, **BYTES_PATHS[path]) as a:
        fp = await a.register_model(SPEC)
        first = await a.put(fp, toks, kv)
        assert (first.stored, first.not_durable) == (2, 2)
    async with EngramClient(srv.address, namespace=NS, **BYTES_PATHS[path]) as b:
        fp = await b.register_model(SPEC)
        assert (await b._data_channel() is not None) == (path == "data channel")
        assert [r.not_durable for r in (await b.lookup(fp, toks)).blocks] == [True, True]
        again = await b.put(fp, toks, kv)
        assert (again.skipped, again.deduplicated, again.not_durable) == (0, 2, 2)
        assert (await b.stats()).blocks_not_durable == 4
        state["on"] = False  # the disk is back: the flusher copies them
        await _all_on_nvme(srv)
        assert [r.not_durable for r in (await b.lookup(fp, toks)).blocks] == [False, False]
        counted = _put_counters(srv)
        durable = await b.put(fp, toks, kv)
        assert (durable.skipped, durable.stored, durable.deduplicated, durable.not_durable) == (2, 0, 0, 0)
        assert _put_counters(srv) == counted  # nothing was sent


@pytest.mark.parametrize("path", list(BYTES_PATHS))
async def test_a_put_of_a_cached_block_whose_nvme_copy_was_dropped_is_refused_until_the_disk_is_back(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, path: str) -> None:
    """Under fail (the default), a cached block whose NVMe copy `check --fix` dropped as damaged (written again
    from memory, which failed: the disk failed writes) is not acknowledged by a later put of the same tokens: the
    put sends it and the blocks after it, and is refused UNAVAILABLE; once the disk is back a put is acknowledged
    with the block on NVMe again. It was skipped as cached and acknowledged durable (an audit, session 46)."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.capacity": 64 * BLOCK, "tiers.retry_s": 0.05})
    nvme = srv.store.tiers[-1]
    toks = tokens(2 * BLOCK_TOKENS, seed=32)
    kv = random_kv(SPEC, len(toks), seed=32)
    async with EngramClient(srv.address, namespace=NS, **BYTES_PATHS[path]) as client:
        fp = await client.register_model(SPEC)
        assert (await client._data_channel() is not None) == (path == "data channel")
        keys = (await client.put(fp, toks, kv)).keys
        _flip_last_byte(nvme.path_of(keys[0]))  # the first block's NVMe copy is damaged, its DRAM copy is not
        hook, state = fault(errno.EIO)
        nvme.fault_hook = hook  # writing it again fails
        await client.check(fix=True)
        first = srv.store.block(keys[0])
        assert first is not None and first.locations == ["dram"] and state["hits"] >= 1
        assert [r.not_durable for r in (await client.lookup(fp, toks)).blocks] == [True, False]
        counted = _put_counters(srv)
        with pytest.raises(errors.Unavailable, match="write-through"):
            await client.put(fp, toks, kv)
        assert _put_counters(srv) == counted  # not acknowledged: neither counted
        state["on"] = False  # the disk is back
        await asyncio.sleep(0.1)  # past tiers.retry_s
        put = await client.put(fp, toks, kv)
        assert put.not_durable == 0 and put.stored == 0
        await _all_on_nvme(srv)
        assert [r.not_durable for r in (await client.lookup(fp, toks)).blocks] == [False, False]


async def test_with_an_hbm_tier_the_write_through_copy_goes_to_nvme(server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.hbm.capacity": 64 * BLOCK, "tiers.hbm.device": "cpu",
                                  "tiers.dram.capacity": 64 * BLOCK, "tiers.dram.pool": "private"})
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        toks = tokens(3 * BLOCK_TOKENS, seed=4)
        await client.put(fp, toks, random_kv(SPEC, len(toks), seed=4))
    assert [t.name for t in srv.store.tiers] == ["hbm", "dram", "nvme"]
    assert [m.locations for m in srv.store.blocks()] == [["hbm", "nvme"]] * 3


def _nothing_leaked(srv) -> None:  # type: ignore[no-untyped-def]
    """Every slot of the shared pool holds an indexed block (no reservation's slot left behind), no bytes are
    charged as in flight, no reservation is open."""
    store, pool = srv.store, srv.store.tiers[0]
    assert sorted(pool._slots) == sorted(m.key for m in store.blocks() if pool.name in m.locations)
    assert all(v == 0 for v in store._quota_pending.values())
    assert len(srv.service.inplace) == 0


@pytest.mark.parametrize("second", ["in place", "bytes"])
async def test_a_put_of_a_block_whose_durable_copy_is_being_written_waits_for_it(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                  second: str) -> None:
    """An in-place put's block is not published (found by a Lookup, deduplicated against) until its NVMe copy is
    written: another put of it meanwhile waits, and when that copy fails it is not acknowledged either."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": "shared", "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.retry_s": 0.05, "server.metrics_port": -1})
    nvme = srv.store.tiers[-1]
    gate, stuck = threading.Event(), threading.Event()
    state = {"on": True}

    def slow_then_eio(op: str, path: Path) -> None:
        if op == "write" and state["on"]:
            stuck.set()
            gate.wait(30)
            raise OSError(errno.EIO, "Input/output error")

    toks = tokens(BLOCK_TOKENS, seed=11)
    kv = random_kv(SPEC, len(toks), seed=11)
    async with EngramClient(srv.address, namespace=NS, in_place_min_bytes=0) as first_client, \
            EngramClient(srv.address, namespace=NS, in_place_min_bytes=0 if second == "in place" else 1 << 40) as other:
        fp = await first_client.register_model(SPEC)
        await other.register_model(SPEC)
        nvme.fault_hook = slow_then_eio
        try:
            first = asyncio.create_task(first_client.put(fp, toks, kv))
            await asyncio.to_thread(stuck.wait, 30)  # the first put's NVMe copy is being written
            assert (await other.lookup(fp, toks, probe=True)).matched_tokens == 0  # not published yet
            again = asyncio.create_task(other.put(fp, toks, kv))
            await asyncio.sleep(0.3)
            assert not again.done()  # it waits for the first put's copy instead of deduplicating against it
        finally:
            gate.set()
        with pytest.raises(errors.Unavailable):
            await first
        with pytest.raises(errors.Unavailable):  # it stored the block itself, and its own copy failed too
            await again
        # the first put reserved its slot (in place), and so did the second when in place
        assert rpcs_answered(srv, "ReservePut") == (2 if second == "in place" else 1)
        assert (await other.lookup(fp, toks)).matched_tokens == 0
        _nothing_leaked(srv)
        state["on"] = False
        await asyncio.sleep(0.1)  # past tiers.retry_s
        put = await other.put(fp, toks, kv)
        assert (put.stored, put.not_durable) == (1, 0) and (put.reserve_ms > 0) == (second == "in place")
        assert all("nvme" in m.locations for m in srv.store.blocks())
        _nothing_leaked(srv)


async def test_an_in_place_put_of_a_block_a_put_stream_is_storing_is_deduplicated(server_factory,  # type: ignore[no-untyped-def]
                                                                                 tmp_path: Path) -> None:
    """ReservePut finds nothing indexed while a Put stream of the same block writes its NVMe copy: its commit
    waits for that put and deduplicates (it once failed renaming onto the block's slot, leaking its own slot and
    quota for good)."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.dram.pool": "shared", "tiers.dram.capacity": 64 * BLOCK})
    nvme = srv.store.tiers[-1]
    gate, stuck = threading.Event(), threading.Event()

    def slow(op: str, path: Path) -> None:
        if op == "write":
            stuck.set()
            gate.wait(30)

    toks = tokens(BLOCK_TOKENS, seed=21)
    kv = random_kv(SPEC, len(toks), seed=21)
    async with EngramClient(srv.address, namespace=NS, in_place_min_bytes=1 << 40) as streams, \
            EngramClient(srv.address, namespace=NS, in_place_min_bytes=0) as in_place:
        fp = await streams.register_model(SPEC)
        await in_place.register_model(SPEC)
        nvme.fault_hook = slow
        try:
            streamed = asyncio.create_task(streams.put(fp, toks, kv))
            await asyncio.to_thread(stuck.wait, 30)
            asyncio.get_running_loop().call_later(0.3, gate.set)  # the disk finishes later
            put = await in_place.put(fp, toks, kv)
        finally:
            gate.set()
        assert (put.stored, put.deduplicated, put.not_durable) == (0, 1, 0) and put.reserve_ms > 0  # in place
        assert (await streamed).stored == 1
        _nothing_leaked(srv)
        n, got = await in_place.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)


async def test_a_deduplicated_put_makes_the_durable_copy_from_the_blocks_own_bytes(server_factory,  # type: ignore[no-untyped-def]
                                                                                   tmp_path: Path) -> None:
    """A block acknowledged without a durable copy (degrade) is put again with other bytes for the same tokens
    (another worker's numerics): the put is deduplicated, and the NVMe copy it makes is the stored block's own
    bytes, not the new payload under the old checksum (a file that would fail every read after a restart)."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
                                  "tiers.on_nvme_failure": "degrade", "tiers.dram.capacity": 64 * BLOCK,
                                  "tiers.retry_s": 0.05})
    hook, state = fault(errno.EIO)
    nvme = srv.store.tiers[-1]
    nvme.fault_hook = hook
    toks = tokens(BLOCK_TOKENS, seed=5)
    mine, theirs = random_kv(SPEC, len(toks), seed=5), random_kv(SPEC, len(toks), seed=6)
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        first = await client.put(fp, toks, mine)
        assert first.not_durable == 1
        flusher = srv.store.flusher._task  # stopped: the dedupe below is the only writer of the NVMe copy
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
        state["on"] = False
        await asyncio.sleep(0.1)  # past tiers.retry_s
        again = await client.put(fp, toks, theirs, skip_cached=False)
        assert (again.stored, again.deduplicated, again.not_durable) == (0, 1, 0)
        [meta] = srv.store.blocks()
        assert meta.locations == ["dram", "nvme"]
        assert await nvme.read(meta.key) == await srv.store.tiers[0].read(meta.key)  # verified, and its own
        [got] = await client.get(fp, list(first.keys), zero_copy=False)
        assert torch.equal(got, mine)


async def test_blocks_put_concurrently_under_write_through_stay_eviction_candidates(tmp_path: Path) -> None:
    """A put's block is an eviction candidate of its tier from its first copy on; while its NVMe copy is written
    (unindexed yet) another put's victim search drops it as unindexed. Published, it competes again: two chains
    put at once into a 4-block DRAM both land, and later puts still find victims (DRAM once wedged: every put
    refused as if every block were pinned, none was)."""
    from helpers import put_tokens

    store, fp = await _write_through_store(tmp_path)
    store.wait_for_room_s = 0.5
    try:
        chains = [tokens(6 * BLOCK_TOKENS, seed=s) for s in (1, 2)]
        await asyncio.gather(*(put_tokens(store, ns, fp, t, random_kv(SPEC, len(t), seed=i))
                               for i, (ns, t) in enumerate(zip(("a", "b"), chains, strict=True))))
        victims = store.placement.victims["dram"]
        in_dram = [m for m in store.index if "dram" in m.locations]
        assert in_dram and all(id(m) in victims._all.pos for m in in_dram)
        for s in range(3, 9):  # each needs a DRAM victim
            t = tokens(BLOCK_TOKENS, seed=s)
            await put_tokens(store, "a", fp, t, random_kv(SPEC, len(t), seed=s))
    finally:
        await store.close()


async def test_a_dedupe_whose_block_is_evicted_while_it_waits_is_not_acknowledged(tmp_path: Path) -> None:
    """A put deduplicated against a block held only in memory waits for a move of that block before making it
    durable; the block is evicted meanwhile. The put is refused (NotDurable: put again), not acknowledged
    durable with an NVMe file no block lists (it leaked, and a restart revived the evicted block)."""
    from engram.errors import NotDurable

    store, fp = await _write_through_store(tmp_path)
    try:
        header, payload = _one_block(seed=8)

        def put():  # type: ignore[no-untyped-def]
            return store.put("a", fp, store.root("a", fp), header, payload)

        meta = store.block((await put()).key)
        assert meta is not None
        await store.drop_copy(meta, "nvme")  # in DRAM only now (its NVMe copy evicted)
        need = store.begin_copy_now(meta, "nvme")  # a move of it in flight
        assert need is not None
        again = asyncio.create_task(put())  # deduplicated: it waits for the move, then makes it durable
        await asyncio.sleep(0.01)
        store.tiers[1].unreserve(need)
        store.end_copy(meta, "nvme", ok=False)  # the move is abandoned...
        await store.remove(meta)  # ...and the block evicted while the put waits
        with pytest.raises(NotDurable, match="evicted while its durable copy waited"):
            await again
        assert store.block(meta.key) is None and meta.key not in store.tiers[1]
    finally:
        await store.close()


async def test_a_block_being_copied_by_keep_only_in_is_not_removed_under_it(tmp_path: Path) -> None:
    """`keep_only_in` (how verify-isolation puts a block in the tier it probes) holds the block from its read
    on: an Evict meanwhile is refused, instead of the copy landing in DRAM for a block no longer indexed."""
    from engram.errors import FailedPrecondition

    store, fp = await _write_through_store(tmp_path)
    try:
        header, payload = _one_block(seed=9)
        meta = store.block((await store.put("a", fp, store.root("a", fp), header, payload)).key)
        assert meta is not None
        await store.drop_copy(meta, "dram")  # on NVMe only
        copy = asyncio.create_task(store.keep_only_in(meta, "dram"))
        await asyncio.sleep(0)  # it reads the NVMe copy
        with pytest.raises(FailedPrecondition):
            await store.remove(meta)
        await copy
        assert store.block(meta.key) is meta and meta.locations == ["dram"]
    finally:
        await store.close()


async def test_a_put_on_a_parent_without_a_durable_copy_gives_the_parent_one_first(tmp_path: Path) -> None:
    """A block on NVMe whose parent is not is an orphan to the next start's recovery, which drops it. So X3,
    put on X2 when X2 has lost its NVMe copy (`check --fix` found the file corrupt; DRAM keeps a good copy, and
    writing it to NVMe again failed: the disk failed writes then) but not its DRAM copy (a client's Lookup skips
    X2 and sends X3 alone), is acknowledged durable only once X2 is on NVMe again: a crash-like restart finds
    the whole chain."""
    import shutil

    from engram.block import BlockHeader, checksum
    from engram.codec.stored import RAW, encode
    from engram.config import load_config
    from engram.server.app import build_store

    from helpers import put_raw_chain

    store, fp = await _write_through_store(tmp_path)
    try:
        keys = await put_raw_chain(store, "a", SPEC, seed=11, n_blocks=2)
        x2 = store.block(keys[1])
        assert x2 is not None
        file = store.tiers[-1].path_of(x2.key)  # type: ignore[attr-defined]
        data = bytearray(file.read_bytes())
        data[-1] ^= 0x40  # a payload byte: the NVMe copy is corrupt, the DRAM copy is not
        file.write_bytes(bytes(data))
        nvme = store.tiers[-1]
        hook, state = fault(errno.EIO)
        nvme.fault_hook = hook  # type: ignore[attr-defined]  # the copy `check --fix` writes again fails
        await store.check(fix=True)
        assert x2.locations == ["dram"] and state["hits"] >= 1
        assert store.write_back_pending().blocks == 1  # held only in DRAM: Stats shows it
        assert store.flusher is not None
        await store.flusher.close()  # stopped: the put below is the only writer of X2's NVMe copy
        state["on"] = False  # the disk is back
        toks = tokens(3 * BLOCK_TOKENS, seed=11)  # put_raw_chain's chain, one block longer
        block = random_kv(SPEC, len(toks), seed=11)[:, :, 2 * BLOCK_TOKENS :]
        payload = encode(block, RAW)
        header = BlockHeader(toks[2 * BLOCK_TOKENS :], SPEC.layout.dtype, tuple(block.shape), len(payload),
                             checksum(payload))
        x3 = await store.put("a", fp, x2.key, header, payload, index=0)
        assert x3.durable and x2.locations == ["dram", "nvme"]
        crash = tmp_path / "crash"  # the NVMe directory as a SIGKILL now would leave it
        shutil.copytree(tmp_path / "nvme", crash, ignore=shutil.ignore_patterns("engram.lock"))
        recovered = await build_store(load_config(env={}, overrides={
            "tiers.nvme.path": str(crash), "tiers.dram.capacity": 64 * BLOCK}))
        try:
            assert [recovered.block(k) is not None for k in [*keys, x3.key]] == [True] * 3
        finally:
            await recovered.close()
    finally:
        await store.close()


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_a_block_whose_nvme_file_check_fix_drops_is_written_to_nvme_again_from_memory(tmp_path: Path,
                                                                                          policy: str) -> None:
    """`check --fix` finds X2's NVMe file corrupt and drops that copy while DRAM holds a sound one. X2 stayed
    acknowledged and indexed but held only in DRAM, with nothing pending in Stats: a crash lost it and X3 (an
    orphan then). Now it is written to NVMe again: under write-through before the check returns; under
    write-back it is pending (Stats counts it) until the flusher writes it. A crash after that keeps every block."""
    from helpers import put_raw_chain

    store, _ = await _store_over_nvme(tmp_path, policy)
    try:
        keys = await put_raw_chain(store, "a", SPEC, seed=21, n_blocks=3)
        await store.flush(30)  # write-back: on NVMe too, nothing pending (write-through: already)
        want = await _payloads(store, keys)
        x2 = store.block(keys[1])
        assert x2 is not None and x2.locations == ["dram", "nvme"]
        await asyncio.sleep(1.1)  # older than the window: Stats' oldest pending age counts from the drop, not the put
        _flip_last_byte(store.tiers[-1].path_of(x2.key))  # type: ignore[attr-defined]  # a payload byte
        report = await store.check(fix=True)
        assert [fixed for path, _, fixed in report.findings if x2.key.hex() in path] == [True]
        await _written_again(store, x2, policy)
        assert (await store.check(fix=False)).ok
        assert await _after_a_crash(tmp_path) == want
    finally:
        await store.close()


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
async def test_a_block_whose_nvme_file_a_read_finds_corrupt_is_written_to_nvme_again_from_memory(tmp_path: Path,
                                                                                               policy: str) -> None:
    """Two readers of X2, held on NVMe only: the first is slow to open the file; the second reads it sound and
    brings it up into DRAM; then the disk damages the file, and the first finds it corrupt. It drops the NVMe
    copy and serves the DRAM one; X2 must go to NVMe again from DRAM, as after `check --fix`."""
    from helpers import put_raw_chain

    store, _ = await _store_over_nvme(tmp_path, policy)
    try:
        keys = await put_raw_chain(store, "a", SPEC, seed=22, n_blocks=3)
        await store.flush(30)
        want = await _payloads(store, keys)
        x2 = store.block(keys[1])
        assert x2 is not None
        await store.drop_copy(x2, "dram")  # on NVMe only
        nvme = store.tiers[-1]
        path = nvme.path_of(x2.key)  # type: ignore[attr-defined]
        entered, go_on = threading.Event(), threading.Event()

        def slow_first_read(op: str, p: Path) -> None:
            if op == "read" and p == path and not entered.is_set():
                entered.set()
                go_on.wait(10)

        nvme.fault_hook = slow_first_read  # type: ignore[attr-defined]
        first = asyncio.create_task(store.read(x2))
        assert await asyncio.to_thread(entered.wait, 10)
        assert await store.read(x2) == want[x2.key]  # the second reader, promoting it
        assert x2.locations == ["dram", "nvme"]
        _flip_last_byte(path)
        go_on.set()
        assert await first == want[x2.key]  # served from DRAM
        assert store.counters.tiers["nvme"].corrupt_blocks == 1
        await _written_again(store, x2, policy)
        assert await _after_a_crash(tmp_path) == want
    finally:
        await store.close()


async def test_the_flusher_never_writes_a_damaged_dram_copy_to_nvme(tmp_path: Path) -> None:
    """A write-back block whose shared-pool copy a stray writer damaged before it was flushed: the flusher
    verifies the copy, finds it corrupt and drops the block (and what extends it, unreachable), as a read would.
    It wrote the damaged bytes under the block's checksum: an NVMe file that fails every read, `check` reporting
    it, the block still indexed."""
    from helpers import put_raw_chain

    store, _ = await _store_over_nvme(tmp_path, "write-back")
    try:
        keys = await put_raw_chain(store, "a", SPEC, seed=23, n_blocks=3)
        want = await _payloads(store, keys[:1])
        view = store.tiers[0].view(keys[1])  # type: ignore[attr-defined]  # its slot in the shared pool
        view[-1] ^= 0x40
        await store.flush(30)
        assert [store.block(k) is not None for k in keys] == [True, False, False]
        assert store.counters.corrupt_blocks == 1
        assert (await store.check(fix=False)).ok
        assert await _after_a_crash(tmp_path) == want
    finally:
        await store.close()


async def test_a_demotion_never_writes_a_damaged_dram_copy_to_nvme(tmp_path: Path) -> None:
    """A write-back chain fills a 4-block shared pool, held there only (no flush by age); a stray writer damages
    its last block's copy; the next chain's puts demote all four to NVMe. The three sound ones land on NVMe and
    read back as put; the damaged one is dropped, counted, as a read drops it. It was written down under the
    block's checksum: an NVMe file that fails every read, the block still indexed, found only when read."""
    from helpers import put_raw_chain

    store, _ = await _store_over_nvme(tmp_path, "write-back", dram_blocks=4, window_s=0)
    try:
        keys = await put_raw_chain(store, "a", SPEC, seed=24, n_blocks=4)
        want = await _payloads(store, keys[:3])
        store.tiers[0].view(keys[3])[-1] ^= 0x40  # type: ignore[attr-defined]  # its only copy, in the pool
        await put_raw_chain(store, "b", SPEC, seed=25, n_blocks=4)  # room for them: every block of "a" goes down
        nvme = store.tiers[-1]
        assert [store.block(k) is not None for k in keys] == [True, True, True, False]
        assert keys[3] not in nvme and not nvme.path_of(keys[3]).exists()  # type: ignore[attr-defined]
        assert all(store.block(k).locations == ["nvme"] for k in keys[:3])  # type: ignore[union-attr]
        assert await _payloads(store, keys[:3]) == want
        assert (store.counters.corrupt_blocks, store.counters.tiers["dram"].corrupt_blocks) == (1, 1)
        assert store.counters.tiers["dram"].demotions == 3
        assert (await store.check(fix=False)).ok
    finally:
        await store.close()


async def test_a_put_whose_parent_is_dropped_while_it_makes_room_is_refused_not_stored_as_an_orphan(
        tmp_path: Path) -> None:
    """A block's put makes room in a full pool by demoting its own parent (the least recently used block), whose
    pool copy a stray writer damaged: the parent is dropped as damaged, and the child, put under a parent that is
    no longer stored, is refused (Lookup again) instead of published as an orphan that no Lookup reaches and a
    restart drops."""
    from engram.keys import block_key

    from helpers import put_raw_chain

    store, fp = await _store_over_nvme(tmp_path, "write-back", dram_blocks=4, window_s=0)
    try:
        parent = (await put_raw_chain(store, "a", SPEC, seed=30, n_blocks=1))[0]
        await put_raw_chain(store, "a", SPEC, seed=31, n_blocks=3)  # the pool is full; the parent is its oldest
        store.tiers[0].view(parent)[-1] ^= 0x40  # type: ignore[attr-defined]
        header, payload = _one_block(seed=32)
        with pytest.raises(errors.FailedPrecondition, match="left the store while this put"):
            await store.put("a", fp, parent, header, payload)
        assert store.block(parent) is None
        assert store.block(block_key(parent, header.tokens)) is None
        assert store.counters.tiers["dram"].corrupt_blocks == 1
        assert (await store.check(fix=False)).ok
    finally:
        await store.close()


async def test_a_deduplicated_put_never_makes_a_damaged_dram_copy_durable(tmp_path: Path) -> None:
    """Write-through: a block held only in DRAM (its NVMe copy gone) whose pool copy a stray writer damaged is
    put again with other bytes for the same tokens. Making it durable again needs the block's own bytes: its
    one copy fails its checksum, so it is dropped (counted) and the put stores its own bytes, durable. It was
    written to NVMe as it lay, under the block's checksum, and the put acknowledged as a durable dedupe."""
    store, fp = await _store_over_nvme(tmp_path, "write-through")
    try:
        header, payload = _one_block(seed=26)
        meta = store.block((await store.put("a", fp, store.root("a", fp), header, payload)).key)
        assert meta is not None
        await store.drop_copy(meta, "nvme")  # in DRAM only now
        store.tiers[0].view(meta.key)[-1] ^= 0x40  # type: ignore[attr-defined]
        other_header, other = _one_block(seed=26, kv_seed=27)
        assert other_header.checksum != header.checksum
        again = await store.put("a", fp, store.root("a", fp), other_header, other)
        assert (again.stored, again.durable) == (True, True)
        stored = store.block(meta.key)
        assert stored is not None and stored is not meta and stored.locations == ["dram", "nvme"]
        assert await store.tiers[-1].read(meta.key) == other
        assert await store.read(stored) == other
        assert store.counters.tiers["dram"].corrupt_blocks == 1
        assert (await store.check(fix=False)).ok
    finally:
        await store.close()


async def test_keep_only_in_never_copies_a_damaged_dram_copy_to_nvme(tmp_path: Path) -> None:
    """`keep_only_in` (verify-isolation's way of putting a block in the tier it probes) copies a block down to
    NVMe from its memory copy: a sound copy lands there and reads back; a damaged one is dropped as a read drops
    it (DataLoss, counted) and the block with it. It was written down as it lay and the pool's copy dropped:
    the block held on NVMe alone in a file that fails every read."""
    from engram.errors import DataLoss

    from helpers import put_raw_chain

    store, _ = await _store_over_nvme(tmp_path, "write-back")
    try:
        assert store.flusher is not None
        await store.flusher.close()  # no flush: the blocks are held in the pool only
        keys = await put_raw_chain(store, "a", SPEC, seed=28, n_blocks=2)
        want = await _payloads(store, keys[:1])
        sound, damaged = store.block(keys[0]), store.block(keys[1])
        assert sound is not None and damaged is not None
        store.tiers[0].view(damaged.key)[-1] ^= 0x40  # type: ignore[attr-defined]
        with pytest.raises(DataLoss):
            await store.keep_only_in(damaged, "nvme")
        nvme = store.tiers[-1]
        assert store.block(damaged.key) is None and damaged.key not in nvme
        assert not nvme.path_of(damaged.key).exists()  # type: ignore[attr-defined]
        assert store.counters.tiers["dram"].corrupt_blocks == 1
        await store.keep_only_in(sound, "nvme")
        assert sound.locations == ["nvme"] and await _payloads(store, keys[:1]) == want
        assert (await store.check(fix=False)).ok
    finally:
        await store.close()


async def test_a_put_on_a_parent_held_damaged_in_memory_alone_drops_the_parent_instead_of_keeping_it(
        tmp_path: Path) -> None:
    """Write-through: X2 is held in the pool alone (its NVMe copy lost) and a stray writer damages it there; X3 is
    put on it. Making X3 durable first gives X2 its NVMe copy, from a copy that verifies: none does, so X2 is
    dropped (counted corrupt) and the put refused FAILED_PRECONDITION, its parent gone (Lookup again and put from
    the first missing block), which stores the chain again, durable. X2 stayed indexed, uncounted, with its one
    copy failing every read, and the put answered UNAVAILABLE as if the disk had failed."""
    from engram.block import BlockHeader, checksum
    from engram.codec.stored import RAW, encode
    from engram.errors import FailedPrecondition

    from helpers import put_raw_chain

    store, fp = await _store_over_nvme(tmp_path, "write-through")
    try:
        assert store.flusher is not None
        await store.flusher.close()  # stopped: only the put below writes X2's NVMe copy
        keys = await put_raw_chain(store, "a", SPEC, seed=29, n_blocks=2)
        x2 = store.block(keys[1])
        assert x2 is not None
        await store.drop_copy(x2, "nvme")
        store.tiers[0].view(x2.key)[-1] ^= 0x40  # type: ignore[attr-defined]
        toks = tokens(3 * BLOCK_TOKENS, seed=29)  # put_raw_chain's chain, one block longer
        block = random_kv(SPEC, len(toks), seed=29)[:, :, 2 * BLOCK_TOKENS :]
        payload = encode(block, RAW)
        header = BlockHeader(toks[2 * BLOCK_TOKENS :], SPEC.layout.dtype, tuple(block.shape), len(payload),
                             checksum(payload))
        with pytest.raises(FailedPrecondition, match="put the chain from its first missing block"):
            await store.put("a", fp, x2.key, header, payload, index=2)
        assert store.block(x2.key) is None and store.block(keys[0]) is not None
        assert (store.counters.corrupt_blocks, store.counters.tiers["dram"].corrupt_blocks) == (1, 1)
        assert (await store.check(fix=False)).ok
        assert await put_raw_chain(store, "a", SPEC, seed=29, n_blocks=2) == keys
        x3 = await store.put("a", fp, keys[1], header, payload, index=2)
        assert x3.stored and x3.durable
        assert all(store.block(k).locations == ["dram", "nvme"] for k in [*keys, x3.key])  # type: ignore[union-attr]
    finally:
        await store.close()


async def _store_over_nvme(tmp_path: Path, policy: str, *, dram_blocks: int = 64,  # type: ignore[no-untyped-def]
                           window_s: float = 1.0):
    """A store on its own: a shared DRAM pool of `dram_blocks` blocks over NVMe, the write policy given (write-back:
    a one-second window unless told; 0, no flush by age), least recently used order; and the model's fingerprint."""
    from engram.config import load_config
    from engram.server.app import build_store

    store = await build_store(load_config(env={}, overrides={
        "tiers.dram.capacity": dram_blocks * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme"),
        "tiers.write_policy": policy, "tiers.write_back_window_s": window_s, "tiers.eviction": "lru"}))
    return store, store.registry.register(SPEC)


async def _payloads(store, keys: list[bytes]) -> dict[bytes, bytes]:  # type: ignore[no-untyped-def]
    return {k: await store.read(store.block(k), promote=False) for k in keys}


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


async def _written_again(store, meta, policy: str) -> None:  # type: ignore[no-untyped-def]
    """`meta` lost its NVMe copy as damaged: under write-through it has one again already; under write-back it is
    pending (Stats counts it) until the flusher writes it, within the window."""
    if policy == "write-through":
        assert meta.locations == ["dram", "nvme"] and store.write_back_pending().blocks == 0
        return
    assert meta.locations == ["dram"]
    pending = store.write_back_pending()
    assert (pending.blocks, pending.bytes) == (1, meta.nbytes) and pending.oldest_s < 1.0
    for _ in range(200):
        if not store.write_back_pending().blocks:
            break
        await asyncio.sleep(0.05)
    assert meta.locations == ["dram", "nvme"] and store.write_back_pending().blocks == 0


async def _after_a_crash(tmp_path: Path) -> dict[bytes, bytes]:
    """What a SIGKILL now would leave: the NVMe directory copied as it is, opened by a new store; every block it
    recovers, with its verified bytes."""
    import shutil

    from engram.config import load_config
    from engram.server.app import build_store

    crash = tmp_path / "crash"
    shutil.copytree(tmp_path / "nvme", crash, ignore=shutil.ignore_patterns("engram.lock"))
    recovered = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(crash), "tiers.dram.pool": "private", "tiers.dram.capacity": 64 * BLOCK}))
    try:
        return await _payloads(recovered, [m.key for m in recovered.blocks()])
    finally:
        await recovered.close()


async def _write_through_store(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A store on its own (no daemon): a 4-block private DRAM over NVMe, write-through; and the model's fingerprint."""
    from engram.config import load_config
    from engram.server.app import build_store

    store = await build_store(load_config(env={}, overrides={
        "tiers.dram.pool": "private", "tiers.dram.capacity": 4 * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme"),
        "tiers.write_policy": "write-through"}))
    return store, store.registry.register(SPEC)


def _one_block(seed: int, kv_seed: int | None = None):  # type: ignore[no-untyped-def]
    """A first block's header and raw payload, as a Put sends them (`kv_seed`: other KV for the same tokens)."""
    from engram.block import BlockHeader, checksum

    toks = tokens(BLOCK_TOKENS, seed=seed)
    payload = random_kv(SPEC, BLOCK_TOKENS, seed=seed if kv_seed is None else kv_seed).view(torch.uint8).numpy().tobytes()
    return BlockHeader(toks, SPEC.layout.dtype, SPEC.layout.block_shape(BLOCK_TOKENS), len(payload),
                       checksum(payload)), payload

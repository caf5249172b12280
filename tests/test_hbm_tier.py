"""The HBM tier's logic in the real store chain hbm -> dram -> nvme, run on a CPU "device" here (the same
PoolTier code runs over a CUDA tensor on a GPU; test_gpu_data_path.py checks that one on the H200): puts
land in HBM, pressure demotes to DRAM and then NVMe, a hit below HBM is promoted back, every byte intact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engram.client import EngramClient
from engram.tiers.hbm import hbm_tier

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)


def tier_stats(stats, name):  # type: ignore[no-untyped-def]
    return next(t for t in stats.tiers if t.name == name)


async def test_blocks_move_down_the_chain_and_are_promoted_on_a_hit(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    srv = await server_factory(**{"tiers.hbm.capacity": 4 * BLOCK, "tiers.hbm.device": "cpu",
                                  "tiers.dram.capacity": 4 * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme")})
    assert [t.name for t in srv.store.tiers] == ["hbm", "dram", "nvme"]
    # Puts as bytes, which land in the top tier (an in-place put lands in the shared DRAM pool it can write).
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        seqs = [tokens(4 * BLOCK_TOKENS, seed=s) for s in range(4)]  # 16 blocks into 4 + 4 + nvme
        kvs = [random_kv(SPEC, len(t), seed=s) for s, t in enumerate(seqs)]
        keys = [list((await c.put(fp, t, kv)).keys) for t, kv in zip(seqs, kvs, strict=True)]
        st = await c.stats()
        hbm, dram, nvme = (tier_stats(st, n) for n in ("hbm", "dram", "nvme"))
        assert hbm.blocks == 4 and hbm.demotions >= 12 and dram.demotions >= 8 and nvme.blocks >= 8
        assert all(srv.store.index.get(k).tier == "hbm" for k in keys[-1])  # the newest in HBM
        assert all(srv.store.index.get(k).tier == "nvme" for k in keys[0])  # the oldest on NVMe
        # A hit on the oldest sequence is served from NVMe and promoted to HBM; the bytes are the same
        # on every path (zero-copy from the DRAM pool where a block is there, bytes otherwise).
        for t, kv in zip(seqs, kvs, strict=True):
            n, got = await c.get_prefix(fp, t)  # same host: zero-copy where the block is in DRAM
            assert n == len(t) and got is not None and torch.equal(got, kv)
            hit = [b.key for b in (await c.lookup(fp, t)).blocks]
            assert torch.equal(torch.cat(await c.get(fp, hit, zero_copy=False), dim=2), kv)
        st = await c.stats()
        assert tier_stats(st, "hbm").promotions > 0 and tier_stats(st, "nvme").hits > 0
        assert tier_stats(st, "hbm").used_bytes <= 4 * BLOCK


async def test_the_pool_is_one_allocation_and_is_released_on_close() -> None:
    tier = hbm_tier(64 * 1024, "cpu", 4096)
    base = tier.buffer.data_ptr()
    assert tier.buffer.numel() == 64 * 1024 and tier.capacity_bytes == 64 * 1024
    from engram.block import BlockRecord
    from engram.layout import DType

    for i in range(8):
        payload = bytes([i]) * 5000
        rec = BlockRecord(bytes([i]) * 8, b"p", b"fp", "ns", DType.BF16, True, (5000,), b"", 5000, 0)
        need = tier.space_for(rec)
        assert tier.reserve(need)
        await tier.write(rec, payload, need)
        slot = tier.slot(rec.key)
        assert base <= tier.region(slot).data_ptr() < base + 64 * 1024  # carved from the one buffer
        assert await tier.read(rec.key) == payload
    assert not tier.reserve(8192 * 2)  # full (8 x 2 pages of 16): refused, the store evicts
    await tier.close()
    assert tier.buffer.numel() == 0 and len(tier) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_an_hbm_tier_without_cuda_is_refused_with_what_to_change() -> None:
    from engram.config import load_config
    from engram.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\.hbm\.device = cpu"):
        load_config(env={}, overrides={"tiers.hbm.capacity": "1MiB"})


async def test_a_get_that_holds_dram_full_skips_promotions_instead_of_waiting_or_deleting(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Get whose blocks fill DRAM and reach NVMe: each NVMe hit's promotion to HBM needs an HBM victim demoted
    into DRAM, where only this Get's own leases hold every block. The promotion is skipped: it once waited
    wait_for_room_s (10 s) per block on those leases, then deleted the HBM blocks it could not demote."""
    srv = await server_factory(**{"tiers.hbm.capacity": 2 * BLOCK, "tiers.hbm.device": "cpu",
                                  "tiers.dram.capacity": 4 * BLOCK, "tiers.nvme.path": str(tmp_path / "nvme"),
                                  "tiers.write_back_window_s": 3600})
    async with EngramClient(srv.address, namespace="t", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        toks = tokens(10 * BLOCK_TOKENS, seed=7)
        kv = random_kv(SPEC, len(toks), seed=7)
        keys = list((await c.put(fp, toks, kv)).keys)
        assert [srv.store.index.get(k).tier for k in keys] == ["nvme"] * 4 + ["dram"] * 4 + ["hbm"] * 2
        # within the daemon's 10 s room wait: a bound on the Get, which now waits on nothing
        got = await asyncio.wait_for(c.get(fp, keys[:8], zero_copy=False), 5)
        assert torch.equal(torch.cat(got, dim=2), kv[:, :, :8 * BLOCK_TOKENS])
        assert all(srv.store.index.get(k) is not None for k in keys)  # nothing deleted for a promotion


async def test_a_read_that_fails_while_another_promotes_the_block_keeps_it_indexed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reader B's NVMe read is slow and fails (EIO) while reader A reads the same block and promotes it to HBM. B
    falls back to the new HBM copy instead of dropping the block (it walked the copies it saw first, then
    unindexed a block with a valid HBM copy: that slot was then held by nothing, never evicted)."""
    import errno
    import time

    from helpers import put_tokens

    store, fp = await _small_tiers(tmp_path)
    try:
        toks = tokens(5 * BLOCK_TOKENS, seed=3)
        kv = random_kv(SPEC, len(toks), seed=3)
        metas = await put_tokens(store, "t", fp, toks, kv)
        await store.remove(metas[-1])  # room in HBM: A's promotion evicts nothing
        [m] = [x for x in metas[:-1] if x.locations == ["nvme"]][:1]
        want = await store.tiers[-1].read(m.key)
        calls: list[Path] = []

        def slow_eio_once(op: str, path: Path) -> None:
            if op == "read":
                calls.append(path)
                if len(calls) == 1:  # B's read
                    time.sleep(0.1)
                    raise OSError(errno.EIO, "Input/output error")

        store.tiers[-1].fault_hook = slow_eio_once  # type: ignore[attr-defined]

        async def read(delay: float) -> bytes:
            await asyncio.sleep(delay)
            with store.reading([m]):
                return bytes(await store.read(m))

        b, a = await asyncio.gather(read(0), read(0.02))
        assert a == b == want  # B got the HBM copy A made
        assert store.index.get(m.key) is m and m.locations == ["hbm"]
    finally:
        await store.close()


async def test_a_promotion_that_lands_on_a_block_dropped_meanwhile_leaves_no_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reader A's promotion waits while room is made (a slow demotion to NVMe); reader B's read of the block's only
    copy fails (EIO) meanwhile, and the block is dropped. A's copy must not outlive it: HBM holds a block's bytes
    exactly when the block is indexed there (the copy once stayed, listed by nothing, never evicted)."""
    import errno
    import time

    from helpers import put_tokens

    store, fp = await _small_tiers(tmp_path)
    try:
        toks = tokens(6 * BLOCK_TOKENS, seed=4)
        metas = await put_tokens(store, "t", fp, toks, random_kv(SPEC, len(toks), seed=4))
        m = metas[0]
        assert m.locations == ["nvme"]
        reads: list[Path] = []

        def disk(op: str, path: Path) -> None:
            if op == "write":
                time.sleep(0.1)  # the promotion's room: a demotion down to NVMe takes a while
            elif op == "read":
                reads.append(path)
                if len(reads) == 2:  # B's read fails while A's promotion makes room
                    time.sleep(0.03)
                    raise OSError(errno.EIO, "Input/output error")

        store.tiers[-1].fault_hook = disk  # type: ignore[attr-defined]

        async def read(delay: float) -> str:
            await asyncio.sleep(delay)
            with store.reading([m]):
                try:
                    await store.read(m)
                    return "ok"
                except Exception as exc:  # B's DataLoss
                    return type(exc).__name__

        await asyncio.gather(read(0), read(0.01))
        store.tiers[-1].fault_hook = None  # type: ignore[attr-defined]
        hbm = store.tiers[0]
        assert (m.key in hbm) == (store.index.get(m.key) is m and "hbm" in m.locations)  # type: ignore[operator]
        assert hbm.used_bytes == sum(hbm.space_for(x.record()) for x in store.index if "hbm" in x.locations)
    finally:
        await store.close()


async def _small_tiers(tmp_path):  # type: ignore[no-untyped-def]
    """A store on its own: 2 blocks of HBM (on the CPU), 2 of private DRAM, NVMe below; and the model's fingerprint."""
    from engram.config import load_config
    from engram.server.app import build_store

    store = await build_store(load_config(env={}, overrides={
        "tiers.hbm.capacity": 2 * BLOCK, "tiers.hbm.device": "cpu", "tiers.dram.capacity": 2 * BLOCK,
        "tiers.dram.pool": "private", "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_back_window_s": 3600}))
    return store, store.registry.register(SPEC)

"""A put deduplicated against a stored block drops its caller's bytes on the strength of the stored copy, so that
copy is verified first (BlockStore.verify_stored): one that fails is dropped, counted, and the put stores the
caller's bytes, reported stored, not deduplicated, and served by later hits; an intact copy still dedupes. Real
daemons (loopback TCP and a unix socket), Put streams over the data channel and over gRPC, blocks damaged as a stray
writer (a byte flipped in the shared pool) or a failing disk (an NVMe file corrupt or gone) would. The in-place
path's cases are in tests/test_put_in_place.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engram.client import EngramClient

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()
CHANNELS = ["data", "grpc"]


def _blocks(kv: torch.Tensor) -> list[torch.Tensor]:
    return [kv[:, :, i : i + BLOCK_TOKENS] for i in range(0, kv.shape[2], BLOCK_TOKENS)]


@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_put_of_a_block_whose_pool_copy_is_damaged_stores_the_callers_bytes(server_factory,  # type: ignore[no-untyped-def]
                                                                                    channel: str) -> None:
    """A chain of two blocks held in the shared pool alone (no NVMe tier); a stray writer flips a byte of the
    second one. The same tokens put again with another worker's KV (skip_cached=False: every block sent): the
    first block, intact, is deduplicated; the second's copy fails its check, is dropped (counted corrupt) and the
    caller's bytes are stored, which a Get then serves. It was deduplicated too: acknowledged, stored nowhere, and
    its every hit failed."""
    srv = await server_factory()
    toks = tokens(2 * BLOCK_TOKENS, seed=41)
    first, again = random_kv(SPEC, len(toks), seed=41), random_kv(SPEC, len(toks), seed=42)
    async with EngramClient(srv.address, namespace="d", zero_copy=False, data_channel=channel == "data") as c:
        fp = await c.register_model(SPEC)
        put = await c.put(fp, toks, first)
        assert put.stored == 2
        srv.store.tiers[0].view(put.keys[1])[-1] ^= 0x40
        before = await c.stats()
        result = await c.put(fp, toks, again, skip_cached=False)
        assert (result.stored, result.deduplicated) == (1, 1)
        after = await c.stats()
        assert (after.blocks_put - before.blocks_put, after.blocks_deduplicated - before.blocks_deduplicated) == (1, 1)
        assert after.corrupt_blocks == 1
        got = await c.get(fp, list(put.keys))
        assert torch.equal(got[0], _blocks(first)[0]) and torch.equal(got[1], _blocks(again)[1])
    assert (await srv.store.check(fix=False)).ok


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_put_of_a_block_whose_nvme_file_is_damaged_stores_the_callers_bytes(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                    channel: str, damage: str) -> None:
    """A chain of two blocks held on NVMe alone (moved down, the flusher stopped); the second one's file is then
    corrupt (a byte flipped) or gone. The same tokens put again with another worker's KV: the first block's file
    is read back and verifies, so it is deduplicated; the second's fails, is dropped (counted) and the caller's
    bytes are stored, which a Get then serves. It was deduplicated against the damaged file."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme")})
    await srv.store.flusher.close()
    toks = tokens(2 * BLOCK_TOKENS, seed=43)
    first, again = random_kv(SPEC, len(toks), seed=43), random_kv(SPEC, len(toks), seed=44)
    async with EngramClient(srv.address, namespace="d", zero_copy=False, data_channel=channel == "data") as c:
        fp = await c.register_model(SPEC)
        put = await c.put(fp, toks, first)
        for key in put.keys:
            await srv.store.keep_only_in(srv.store.block(key), "nvme")
        path = srv.store.tiers[-1].path_of(put.keys[1])
        if damage == "corrupt":
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x40
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        result = await c.put(fp, toks, again, skip_cached=False)
        assert (result.stored, result.deduplicated) == (1, 1)
        assert (await c.stats()).tier("nvme").corrupt_blocks == 1  # a file gone counts so too (DataLoss)
        got = await c.get(fp, list(put.keys))
        assert torch.equal(got[0], _blocks(first)[0]) and torch.equal(got[1], _blocks(again)[1])
    assert (await srv.store.check(fix=False)).ok


async def test_a_put_of_a_block_stored_intact_is_deduplicated_and_its_bytes_dropped(server_factory,  # type: ignore[no-untyped-def]
                                                                                   tmp_path: Path) -> None:
    """The common case stays as it was: the same tokens put again with other bytes, their stored copies intact
    (one in the pool, one on NVMe alone), are deduplicated, counted so, nothing dropped as corrupt, and a Get
    serves the stored bytes, not the caller's."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme")})
    await srv.store.flusher.close()
    toks = tokens(2 * BLOCK_TOKENS, seed=45)
    first, again = random_kv(SPEC, len(toks), seed=45), random_kv(SPEC, len(toks), seed=46)
    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c:
        fp = await c.register_model(SPEC)
        put = await c.put(fp, toks, first)
        await srv.store.keep_only_in(srv.store.block(put.keys[1]), "nvme")
        before = (await c.stats()).blocks_deduplicated
        result = await c.put(fp, toks, again, skip_cached=False)
        assert (result.stored, result.deduplicated) == (0, 2)
        stats = await c.stats()
        assert stats.blocks_deduplicated == before + 2 and stats.corrupt_blocks == 0
        got = await c.get(fp, list(put.keys))
        assert all(torch.equal(g, w) for g, w in zip(got, _blocks(first), strict=True))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_write_through_dedupe_checks_the_durable_copy_beside_a_sound_memory_copy(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path, channel: str, damage: str) -> None:
    """Write-through: a chain of two blocks in the shared pool and on NVMe; the second one's file is then corrupt
    or gone (a failing disk), its pool copy sound. The same tokens put again, every block sent: the dedupe
    acknowledges them durable, so the second's NVMe copy is read back, fails, is dropped (counted) and written
    again; the file then holds the block's bytes. It was acknowledged durable on the index's word, the memory copy
    alone verified, and a crash lost the block (a review, session 46)."""
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    store, nvme = srv.store, srv.store.tiers[-1]
    toks = tokens(2 * BLOCK_TOKENS, seed=45)
    kv = random_kv(SPEC, len(toks), seed=45)
    async with EngramClient(srv.address, namespace="d", zero_copy=False, data_channel=channel == "data") as c:
        fp = await c.register_model(SPEC)
        put = await c.put(fp, toks, kv)
        assert put.stored == 2 and put.not_durable == 0
        key = put.keys[1]
        assert store.block(key).locations == [store.tiers[0].name, nvme.name]
        path = nvme.path_of(key)
        if damage == "missing":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x40
            path.write_bytes(bytes(data))
        again = await c.put(fp, toks, kv, skip_cached=False)
        assert (again.stored, again.deduplicated, again.not_durable) == (0, 2, 0)
        assert (await c.stats()).corrupt_blocks + (await c.stats()).tiers[-1].io_errors >= 1
    assert nvme.name in store.block(key).locations
    assert await nvme.read(key) == _blocks(kv)[1].contiguous().view(torch.uint8).numpy().tobytes()
    assert (await store.check(fix=False)).ok

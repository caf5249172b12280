"""`check --fix` while puts, gets, demotions and evictions run: it may only drop what is really broken.

The bug this pins: the check listed the NVMe files first and compared the index with that listing after, so
every block written during the scan was "indexed but its file is missing" and dropped from the index, its
valid file left untracked on disk (140 of 400 in one run); temp files of writes in flight were deleted as
torn. Expected now: every acknowledged block that nothing evicted is still indexed and readable, every file on
disk is tracked, and a file corrupted on purpose during the load is still found and dropped.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np

from engram.block import checksum
from engram.config import load_config
from engram.errors import FailedPrecondition
from engram.server.app import build_store
from engram.store import BlockStore

from helpers import BLOCK_TOKENS, put_raw_chain, tiny_model, tokens

SPEC = tiny_model()
NS = "load"


async def put_chain(store: BlockStore, seed: int, n_blocks: int) -> list[bytes]:
    return await put_raw_chain(store, NS, SPEC, seed, n_blocks)


async def test_check_fix_under_puts_gets_demotions_and_evictions_drops_only_what_is_broken(tmp_path: Path) -> None:
    block = SPEC.layout.block_nbytes(BLOCK_TOKENS)
    store = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(tmp_path), "tiers.dram.capacity": 24 * block, "tiers.dram.pool": "private",
        "tiers.nvme.capacity": 4000 * (block + 512)}))  # write-back: DRAM pressure demotes to NVMe
    store.registry.register(SPEC)
    nvme = store.tiers[-1]
    for seed in range(100):  # 400 blocks, most of them on NVMe: the check takes a while
        await put_chain(store, seed, 4)
    victim = store.lookup(NS, SPEC.fingerprint, tokens(4 * BLOCK_TOKENS, seed=7)).blocks[3]
    assert victim.locations == ["nvme"]

    acked: dict[bytes, int] = {}  # key -> seed of the blocks put while the checks ran
    evicted: set[bytes] = set()
    stop = asyncio.Event()

    async def writer(w: int) -> None:
        seed = 1000 + w * 10_000
        while not stop.is_set():
            for key in await put_chain(store, seed, 3):
                acked[key] = seed
            seed += 1

    async def reader(w: int) -> None:
        rng = random.Random(w)
        while not stop.is_set():
            match = store.lookup(NS, SPEC.fingerprint, tokens(4 * BLOCK_TOKENS, seed=rng.randrange(100)))
            with store.reading(match.blocks):
                for meta in match.blocks:
                    if meta.key != victim.key:
                        assert checksum(await store.read(meta)) == meta.checksum
            await asyncio.sleep(0)

    async def evictor() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            chain = store.lookup(NS, SPEC.fingerprint, tokens(4 * BLOCK_TOKENS, seed=rng.randrange(50, 100))).blocks
            if chain and chain[-1].key != victim.key:
                try:
                    await store.remove(chain[-1])  # the chain's leaf, as `engram evict` removes it
                    evicted.add(chain[-1].key)
                except FailedPrecondition:
                    pass  # being read or moved right now
            await asyncio.sleep(0.01)

    # Corrupt one NVMe file on purpose: the check must still find it (and only it).
    path = nvme.path_of(victim.key)  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))

    tasks = [asyncio.create_task(f) for f in (writer(0), writer(1), reader(0), reader(1), evictor())]
    reports = []
    while len(reports) < 3 or (len(acked) < 60 and len(reports) < 100):  # checks until enough puts overlapped
        reports.append(await store.check(fix=True))
    stop.set()
    await asyncio.gather(*tasks)

    assert len(acked) > 30, "the writers should have put blocks while the checks ran"
    found = [problem for r in reports for _, problem, _ in r.findings]
    assert len(found) == 1 and "checksum" in found[0], found  # the corrupted file, and nothing else
    assert victim.key not in store.index
    for key in acked:
        if key in evicted:
            continue
        meta = store.block(key)
        assert meta is not None, "a block put during the check was dropped from the index"
        with store.reading([meta]):
            assert checksum(await store.read(meta, promote=False)) == meta.checksum
    on_disk = {bytes.fromhex(p.stem) for p in (tmp_path / "blocks").rglob("*.blk")}
    tracked = set(nvme.keys())  # type: ignore[attr-defined]
    assert on_disk == tracked, "valid files left untracked on disk (or tracked files missing)"
    assert on_disk == {m.key for m in store.blocks() if "nvme" in m.locations}
    assert list((tmp_path / "tmp").iterdir()) == []
    assert (await store.check(fix=False)).ok
    await store.close()
    _ = np  # numpy is the tokens' type

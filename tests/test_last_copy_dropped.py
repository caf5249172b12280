"""A block whose last copy a read finds damaged leaves the index before the tier deletes that copy: a Lookup or a
GetPrefix meanwhile (an NVMe unlink is awaited in the tier's I/O threads) found it indexed with no copy and failed
INTERNAL (IndexError in BlockMeta.tier). A real daemon, both copies damaged (a byte flipped in the shared pool and in
the NVMe file), the unlink held in the tier's own fault hook."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engram import errors
from engram.client import EngramClient

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

SPEC = tiny_model()


async def test_a_lookup_while_a_blocks_last_damaged_copy_is_deleted_does_not_find_it(  # type: ignore[no-untyped-def]
        server_factory, tmp_path: Path) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through"})
    pool, nvme = srv.store.tiers[0], srv.store.tiers[-1]
    toks = tokens(2 * BLOCK_TOKENS, seed=5)
    entered, go = threading.Event(), threading.Event()

    def hold_first_delete(op: str, path: Path) -> None:
        if op == "delete" and not entered.is_set():  # (in the tier's I/O thread)
            entered.set()
            go.wait(30)

    async with EngramClient(srv.address, namespace="d", zero_copy=False) as c, \
            EngramClient(srv.address, namespace="d", zero_copy=False) as other:
        fp = await c.register_model(SPEC)
        await other.register_model(SPEC)
        keys = (await c.put(fp, toks, random_kv(SPEC, len(toks), seed=5))).keys
        assert srv.store.block(keys[1]).locations == ["dram", "nvme"]  # type: ignore[union-attr]
        pool.view(keys[1])[-1] ^= 0x40
        path = nvme.path_of(keys[1])
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
        nvme.fault_hook = hold_first_delete
        get = asyncio.create_task(c.get(fp, [keys[1]]))  # both copies fail: the block goes, its file unlinked
        try:
            assert await asyncio.to_thread(entered.wait, 30), "the damaged file was never unlinked"
            looked = await other.lookup(fp, toks)  # while the unlink is held
            assert looked.matched_tokens == BLOCK_TOKENS  # the first block only
            n, got = await other.get_prefix(fp, toks)
            assert n == BLOCK_TOKENS
        finally:
            go.set()
        with pytest.raises(errors.DataLoss):
            await get
    assert srv.store.block(keys[1]) is None and srv.store.block(keys[0]) is not None

"""A put that waits for room (every block in a full tier leased or moving) and is cancelled as the wait ends:
the cancel is raised, not dropped. Placement.make_room waited under asyncio.wait_for, which on Python 3.11
returns the wait's result and drops a cancel landing in the same turn (CPython gh-86296): the put went on
waiting for room, for nobody, to its deadline (then failed ResourceExhausted, or stored its block)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers import BLOCK_TOKENS, put_tokens, tiny_model, tokens


async def test_a_put_cancelled_as_its_wait_for_room_ends_is_cancelled_not_left_waiting(tmp_path: Path) -> None:
    from engram.config import load_config
    from engram.server.app import build_store

    spec = tiny_model()
    block = spec.layout.block_nbytes(BLOCK_TOKENS)
    store = await build_store(load_config(env={}, overrides={  # DRAM alone: a full tier evicts only its leaves
        "tiers.dram.pool": "private", "tiers.dram.capacity": 4 * block}))
    try:
        fp = store.registry.register(spec)
        held = await put_tokens(store, "a", fp, tokens(4 * BLOCK_TOKENS, seed=1))  # the tier is full
        store.wait_for_room_s = 30.0  # the dropped cancel's put waited all of it
        store.acquire(held)  # every block read: no victim until a lease ends
        placement = store.placement
        wanting = asyncio.create_task(placement.make_room(0, block))
        while not placement.freed._waiters:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        # The wait ends (a notify, as a released lease's) and the put's caller goes, in one turn of the loop
        async with placement.freed:
            placement.freed.notify_all()
        wanting.cancel()
        done, _ = await asyncio.wait({wanting}, timeout=5.0)  # (a bound on a failure, not a timing assert)
        assert done, "the cancelled put still waits for room"
        with pytest.raises(asyncio.CancelledError):
            wanting.result()
        store.release(held)
    finally:
        await store.close()

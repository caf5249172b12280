"""Puts of a block that another put is still storing: they wait for it and dedupe against what it stored, and
they go on storing it themselves if that put failed (BlockStore._store's puts in flight)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engram.block import BlockRecord, Payload
from engram.errors import Unavailable
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import DramTier

from helpers import put_tokens, tiny_model, tokens


class GatedTier:
    """A real DRAM tier whose writes wait for a gate (and fail once if told to): a put stays in flight as long as
    the test wants. Composition, not a subclass: a compiled DramTier takes no interpreted subclasses."""

    def __init__(self, inner: DramTier) -> None:
        self.inner, self.name = inner, inner.name
        self.gate = asyncio.Event()
        self.writes = 0
        self.fail_next = False

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    async def write(self, rec: BlockRecord, payload: Payload, reserved: int) -> None:
        self.writes += 1
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            self.inner.unreserve(reserved)
            raise Unavailable("the test's tier failed this write")
        await self.inner.write(rec, payload, reserved)


def gated_store() -> tuple[BlockStore, bytes, GatedTier]:
    spec = tiny_model()
    tier = GatedTier(DramTier(8 * spec.layout.block_nbytes(spec.layout.block_tokens)))
    store = BlockStore([tier], ModelRegistry(default_codec="raw"))  # type: ignore[list-item]
    return store, store.registry.register(spec), tier


async def test_puts_of_a_block_in_flight_wait_for_it_and_find_it_stored() -> None:
    store, fp, tier = gated_store()
    t = tokens(tiny_model().layout.block_tokens, seed=5)
    puts = [asyncio.create_task(put_tokens(store, "ns", fp, t)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert tier.writes == 1 and not any(p.done() for p in puts) and len(store) == 0  # two wait on the first
    tier.gate.set()
    chains = await asyncio.gather(*puts)
    assert len(store) == 1 and tier.writes == 1
    assert store.counters.blocks_put == 1 and store.counters.blocks_deduplicated == 2
    assert chains[0][0] is chains[1][0] is chains[2][0]


async def test_a_put_waiting_on_one_that_fails_stores_the_block_itself() -> None:
    store, fp, tier = gated_store()
    t = tokens(tiny_model().layout.block_tokens, seed=6)
    tier.fail_next = True
    first = asyncio.create_task(put_tokens(store, "ns", fp, t))
    second = asyncio.create_task(put_tokens(store, "ns", fp, t))
    await asyncio.sleep(0.05)
    assert tier.writes == 1 and len(store) == 0
    tier.gate.set()
    with pytest.raises(Unavailable):
        await first
    (meta,) = await second
    assert tier.writes == 2 and len(store) == 1 and store.counters.blocks_put == 1
    assert store.counters.blocks_deduplicated == 0 and meta.locations == ["dram"]

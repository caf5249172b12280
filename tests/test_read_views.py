"""BlockStore.read_views (engram/store/core.py): a chain read in one call serves and counts exactly what
read_view block by block does, verifies top-tier copies, and sends a copy below the top tier through the
promoting path."""

from __future__ import annotations

import pytest

from engram.errors import DataLoss
from engram.registry import ModelRegistry
from engram.store import BlockStore
from engram.tiers.dram import DramTier
from tests.helpers import dram_store, put_tokens, tiny_model, tokens


def _counts(store: BlockStore) -> list[tuple[str, int, int, int]]:
    return [(name, t.hits, t.served_bytes, t.misses) for name, t in sorted(store.counters.tiers.items())]


async def test_a_batch_read_serves_and_counts_what_reads_block_by_block_do() -> None:
    stores = [dram_store()[0], dram_store()[0]]
    chains = []
    for store in stores:
        fp = store.registry.register(tiny_model())
        chains.append(await put_tokens(store, "ns", fp, tokens(5 * 16, seed=3)))
    (one, batch), (c1, c2) = stores, chains
    with one.reading(c1):
        singly = [bytes(await one.read_view(m)) for m in c1]
    with batch.reading(c2):
        together = [bytes(p) for p in await batch.read_views(c2)]
    assert together == singly
    assert _counts(batch) == _counts(one)
    assert (batch.counters.blocks_served, batch.counters.bytes_served) == (5, sum(m.nbytes for m in c2))
    assert [m.hits for m in c2] == [1] * 5


async def test_a_corrupt_top_copy_is_never_served_by_a_batch_read() -> None:
    store, fp = dram_store()
    chain = await put_tokens(store, "ns", fp, tokens(3 * 16, seed=4))
    tier = store.tiers[0]
    assert isinstance(tier, DramTier)
    good = tier._blocks[chain[1].key]
    tier._blocks[chain[1].key] = bytes(len(good))  # the middle block's only copy rots
    with store.reading(chain), pytest.raises(DataLoss):
        await store.read_views(chain)
    assert store.counters.corrupt_blocks == 1
    assert store.block(chain[1].key) is None  # dropped, never served


async def test_a_block_below_the_top_tier_is_served_from_there_and_promoted() -> None:
    spec = tiny_model()
    nbytes = spec.layout.block_nbytes(spec.layout.block_tokens)
    store = BlockStore([DramTier(2 * nbytes), DramTier(8 * nbytes, name="nvme")], ModelRegistry(default_codec="raw"))
    fp = store.registry.register(spec)
    chain = await put_tokens(store, "ns", fp, tokens(3 * 16, seed=5))
    assert [m.locations for m in chain] == [["nvme"], ["dram"], ["dram"]]  # the first was demoted
    with store.reading(chain):
        payloads = await store.read_views(chain)
    assert len(payloads) == 3
    assert store.counters.tiers["nvme"].hits == 1 and store.counters.tiers["dram"].hits == 2
    assert store.counters.tiers["dram"].misses == 1  # the block served from below missed the top tier
    assert store.counters.tiers["dram"].promotions == 0  # the top tier holds only blocks this read leases
    with store.reading(chain[:1]):
        await store.read_views(chain[:1])
    assert store.counters.tiers["dram"].promotions == 1  # now room is made (another block goes down)
    assert "dram" in chain[0].locations

"""LeaseTable on its own (engram/leases.py), over a real BlockStore and DRAM tier: a lease holds the store's
read lease on its blocks (so they are neither evicted nor demoted) until it is released, dropped or expires;
ids are random and only usable in the namespace that took them; a release is all or nothing."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from engram.errors import InvalidArgument, NotFound, Unavailable
from engram.leases import LeaseTable

from helpers import BLOCK_TOKENS, dram_store, put_tokens, tokens

LEASE_S = 0.05


def test_a_lease_must_last_a_positive_time() -> None:
    store, _ = dram_store()
    for bad in (0, -1.0):
        with pytest.raises(InvalidArgument, match="lease_s must be positive"):
            LeaseTable(store, bad)


async def test_a_lease_holds_the_store_read_lease_on_each_block_until_released() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(3 * BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    lease = table.grant("ns", blocks)
    assert [m.leases for m in blocks] == [1, 1, 1]
    assert not any(m.evictable for m in blocks)
    assert table.release("ns", [lease.id]) == 1
    assert [m.leases for m in blocks] == [0, 0, 0]
    assert all(m.evictable for m in blocks)
    assert len(table) == 0


async def test_a_leased_block_survives_pressure_and_goes_once_released() -> None:
    store, fp = dram_store(capacity_blocks=4)
    (old,) = await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS, seed=1))
    table = LeaseTable(store, 60)
    lease = table.grant("ns", [old])
    for seed in range(2, 6):  # four more single-block chains: the tier holds four blocks
        await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS, seed=seed), seed=seed)
    assert store.holds("ns", old.key)  # the least recently used leaf, kept by its lease
    table.release("ns", [lease.id])
    await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS, seed=9), seed=9)
    assert not store.holds("ns", old.key)  # released: the next put that needs room takes it


async def test_a_lease_expires_after_lease_s_and_frees_its_blocks() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(2 * BLOCK_TOKENS))
    table = LeaseTable(store, LEASE_S)
    before = time.monotonic()
    lease = table.grant("ns", blocks)
    assert before + LEASE_S <= lease.expires <= time.monotonic() + LEASE_S
    await asyncio.sleep(LEASE_S * 4)
    assert len(table) == 0
    assert table.expired == 1
    assert [m.leases for m in blocks] == [0, 0]
    with pytest.raises(NotFound, match="expired"):
        table.release("ns", [lease.id])


async def test_a_released_lease_does_not_expire_later() -> None:
    # Two leases on one block: when the first one's deadline passes, the second one's hold must stand, and
    # the released lease leaves no timer pending on the loop (thousands of Gets a second would pile them up).
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, LEASE_S)
    first = table.grant("ns", blocks)
    table.grant("ns", blocks)
    assert blocks[0].leases == 2
    table.release("ns", [first.id])
    assert blocks[0].leases == 1
    assert first.timer is not None and first.timer.cancelled()
    await asyncio.sleep(LEASE_S * 4)
    assert table.expired == 1  # only the second lease expired
    assert blocks[0].leases == 0


async def test_lease_ids_are_random_nonzero_63_bit_numbers() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    ids = [table.grant("ns", blocks).id for _ in range(200)]
    assert len(set(ids)) == 200
    assert all(0 < i < 2**63 for i in ids)
    assert max(ids) > 2**40  # not a counter
    table.close()


async def test_another_namespaces_lease_id_is_reported_like_an_unknown_one() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "alice", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    lease = table.grant("alice", blocks)
    unknown = lease.id ^ 1
    with pytest.raises(NotFound) as foreign_exc:
        table.release("bob", [lease.id])
    with pytest.raises(NotFound) as unknown_exc:
        table.release("bob", [unknown])
    # The same words, only the id differs: bob learns nothing about alice's leases.
    assert str(foreign_exc.value).replace(str(lease.id), "ID") == str(unknown_exc.value).replace(str(unknown), "ID")
    assert len(table) == 1
    assert blocks[0].leases == 1
    assert table.release("alice", [lease.id]) == 1


async def test_a_release_naming_one_unknown_id_releases_nothing() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(2 * BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    a, b = table.grant("ns", blocks[:1]), table.grant("ns", blocks[1:])
    with pytest.raises(NotFound, match=re.escape("lease 1 (12345)")):
        table.release("ns", [a.id, 12345, b.id])
    assert len(table) == 2
    assert [m.leases for m in blocks] == [1, 1]


async def test_an_id_named_twice_ends_its_lease_once_and_a_second_release_is_not_found() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    lease = table.grant("ns", blocks)
    assert table.release("ns", [lease.id, lease.id]) == 1
    assert blocks[0].leases == 0
    with pytest.raises(NotFound, match="released already"):
        table.release("ns", [lease.id])
    assert blocks[0].leases == 0


async def test_drop_ends_an_undelivered_lease_once() -> None:
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, 60)
    lease = table.grant("ns", blocks)
    table.drop(lease)
    table.drop(lease)  # already gone: nothing happens
    assert len(table) == 0
    assert blocks[0].leases == 0
    assert table.expired == 0


async def test_close_ends_every_lease() -> None:
    store, fp = dram_store()
    a = await put_tokens(store, "alice", fp, tokens(BLOCK_TOKENS))
    b = await put_tokens(store, "bob", fp, tokens(BLOCK_TOKENS))
    table = LeaseTable(store, LEASE_S)
    leases = [table.grant("alice", a), table.grant("bob", b)]
    table.close()
    assert len(table) == 0
    assert all(lease.timer is not None and lease.timer.cancelled() for lease in leases)
    assert a[0].leases == b[0].leases == 0
    await asyncio.sleep(LEASE_S * 4)  # nothing expires after close
    assert table.expired == 0


async def test_a_lease_that_expired_while_its_answer_was_built_is_neither_shortened_nor_renewed() -> None:
    """GetPrefix builds its answer a slice at a time under one lease (engram/server/prefixheader.py); one that
    expired meanwhile is Unavailable ('ask again') when the answer is cut or renewed. Shortened, it released its
    blocks a second time (another lease's hold on them gone); renewed, the answer named a lease already ended and
    claimed a full term (a review, session 49)."""
    store, fp = dram_store()
    blocks = await put_tokens(store, "ns", fp, tokens(4 * BLOCK_TOKENS))
    table = LeaseTable(store, 0.01)
    lease = table.grant("ns", blocks[2:])
    other = LeaseTable(store, 60).grant("ns", blocks[2:])  # another caller's hold on the same blocks
    await asyncio.sleep(0.05)
    assert table.expired == 1 and [m.leases for m in blocks] == [0, 0, 1, 1]
    with pytest.raises(Unavailable, match="ask again"):
        table.shorten(lease, 0)
    with pytest.raises(Unavailable, match="ask again"):
        table.renew(lease)
    assert [m.leases for m in blocks] == [0, 0, 1, 1] and len(table) == 0 and other.metas == blocks[2:]

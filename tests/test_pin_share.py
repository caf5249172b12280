"""A tenant's share of pinned bytes (server.max_pinned_fraction_per_tenant, engram/store/pins.py), through a real
daemon with tenants. An audit (session 44) had a tenant without a quota pin its blocks until DRAM and NVMe were
full: every other tenant's put was then RESOURCE_EXHAUSTED until it unpinned. Each test checks the daemon's count
of pinned bytes against a recount from the blocks themselves, so a drift (a tenant refused for pins it no longer
holds) shows."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer
from engram.store import BlockStore
from engram.tiers.journal import FILE_HEAD_LEN as JOURNAL_HEAD_LEN
from engram.tiers.journal import OWNED_PINS, PINS, encode_entry, parse_entries

from helpers import BLOCK_TOKENS, random_kv, rpcs_answered, tiny_model, tokens

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.admin_tokens": ADMIN,
        "auth.salt_secret": "test-secret"}  # no quotas: the default, as in the audit
BLOCK = 4096  # bytes of one tiny_model block
SHARE = 256 * 1024  # 0.5 (the default) of the largest tier, NVMe's 512 KiB: 64 blocks


async def start(server_factory: Any, tmp_path: Path, **extra: Any) -> RunningServer:
    srv: RunningServer = await server_factory(**AUTH, **{"tiers.dram.capacity": "256KiB",
                                                          "tiers.nvme.capacity": "512KiB",
                                                          "tiers.nvme.path": str(tmp_path / "nvme")}, **extra)
    return srv


def as_(srv: RunningServer, token: str, namespace: str = "", **kw: Any) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace=namespace, **kw)


def recounted(store: BlockStore, ns: str) -> int:
    """The namespace's pinned bytes from scratch: each block a tenant pinned and every block it extends, once (an
    admin's pins are the operator's, outside every share)."""
    held: dict[bytes, int] = {}
    for meta in store.blocks(ns):
        m = meta if meta.tenant_pins else None
        while m is not None and m.key not in held:
            held[m.key] = m.nbytes
            m = store.index.get_in(ns, m.parent)
    return sum(held.values())


def pinned(srv: RunningServer, ns: str = "alice") -> int:
    counted = srv.store.index.pinned_bytes(ns)
    assert counted == recounted(srv.store, ns)
    return counted


async def put(c: EngramClient, fp: bytes, blocks: int, seed: int, *, pin: bool) -> tuple[bytes, ...]:
    toks = tokens(blocks * BLOCK_TOKENS, seed=seed)
    r = await c.put(fp, toks, random_kv(tiny_model(), len(toks), seed=seed), pin=pin)
    assert r.stored == blocks
    return r.keys


async def test_a_tenant_pins_up_to_its_share_then_is_refused_while_other_tenants_puts_land(
        server_factory: Any, tmp_path: Path) -> None:
    srv = await start(server_factory, tmp_path)
    async with as_(srv, ALICE) as a, as_(srv, BOB) as b, as_(srv, ADMIN, "ops") as admin:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        chains = [await put(a, fp, 8, seed, pin=True) for seed in range(SHARE // BLOCK // 8)]
        assert pinned(srv) == SHARE
        with pytest.raises(errors.ResourceExhausted) as refused:
            await put(a, fp, 8, 100, pin=True)
        said = str(refused.value)
        assert "server.max_pinned_fraction_per_tenant = 0.5 of the largest tier, nvme's 524288 bytes" in said
        assert f"namespaces (alice) hold {SHARE} bytes pinned" in said and "bob" not in said
        assert pinned(srv) == SHARE  # the refused put stored nothing
        # Bob's puts land, many times what the store holds beside Alice's pins; his own pins have a share too.
        for seed in range(40):
            await put(b, fp, 4, 1000 + seed, pin=False)
        await put(b, fp, 8, 2000, pin=True)
        assert pinned(srv, "bob") == 8 * BLOCK and pinned(srv) == SHARE
        # Alice unpins her blocks: her share is hers again; the admin's pins have no share, and count in none.
        for keys in chains:
            await a.pin(fp, keys, unpin=True)
        assert pinned(srv) == 0
        await admin.register_model(tiny_model())
        keys = await put(admin, fp, SHARE // BLOCK + 8, 3000, pin=True)
        assert [m.pins for m in srv.store.find("ops", fp, keys)] == [1] * len(keys) and pinned(srv, "ops") == 0


async def test_pinned_bytes_stay_exact_through_unpin_evict_and_restart(server_factory: Any, tmp_path: Path) -> None:
    """A pin on a chain's last block keeps the chain (only leaves leave the last tier): counted whole. The count
    follows unpins (of a block pinned twice too), a forced evict and a restart (the pins come back, and so does
    their count), so Alice can always pin up to her share again, and never past it."""
    srv = await start(server_factory, tmp_path)
    async with as_(srv, ALICE) as a, as_(srv, ADMIN) as admin:
        fp = await a.register_model(tiny_model())
        keys = await put(a, fp, 80, 1, pin=False)
        with pytest.raises(errors.ResourceExhausted, match=f"would pin {80 * BLOCK} more bytes"):
            await a.pin(fp, keys[-1:])
        assert pinned(srv) == 0  # none of it taken
        assert await a.pin(fp, [keys[63]]) == 1
        assert pinned(srv) == SHARE
        for more in ([keys[64]], [keys[70], keys[10]]):
            with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
                await a.pin(fp, more)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(a, fp, 1, 2, pin=True)
        await a.pin(fp, [keys[63]], unpin=True)
        assert pinned(srv) == 0
        await a.pin(fp, [keys[31], keys[31], keys[20]])
        assert pinned(srv) == 32 * BLOCK
        await a.pin(fp, [keys[31]], unpin=True)
        assert pinned(srv) == 32 * BLOCK  # still pinned once
        await a.pin(fp, [keys[31], keys[20]], unpin=True)
        assert pinned(srv) == 0
        await a.pin(fp, [keys[63]])
        await admin.evict(whole_namespace=True, force=True, namespace="alice")
        assert pinned(srv) == 0
        keys = await put(a, fp, 64, 3, pin=True)
        assert pinned(srv) == SHARE
    await srv.stop(0)
    srv = await start(server_factory, tmp_path)
    assert len(srv.store.blocks("alice")) == 64 and pinned(srv) == SHARE  # the blocks came back pinned
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(tiny_model())
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(a, fp, 1, 4, pin=True)
        await a.pin(fp, keys, unpin=True)
        assert pinned(srv) == 0
        await a.pin(fp, keys)
        assert pinned(srv) == SHARE


async def test_an_in_place_put_with_pin_stops_at_the_tenants_share(server_factory: Any, tmp_path: Path) -> None:
    srv = await start(server_factory, tmp_path, **{"auth.same_host_paths": "on"})
    async with as_(srv, ALICE, in_place_min_bytes=0) as a:
        fp = await a.register_model(tiny_model())
        toks = tokens(56 * BLOCK_TOKENS, seed=1)
        r = await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=1), pin=True)
        assert r.stored == 56 and r.write_ms > 0  # written in place
        toks = tokens(16 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=2), pin=True)
        assert pinned(srv) == SHARE  # the blocks reserved within the share were committed, as under a quota
        toks = tokens(BLOCK_TOKENS, seed=3)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=3), pin=True)


async def test_an_in_place_put_with_pin_that_goes_on_as_bytes_pins_each_block_once(
        server_factory: Any, tmp_path: Path) -> None:
    """An in-place put stopped by the share after a round goes on as bytes from the block it stopped at: it sent
    the whole chain again, so the daemon pinned the blocks of the first round a second time, and Alice's unpin of
    the chain left them pinned (and in her share)."""
    srv = await start(server_factory, tmp_path, **{"auth.same_host_paths": "on", "server.metrics_port": -1,
                                                   "server.metrics_token": "metrics-token"})
    async with as_(srv, ALICE, in_place_min_bytes=0) as a:
        fp = await a.register_model(tiny_model())
        toks = tokens(56 * BLOCK_TOKENS, seed=1)
        assert (await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=1), pin=True)).reserve_ms > 0
        reserved = rpcs_answered(srv, "ReservePut")
        toks = tokens(16 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=2), pin=True)
        # a round reserved in place, the next refused for the share: the rest went on as bytes
        assert rpcs_answered(srv, "ReservePut") == reserved + 1
        assert rpcs_answered(srv, "ReservePut", "RESOURCE_EXHAUSTED") == 1
        stored = [b.key for b in (await a.lookup(fp, toks)).blocks]
        assert len(stored) == 8 and pinned(srv) == SHARE  # the round within the share went in place
        assert [m.pins for m in srv.store.find("alice", fp, stored)] == [1] * 8
        assert await a.pin(fp, stored, unpin=True) == 8
        assert pinned(srv) == 56 * BLOCK and not any(m.pins for m in srv.store.find("alice", fp, stored))


async def test_an_admins_pins_in_a_tenants_namespace_take_nothing_of_its_share(
        server_factory: Any, tmp_path: Path) -> None:
    """An admin pinning a shared prefix in Alice's namespace used up her share: she could pin nothing of her own.
    The operator's pins now count in no share; a block both pin counts once, in hers; her unpin lifts her pins,
    never the admin's, and the admin's lifts its own first."""
    srv = await start(server_factory, tmp_path)
    async with as_(srv, ALICE) as a, as_(srv, ADMIN, "alice") as admin:
        fp = await a.register_model(tiny_model())
        await admin.register_model(tiny_model())
        theirs = await put(admin, fp, SHARE // BLOCK, 1, pin=True)  # her whole share's worth
        assert pinned(srv) == 0
        mine = await put(a, fp, SHARE // BLOCK, 2, pin=True)  # refused before: her share was the admin's
        assert pinned(srv) == SHARE
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await a.pin(fp, theirs[:1])  # hers too, it would count in her share
        assert await a.pin(fp, theirs, unpin=True) == 0  # not hers to lift
        assert [m.pins for m in srv.store.find("alice", fp, theirs)] == [1] * len(theirs)
        assert await admin.pin(fp, mine[-1:]) == 1  # the operator's pin beside hers
        assert pinned(srv) == SHARE
        assert await admin.pin(fp, mine[-1:], unpin=True) == 1  # lifts its own: hers stays
        assert srv.store.find("alice", fp, mine[-1:])[0].pins == 1 and pinned(srv) == SHARE
        assert await admin.pin(fp, theirs, unpin=True) == len(theirs)
        assert await a.pin(fp, mine, unpin=True) == len(mine)
        assert pinned(srv) == 0 and not any(m.pins for m in srv.store.blocks("alice"))


async def test_a_restart_pins_a_tenants_blocks_again_within_its_share_as_it_is_now(
        server_factory: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Pins are kept with the NVMe tier's journal: a restart pins the blocks that come back. A tenant's come back
    within its share as configured now (first recorded first), the rest stored unpinned and logged; the
    operator's come back whole."""
    srv = await start(server_factory, tmp_path)
    async with as_(srv, ALICE) as a, as_(srv, ADMIN, "alice") as admin:
        fp = await a.register_model(tiny_model())
        await admin.register_model(tiny_model())
        first = await put(a, fp, 32, 1, pin=True)
        second = await put(a, fp, 32, 2, pin=True)
        operators = await put(admin, fp, 16, 3, pin=True)
        assert pinned(srv) == SHARE
    await srv.stop(0)
    srv = await start(server_factory, tmp_path, **{"server.max_pinned_fraction_per_tenant": 0.25})  # 32 blocks
    pins = {m.key: m.pins for m in srv.store.blocks("alice")}
    assert [pins[k] for k in first] == [1] * 32 and [pins[k] for k in second] == [0] * 32
    assert [pins[k] for k in operators] == [1] * 16 and pinned(srv) == SHARE // 2
    said = [r.getMessage() for r in caplog.records if "were not pinned again" in r.getMessage()]
    assert len(said) == 1 and "32 pinned blocks" in said[0] and "namespaces alice" in said[0], said
    await srv.stop(0)
    srv = await start(server_factory, tmp_path)  # what was dropped stays dropped: recorded as cleared
    assert pinned(srv) == SHARE // 2 and sum(m.pins for m in srv.store.blocks("alice")) == 48


SHARED_AUTH = {"auth.tenants.alice.namespaces": "alice,shared", "auth.tenants.bob.namespaces": "bob,shared"}
# Every block on NVMe before its put returns: a copy of the directory taken while the daemon runs (a SIGKILL's) has it
RESTARTED = {**SHARED_AUTH, "tiers.write_policy": "write-through"}


def pinned_by(srv: RunningServer, ns: str, tenant: str) -> int:
    """What `tenant`'s own pins keep in `ns`, as the daemon counts it, checked against a recount from the blocks."""
    store = srv.store
    held: dict[bytes, int] = {}
    for meta in store.blocks(ns):
        m = meta if meta.owner_pins(tenant) else None  # ("": the pins of no recorded owner)
        while m is not None and m.key not in held:
            held[m.key] = m.nbytes
            m = store.index.get_in(ns, m.parent)
    counted = store.index.pinned_bytes(ns, tenant)
    assert counted == sum(held.values())
    return counted


async def test_a_tenants_pin_in_a_shared_namespace_is_lifted_by_it_or_an_admin_only(
        server_factory: Any, tmp_path: Path) -> None:
    """Alice pins a chain's last block in `shared`, which Bob shares: Bob's unpin lifts nothing and his forced
    evict keeps the chain, reporting it in use (both lifted her pin, and the evict removed her chain: an audit, session
    48). His own pin on the block is his to lift; hers is hers, and the admin's unpin lifts a tenant's pin."""
    srv = await start(server_factory, tmp_path, **SHARED_AUTH)
    async with as_(srv, ALICE, "shared") as a, as_(srv, BOB, "shared") as b, as_(srv, ADMIN, "shared") as admin:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        await admin.register_model(tiny_model())
        chain = await put(a, fp, 2, 1, pin=False)
        last = list(chain[-1:])

        async def pins() -> list[int]:
            return [d.pins for d in (await admin.describe_blocks(key_prefixes=[k.hex() for k in chain])).blocks]

        assert await a.pin(fp, last) == 1
        assert await b.pin(fp, last, unpin=True) == 0
        assert await pins() == [0, 1]
        done = await b.evict(key_prefixes=[chain[0].hex()], force=True)
        assert not done.evicted and done.unpinned == 0 and sorted(done.in_use) == sorted(chain)  # not saying why
        assert await pins() == [0, 1] and pinned_by(srv, "shared", "alice") == 2 * BLOCK
        assert await b.pin(fp, last) == 1 and await pins() == [0, 2]  # his own pin, beside hers
        assert pinned_by(srv, "shared", "bob") == 2 * BLOCK
        assert await b.pin(fp, last, unpin=True) == 1 and await b.pin(fp, last, unpin=True) == 0
        assert await pins() == [0, 1] and pinned_by(srv, "shared", "bob") == 0
        assert await a.pin(fp, last, unpin=True) == 1 and await pins() == [0, 0]
        assert pinned_by(srv, "shared", "alice") == 0
        assert await a.pin(fp, last) == 1
        assert await admin.pin(fp, last, unpin=True, namespace="shared") == 1 and await pins() == [0, 0]
        assert pinned_by(srv, "shared", "alice") == 0 and pinned(srv, "shared") == 0


async def test_pins_in_a_shared_namespace_count_in_the_pinning_tenants_share_alone(
        server_factory: Any, tmp_path: Path) -> None:
    """Shares of 32 blocks (0.25 of NVMe's 512 KiB). Alice pins her whole share in `shared`: Bob still pins his
    whole share there (every pin in a namespace two tenants share counted in both tenants' totals: Alice's pins
    used up Bob's share, and he could pin nothing), and then his next pin is refused for his own."""
    srv = await start(server_factory, tmp_path, **SHARED_AUTH, **{"server.max_pinned_fraction_per_tenant": 0.25})
    share = 128 * 1024
    async with as_(srv, ALICE, "shared") as a, as_(srv, BOB, "shared") as b:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        for seed in range(share // BLOCK // 8):
            await put(a, fp, 8, seed, pin=True)
        for seed in range(share // BLOCK // 8):
            await put(b, fp, 8, 100 + seed, pin=True)
        assert pinned(srv, "shared") == 2 * share
        assert pinned_by(srv, "shared", "alice") == pinned_by(srv, "shared", "bob") == share
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(b, fp, 1, 200, pin=True)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(a, fp, 1, 201, pin=True)


async def test_a_tenants_pins_restored_by_a_restart_count_once_when_it_pins_them_again(
        server_factory: Any, tmp_path: Path) -> None:
    """A restart restores a tenant's pins with no recorded owner, which its share counts as held; pinning the same
    chain again (by key, or by a put with pin) adds nothing. Counting only its own pins as held, the daemon counted
    the chain twice: its re-pin was refused past the share, and the put stopped part-way (a review, session 49)."""
    srv = await start(server_factory, tmp_path)
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(tiny_model())
        keys = await put(a, fp, 40, 1, pin=True)  # 40 of the share's 64 blocks: twice would not fit
    await srv.stop(0)
    srv = await start(server_factory, tmp_path)
    assert [m.pins for m in srv.store.blocks("alice")] == [1] * 40 and pinned(srv) == 40 * BLOCK
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(tiny_model())
        assert await a.pin(fp, list(keys)) == 40  # each block pinned twice now; refused RESOURCE_EXHAUSTED before
        toks = tokens(40 * BLOCK_TOKENS, seed=1)
        again = await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=1), pin=True)
        assert again.keys == keys  # the whole chain (it stopped part-way before)
    assert pinned(srv) == 40 * BLOCK


async def restarted(server_factory: Any, tmp_path: Path, srv: RunningServer, how: str, **extra: Any) -> RunningServer:
    """A daemon on the NVMe directory `srv` left: its journal replayed (a copy taken while it ran, as a SIGKILL
    leaves it: no snapshot since), or the snapshot its stop wrote."""
    where = tmp_path
    if how == "journal":
        where = tmp_path / "crash"
        shutil.copytree(tmp_path / "nvme", where / "nvme", ignore=shutil.ignore_patterns("engram.lock"))
    await srv.stop(0)
    return await start(server_factory, where, **extra)


@pytest.mark.parametrize("how", ["journal", "snapshot"])
async def test_after_a_restart_only_the_pinning_tenant_or_an_admin_lifts_its_pin_in_a_shared_namespace(
        server_factory: Any, tmp_path: Path, how: str) -> None:
    """The journal records whose each tenant pin is: after a restart Bob's unpin of Alice's pin in `shared` lifts
    nothing and his forced evict keeps her chain, his own pin beside hers is his to lift, and the admin's unpin
    lifts hers. The journal kept counts only: her pin came back of no recorded owner, and Bob lifted it (a review,
    session 49)."""
    srv = await start(server_factory, tmp_path, **RESTARTED)
    async with as_(srv, ALICE, "shared") as a, as_(srv, BOB, "shared") as b:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        chain = await put(a, fp, 2, 1, pin=False)
        mine = await put(a, fp, 2, 2, pin=True)
        assert await a.pin(fp, chain[-1:]) == 1 and await b.pin(fp, chain[-1:]) == 1
    srv = await restarted(server_factory, tmp_path, srv, how, **RESTARTED)
    last = list(chain[-1:])
    async with as_(srv, ALICE, "shared") as a, as_(srv, BOB, "shared") as b, as_(srv, ADMIN, "shared") as admin:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        await admin.register_model(tiny_model())

        async def pins(keys: tuple[bytes, ...]) -> list[int]:
            return [d.pins for d in (await admin.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks]

        assert await pins(chain) == [0, 2] and await pins(mine) == [1, 1]
        assert pinned_by(srv, "shared", "alice") == 4 * BLOCK and pinned_by(srv, "shared", "bob") == 2 * BLOCK
        assert await b.pin(fp, list(mine), unpin=True) == 0  # hers: lifted before
        assert await b.pin(fp, last, unpin=True) == 1 and await b.pin(fp, last, unpin=True) == 0  # his own, once
        done = await b.evict(key_prefixes=[chain[0].hex(), mine[0].hex()], force=True)
        assert not done.evicted and sorted(done.in_use) == sorted(chain + mine)
        assert await pins(chain) == [0, 1] and await pins(mine) == [1, 1]
        assert await admin.pin(fp, last, unpin=True, namespace="shared") == 1
        assert await a.pin(fp, list(mine), unpin=True) == 2
        assert await pins(chain) == [0, 0] and await pins(mine) == [0, 0] and pinned(srv, "shared") == 0


@pytest.mark.parametrize("how", ["journal", "snapshot"])
async def test_after_a_restart_a_tenants_pins_in_a_shared_namespace_count_in_its_share_alone(
        server_factory: Any, tmp_path: Path, how: str) -> None:
    """Shares of 32 blocks. Alice pins her whole share in `shared`; after a restart Bob still pins his whole share
    there, then is refused for his own, and so is Alice. Her pins came back of no recorded owner and counted in
    Bob's share too: he could pin nothing (a review, session 49)."""
    config = {**RESTARTED, "server.max_pinned_fraction_per_tenant": 0.25}
    share = 128 * 1024
    srv = await start(server_factory, tmp_path, **config)
    async with as_(srv, ALICE, "shared") as a:
        fp = await a.register_model(tiny_model())
        for seed in range(share // BLOCK // 8):
            await put(a, fp, 8, seed, pin=True)
    srv = await restarted(server_factory, tmp_path, srv, how, **config)
    assert pinned_by(srv, "shared", "alice") == share and pinned_by(srv, "shared", "bob") == 0
    async with as_(srv, ALICE, "shared") as a, as_(srv, BOB, "shared") as b:
        fp = await a.register_model(tiny_model())
        await b.register_model(tiny_model())
        for seed in range(share // BLOCK // 8):
            await put(b, fp, 8, 100 + seed, pin=True)
        assert pinned_by(srv, "shared", "bob") == share and pinned(srv, "shared") == 2 * share
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(b, fp, 1, 200, pin=True)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(a, fp, 1, 201, pin=True)


def _as_an_earlier_build_wrote(index_dir: Path) -> None:
    """The index files as a build from before owners were journaled wrote them: each owned pins entry a pins entry
    of the same counts."""
    for path in index_dir.iterdir():
        data = path.read_bytes()
        entries, end = parse_entries(data)
        assert end == len(data)
        old = [(PINS, body[:24]) if kind == OWNED_PINS else (kind, body) for kind, body in entries]
        path.write_bytes(data[:JOURNAL_HEAD_LEN] + b"".join(encode_entry(k, b) for k, b in old))


@pytest.mark.parametrize("how", ["journal", "snapshot"])
async def test_an_index_journal_an_earlier_build_wrote_still_loads_its_tenant_pins_of_no_recorded_owner(
        server_factory: Any, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """Backward compatibility: a journal and snapshot without owners (a build from before them) are trusted, and
    the tenant pins they record come back of no recorded owner, as that build restored them: counted in the share
    of every tenant of the namespace, lifted by any."""
    srv = await start(server_factory, tmp_path, **RESTARTED)
    async with as_(srv, ALICE, "shared") as a:
        fp = await a.register_model(tiny_model())
        keys = await put(a, fp, 4, 1, pin=True)
    where = tmp_path / "crash" if how == "journal" else tmp_path
    if how == "journal":
        shutil.copytree(tmp_path / "nvme", where / "nvme", ignore=shutil.ignore_patterns("engram.lock"))
    await srv.stop(0)
    _as_an_earlier_build_wrote(where / "nvme" / "index")
    caplog.clear()
    srv = await start(server_factory, where, **RESTARTED)
    assert "not trusted" not in caplog.text
    assert [(m.pins, m.pin_owners) for m in srv.store.find("shared", fp, keys)] == [(1, None)] * 4
    assert pinned_by(srv, "shared", "") == 4 * BLOCK and pinned_by(srv, "shared", "alice") == 0
    async with as_(srv, BOB, "shared") as b:
        await b.register_model(tiny_model())
        assert await b.pin(fp, list(keys), unpin=True) == 4
    assert pinned(srv, "shared") == 0


async def test_a_restart_gives_the_pins_of_a_tenant_no_longer_given_the_namespace_no_recorded_owner(
        server_factory: Any, tmp_path: Path) -> None:
    """Alice's pins in `shared`, and the config then takes `shared` from her: no share of hers counts them there, so
    they come back of no recorded owner, counted in Bob's share and his to lift (as every restored tenant pin was
    before owners were journaled), not a start that fails on an owner it has no share for."""
    srv = await start(server_factory, tmp_path, **RESTARTED)
    async with as_(srv, ALICE, "shared") as a:
        fp = await a.register_model(tiny_model())
        keys = await put(a, fp, 2, 1, pin=True)
    await srv.stop(0)
    srv = await start(server_factory, tmp_path, **{**RESTARTED, "auth.tenants.alice.namespaces": "alice"})
    assert [(m.pins, m.pin_owners) for m in srv.store.find("shared", fp, keys)] == [(1, None)] * 2
    assert pinned_by(srv, "shared", "") == 2 * BLOCK and pinned_by(srv, "shared", "alice") == 0
    async with as_(srv, BOB, "shared") as b:
        await b.register_model(tiny_model())
        assert await b.pin(fp, list(keys), unpin=True) == 2
    assert pinned(srv, "shared") == 0

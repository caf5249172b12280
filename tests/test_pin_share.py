"""A tenant's share of pinned bytes (server.max_pinned_fraction_per_tenant, engram/store/pins.py), through a real
daemon with tenants. An audit (session 44) had a tenant without a quota pin its blocks until DRAM and NVMe were
full: every other tenant's put was then RESOURCE_EXHAUSTED until it unpinned. Each test checks the daemon's count
of pinned bytes against a recount from the blocks themselves, so a drift (a tenant refused for pins it no longer
holds) shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engram import errors
from engram.client import EngramClient
from engram.server import RunningServer
from engram.store import BlockStore

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens

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
    """The namespace's pinned bytes from scratch: each pinned block and every block it extends, once."""
    held: dict[bytes, int] = {}
    for meta in store.blocks(ns):
        m = meta if meta.pins else None
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
        # Alice unpins her blocks: her share is hers again; the admin's pins have no share.
        for keys in chains:
            await a.pin(fp, keys, unpin=True)
        assert pinned(srv) == 0
        await admin.register_model(tiny_model())
        await put(admin, fp, SHARE // BLOCK + 8, 3000, pin=True)
        assert pinned(srv, "ops") == SHARE + 8 * BLOCK


async def test_pinned_bytes_stay_exact_through_unpin_evict_and_restart(server_factory: Any, tmp_path: Path) -> None:
    """A pin on a chain's last block keeps the chain (only leaves leave the last tier): counted whole. The count
    follows unpins (of a block pinned twice too), a forced evict and a restart (pins are not persisted), so Alice
    can always pin up to her share again."""
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
    assert len(srv.store.blocks("alice")) == 64 and pinned(srv) == 0  # the blocks came back; pins do not persist
    async with as_(srv, ALICE) as a:
        fp = await a.register_model(tiny_model())
        await a.pin(fp, keys)
        assert pinned(srv) == SHARE
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await put(a, fp, 1, 4, pin=True)


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
    srv = await start(server_factory, tmp_path, **{"auth.same_host_paths": "on"})
    async with as_(srv, ALICE, in_place_min_bytes=0) as a:
        fp = await a.register_model(tiny_model())
        toks = tokens(56 * BLOCK_TOKENS, seed=1)
        await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=1), pin=True)
        toks = tokens(16 * BLOCK_TOKENS, seed=2)
        with pytest.raises(errors.ResourceExhausted, match="max_pinned_fraction_per_tenant"):
            await a.put(fp, toks, random_kv(tiny_model(), len(toks), seed=2), pin=True)
        stored = [b.key for b in (await a.lookup(fp, toks)).blocks]
        assert len(stored) == 8 and pinned(srv) == SHARE  # the round within the share went in place
        assert [m.pins for m in srv.store.find("alice", fp, stored)] == [1] * 8
        assert await a.pin(fp, stored, unpin=True) == 8
        assert pinned(srv) == 56 * BLOCK and not any(m.pins for m in srv.store.find("alice", fp, stored))


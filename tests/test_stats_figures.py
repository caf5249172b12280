"""Stats' figures of the stored blocks (tokens and pinned blocks per tier, a tenant's copies per tier, blocks, bytes
and tokens per model, a namespace's blocks, logical bytes and referenced blocks; `engram ls`'s per namespace) are kept by the index as blocks
come and go (engram/index.py `Tally`), not walked over every block at each Stats: the walk ran on the daemon's
event loop, several times per call, so a store of a million blocks stalled every request for seconds whenever
`engram top` or a client's check() asked (benchmarks/RESULTS.md stats_cost).

The walks Stats made are kept here as the oracle: a real daemon (HBM on the CPU, the DRAM pool and real NVMe files,
small tiers so puts evict and demote, write-back's flusher copying to NVMe) takes a seeded random mix of puts,
reads (promotions), pins and unpins, sessions opened, appended, forked and closed, and evictions on request, and
after each step every figure must equal the walk's; then a restart rebuilds the index from NVMe (pins restored)
and the figures must equal the walk again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from engram.api import SessionMode, TierStats
from engram.config import load_config
from engram.errors import FailedPrecondition
from engram.index import BlockMeta
from engram.inspection import Inspector
from engram.server import RunningServer, start_server
from engram.sessions import SessionManager
from engram.store import BlockStore
from engram.store.counters import ModelUsage, NamespaceUsage
from engram.store.pins import PinShare

from helpers import BLOCK_TOKENS, put_tokens, tiny_model, tokens

SPECS = (tiny_model(), tiny_model(weights_id="seed-1"))
BLOCK = SPECS[0].layout.block_nbytes(BLOCK_TOKENS)
NAMESPACES = ("a", "b", "c")
TENANTS = ("t1", "t2")  # pinning tenants, each of every namespace: a tenant sees the pins it may lift


# ---- the oracle: the walks Stats made before the index kept its figures ------------------------------------------


def walked_tier_figures(store: BlockStore, blocks: Iterable[BlockMeta], tenant: str = "", *, homes: bool = False
                        ) -> dict[str, tuple[int, int, int, int]]:
    """Per tier, of `blocks`: (copies, stored bytes, tokens, pinned copies); a `tenant`'s pinned copies are those
    held by pins it may lift, as its DescribeBlocks counts them (its own, and those of no recorded owner). With
    `homes`, each block once, in its home: the slowest tier holding a copy (a tenant's view of a namespace other
    tenants share)."""
    out: dict[str, list[int]] = {t.name: [0, 0, 0, 0] for t in store.tiers}
    for meta in blocks:
        slowest = max(meta.locations, key=store.tier_rank, default=None)
        for name in meta.locations if not homes else () if slowest is None else (slowest,):
            row = out[name]
            row[0] += 1
            row[1] += meta.nbytes
            row[2] += meta.num_tokens
            row[3] += bool(meta.owner_pins(tenant) + meta.owner_pins("") if tenant else meta.pins)
    return {name: (row[0], row[1], row[2], row[3]) for name, row in out.items()}


def walked_model_usage(store: BlockStore, blocks: Iterable[BlockMeta]) -> list[ModelUsage]:
    acc: dict[bytes, list[int]] = {}
    for meta in blocks:
        row = acc.setdefault(meta.model_fingerprint, [0, 0, 0])
        row[0] += 1
        row[1] += meta.nbytes
        row[2] += meta.num_tokens
    out = []
    for spec in store.registry:
        n, nbytes, held_tokens = acc.get(spec.fingerprint, [0, 0, 0])
        out.append(ModelUsage(spec.fingerprint, spec.name, spec.codec, n, nbytes, held_tokens,
                              held_tokens * spec.layout.bytes_per_token()))
    return out


def walked_namespace_usage(store: BlockStore, namespace: str) -> NamespaceUsage:
    blocks = store.index.blocks_in(namespace)
    return NamespaceUsage(len(blocks), sum(m.nbytes for m in blocks), sum(m.nbytes * max(1, m.refs) for m in blocks),
                          sum(1 for m in blocks if m.refs))


def blocks_of(store: BlockStore, namespaces: Sequence[str] | None) -> list[BlockMeta]:
    return list(store.index) if namespaces is None else [m for ns in namespaces for m in store.index.blocks_in(ns)]


def walked_namespace_summaries(store: BlockStore) -> dict[str, tuple[int, int, int, int]]:
    """`engram ls`'s figures per namespace: blocks, stored bytes, tokens, pinned blocks."""
    acc: dict[str, list[int]] = {}
    for meta in store.index:
        row = acc.setdefault(meta.namespace, [0, 0, 0, 0])
        row[0] += 1
        row[1] += meta.nbytes
        row[2] += meta.num_tokens
        row[3] += meta.pins > 0
    return {ns: (row[0], row[1], row[2], row[3]) for ns, row in acc.items()}


def assert_figures_match_the_walk(store: BlockStore, sessions: SessionManager, when: str) -> None:
    admin = {t.name: t for t in store.tier_stats()}
    walk = walked_tier_figures(store, store.index)
    assert {n: (t.tokens, t.pinned_blocks) for n, t in admin.items()} == \
        {n: (w[2], w[3]) for n, w in walk.items()}, when
    for scope, tenant in itertools.product(([], ["a"], ["b", "c"], list(NAMESPACES), ["a", "a", "nobody"]), TENANTS):
        own = store.own_tier_stats(scope, tenant)
        walk = walked_tier_figures(store, blocks_of(store, sorted(set(scope))), tenant)
        assert own == tuple(TierStats(name=t.name, capacity_bytes=t.usage().capacity_bytes, used_bytes=walk[t.name][1],
                                      blocks=walk[t.name][0], tokens=walk[t.name][2], pinned_blocks=walk[t.name][3],
                                      state=store.placement.health[t.name].state,
                                      state_reason=store.placement.health[t.name].reason)
                            for t in store.tiers), f"{when}: tenant {tenant} of {scope}"
        assert store.model_usage(scope) == walked_model_usage(store, blocks_of(store, sorted(set(scope)))), when
        homes = walked_tier_figures(store, blocks_of(store, sorted(set(scope))), tenant, homes=True)
        kept = store.index.home_tallies(scope)
        pinned = store.index.pinned_tiers(scope, tenant, homes=True)
        assert {t.name: ((k.blocks, k.nbytes, k.tokens) if (k := kept.get(t.name)) else (0, 0, 0),
                         pinned.get(t.name, 0)) for t in store.tiers} == {n: (h[:3], h[3]) for n, h in homes.items()}, \
            f"{when}: homes of tenant {tenant} of {scope}"
    assert store.model_usage() == walked_model_usage(store, store.index), when
    for ns in (*NAMESPACES, "nobody"):
        assert store.namespace_usage(ns) == walked_namespace_usage(store, ns), f"{when}: namespace {ns}"
    listed = {n.namespace: (n.blocks, n.stored_bytes, n.tokens, n.pinned_blocks)
              for n in Inspector(store, sessions).namespaces() if n.blocks}
    assert listed == walked_namespace_summaries(store), when
    # the tiers' own block counts agree with the copies the index lists (a drift in locations would show here)
    assert {n: t.blocks for n, t in admin.items()} == {n: w[0] for n, w in walked_tier_figures(
        store, store.index).items()}, when


# ---- the random run ----------------------------------------------------------------------------------------------


def config(tmp_path: Path) -> dict[str, object]:
    return {"server.port": 0, "server.unix_socket": str(tmp_path / "engram.sock"),
            "tiers.hbm.capacity": 6 * BLOCK, "tiers.hbm.device": "cpu", "tiers.dram.capacity": 12 * BLOCK,
            "tiers.dram.prefault": False, "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.nvme.fsync": False,
            "tiers.write_back_window_s": 0.01}


async def random_steps(srv: RunningServer, rng: random.Random, steps: int) -> None:
    store, sessions = srv.store, srv.sessions
    fps = [store.registry.register(spec) for spec in SPECS]
    prompts: list[tuple[str, bytes, np.ndarray]] = []  # what was put: later puts extend them (shared prefixes)
    open_sessions: list[tuple[str, str, np.ndarray]] = []
    for step in range(steps):
        op = rng.choice(("put", "put", "put", "read", "pin", "unpin", "open", "append", "fork", "close", "evict"))
        if op == "put" or not prompts:
            if prompts and rng.random() < 0.5:  # extend a stored prompt: its blocks are deduplicated
                ns, fp, base = rng.choice(prompts)
            else:
                ns, fp, base = rng.choice(NAMESPACES), rng.choice(fps), np.zeros(0, dtype=np.int32)
            more = tokens(rng.randrange(1, 4 * BLOCK_TOKENS + 1), seed=rng.randrange(1 << 30))
            toks = np.concatenate([base[: len(base) // BLOCK_TOKENS * BLOCK_TOKENS], more]).astype(np.int32)
            await put_tokens(store, ns, fp, toks)
            prompts.append((ns, fp, toks))
        elif op == "read":
            ns, fp, toks = rng.choice(prompts)
            hit = store.index.match(ns, fp, toks, BLOCK_TOKENS).blocks
            with store.reading(hit):
                for meta in hit:
                    await store.read(meta)  # a hit below HBM is promoted
        elif op in ("pin", "unpin"):
            metas = [m for m in store.index if m.pins or op == "pin"]
            if metas:
                m = rng.choice(metas)
                # the operator, a tenant (every namespace shared by both), or a pin of no recorded owner (as a
                # restart gives back one an earlier build journaled: engram/store/pins.py restore)
                pinner = rng.choice(("", "restored", *TENANTS))
                if pinner == "restored" and op == "pin":
                    store.index.set_pins(m, m.pins + 1)
                else:
                    share = PinShare.of(NAMESPACES, 1.0, store.tiers, pinner) if pinner in TENANTS else None
                    store.pin(m.namespace, m.model_fingerprint, [m.key], unpin=op == "unpin", share=share)
        elif op == "open":
            ns, fp, toks = rng.choice(prompts)
            s = sessions.open(ns, fp, SessionMode.PERSIST, tokens=toks[: rng.randrange(1, len(toks) + 1)])
            open_sessions.append((ns, s.id, toks))
        elif op == "append" and open_sessions:
            ns, sid, toks = rng.choice(open_sessions)
            sessions.append(ns, sid, tokens(rng.randrange(1, 2 * BLOCK_TOKENS), seed=rng.randrange(1 << 30)))
        elif op == "fork" and open_sessions:
            ns, sid, toks = rng.choice(open_sessions)
            open_sessions.append((ns, sessions.fork(ns, sid).id, toks))
        elif op == "close" and open_sessions:
            ns, sid, _ = open_sessions.pop(rng.randrange(len(open_sessions)))
            sessions.close(ns, sid)
        elif op == "evict" and len(store.index):
            with contextlib.suppress(FailedPrecondition):  # pinned, without force
                await Inspector(store, sessions).evict([rng.choice(list(store.index))], force=rng.random() < 0.5)
        if rng.random() < 0.3:
            await asyncio.sleep(0.02)  # the flusher copies what is due to NVMe
        assert_figures_match_the_walk(store, sessions, f"step {step} ({op})")


async def test_stats_figures_kept_by_the_index_equal_a_walk_over_every_block_through_random_changes(
        tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides=config(tmp_path))
    srv = await start_server(cfg)
    try:
        assert [t.name for t in srv.store.tiers] == ["hbm", "dram", "nvme"]
        await random_steps(srv, random.Random(46), 250)
        store = srv.store
        assert store.counters.tiers["hbm"].demotions and store.counters.tiers["dram"].demotions
        assert store.counters.tiers["hbm"].promotions and any(m.pins for m in store.index)
        assert any(m.refs > 1 for m in store.index) and store.counters.blocks_evicted_on_request
        assert store.counters.blocks_flushed
        await store.flush(10.0)
    finally:
        await srv.stop(0)
    srv = await start_server(load_config(env={}, overrides=config(tmp_path)))  # the index rebuilt from NVMe
    try:
        assert len(srv.store.index) and any(m.pins for m in srv.store.index)
        assert_figures_match_the_walk(srv.store, srv.sessions, "after a restart")
        await random_steps(srv, random.Random(47), 60)
    finally:
        await srv.stop(0)


# ---- the cost ----------------------------------------------------------------------------------------------------


class _NoWalk(dict):  # type: ignore[type-arg]
    """An index's entries that answer lookups but refuse to be walked: what Stats must not do per block."""

    def _walked(self, *args: object) -> object:
        raise AssertionError("walked every block")

    __iter__ = keys = values = items = _walked  # type: ignore[assignment]


async def test_stats_and_namespace_listings_of_a_store_of_50k_blocks_walk_none_of_them(tmp_path: Path) -> None:
    """An admin's and a tenant's Stats (of its own namespaces, and of namespaces other tenants share too, counted by
    each block's home tier), DescribeNamespace's figures and `engram ls`'s listing, as the daemon builds
    them on its event loop, with 50,000 blocks stored, read no block: the index's entries (every namespace's, and
    the daemon's) refuse to be walked while they run. Before, each walked every block (Stats three times: 40 ms
    here for an admin's Stats, 1.5 s at a million blocks; benchmarks/stats_cost.py measures it)."""
    from engram.block import checksum
    from engram.keys import chain_keys, root_key
    from engram.registry import ModelRegistry
    from engram.server import auth
    from engram.tenancy import OPEN
    from engram.tiers.dram import DramTier

    n, chain = 50_000, 50
    store = BlockStore([DramTier(2 * n * BLOCK)], ModelRegistry(default_codec="raw"))  # the trace replayer's tier
    srv = await start_server(load_config(env={}, overrides={"server.port": 0,
                                                            "server.unix_socket": str(tmp_path / "s.sock")}), store)
    try:
        fps = [store.registry.register(spec) for spec in SPECS]
        payload = bytes(BLOCK)
        rng = np.random.default_rng(0)
        for c in range(n // chain):  # the replayer's put: the same placement and index as a Put, 10x faster
            ns, fp = NAMESPACES[c % 3], fps[c % 2]
            toks = rng.integers(0, 1 << 20, chain * BLOCK_TOKENS, dtype=np.int32)
            blocks = [(k, toks[s:e].astype("<i4").tobytes()) for k, s, e in chain_keys(ns, fp, toks, BLOCK_TOKENS)]
            metas = await store.put_chain(ns, fp, root_key(ns, fp), blocks, payload, checksum(payload))
            store.pin(ns, fp, [metas[0].key])
            store.reference(metas[: chain // 2], +1)
        assert len(store.index) == n
        service, inspector = srv.service, Inspector(store, srv.sessions)
        every = store.namespaces_in_use()
        auth._principal.set(OPEN)  # as a guarded RPC calls them (tenancy off)
        async def in_a_shared_namespace() -> object:  # its tiers counted by each block's home (index.home_tallies)
            store.namespaces.shared = lambda namespace: True  # type: ignore[method-assign]
            try:
                return await service.tenant_stats(["a", "b"], ["a", "b"])
            finally:
                del store.namespaces.shared

        calls = {"an admin's Stats": lambda: service.stats(every),
                 "a tenant's Stats": lambda: service.tenant_stats(["a"], ["a"]),
                 "a tenant's Stats of namespaces others share": in_a_shared_namespace,
                 "DescribeNamespace": lambda: service._namespace_stats("a", with_salt=True),
                 "engram ls": inspector.namespaces}
        index = store.index
        kept = index._entries, {ns: space.entries for ns, space in index._spaces.items()}
        index._entries = _NoWalk(kept[0])
        for space in index._spaces.values():
            space.entries = _NoWalk(space.entries)
        try:
            for what, call in calls.items():
                try:
                    got = call()
                    if asyncio.iscoroutine(got):
                        await got
                except AssertionError as exc:
                    raise AssertionError(f"{what} {exc}") from None
        finally:
            index._entries = kept[0]
            for ns, space in index._spaces.items():
                space.entries = kept[1][ns]
        stats = await service.stats(every)  # and they are the blocks' figures
        assert sum(m.blocks for m in stats.models) == n and stats.tiers[0].pinned_blocks == n // chain
        assert stats.tiers[0].tokens == n * BLOCK_TOKENS
        assert sum(ns.referenced_blocks for ns in stats.namespaces) == n // 2
    finally:
        await srv.stop(0)
        await store.close()

"""The learned part of eviction (engram/eviction.py): comebacks and gones per class and age, the hit
density computed from them, ghosts of deleted blocks, the LeCaR weights between the recency and density
orders, and what it buys end to end in the real store (engram/trace/replay.py over BlockStore)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import eviction
from engram.eviction import CLOCK, DENSITY, RECENCY, ReturnModel, TierVictims, age_bucket, densities
from engram.index import BlockMeta
from engram.layout import DType
from engram.trace import replay_all
from engram.trace.synth import conversation_trace


def block(name: str, *, tier: str = "dram") -> BlockMeta:
    return BlockMeta(key=name.encode(), parent=b"", namespace="ns", model_fingerprint=b"fp", tokens=b"",
                     num_tokens=16, dtype=DType.BF16, shape=(1, 2, 16, 1, 1), nbytes=64, checksum=0,
                     locations=[tier], full=True)


class Store:
    """The blocks a model and a tier see, as the store would keep them."""

    def __init__(self, **model_args: int) -> None:
        self.blocks: dict[bytes, BlockMeta] = {}
        self.model = ReturnModel(lambda: list(self.blocks.values()), lambda: len(self.blocks), **model_args)
        self.tier = TierVictims("dram", self.blocks.get, self.model)

    def put(self, name: str) -> BlockMeta:
        meta = block(name)
        self.model.arrive(meta)
        self.blocks[meta.key] = meta
        self.tier.add(meta)
        return meta

    def delete(self, name: str) -> None:
        meta = self.blocks.pop(name.encode())
        meta.locations = []
        self.model.forget(meta)


def advance(n: int) -> None:
    """Other traffic: the clock moves on by n uses."""
    CLOCK.now += n


def brute_density(hits: list[float], gone: list[float], a: int) -> float:
    ages = eviction._AGES
    best = 0.0
    for t in range(a + 1, len(hits)):
        h = sum(hits[a + 1 : t + 1])
        occ = sum((min(ages[x], ages[t]) - ages[a]) * (hits[x] + gone[x]) for x in range(a + 1, len(hits)))
        if occ > 0:
            best = max(best, h / occ)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=2, max_size=24))
def test_densities_equal_the_definition_computed_directly(counts: list[tuple[int, int]]) -> None:
    hits = np.zeros((1, eviction._NB))
    gone = np.zeros((1, eviction._NB))
    for b, (h, g) in enumerate(counts):
        hits[0, b], gone[0, b] = h, g
    got = densities(hits, gone)[0]
    for a in range(len(counts)):
        assert abs(got[a] - brute_density(list(hits[0, :len(counts)]), list(gone[0, :len(counts)]), a)) < 1e-9
    assert not got[len(counts):].any()


def test_blocks_that_come_back_late_rank_a_young_block_below_one_about_to_return() -> None:
    """Every block comes back 900 uses after its use, never sooner: one used a moment ago has the longest
    wait ahead, one used 700 uses ago the shortest, and one idle past every comeback will not return."""
    s = Store(horizon=16)
    for i in range(400):
        meta = s.put(f"b{i}")
        advance(900)
        s.model.use(meta)  # its comeback, at age 901 (within the first horizon, 1,024 uses)
    s.model.recompute()
    d = s.model.density
    assert d is not None
    young, ripe, late = (d[0][age_bucket(a)] for a in (10, 700, 3000))  # class 0: unheld, no comeback yet
    assert young < ripe
    assert late == 0.0


def test_the_order_is_least_recently_used_until_enough_comebacks_are_seen() -> None:
    s = Store()
    metas = [s.put(f"b{i}") for i in range(5)]
    s.model.use(metas[0])  # b0 is now the most recently used
    assert s.model.density is None
    found = s.tier.victim(leaf_only=True)
    assert found is not None and found.key == b"b1"


def test_a_deleted_block_put_again_counts_as_a_comeback_at_its_true_age_and_keeps_its_reuse() -> None:
    s = Store()
    meta = s.put("x")
    s.model.use(meta)
    assert meta.uses == 1
    s.delete("x")
    advance(300)
    before = sum(s.model.hits[meta.cls])
    again = s.put("x")
    assert again.uses == 2  # a reuser, across its deletion
    assert sum(s.model.hits[meta.cls]) == before + 1
    bucket = age_bucket(again.tick - meta.tick)
    assert s.model.hits[meta.cls][bucket] >= 1


def test_a_block_idle_past_the_horizon_counts_gone_once_and_its_late_use_counts_no_comeback() -> None:
    s = Store(horizon=1)  # horizon: max(1024, 1 x blocks)
    meta = s.put("idle")
    s.model.recompute()  # sets the horizon for the 1 stored block: 1024 uses
    advance(5000)
    s.model.recompute()
    cls = 0
    assert meta.cls == -1
    assert sum(s.model.gone[cls]) == 0.5  # counted once, then halved with every count
    hits_before = sum(map(sum, s.model.hits))
    s.model.use(meta)
    assert sum(map(sum, s.model.hits)) == hits_before
    assert meta.cls == 1  # a use like any other from now on


def test_an_order_whose_victim_comes_back_soon_loses_weight() -> None:
    s = Store()
    meta = s.put("v")
    meta.chosen = 1 << DENSITY
    s.delete("v")
    advance(5)
    s.put("v")
    assert s.model.weights[DENSITY] < 0.5 < s.model.weights[RECENCY]
    meta = s.put("w")
    meta.chosen = 1 << RECENCY
    s.delete("w")
    advance(10**9)  # back after ages: no regret worth the name
    w = list(s.model.weights)
    s.put("w")
    assert abs(s.model.weights[RECENCY] - w[RECENCY]) < 1e-6


def test_a_warm_model_picks_by_the_order_its_weights_draw() -> None:
    s = Store()
    s.model.hits[0][age_bucket(2000)] = 100  # blocks come back 2,000 uses after their last use, never sooner
    s.model.evidence = 1000
    s.model.recompute()
    assert s.model.density is not None
    ripe, young = s.put("ripe"), s.put("young")
    ripe.tick, young.tick = CLOCK.now - 1500, CLOCK.now - 10
    s.model.weights[:] = [1.0, 0.0]
    assert s.tier.victim(leaf_only=True) is ripe  # recency: the least recently used
    assert ripe.chosen & (1 << RECENCY)
    s.model.weights[:] = [0.0, 1.0]
    assert s.tier.victim(leaf_only=True) is young  # density: the young one waits longest for its comeback
    assert young.chosen == 1 << DENSITY


def test_the_store_beats_lru_on_chats_whose_think_time_outlasts_the_cache() -> None:
    """End to end through the real store (the trace replayer): conversations come back 30-600 s after each
    turn, more traffic than the cache holds arrives meanwhile, and LRU evicts each one before it returns."""
    trace = conversation_trace(600, seed=5)
    res = {r.policy: r for r in replay_all(trace, [300], policies=("engram", "lru"))}
    assert res["engram"].hit_blocks > 1.1 * res["lru"].hit_blocks


def test_the_ghost_tables_stay_bounded() -> None:
    s = Store()
    for i in range(3000):  # 3,000 blocks put and deleted, with at most one stored at a time
        s.put(f"g{i}")
        s.delete(f"g{i}")
    assert len(s.model.ghosts) <= eviction.GHOSTS_PER_BLOCK * 1 + 1024
    assert len(s.model.ghosts) + len(s.model.past) <= 3000
    s.model.recompute()
    assert len(s.model.past) <= 65536


def test_a_large_store_checks_a_sample_of_its_blocks_for_idleness(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(eviction, "SWEEP_MAX", 100)
    s = Store()
    metas = [s.put(f"i{i}") for i in range(300)]
    advance(10**6)
    s.model.recompute()
    assert sum(m.cls == -1 for m in metas) == 100  # counted gone: the sample only, once each
    s.model.recompute()
    assert 100 < sum(m.cls == -1 for m in metas) <= 200  # the next recomputation samples others too


def test_a_store_configured_for_lru_never_ranks_by_density(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """tiers.eviction = "lru": the model still counts comebacks (Stats shows them) but never warms up, so
    every victim is least recently used; the same trace warms a learned store and decides differently."""
    from engram.trace import replay as trace_replay

    trace = conversation_trace(200, seed=3)
    made = []
    real_store = trace_replay.BlockStore

    def store(*args, eviction: str = "learned", **kwargs):  # type: ignore[no-untyped-def]
        made.append(real_store(*args, eviction=eviction, **kwargs))
        return made[-1]

    monkeypatch.setattr(trace_replay, "BlockStore", store)
    learned = replay_all(trace, [100], policies=("engram",))[0]
    assert made[-1].placement.model.density is not None
    monkeypatch.setattr(trace_replay, "BlockStore", lambda *a, **k: store(*a, eviction="lru", **k))
    plain = replay_all(trace, [100], policies=("engram",))[0]
    model = made[-1].placement.model
    assert model.density is None and model.evidence > 10 * eviction.MIN_EVIDENCE
    assert plain.hit_blocks != learned.hit_blocks


async def test_another_tenant_putting_the_same_tokens_inherits_nothing_from_a_deleted_blocks_ghost() -> None:
    """Keys are per namespace, so a ghost is too: a tenant who puts exactly the tokens another tenant's
    deleted blocks held gets fresh blocks (no comeback, no reuse count), and cannot learn from the model
    that the other tenant ever stored them."""
    from helpers import dram_store, put_tokens, tokens

    store, fp = dram_store()
    toks = tokens(3 * 16, seed=8)
    theirs = await put_tokens(store, "victim", fp, toks)
    store.lookup("victim", fp, toks)  # reused once: a reuser class
    for meta in reversed(theirs):
        await store.remove(meta)
    model = store.placement.model
    assert {m.key for m in theirs} <= set(model.ghosts)
    before = model.evidence
    mine = await put_tokens(store, "attacker", fp, toks)
    assert [m.uses for m in mine] == [0, 0, 0]
    assert model.evidence == before  # no comeback was counted for the attacker's puts
    assert not {m.key for m in mine} & {m.key for m in theirs}

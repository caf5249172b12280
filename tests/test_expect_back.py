"""Sessions' hints of when they are back (AppendSession expect_back_ms; a trace's back_ms): blocks point at the
hint of the session holding them, eviction's hint order gives up the session due back last first, a hint
lapses when its session is very late, and the whole path through the daemon, the trace format, the workload
generator and the replayer. Real store, real DRAM tier, real gRPC daemon."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram import errors, eviction
from engram.api import SessionMode
from engram.client import EngramClient
from engram.errors import InvalidArgument
from engram.eviction import HINT, RECENCY, Expected, TierVictims
from engram.index import BlockMeta
from engram.layout import DType
from engram.registry import ModelRegistry
from engram.replay.runtime import ReplayRuntime
from engram.sessions import SessionManager
from engram.store import BlockStore
from engram.tiers.dram import DramTier
from engram.trace import TierSpec, read_trace, replay_all, write_trace
from engram.trace.synth import agent_workload

from helpers import dram_store, put_tokens, random_kv, tiny_model, tokens

PERSIST = SessionMode.PERSIST


def block(name: str) -> BlockMeta:
    return BlockMeta(key=name.encode(), parent=b"", namespace="ns", model_fingerprint=b"fp", tokens=b"",
                     num_tokens=16, dtype=DType.BF16, shape=(1, 2, 16, 1, 1), nbytes=64, checksum=0,
                     locations=["dram"], full=True)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


def daemon(capacity_blocks: int) -> tuple[BlockStore, bytes, SessionManager, Clock]:
    store, fp = dram_store(capacity_blocks)
    clock = Clock()
    store.placement.model.clock_ms = clock
    return store, fp, SessionManager(store, ReplayRuntime([])), clock


def warm(store: BlockStore, weights: list[float]) -> None:
    """A model past its cold start, drawing orders by `weights` (recency, density, hint)."""
    model = store.placement.model
    model.hits[0][eviction.age_bucket(100)] = 1000
    model.evidence = 10 * eviction.MIN_EVIDENCE
    model.recompute()
    assert model.density is not None
    model.weights[:] = weights


async def test_a_sessions_blocks_point_at_its_hint_and_forget_it_when_it_lets_go() -> None:
    store, fp, sm, clock = daemon(64)
    bt = tiny_model().layout.block_tokens
    blocks = await put_tokens(store, "ns", fp, tokens(3 * bt, seed=1))
    a = sm.open("ns", fp, PERSIST, session_id="a", tokens=tokens(3 * bt, seed=1))
    assert store.placement.model.weights[HINT] == 0 and not store.placement.model.hinted
    sm.expect_back(a, 1500)
    assert all(m.holder is a.expected for m in blocks)
    assert a.expected.due == clock.ms + 1500 and a.info().expect_back_ms == 1500
    assert store.placement.model.weights[HINT] == pytest.approx(1 / 3)  # the hint order takes part from now
    b = sm.open("ns", fp, PERSIST, session_id="b", tokens=tokens(2 * bt, seed=1))  # a sub-agent on 2 of them
    assert [m.holder for m in blocks] == [b.expected, b.expected, a.expected]
    sm.close("ns", "b")
    assert [m.holder for m in blocks] == [None, None, a.expected]  # b's hint is gone with b
    c = sm.fork("ns", "a", "c")  # a sub-agent forking a's history: a's blocks point at c's hint (none) ...
    assert all(m.holder is c.expected and m.refs == 2 for m in blocks)
    sm.close("ns", "c")  # ... and at a's again when it ends
    assert all(m.holder is a.expected and m.refs == 1 for m in blocks)
    sm.append("ns", "a", tokens(0))  # a turn that says nothing: the hint given before lapses
    assert a.expected.due == 0 and a.info().expect_back_ms == 0
    sm.close("ns", "a")
    assert all(m.holder is None and m.refs == 0 for m in blocks)


async def test_hints_outside_zero_to_a_day_are_refused_and_change_nothing() -> None:
    store, fp, sm, _ = daemon(64)
    bt = tiny_model().layout.block_tokens
    s = sm.open("ns", fp, PERSIST, session_id="s", tokens=tokens(bt, seed=1))
    for bad in (-1, 86_400_001):
        with pytest.raises(InvalidArgument, match="expect_back_ms"):
            sm.append("ns", "s", tokens(bt, seed=2), expect_back_ms=bad)
        with pytest.raises(InvalidArgument, match="expect_back_ms"):
            sm.expect_back(s, bad)
    assert len(s.tokens) == bt and s.expected.due == 0 and not store.placement.model.hinted


async def test_the_hint_order_gives_up_the_session_due_back_last_first() -> None:
    """Two sessions' chains fill the tier; the older one's client says it is back in 200 ms (a file read),
    the newer one's in two minutes (its user). Recency would take the older chain's tail; the hint order takes
    the newer one's, and then lets a hint lapse once its session is three waits late."""
    store, fp, sm, clock = daemon(4)
    bt = tiny_model().layout.block_tokens
    soon = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=1))
    s_soon = sm.open("ns", fp, PERSIST, session_id="soon", tokens=tokens(2 * bt, seed=1))
    late = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=2))
    s_late = sm.open("ns", fp, PERSIST, session_id="late", tokens=tokens(2 * bt, seed=2))
    sm.expect_back(s_soon, 200)
    sm.expect_back(s_late, 120_000)
    warm(store, [0.0, 0.0, 1.0])
    await put_tokens(store, "ns", fp, tokens(bt, seed=3))
    assert [store.holds("ns", m.key) for m in soon + late] == [True, True, True, False]
    victim = [m for m in late if not store.holds("ns", m.key)]
    assert store.placement.model.ghosts[victim[0].key][3] & (1 << HINT)  # chosen by the hint order

    third = sm.open("ns", fp, PERSIST, session_id="third", tokens=tokens(bt, seed=3))
    sm.expect_back(third, 60_000)
    clock.ms += 200 + 3 * 1000 + 1  # "soon" is late by three times its wait (at least 3 s): its hint lapsed
    await put_tokens(store, "ns", fp, tokens(bt, seed=4))
    # A lapsed hint counts as none, which goes before every live one; had it held, "late" would have gone.
    assert [store.holds("ns", m.key) for m in soon + late[:1]] == [True, False, True]

    # The same tier without hints: least recently used takes the older chain's tail.
    store, fp, sm, _ = daemon(4)
    soon = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=1))
    sm.open("ns", fp, PERSIST, session_id="soon", tokens=tokens(2 * bt, seed=1))
    late = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=2))
    sm.open("ns", fp, PERSIST, session_id="late", tokens=tokens(2 * bt, seed=2))
    warm(store, [1.0, 0.0, 0.0])
    await put_tokens(store, "ns", fp, tokens(bt, seed=3))
    assert [store.holds("ns", m.key) for m in soon + late] == [True, False, True, True]


def test_a_hint_order_whose_victim_comes_back_soon_loses_weight() -> None:
    store, _, _, _ = daemon(8)
    model = store.placement.model
    model.hint_seen()
    before = list(model.weights)
    model._regret(1 << HINT, 1)  # its victim was put again one use after it went
    assert model.weights[HINT] < before[HINT] and model.weights[RECENCY] > before[RECENCY]
    assert sum(model.weights) == pytest.approx(1.0)


# ---- through the daemon ------------------------------------------------------------------------------------


async def test_append_session_carries_the_hint_and_stats_show_the_hint_order(server_factory: Any) -> None:
    srv = await server_factory()
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(tiny_model())
        s = await c.open_session(fp, mode="persist")
        assert (await c.stats()).eviction.hint_weight == 0
        info = await c.append_session(s.session_id, tokens(16, seed=1), expect_back_ms=2500)
        assert info.expect_back_ms == 2500
        assert (await c.stats()).eviction.hint_weight == pytest.approx(1 / 3)
        with pytest.raises(errors.InvalidArgument, match="expect_back_ms"):
            await c.append_session(s.session_id, tokens(16, seed=2), expect_back_ms=86_400_001)
        assert (await c.append_session(s.session_id, tokens(16, seed=3))).expect_back_ms == 0  # the daemon is up
        assert (await c.append_session(s.session_id, tokens(0))).tokens == 32  # the refused append added nothing


# ---- traces: the format, the generator, the replayer ---------------------------------------------------------


def test_back_ms_is_read_written_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "hash_ids": [1, 2], "session": "s", "back_ms": 700}) + "\n")
    [r] = read_trace(path)
    assert r.back_ms == 700
    write_trace(tmp_path / "u.jsonl", [r])
    assert read_trace(tmp_path / "u.jsonl") == [r]
    for bad, why in (({"session": "s", "back_ms": -5}, "non-negative"), ({"back_ms": 5}, "without session")):
        path.write_text(json.dumps({"timestamp": 0, "hash_ids": [1]} | bad) + "\n")
        with pytest.raises(InvalidArgument, match=f"t.jsonl:1: .*{why}"):
            read_trace(path)


def _pressed(**kw: Any) -> list[Any]:
    """Many agents at once whose contexts outgrow the cache: who comes back when decides the hits."""
    return agent_workload(sessions=12, seed=4, system_blocks=16, tool_blocks=8, repo_blocks=8, turns=(20, 40),
                          tool_result_blocks=(2, 16), arrival_ms=1000, subagent_p=0.02, **kw)


def test_the_generators_hints_change_no_id_or_time() -> None:
    hinted, bare = _pressed(), _pressed(hint_noise=-1)
    assert [(r.timestamp, r.hash_ids) for r in hinted] == [(r.timestamp, r.hash_ids) for r in bare]
    assert all(r.back_ms == 0 for r in bare)
    nexts: dict[str, int] = {}
    gaps = []
    for r in reversed(hinted):
        if r.back_ms and r.session in nexts:
            gaps.append(r.back_ms / (nexts[r.session] - r.timestamp))
        nexts[r.session] = r.timestamp
    assert len(gaps) > 0.8 * len(hinted) - 12 * 2  # nearly every request but the last says when it is back
    assert 0.5 < sorted(gaps)[len(gaps) // 2] < 2  # a tool call's hint is its wait within a log-normal error


def test_hints_raise_the_stores_hits_when_agents_outgrow_the_cache() -> None:
    trace = _pressed()
    cap = [600]
    with_hints = replay_all(trace, cap, policies=("engram",))[0]
    without = replay_all(trace, cap, policies=("engram",), hints=False)[0]
    bare = replay_all(_pressed(hint_noise=-1), cap, policies=("engram",))[0]
    assert without.hit_blocks == bare.hit_blocks  # hints=False is a trace without them
    assert with_hints.eviction is not None and with_hints.eviction.hint_weight > 0
    assert without.eviction is not None and without.eviction.hint_weight == 0
    assert with_hints.hit_blocks > 1.05 * without.hit_blocks


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.one_of(st.none(), st.tuples(st.integers(0, 20_000),
                                                                           st.integers(0, 5_000))),
                          st.integers(1, 50)), min_size=1, max_size=20),
       st.integers(0, 30_000))
def test_the_hint_orders_pick_equals_its_definition(cands: list[tuple[int, Any, int]], now_ms: int) -> None:
    """Lowest held class first; within it the latest due back, a block without a live hint (none, 0, or its
    session late by HINT_LAPSE x its wait, at least HINT_LAPSE s) before all; then the least recently used."""
    metas = []
    for i, (refs, hint, tick) in enumerate(cands):
        m = block(f"b{i}")
        m.refs, m.tick = refs, tick
        if hint is not None:
            m.holder = Expected()
            m.holder.due, m.holder.wait = float(hint[0]), float(hint[1])
        metas.append(m)

    def due(m: BlockMeta) -> float:
        h = m.holder
        live = h is not None and h.due and now_ms <= h.due + eviction.HINT_LAPSE * max(h.wait, 1000.0)
        return h.due if live else math.inf

    want = min(metas, key=lambda m: (min(m.refs, 2), -due(m), m.tick))
    assert TierVictims._hint_best(metas, now_ms) is want


# ---- prefetch: a hinted session's blocks come up before it is due --------------------------------------------


async def two_tiers(top_blocks: int) -> tuple[BlockStore, bytes, SessionManager, Clock, int]:
    spec = tiny_model()
    nb = spec.layout.block_nbytes(spec.layout.block_tokens)
    store = BlockStore([DramTier(top_blocks * nb), DramTier(64 * nb, name="nvme")], ModelRegistry(default_codec="raw"))
    fp = store.registry.register(spec)
    clock = Clock()
    store.placement.model.clock_ms = clock
    return store, fp, SessionManager(store, ReplayRuntime([]), prefetch_lead_ms=1000), clock, spec.layout.block_tokens


async def move_down(store: BlockStore, metas: list[BlockMeta]) -> None:
    """Leave each block's only copy in the lower tier (as a demotion would)."""
    for m in metas:
        if "nvme" not in m.locations:  # (a daemon's write-back may have copied it down already)
            await store.placement.place(m, 1, bytes(await store.placement.tier("dram").read(m.key)))
        await store.placement.drop_spare_copy(m, "dram")
    assert all(m.locations == ["nvme"] for m in metas)


async def test_a_hinted_session_has_its_blocks_copied_up_before_it_is_due_and_nothing_served() -> None:
    store, fp, sm, clock, bt = await two_tiers(8)
    a_blocks = await put_tokens(store, "ns", fp, tokens(3 * bt, seed=1))
    a = sm.open("ns", fp, PERSIST, session_id="a", tokens=tokens(3 * bt, seed=1))
    await move_down(store, a_blocks)
    served = store.counters.blocks_served
    sm.expect_back(a, 10_000)
    clock.ms += 8_000
    assert await sm.prefetch_due() == 0 and all(m.locations == ["nvme"] for m in a_blocks)  # not yet
    clock.ms += 1_500  # within prefetch_lead_ms of its due time
    assert await sm.prefetch_due() == 3
    assert all(m.locations[0] == "dram" for m in a_blocks)
    assert store.counters.blocks_prefetched == 3 and store.counters.blocks_served == served  # no hit counted
    assert all(m.leases == 0 for m in a_blocks) and store.placement.busy == 0
    assert await sm.prefetch_due() == 0  # once


async def test_prefetch_skips_sessions_closed_or_rehinted_and_never_copies_a_corrupt_block_up() -> None:
    store, fp, sm, clock, bt = await two_tiers(8)
    a_blocks = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=1))
    b_blocks = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=2))
    a = sm.open("ns", fp, PERSIST, session_id="a", tokens=tokens(2 * bt, seed=1))
    b = sm.open("ns", fp, PERSIST, session_id="b", tokens=tokens(2 * bt, seed=2))
    await move_down(store, a_blocks + b_blocks)
    sm.expect_back(a, 2_000)
    sm.expect_back(b, 2_000)
    sm.expect_back(a, 60_000)  # a's client changed its mind: a tool call that takes a minute
    sm.close("ns", "b")
    clock.ms += 1_500
    assert await sm.prefetch_due() == 0
    assert all(m.locations == ["nvme"] for m in a_blocks + b_blocks)

    lower = store.placement.tier("nvme")
    assert isinstance(lower, DramTier)
    lower._blocks[a_blocks[1].key] = bytes(len(lower._blocks[a_blocks[1].key]))  # its only copy rots
    clock.ms += 58_000
    assert await sm.prefetch_due() == 1  # the head came up; the corrupt block was dropped, not copied
    assert a_blocks[0].locations[0] == "dram" and not store.holds("ns", a_blocks[1].key)
    assert store.counters.corrupt_blocks == 1


async def test_the_daemon_prefetches_a_hinted_sessions_blocks_from_nvme(server_factory: Any, tmp_path: Path) -> None:
    srv = await server_factory(**{"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.prefetch_lead_ms": 1000})
    async with EngramClient(srv.address) as c:
        spec = tiny_model()
        fp = await c.register_model(spec)
        toks = tokens(3 * spec.layout.block_tokens, seed=1)
        keys = (await c.put(fp, toks, random_kv(spec, len(toks)))).keys
        s = await c.open_session(fp, mode="persist", tokens=toks)
        metas = [srv.store.index.get(k) for k in keys]
        await move_down(srv.store, [m for m in metas if m is not None])  # as if demoted while the session waited
        await c.append_session(s.session_id, tokens(0), expect_back_ms=1200)  # prefetched from 200 ms on
        for _ in range(250):
            if all(m is not None and m.locations[0] == "dram" for m in metas):
                break
            await asyncio.sleep(0.02)
        assert all(m is not None and m.locations[0] == "dram" for m in metas)
        assert srv.store.counters.blocks_prefetched == 3 == (await c.stats()).blocks_prefetched


def test_prefetch_moves_a_replays_hits_from_the_lower_tier_to_the_top_one() -> None:
    trace = _pressed()
    nb = replay_all(trace[:1], [1], block_bytes=4096, policies=("engram",))[0].tiers[0].capacity_bytes
    tiers = [TierSpec("dram", 600 * nb), TierSpec("nvme", 2000 * nb)]
    runs = {lead: replay_all(trace, [], 4096, policies=("engram",), tiers=tiers, prefetch_lead_ms=lead)[0]
            for lead in (0, 1000)}
    lower = {lead: r.tiers[1].hits for lead, r in runs.items()}
    assert lower[1000] < 0.85 * lower[0]
    assert abs(runs[1000].hit_blocks - runs[0].hit_blocks) < 0.01 * runs[0].hit_blocks  # the same hits, mostly


async def test_planned_prefetches_stay_bounded_when_a_client_hints_again_and_again() -> None:
    store, fp, sm, _, bt = await two_tiers(8)
    s = sm.open("ns", fp, PERSIST, session_id="s", tokens=tokens(bt, seed=1))
    for i in range(5000):  # a day ahead each time: none is due while this runs
        sm.expect_back(s, 86_400_000 - i)
    assert len(sm._due) <= 2 * 1 + 1024 + 1
    assert sum(sm._current(d[2], d[3]) for d in sm._due) == 1


async def test_the_prefetcher_outlives_a_failed_round_and_stops_when_cancelled(monkeypatch: Any) -> None:
    store, fp, sm, _, _ = await two_tiers(8)
    rounds: list[int] = []

    async def flaky() -> int:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise OSError("the NVMe tier went away for a moment")
        return 0

    monkeypatch.setattr(sm, "prefetch_due", flaky)
    task = asyncio.get_running_loop().create_task(sm.run_prefetch(period_s=0.001))
    for _ in range(500):
        if len(rounds) >= 3:
            break
        await asyncio.sleep(0.002)
    assert len(rounds) >= 3 and not task.done()  # the failed first round was logged, the next ones ran
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_bench_trace_uses_the_traces_hints_unless_told_not_to(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from engram.cli.main import app

    path = tmp_path / "w.jsonl"
    write_trace(path, _pressed())

    def run(*args: str) -> dict[str, Any]:
        res = CliRunner().invoke(app, ["bench", "trace", str(path), "--capacity", "600", "--policy", "engram",
                                       "--json", "--block-bytes", "4096", *args])
        assert res.exit_code == 0, res.output
        [row] = json.loads(res.output)
        return row

    hinted, bare = run(), run("--no-hints")
    assert hinted["eviction"]["hint_weight"] > 0 and bare["eviction"]["hint_weight"] == 0
    assert hinted["hit_blocks"] > bare["hit_blocks"]
    bad = CliRunner().invoke(app, ["bench", "trace", str(path), "--prefetch-lead-ms", "-1"])
    assert bad.exit_code == 4 and "--prefetch-lead-ms" in bad.output


async def test_a_tenant_cannot_hint_another_tenants_session(server_factory: Any) -> None:
    """Bob names Alice's session id in his own namespace and in hers: NOT_FOUND and PERMISSION_DENIED, and
    Alice's blocks keep her word, not his."""
    srv = await server_factory(**{"auth.tenants.alice.token": "a", "auth.tenants.bob.token": "b",
                                  "auth.salt_secret": "s"})
    async with EngramClient(srv.address, token="a", namespace="alice") as alice, \
            EngramClient(srv.address, token="b", namespace="bob") as bob:
        fp = await alice.register_model(tiny_model())
        await bob.register_model(tiny_model())
        toks = tokens(32, seed=1)
        await alice.put(fp, toks, random_kv(tiny_model(), 32))
        s = await alice.open_session(fp, mode="persist", tokens=toks)
        await alice.append_session(s.session_id, tokens(0), expect_back_ms=60_000)
        with pytest.raises(errors.NotFound):
            await bob.append_session(s.session_id, tokens(0), expect_back_ms=1)
        with pytest.raises(errors.PermissionDenied):
            await bob.append_session(s.session_id, tokens(0), expect_back_ms=1, namespace="alice")
        session = srv.sessions.get("alice", s.session_id)
        assert session.expected.wait == 60_000 and len(session.held) == 2
        assert all(m.holder is session.expected for m in session.held.values())

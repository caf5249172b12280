"""SessionManager on its own (engram/sessions.py), over a real BlockStore and DRAM tier and a tiny real replay
model: the lifecycle (open, append, fork, suspend, close), the references a live session holds on its
prefix's blocks, the three modes, hot windows (kept until suspend, append or LRU push-out), and errors."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from engram.api import SessionMode
from engram.errors import FailedPrecondition, InvalidArgument, NotFound
from engram.index import BlockMeta
from engram.layout import DType
from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern
from engram.replay.runtime import ReplayRuntime, model_spec_for
from engram.sessions import SessionManager, Window
from engram.store import BlockStore

from helpers import dram_store, put_tokens

BT = 16
W = 4
EXACT, APPROX, PERSIST = SessionMode.EXACT, SessionMode.APPROX, SessionMode.PERSIST


@pytest.fixture(scope="module")
def model() -> HybridDecoder:
    return HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=W, dtype=torch.float32, seed=3), device="cpu")


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.int32)


class Daemon:
    """What the server wires together, minus gRPC: a store, a runtime with the model, sessions."""

    def __init__(self, model: HybridDecoder, *, capacity_blocks: int = 64, max_hot_windows: int = 64,
                 replay: bool = True) -> None:
        self.model = model
        self.store: BlockStore
        self.store, self.fp = dram_store(capacity_blocks, model_spec_for(model, block_tokens=BT))
        self.sessions = SessionManager(self.store, ReplayRuntime([model] if replay else []),
                                       max_hot_windows=max_hot_windows)

    async def put(self, t: np.ndarray, namespace: str = "ns") -> list[BlockMeta]:
        res = self.model.prefill(torch.as_tensor(t, dtype=torch.long), logits=False)
        kv = torch.stack([torch.stack((k, v)) for k, v in res.global_kv])  # (global layers, 2, T, H, D)
        return await put_tokens(self.store, namespace, self.fp, t, kv)

    def window(self, t: np.ndarray, p: int | None = None) -> Window:
        """The SWA window a worker would upload for a query at p (the prefill's own)."""
        p = len(t) if p is None else p
        res = self.model.prefill(torch.as_tensor(t[:p], dtype=torch.long), logits=False)
        cfg = self.model.config
        return Window.from_swa(res.swa_window(p), DType.FP32, cfg.n_kv_heads, cfg.head_dim)


def refs(blocks: list[BlockMeta]) -> list[int]:
    return [m.refs for m in blocks]


# ---- open and modes ----------------------------------------------------------------------------------------


async def test_open_records_the_mode_and_refuses_replay_modes_without_a_model(model: HybridDecoder) -> None:
    d = Daemon(model, replay=False)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=toks(8))
    assert s.mode == PERSIST and len(s.tokens) == 8 and s.tokens.dtype == np.int32
    for mode, k in ((EXACT, 0.0), (APPROX, 1.0)):  # refused at open, not at the first Resume
        with pytest.raises(FailedPrecondition, match="no replay model"):
            d.sessions.open("ns", d.fp, mode, approx_k=k)
    assert len(d.sessions) == 1


async def test_open_errors_say_what_to_change(model: HybridDecoder) -> None:
    d = Daemon(model)
    with pytest.raises(InvalidArgument, match="approx_k > 0"):
        d.sessions.open("ns", d.fp, APPROX, approx_k=0.0)
    with pytest.raises(NotFound):
        d.sessions.open("ns", b"\x00" * 16, PERSIST)  # an unregistered model
    d.sessions.open("ns", d.fp, EXACT, session_id="agent")
    with pytest.raises(InvalidArgument, match="already exists in this namespace"):
        d.sessions.open("ns", d.fp, PERSIST, session_id="agent")
    d.sessions.open("other", d.fp, PERSIST, session_id="agent")  # ids are per namespace
    assert d.sessions.count_in("ns") == d.sessions.count_in("other") == 1


async def test_another_namespaces_session_is_reported_like_an_absent_one(model: HybridDecoder) -> None:
    d = Daemon(model)
    d.sessions.open("alice", d.fp, PERSIST, session_id="s1")
    with pytest.raises(NotFound) as foreign:
        d.sessions.get("bob", "s1")
    with pytest.raises(NotFound) as absent:
        d.sessions.get("bob", "s2")
    assert str(foreign.value).replace("s1", "ID") == str(absent.value).replace("s2", "ID")
    for call in (d.sessions.suspend, d.sessions.close):
        with pytest.raises(NotFound):
            call("bob", "s1")
    assert d.sessions.get("alice", "s1").namespace == "alice"


async def test_sessions_per_namespace_count_opens_forks_and_closes(model: HybridDecoder) -> None:
    """Stats asks every namespace for its live sessions: a count kept as sessions open and close (a scan of every
    session per namespace took 2.4 s behind 10,000 namespaces, an audit), equal to the scan."""
    d = Daemon(model)
    for i in range(6):
        d.sessions.open(f"ns{i % 3}", d.fp, PERSIST, session_id=f"s{i}", tokens=toks(8))
    d.sessions.fork("ns0", "s0", "fork")
    d.sessions.close("ns1", "s1")
    d.sessions.close("ns1", "s4")
    for ns in ("ns0", "ns1", "ns2", "never"):
        assert d.sessions.count_in(ns) == sum(1 for s in d.sessions.sessions() if s.namespace == ns)
    assert [d.sessions.count_in(ns) for ns in ("ns0", "ns1", "ns2")] == [3, 0, 2]
    assert d.sessions.count(["ns0", "ns2"]) == 5


# ---- references on prefix blocks ---------------------------------------------------------------------------


async def test_a_session_references_every_stored_block_of_its_prefix_and_close_drops_them(
        model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(3 * BT)
    blocks = await d.put(t)
    a = d.sessions.open("ns", d.fp, EXACT, tokens=t[: 2 * BT + 5])  # two full blocks and 5 tokens of the third
    assert refs(blocks) == [1, 1, 1]
    assert set(a.held) == {m.key for m in blocks}
    b = d.sessions.open("ns", d.fp, EXACT, tokens=t[:BT])
    assert refs(blocks) == [2, 1, 1]
    d.sessions.close("ns", a.id)
    assert refs(blocks) == [1, 0, 0]
    d.sessions.close("ns", b.id)
    assert refs(blocks) == [0, 0, 0]
    assert d.store.namespace_usage("ns").referenced_blocks == 0
    with pytest.raises(NotFound):
        d.sessions.close("ns", a.id)


async def test_append_picks_up_blocks_put_since_and_moves_references_with_the_prefix(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(3 * BT)
    first = await d.put(t[:BT])
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t[: 2 * BT])
    assert set(s.held) == {first[0].key}  # only what is stored now
    rest = await d.put(t)  # the worker stores the whole history
    d.sessions.append("ns", s.id, t[2 * BT:])
    assert set(s.held) == {m.key for m in rest}
    assert refs(rest) == [1, 1, 1]  # the first block is counted once, not again


async def test_blocks_put_after_an_append_are_held_as_they_are_indexed(model: HybridDecoder) -> None:
    """A client may append before its put lands (the vLLM connector's saves run in the background): the
    session awaits its prefix's next block and holds it when it is put, then the next, up to a partial tail;
    another chain's blocks, or blocks put after the session closed, are not held."""
    d = Daemon(model, replay=False)
    t = toks(2 * BT + 5)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t)
    assert s.held == {}
    await d.put(toks(3 * BT, seed=9))  # another conversation
    assert s.held == {}
    blocks = await d.put(t)  # two full blocks and a partial one
    assert set(s.held) == {m.key for m in blocks} and refs(blocks) == [1, 1, 1]
    assert s.awaiting == b""  # the partial block ends the prefix
    d.sessions.append("ns", s.id, toks(BT, seed=3))  # the next turn, put after it again
    assert s.awaiting != b"" and len(s.held) == 3  # the partial block is a prefix of it still: held until ...
    more = await d.put(np.concatenate([t, toks(BT, seed=3)]))  # ... the whole block in its place is put
    assert set(s.held) == {m.key for m in more} and refs(more) == [1, 1, 1, 1] and blocks[2].refs == 0
    d.sessions.close("ns", s.id)
    later = d.sessions.open("ns", d.fp, PERSIST, tokens=toks(2 * BT, seed=5))
    d.sessions.close("ns", later.id)
    assert refs(await d.put(toks(2 * BT, seed=5))) == [0, 0]  # closed before the put: nothing awaits it


async def test_resume_references_blocks_put_after_open(model: HybridDecoder) -> None:
    d = Daemon(model, replay=False)
    t = toks(2 * BT)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t[:BT])
    d.sessions.append("ns", s.id, t[BT:], d.window(t))  # the worker uploads the window first ...
    assert s.held == {}
    blocks = await d.put(t)  # ... and the KV blocks after
    await d.sessions.resume("ns", s.id)
    assert set(s.held) == {m.key for m in blocks}
    assert refs(blocks) == [1, 1]


async def test_a_block_evicted_and_put_again_gets_the_reference_on_the_next_resolve(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT)
    old = await d.put(t)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t)
    await d.store.remove(old[1])  # the leaf goes (engram evict); the session still counts on the old entry
    assert set(s.held) == {m.key for m in old}
    new = await d.put(t)
    assert new[1] is not old[1] and new[1].key == old[1].key
    d.sessions.append("ns", s.id, t[:0])  # any Append (or Resume) re-resolves the prefix
    assert s.held[old[1].key] is new[1]
    assert (old[1].refs, new[1].refs, new[0].refs) == (0, 1, 1)


async def test_a_fork_holds_the_same_blocks_not_copies(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(3 * BT)
    blocks = await d.put(t)
    parent = d.sessions.open("ns", d.fp, APPROX, approx_k=2.0, tokens=t)
    before = len(d.store)
    child = d.sessions.fork("ns", parent.id, position=2 * BT)
    assert len(d.store) == before
    assert child.parent == parent.id and child.mode == APPROX and child.approx_k == 2.0
    np.testing.assert_array_equal(child.tokens, t[: 2 * BT])
    assert refs(blocks) == [2, 2, 1]
    child.tokens[0] += 1  # tokens are copied: the parent's stay as they were
    assert parent.tokens[0] == t[0]
    whole = d.sessions.fork("ns", parent.id)  # position 0: the parent's whole history
    assert len(whole.tokens) == len(t)
    with pytest.raises(InvalidArgument, match="past the parent's"):
        d.sessions.fork("ns", parent.id, position=len(t) + 1)


async def test_referenced_blocks_outlive_unreferenced_ones_under_pressure(model: HybridDecoder) -> None:
    d = Daemon(model, capacity_blocks=4)
    held = await d.put(toks(2 * BT, seed=1))  # the oldest chain: plain LRU would take its leaf first
    d.sessions.open("ns", d.fp, PERSIST, tokens=toks(2 * BT, seed=1))
    loose = await d.put(toks(2 * BT, seed=2))
    await d.put(toks(2 * BT, seed=3))  # needs two blocks of room
    assert all(d.store.holds("ns", m.key) for m in held)
    assert not any(d.store.holds("ns", m.key) for m in loose)


async def test_a_prefix_two_sessions_hold_outlives_one_sessions_newer_tail(model: HybridDecoder) -> None:
    d = Daemon(model, capacity_blocks=4)
    shared = await d.put(toks(2 * BT, seed=1))  # the oldest chain, held by two sessions
    for sid in ("s1", "s2"):
        d.sessions.open("ns", d.fp, PERSIST, session_id=sid, tokens=toks(2 * BT, seed=1))
    private = await d.put(toks(2 * BT, seed=2))  # newer, held by one
    d.sessions.open("ns", d.fp, PERSIST, session_id="s3", tokens=toks(2 * BT, seed=2))
    await d.put(toks(BT, seed=3))  # needs one block of room: recency alone would take the shared leaf
    d.sessions.open("ns", d.fp, PERSIST, session_id="s4", tokens=toks(BT, seed=3))
    assert [d.store.holds("ns", m.key) for m in shared + private] == [True, True, True, False]
    d.sessions.close("ns", "s2")  # one session holds the first chain now, and it is the oldest
    await d.put(toks(BT, seed=4))
    assert [d.store.holds("ns", m.key) for m in shared + private] == [True, False, True, False]


# ---- windows: persist mode ---------------------------------------------------------------------------------


async def test_persist_mode_serves_the_uploaded_window_and_keeps_it_through_suspend(model: HybridDecoder) -> None:
    d = Daemon(model, replay=False)
    t = toks(2 * BT)
    await d.put(t)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t[:BT])
    window = d.window(t)
    d.sessions.append("ns", s.id, t[BT:], window)
    d.sessions.suspend("ns", s.id)
    r = await d.sessions.resume("ns", s.id)
    assert (r.source, r.position, r.replayed) == ("persisted", 2 * BT, 0)
    assert r.window is window
    assert d.sessions.hot_count() == 0  # a persisted window is not a hot one
    assert d.sessions.window_bytes(persisted=True) == window.nbytes
    assert d.sessions.window_bytes(persisted=False) == 0


async def test_persist_mode_without_a_window_for_the_position_is_refused(model: HybridDecoder) -> None:
    d = Daemon(model, replay=False)
    t = toks(2 * BT)
    await d.put(t)
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=t[:BT])
    with pytest.raises(FailedPrecondition, match=r"holds no window for position 16 \(none\)"):
        await d.sessions.resume("ns", s.id)
    d.sessions.append("ns", s.id, t[BT:BT + 4], d.window(t, BT + 4))
    d.sessions.append("ns", s.id, t[BT + 4:])  # tokens without a window: the old one stays, for its position
    with pytest.raises(FailedPrecondition, match="one for position 20"):
        await d.sessions.resume("ns", s.id)
    assert (await d.sessions.resume("ns", s.id, position=BT + 4)).source == "persisted"


async def test_append_window_errors(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT)
    exact = d.sessions.open("ns", d.fp, EXACT, tokens=t[:BT])
    with pytest.raises(InvalidArgument, match="exact mode: the daemon rebuilds its window"):
        d.sessions.append("ns", exact.id, t[BT:], d.window(t))
    persist = d.sessions.open("ns", d.fp, PERSIST, tokens=t[:BT])
    with pytest.raises(InvalidArgument, match="serves position 20, the session will have 32"):
        d.sessions.append("ns", persist.id, t[BT:], d.window(t, BT + 4))
    good = d.window(t)
    short = Window(good.prefix_len, good.start + 1, good.dtype, good.shape, good.data, good.checksum)
    with pytest.raises(InvalidArgument, match="does not fit a query at 32"):
        d.sessions.append("ns", persist.id, t[BT:], short)
    corrupt = Window(good.prefix_len, good.start, good.dtype, good.shape, good.data, good.checksum ^ 1)
    with pytest.raises(InvalidArgument, match="do not match its shape and checksum"):
        d.sessions.append("ns", persist.id, t[BT:], corrupt)
    assert len(persist.tokens) == BT  # a refused append changes nothing
    assert persist.window is None


# ---- windows: replay modes and the hot set -----------------------------------------------------------------


async def test_resume_replays_once_then_serves_the_hot_window_until_suspend(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT + 5)
    await d.put(t)
    s = d.sessions.open("ns", d.fp, EXACT, tokens=t)
    r = await d.sessions.resume("ns", s.id)
    assert r.source == "replay" and r.position == len(t) and r.replayed > 0 and r.token_layers > 0
    assert r.window.data == d.window(t).data  # batch-invariant numerics: the prefill's window, bit for bit
    assert d.sessions.runtime.counters.replays == 1
    again = await d.sessions.resume("ns", s.id)
    assert (again.source, again.replayed) == ("hot", 0)
    assert again.window is r.window
    assert d.sessions.hot_count() == 1
    assert d.sessions.window_bytes(persisted=False) == r.window.nbytes
    d.sessions.suspend("ns", s.id)
    assert s.window is None and d.sessions.hot_count() == 0
    assert (await d.sessions.resume("ns", s.id)).source == "replay"
    assert d.sessions.runtime.counters.replays == 2


async def test_a_session_closed_during_its_resume_is_refused_and_leaves_nothing_hot(model: HybridDecoder) -> None:
    """CloseSession (or the idle closer) while the session's replay runs in a thread: the Resume answers
    NOT_FOUND, and the closed session is not put back in the hot set (it was, and every block leaving the
    memory tiers then raised in the cold listener: every later eviction, every tenant's put, failed)."""
    d = Daemon(model, capacity_blocks=4)
    t = toks(2 * BT + 5)
    await d.put(t)
    s = d.sessions.open("ns", d.fp, EXACT, tokens=t)
    started, go = threading.Event(), threading.Event()
    rebuild = d.sessions.runtime.rebuild

    def slow_rebuild(*args, **kw):  # type: ignore[no-untyped-def]
        started.set()
        go.wait(30)
        return rebuild(*args, **kw)

    d.sessions.runtime.rebuild = slow_rebuild  # type: ignore[method-assign]
    resume = asyncio.create_task(d.sessions.resume("ns", s.id))
    await asyncio.to_thread(started.wait, 30)
    d.sessions.close("ns", s.id)
    go.set()
    with pytest.raises(NotFound, match="closed during its Resume"):
        await resume
    assert d.sessions.hot_count() == 0
    for seed in range(1, 4):  # evictions from the memory tier run the cold listener
        await d.put(toks(2 * BT, seed=seed))
    assert d.store.counters.tiers["dram"].evictions > 0


async def test_a_failing_cold_listener_does_not_stop_an_eviction_halfway(model: HybridDecoder,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The went-cold listeners run after a copy stopped counting and before the tier deletes it: one that raises
    is logged, and the eviction goes on (it once left copies no index knew, their bytes held for good)."""
    d = Daemon(model, capacity_blocks=4)

    def broken(meta: BlockMeta) -> None:
        raise KeyError("a listener's bug")

    d.store.placement.went_cold.append(broken)
    for seed in range(3):
        await d.put(toks(2 * BT, seed=seed))
    dram = d.store.tiers[0]
    assert d.store.counters.tiers["dram"].evictions > 0 and "went-cold listener failed" in caplog.text
    assert dram.used_bytes == sum(m.nbytes for m in d.store.index if "dram" in m.locations)


async def test_append_makes_a_hot_window_stale(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT)
    await d.put(t)
    s = d.sessions.open("ns", d.fp, EXACT, tokens=t[:BT])
    await d.sessions.resume("ns", s.id)
    d.sessions.append("ns", s.id, t[BT:])
    assert s.window is None and d.sessions.hot_count() == 0
    r = await d.sessions.resume("ns", s.id)
    assert (r.source, r.position) == ("replay", 2 * BT)


async def test_approx_mode_replays_k_windows(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(3 * BT)
    await d.put(t)
    exact = d.sessions.open("ns", d.fp, EXACT, tokens=t)
    approx = d.sessions.open("ns", d.fp, APPROX, approx_k=1.0, tokens=t)
    assert (await d.sessions.resume("ns", approx.id)).replayed == W  # R = ceil(k * W)
    assert (await d.sessions.resume("ns", exact.id)).replayed == 2 * (W - 1)  # R = L_swa * (W - 1)


async def test_the_hot_set_pushes_out_the_least_recently_resumed_window(model: HybridDecoder) -> None:
    d = Daemon(model, max_hot_windows=2)
    t = toks(BT + 3)
    await d.put(t)
    a, b, c = (d.sessions.open("ns", d.fp, EXACT, tokens=t) for _ in range(3))
    await d.sessions.resume("ns", a.id)
    await d.sessions.resume("ns", b.id)
    assert (await d.sessions.resume("ns", a.id)).source == "hot"  # a is now the most recent
    await d.sessions.resume("ns", c.id)
    assert d.sessions.hot_count() == 2
    assert b.window is None and a.window is not None and c.window is not None
    assert (await d.sessions.resume("ns", b.id)).source == "replay"


async def test_a_fork_at_the_parents_window_position_shares_the_hot_window(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT)
    await d.put(t)
    parent = d.sessions.open("ns", d.fp, EXACT, tokens=t)
    r = await d.sessions.resume("ns", parent.id)
    child = d.sessions.fork("ns", parent.id)
    assert child.window is r.window and d.sessions.hot_count() == 2
    assert (await d.sessions.resume("ns", child.id)).source == "hot"
    early = d.sessions.fork("ns", parent.id, position=BT)  # another position: no window to share
    assert early.window is None


async def test_resume_errors(model: HybridDecoder) -> None:
    d = Daemon(model)
    t = toks(2 * BT)
    await d.put(t[:BT])
    empty = d.sessions.open("ns", d.fp, EXACT)
    with pytest.raises(InvalidArgument, match="no tokens to resume from"):
        await d.sessions.resume("ns", empty.id)
    s = d.sessions.open("ns", d.fp, EXACT, tokens=t)
    with pytest.raises(InvalidArgument, match="past the session's end"):
        await d.sessions.resume("ns", s.id, position=len(t) + 1)
    with pytest.raises(FailedPrecondition, match=r"positions \[16, 32\) is not stored"):
        await d.sessions.resume("ns", s.id)
    assert (await d.sessions.resume("ns", s.id, position=BT)).source == "replay"  # what is stored resumes
    with pytest.raises(NotFound):
        await d.sessions.resume("other", s.id)


async def test_moving_references_to_a_grown_prefix_or_to_another_one() -> None:
    """hold_blocks (the trace replayer's hold): a prefix that grew takes references on its new blocks only,
    one that changed lets go of the blocks it no longer has; each block counts one reference per session."""
    from helpers import tiny_model, tokens

    store, fp = dram_store()
    sm = SessionManager(store, ReplayRuntime([]))
    spec = tiny_model()
    bt = spec.layout.block_tokens
    a = await put_tokens(store, "ns", fp, tokens(4 * bt, seed=1))
    b = await put_tokens(store, "ns", fp, tokens(2 * bt, seed=2))
    s = sm.open("ns", fp, SessionMode.PERSIST)
    sm.hold_blocks(s, a[:2])
    sm.hold_blocks(s, a)  # the prefix grew
    assert [m.refs for m in a] == [1, 1, 1, 1] and list(s.held) == [m.key for m in a]
    sm.hold_blocks(s, a[:1] + b)  # another prefix (sharing nothing but a[0] in this list)
    assert [m.refs for m in a] == [1, 0, 0, 0] and [m.refs for m in b] == [1, 1]
    assert list(s.held) == [a[0].key] + [m.key for m in b]  # in the prefix's order
    sm.hold_blocks(s, a)  # back, and past where the two part
    sm.hold_blocks(s, a[:2])  # shorter: the tail's references go
    assert [m.refs for m in a] == [1, 1, 0, 0] and [m.refs for m in b] == [0, 0] and list(s.held) == [a[0].key, a[1].key]
    sm.hold_blocks(s, [])
    assert all(m.refs == 0 for m in a + b)


async def test_a_session_whose_tail_diverges_inside_a_stored_block_awaits_its_own(model: HybridDecoder) -> None:
    d = Daemon(model, replay=False)
    stored = toks(2 * BT)
    await d.put(stored)
    mine = np.concatenate([stored[: BT + 5], toks(6, seed=7)])  # block 1 shares 5 tokens, then goes its own way
    s = d.sessions.open("ns", d.fp, PERSIST, tokens=mine)
    assert len(s.held) == 2 and s.awaiting  # the stored block 1 is the best match, its own is awaited
    blocks = await d.put(mine)
    assert set(s.held) == {m.key for m in blocks} and refs(blocks) == [1, 1]  # its own tail, in place of ...
    assert d.store.match("ns", d.fp, stored).blocks[1].refs == 0  # ... the stored block it shared 5 tokens with

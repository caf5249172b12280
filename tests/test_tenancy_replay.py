"""Tenants' shares of the daemon's replay resources, through a real daemon with tokens: the queue of Resumes
waiting for a replay's turn (replay.max_queued_per_tenant) and the persisted windows
(replay.max_persisted_window_bytes_per_tenant). Both were daemon-wide only: one tenant's burst filled them and
every other tenant was refused. Each test pairs the refusal of the tenant over its share with the other tenant
being served, and ends with the shares' counters back where they started."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from test_limits import window_for
from test_sessions_replay import P, put_session, tokens_for

from engram import errors
from engram.client import EngramClient
from engram.replay import HybridDecoder
from engram.sessions import SessionManager

from helpers import BLOCK_TOKENS, tiny_model, tokens

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.bob.token": BOB, "auth.admin_tokens": ADMIN,
        "auth.salt_secret": "test-secret"}


def as_(srv: Any, token: str, namespace: str) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace=namespace)


async def queued_or_refused(sessions: SessionManager, call: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Start a Resume and return once it waits for a turn or has ended (refused)."""
    before = sessions._replay_turns.waiting
    task = asyncio.create_task(call)
    while not task.done() and sessions._replay_turns.waiting == before:
        await asyncio.sleep(0.01)
    return task


async def test_a_tenant_past_its_share_of_the_replay_queue_is_refused_and_another_still_waits_its_turn(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One replay at a time, two Resumes waiting in all, one a tenant: Alice's replay runs (held at a gate), one
    of hers waits, her next is refused naming replay.max_queued_per_tenant; Bob's still waits its turn (it was
    refused: Alice's burst had filled replay.max_queued) and is answered once the gate opens."""
    srv, gate, ran = await _one_replay_at_a_time(server_factory, model_file, tmp_path, monkeypatch)
    sessions = srv.sessions
    toks = tokens_for(P, seed=40)
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b:
        _, alice_sid = await put_session(a, model, toks)
        _, bob_sid = await put_session(b, model, toks)
        running = asyncio.create_task(a.resume(alice_sid, position=P))
        while not ran:
            await asyncio.sleep(0.01)
        waiting = await queued_or_refused(sessions, a.resume(alice_sid, position=P - 1))
        assert not waiting.done()
        over = await queued_or_refused(sessions, a.resume(alice_sid, position=P - 2))
        assert over.done(), "Alice's Resume past her share waits in the queue"
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_queued_per_tenant"):
            over.result()
        bobs = await queued_or_refused(sessions, b.resume(bob_sid, position=P))
        assert not bobs.done(), f"Bob's Resume was not queued: {bobs.exception() if bobs.done() else ''}"
        gate.set()
        results = await asyncio.gather(running, waiting, bobs)
        assert [r.source for r in results] == ["replay"] * 3
        assert results[2].position == P
    turns = sessions._replay_turns
    assert turns.waiting == 0 and not turns.tenants_waiting  # every share given back


async def test_an_admins_resumes_wait_outside_the_tenants_shares(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin acts on the whole daemon: its Resumes count against replay.max_queued only."""
    srv, gate, ran = await _one_replay_at_a_time(server_factory, model_file, tmp_path, monkeypatch)
    sessions = srv.sessions
    toks = tokens_for(P, seed=41)
    async with EngramClient(srv.address, token=ADMIN, namespace="ops") as admin:
        _, sid = await put_session(admin, model, toks)
        running = asyncio.create_task(admin.resume(sid, position=P))
        while not ran:
            await asyncio.sleep(0.01)
        waiting = [await queued_or_refused(sessions, admin.resume(sid, position=P - i)) for i in (1, 2)]
        assert not any(t.done() for t in waiting)
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_queued\)"):  # the daemon's bound
            await admin.resume(sid, position=P - 3)
        gate.set()
        assert [r.source for r in await asyncio.gather(running, *waiting)] == ["replay"] * 3
    assert sessions._replay_turns.waiting == 0 and not sessions._replay_turns.tenants_waiting


async def _one_replay_at_a_time(server_factory: Any, model_file: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> tuple[Any, threading.Event, list[int]]:
    """A daemon with tenancy running one replay at a time, two Resumes waiting at most (each tenant's share 1),
    its replays held at a gate (`hold_replays`)."""
    srv = await server_factory(**{**AUTH, "replay.models": str(model_file), "replay.max_concurrent": 1,
                                  "replay.max_queued": 2, "replay.max_queued_per_tenant": 1,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    gate, ran = hold_replays(srv.sessions, monkeypatch)
    return srv, gate, ran


def hold_replays(sessions: SessionManager, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[int]]:
    """Each replay waits at a gate (then runs the real rebuild); the positions replayed, in the order they ran."""
    gate, ran = threading.Event(), []
    real_rebuild = sessions.runtime.rebuild

    def rebuild_after_the_gate(model_, tokens, global_kv, mode):  # type: ignore[no-untyped-def]
        ran.append(len(tokens))
        assert gate.wait(30)
        return real_rebuild(model_, tokens, global_kv, mode)

    monkeypatch.setattr(sessions.runtime, "rebuild", rebuild_after_the_gate)
    return gate, ran


async def test_a_tenants_single_resume_waits_one_turn_per_other_tenant_not_for_its_whole_backlog(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One replay at a time: Alice's replay runs (held at a gate) and four more of hers wait, then Bob's one
    Resume: it runs after Alice's next, before her other three (first come, first served, it waited for all
    four of hers, seconds each). Every Resume is answered, and the queue's counts end where they started."""
    srv = await server_factory(**{**AUTH, "replay.models": str(model_file), "replay.max_concurrent": 1,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    sessions = srv.sessions
    gate, ran = hold_replays(sessions, monkeypatch)
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b:
        _, alice_sid = await put_session(a, model, tokens_for(P, seed=42))
        _, bob_sid = await put_session(b, model, tokens_for(P, seed=43))
        running = asyncio.create_task(a.resume(alice_sid, position=P))
        while not ran:
            await asyncio.sleep(0.01)
        alices = [await queued_or_refused(sessions, a.resume(alice_sid, position=P - i)) for i in (1, 2, 3, 4)]
        bobs = await queued_or_refused(sessions, b.resume(bob_sid, position=P - 10))
        assert not any(t.done() for t in (*alices, bobs))
        assert sessions._replay_turns.waiting_of("alice") == 4 and sessions._replay_turns.waiting_of("bob") == 1
        gate.set()
        results = await asyncio.gather(running, *alices, bobs)
        assert [r.source for r in results] == ["replay"] * 6
    assert ran == [P, P - 1, P - 10, P - 2, P - 3, P - 4]
    assert sessions._replay_turns.waiting == 0 and not sessions._replay_turns.tenants_waiting


async def test_resumes_cancelled_while_waiting_or_as_their_turn_comes_leave_the_queue_as_it_was(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice's replay runs (held at a gate), two of hers and two of Bob's wait. One of Alice's is cancelled by its
    client while it waits; the other is cancelled just as the running replay hands it its turn, before it runs
    (that one calls the daemon's session manager itself: a gRPC call cannot be cancelled at that instant, and
    its handler's task cancelled by hand never answers its client): that turn goes on to Bob's, and both of his
    run. No turn is lost and no count is left over: the queue is empty, the one turn free, and a later Resume
    of Alice's is served."""
    srv = await server_factory(**{**AUTH, "replay.models": str(model_file), "replay.max_concurrent": 1,
                                  "replay.max_queued_per_tenant": 2, "tiers.nvme.path": str(tmp_path / "nvme")})
    sessions = srv.sessions
    turns = sessions._replay_turns
    gate, ran = hold_replays(sessions, monkeypatch)
    real_give_back = turns.give_back
    handover: list[asyncio.Task[Any]] = []  # the Resume to cancel as the next turn is handed to it

    def give_back_then_cancel() -> None:
        real_give_back()
        if handover:
            handover.pop().cancel()  # its turn is handed over (its future done) but it has not run yet

    monkeypatch.setattr(turns, "give_back", give_back_then_cancel)
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b:
        _, alice_sid = await put_session(a, model, tokens_for(P, seed=44))
        _, bob_sid = await put_session(b, model, tokens_for(P, seed=45))
        running = asyncio.create_task(a.resume(alice_sid, position=P))
        while not ran:
            await asyncio.sleep(0.01)
        alices = [await queued_or_refused(sessions, sessions.resume("alice", alice_sid, P - 1, tenant="alice")),
                  await queued_or_refused(sessions, a.resume(alice_sid, position=P - 2))]
        bobs = [await queued_or_refused(sessions, b.resume(bob_sid, position=P - i)) for i in (10, 11)]
        assert not any(t.done() for t in (*alices, *bobs))
        assert turns.waiting == 4 and turns.waiting_of("alice") == 2
        alices[1].cancel()  # while it waits
        with pytest.raises(asyncio.CancelledError):
            await alices[1]
        while turns.waiting_of("alice") != 1:
            await asyncio.sleep(0.01)
        assert turns.waiting == 3
        handover.append(alices[0])  # the next turn is hers
        gate.set()
        assert (await running).source == "replay"
        with pytest.raises(asyncio.CancelledError):
            await alices[0]
        assert not handover
        assert [r.source for r in await asyncio.gather(*bobs)] == ["replay"] * 2
        assert turns.waiting == 0 and not turns.tenants_waiting and not turns.busy()
        assert (await a.resume(alice_sid, position=P - 3)).source == "replay"
    assert ran == [P, P - 10, P - 11, P - 3]  # the cancelled two never ran
    assert turns.waiting == 0 and not turns.tenants_waiting and not turns.busy()


async def test_without_tenancy_waiting_resumes_are_served_first_come_first_served(
        server_factory: Any, model_file: Path, model: HybridDecoder, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No tokens: every caller is one principal, whatever its namespace, and the queue is FIFO."""
    srv = await server_factory(**{"replay.models": str(model_file), "replay.max_concurrent": 1,
                                  "tiers.nvme.path": str(tmp_path / "nvme")})
    sessions = srv.sessions
    gate, ran = hold_replays(sessions, monkeypatch)
    async with EngramClient(srv.address, namespace="one") as a, EngramClient(srv.address, namespace="two") as b:
        _, a_sid = await put_session(a, model, tokens_for(P, seed=46))
        _, b_sid = await put_session(b, model, tokens_for(P, seed=47))
        running = asyncio.create_task(a.resume(a_sid, position=P))
        while not ran:
            await asyncio.sleep(0.01)
        waiting = [await queued_or_refused(sessions, a.resume(a_sid, position=P - i)) for i in (1, 2, 3)]
        waiting.append(await queued_or_refused(sessions, b.resume(b_sid, position=P - 10)))
        assert not any(t.done() for t in waiting)
        gate.set()
        assert [r.source for r in await asyncio.gather(running, *waiting)] == ["replay"] * 5
    assert ran == [P, P - 1, P - 2, P - 3, P - 10]
    assert sessions._replay_turns.waiting == 0 and not sessions._replay_turns.tenants_waiting


async def test_a_tenant_past_its_share_of_persisted_windows_is_refused_and_another_still_keeps_its_own(
        server_factory: Any) -> None:
    """The daemon keeps four windows, a tenant two: Alice's third is refused naming
    replay.max_persisted_window_bytes_per_tenant, and saying nothing of what anyone holds; Bob keeps his two
    (Alice's four had filled replay.max_persisted_window_bytes, refusing every one of his). Closing the sessions
    gives every byte back."""
    spec = tiny_model()
    win = window_for(spec, BLOCK_TOKENS)  # 1,792 bytes
    nbytes = win.numel() * win.element_size()
    srv = await server_factory(**{**AUTH, "replay.max_persisted_window_bytes": 4 * nbytes,
                                  "replay.max_persisted_window_bytes_per_tenant": 2 * nbytes})
    toks = tokens(BLOCK_TOKENS)
    start = BLOCK_TOKENS - win.shape[2]
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        alice = [(await a.open_session(fp, mode="persist")).session_id for _ in range(4)]
        bob = [(await b.open_session(fp, mode="persist")).session_id for _ in range(2)]
        for sid in alice[:2]:
            await a.append_session(sid, toks, window=win, window_start=start)
        for sid in alice[2:]:
            with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_persisted_window_bytes_per_tenant") as e:
                await a.append_session(sid, toks, window=win, window_start=start)
            assert str(nbytes * 2) not in str(e.value) and str(nbytes * 4) not in str(e.value)
        for sid in bob:
            await b.append_session(sid, toks, window=win, window_start=start)
        assert (await b.stats()).replay.persisted_window_bytes == 2 * nbytes
        assert (await a.stats()).replay.persisted_window_bytes == 2 * nbytes
        assert srv.sessions._persisted_of == {"alice": 2 * nbytes, "bob": 2 * nbytes}
        # A fork is its forker's: Bob forking his own session would hold a third window, past his share.
        with pytest.raises(errors.ResourceExhausted, match=r"replay\.max_persisted_window_bytes_per_tenant"):
            await b.fork_session(bob[0])
        await a.close_session(alice[0])  # gives its window's bytes back to Alice's share
        await a.append_session(alice[2], toks, window=win, window_start=start)
        for sid in alice[1:]:
            await a.close_session(sid)
        for sid in bob:
            await b.close_session(sid)
    assert srv.sessions._persisted_bytes == 0 and not srv.sessions._persisted_of  # every byte given back


async def test_an_admins_window_on_a_tenants_session_gives_the_tenants_share_back(server_factory: Any) -> None:
    """Bob's window on his session counts against his share of two windows. The admin replaces it with its own
    (an admin has no share): Bob's share gets the bytes back, and Bob keeps two more. A tenant cannot keep a
    window on another tenant's session at all (tests/test_shared_namespace.py: it is NOT_FOUND to him); closing
    the sessions gives every byte back."""
    spec = tiny_model()
    win = window_for(spec, BLOCK_TOKENS)
    nbytes = win.numel() * win.element_size()
    srv = await server_factory(**{**AUTH, "replay.max_persisted_window_bytes": 16 * nbytes,
                                  "replay.max_persisted_window_bytes_per_tenant": 2 * nbytes})
    toks = tokens(BLOCK_TOKENS)
    start = BLOCK_TOKENS - win.shape[2]
    share = r"replay\.max_persisted_window_bytes_per_tenant"
    async with as_(srv, BOB, "bob") as b, as_(srv, ADMIN, "bob") as admin:
        fp = await b.register_model(spec)
        await admin.register_model(spec)
        sids = [(await b.open_session(fp, mode="persist")).session_id for _ in range(3)]
        await b.append_session(sids[0], toks, window=win, window_start=start)
        await b.append_session(sids[1], toks, window=win, window_start=start)
        with pytest.raises(errors.ResourceExhausted, match=share):
            await b.append_session(sids[2], toks, window=win, window_start=start)
        assert srv.sessions._persisted_of == {"bob": 2 * nbytes}
        await admin.append_session(sids[0], toks, window=win, window_start=2 * BLOCK_TOKENS - win.shape[2])
        assert srv.sessions._persisted_of == {"bob": nbytes}
        await b.append_session(sids[2], toks, window=win, window_start=start)
        assert srv.sessions._persisted_of == {"bob": 2 * nbytes}
        for sid in sids:
            await b.close_session(sid)
    assert srv.sessions._persisted_bytes == 0 and not srv.sessions._persisted_of  # every byte given back


async def test_an_admins_windows_count_against_the_daemons_budget_only(server_factory: Any) -> None:
    """An admin acts on the whole daemon: its sessions' windows have no tenant's share."""
    spec = tiny_model()
    win = window_for(spec, BLOCK_TOKENS)
    nbytes = win.numel() * win.element_size()
    srv = await server_factory(**{**AUTH, "replay.max_persisted_window_bytes": 4 * nbytes,
                                  "replay.max_persisted_window_bytes_per_tenant": nbytes})
    toks = tokens(BLOCK_TOKENS)
    async with EngramClient(srv.address, token=ADMIN, namespace="ops") as admin:
        fp = await admin.register_model(spec)
        for _ in range(3):
            sid = (await admin.open_session(fp, mode="persist")).session_id
            await admin.append_session(sid, toks, window=win, window_start=BLOCK_TOKENS - win.shape[2])
    assert srv.sessions._persisted_bytes == 3 * nbytes and not srv.sessions._persisted_of

"""Reviewer's reproductions (session 51, review 2): not for merging as is."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from test_cut_grants import Grants

from engram.client import EngramClient

from helpers import tiny_model


@pytest.mark.parametrize("transport", ["unix"])
async def test_an_in_place_put_cancelled_while_its_commits_run_leaves_no_reservation(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs (one a block); the caller cancels once the daemon has committed run 1 and the client awaits the
    commits' gather: commit 2, waiting on commit 1 client-side, is never sent, and the reservation (run 2's slot)
    stays open for nobody until it lapses."""
    g = await Grants.start(server_factory)
    monkeypatch.setattr(EngramClient, "_commit_runs",
                        staticmethod(lambda slots, first, n: [(1, slots[:1]), (0, slots[1:])]))
    inplace = g.srv.service.inplace
    commit = inplace.commit
    put: list[asyncio.Task[Any]] = []

    async def commit_then_cut(res: Any, count: int = 0) -> Any:
        await asyncio.sleep(0.5)  # the client has written run 2 and awaits the gather by now
        out = await commit(res, count)
        if count and put:
            put[0].cancel()  # the caller leaves after the daemon committed run 1
        return out

    monkeypatch.setattr(inplace, "commit", commit_then_cut)
    async with EngramClient(g.srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(tiny_model())
        put.append(asyncio.create_task(g.through(c, "ReservePut")))
        with pytest.raises(asyncio.CancelledError):
            await put[0]
        await asyncio.sleep(1.0)
        assert not inplace._open, f"reservation left open for nobody: {list(inplace._open)}"


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_sync_client_closed_right_after_its_open_session_timed_out_leaves_no_session(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As test_cut_grants' sync case, but the worker closes the client at once after the DeadlineExceeded (a
    `with` block ending on the error): close() cuts the call let finish, and the daemon's session stays."""
    import time

    from test_cut_grants import after_the_cancel_turns, busy_until

    from engram import errors
    from engram.client import SyncEngramClient
    g = await Grants.start(server_factory)

    def open_from_a_thread() -> None:
        with SyncEngramClient(g.srv.address, namespace="t", timeout_s=1.0) as c:
            c.register_model(tiny_model())
            after_the_cancel_turns(monkeypatch, busy_until(time.monotonic() + 1.5))
            with pytest.raises(errors.DeadlineExceeded):
                c.open_session(g.fp, mode="persist", tokens=g.prefix)

    await asyncio.to_thread(open_from_a_thread)
    await asyncio.sleep(1.0)
    assert len(g.srv.sessions._sessions) == 1, "the session the daemon opened stayed for nobody"


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_sync_client_closed_while_an_in_place_write_outlasts_timeout_s_leaves_no_pending_task(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import gc
    import threading
    import time

    from engram.client import SyncEngramClient
    g = await Grants.start(server_factory)
    entered, go = threading.Event(), threading.Event()

    def run() -> None:
        c = SyncEngramClient(g.srv.address, namespace="t", timeout_s=1.0, in_place_min_bytes=0)
        c.register_model(tiny_model())
        write = c._client._writer.write

        def held_write(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            go.wait(30)
            return write(*args, **kwargs)

        c._client._writer.write = held_write  # type: ignore[method-assign]
        t = threading.Thread(target=lambda: _swallow(lambda: g_through_sync(c, g)))
        t.start()
        assert entered.wait(10)
        c.close()  # waits timeout_s for the give-up, which waits for the write (3 s): cut
        time.sleep(2.0)
        go.set()
        t.join(10)
        time.sleep(0.5)
        gc.collect()

    await asyncio.to_thread(run)
    msgs = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not msgs, msgs


def _swallow(fn: Any) -> None:
    with contextlib.suppress(Exception):
        fn()


def g_through_sync(c: Any, g: Any) -> None:
    from helpers import BLOCK_TOKENS, random_kv, tokens
    fresh = tokens(2 * BLOCK_TOKENS, seed=9)
    c.put(g.fp, fresh, random_kv(tiny_model(), len(fresh), seed=9))

"""Sessions idle past server.session_idle_s are closed by the daemon (an agent that crashed never closes its
own): their blocks' references go, a later call on one says why it is gone, a session whose client said it is
back later is kept until then, and any call keeps a session open. Real store, real gRPC daemon."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import pytest
from test_metrics import scrape

from engram import errors
from engram.api import SessionMode
from engram.client import EngramClient
from engram.config import ConfigError, load_config
from engram.errors import NotFound
from engram.replay.runtime import ReplayRuntime
from engram.sessions import SessionManager
from engram.store import BlockStore

from helpers import dram_store, put_tokens, random_kv, tiny_model, tokens

PERSIST = SessionMode.PERSIST
IDLE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


def manager(idle_s: float = IDLE_S) -> tuple[BlockStore, bytes, SessionManager, Clock]:
    store, fp = dram_store(64)
    clock = Clock()
    store.placement.model.clock_ms = clock  # the clock sessions' activity and hints are read against
    return store, fp, SessionManager(store, ReplayRuntime([]), idle_close_s=idle_s), clock


async def test_an_idle_session_is_closed_and_its_blocks_references_go() -> None:
    store, fp, sm, clock = manager()
    bt = tiny_model().layout.block_tokens
    toks = tokens(3 * bt, seed=1)
    blocks = await put_tokens(store, "ns", fp, toks)
    sm.open("ns", fp, PERSIST, session_id="gone", tokens=toks)
    kept = sm.open("ns", fp, PERSIST, session_id="kept", tokens=toks[:bt])
    assert [m.refs for m in blocks] == [2, 1, 1]
    clock.ms += 40_000
    sm.append("ns", "kept", tokens(0))  # a call: kept's idle time starts again
    clock.ms += 30_000  # gone: 70 s without a call; kept: 30 s
    assert [s.id for s in sm.close_idle()] == ["gone"]
    assert [m.refs for m in blocks] == [1, 0, 0] and sm.closed_idle == 1  # as CloseSession would have left them
    assert sm.get("ns", "kept") is kept and len(sm) == 1
    with pytest.raises(NotFound, match=r"closed after 70 s without a call \(server.session_idle_s\)"):
        sm.append("ns", "gone", tokens(bt, seed=2))
    with pytest.raises(NotFound, match="no session 'gone'"):  # another namespace hears nothing of it
        sm.get("other", "gone")
    assert all(m.key in store.index for m in blocks)  # the blocks stay stored: only the references went
    sm.open("ns", fp, PERSIST, session_id="gone")  # the id may be opened again, and is a live session
    assert sm.get("ns", "gone").tokens.size == 0


async def test_every_kind_of_call_keeps_a_session_open() -> None:
    store, fp, sm, clock = manager()
    bt = tiny_model().layout.block_tokens
    await put_tokens(store, "ns", fp, tokens(2 * bt, seed=1))
    for sid in ("append", "fork", "suspend", "hint", "idle"):
        sm.open("ns", fp, PERSIST, session_id=sid, tokens=tokens(2 * bt, seed=1))
    clock.ms += 50_000
    sm.append("ns", "append", tokens(0))
    sm.fork("ns", "fork", session_id="child")
    sm.suspend("ns", "suspend")
    sm.expect_back(sm.get("ns", "hint"), 0)  # even a hint of "no hint"
    clock.ms += 50_000
    assert [s.id for s in sm.close_idle()] == ["idle"]
    assert sorted(s.id for s in sm.sessions()) == ["append", "child", "fork", "hint", "suspend"]
    sm.get("ns", "append")  # a read (engram show) is not a call that keeps it open
    clock.ms += 20_000
    assert sorted(s.id for s in sm.close_idle()) == ["append", "child", "fork", "hint", "suspend"]


async def test_a_session_said_to_be_back_later_is_kept_until_then() -> None:
    store, fp, sm, clock = manager()
    s = sm.open("ns", fp, PERSIST, session_id="user", tokens=tokens(16, seed=1))
    sm.expect_back(s, 3_600_000)  # its user is back in an hour
    clock.ms += 3_600_000  # an hour without a call, but it said so
    assert sm.close_idle() == []
    clock.ms += 50_000  # 50 s late: within the idle time after its due time
    assert sm.close_idle() == []
    clock.ms += 20_000  # 70 s late
    assert [x.id for x in sm.close_idle()] == ["user"]


async def test_zero_never_closes_a_session() -> None:
    store, fp, sm, clock = manager(idle_s=0)
    sm.open("ns", fp, PERSIST, session_id="a")
    clock.ms += 10 * 86_400_000
    assert sm.close_idle() == [] and len(sm) == 1


def test_a_negative_idle_time_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="session_idle_s"):
        load_config(env={}, overrides={"server.session_idle_s": -1})
    with pytest.raises(ConfigError, match="session_idle_s"):
        load_config(env={}, overrides={"server.session_idle_s": float("nan")})


async def test_the_daemon_closes_idle_sessions_and_says_so(server_factory: Any) -> None:
    """Real time: a daemon with a 1.5 s idle time closes a session left alone (its blocks' references go,
    Stats and /metrics count it) and keeps one its client calls on every 50 ms meanwhile; a call on the closed
    one gets NOT_FOUND saying why, and the daemon stays up. (A 0.3 s idle time left the busy session a quarter
    of a second between calls: a loaded 2-core CI machine's stall could close it.)"""
    srv = await server_factory(**{"server.session_idle_s": 1.5, "server.metrics_port": -1})
    spec = tiny_model()
    bt = spec.layout.block_tokens
    async with EngramClient(srv.address) as c:
        fp = await c.register_model(spec)
        toks = tokens(2 * bt, seed=1)
        await c.put(fp, toks, random_kv(spec, 2 * bt))
        left = await c.open_session(fp, mode="persist", tokens=toks)
        busy = await c.open_session(fp, mode="persist", tokens=toks)
        assert (await c.describe_blocks(session_id=left.session_id)).blocks[0].sessions == 2
        deadline = time.monotonic() + 30
        while (await c.stats()).sessions_closed_idle == 0:  # busy appends every 50 ms, left says nothing
            assert time.monotonic() < deadline, "the idle session was not closed"
            await c.append_session(busy.session_id, tokens(0))
            await asyncio.sleep(0.05)
        with pytest.raises(errors.NotFound, match="without a call"):
            await c.append_session(left.session_id, tokens(0))
        assert (await c.stats()).sessions_closed_idle == 1
        assert scrape(srv.metrics.port)[("engram_sessions_closed_idle_total", ())] == 1
        assert (await c.describe_blocks(session_id=busy.session_id)).blocks[0].sessions == 1  # left's went
        assert (await c.append_session(busy.session_id, tokens(0))).tokens == 2 * bt
    await srv.stop(0)
    assert srv.closer is not None and srv.closer.done()  # the closer stops with the daemon


FORGED = "s1\n2026-01-01 00:00:00 ERROR engram.store: FORGED disk failure, all data lost"


async def test_a_session_id_cannot_forge_a_line_of_the_daemons_log(server_factory: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A session id is the client's to choose and the daemon names it in its log (the idle-close line): one with a
    newline wrote a line of its own choosing there, an ERROR of engram.store, say (an audit, session 47). Ids with a
    control character or a line separator are refused at OpenSession and ForkSession (INVALID_ARGUMENT), and the
    line quotes the id as it quotes the namespace."""
    srv = await server_factory(**{"server.session_idle_s": 0.2})
    spec = tiny_model()
    caplog.set_level(logging.INFO, logger="engram")
    async with EngramClient(srv.address, namespace="a") as c:
        fp = await c.register_model(spec)
        for bad in (FORGED, "s1\r", "s1\x1b[2K", "s1\x85", "s1\u2028"):
            with pytest.raises(errors.InvalidArgument, match="the session id holds a control character"):
                await c.open_session(fp, mode="persist", session_id=bad)
        parent = await c.open_session(fp, mode="persist", session_id="agent 7")
        with pytest.raises(errors.InvalidArgument, match="the session id holds a control character"):
            await c.fork_session(parent.session_id, session_id=FORGED)
        for _ in range(40):  # the closer runs every 50 ms
            await asyncio.sleep(0.05)
            if (await c.stats()).sessions_closed_idle:
                break
    lines = [r.getMessage() for r in caplog.records if "closed session" in r.getMessage()]
    assert len(lines) == 1
    assert re.fullmatch(r"closed session 'agent 7' of namespace 'a': no call for \d+ s \(server.session_idle_s\)",
                        lines[0])
    assert "FORGED" not in caplog.text

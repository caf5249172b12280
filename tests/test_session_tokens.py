"""The tokens live sessions hold are daemon memory (4 bytes each, up to server.max_tokens_per_request a session,
until closed or idle a day): bounded for the daemon (server.max_live_session_tokens) and per tenant (its
_per_tenant share), where a tenant with no quota (the default) held any number (an audit, session 45: 13 MiB a
session of 2M tokens, 4,096 sessions a namespace). And the sessions the daemon closes idle are logged within a
budget. Real daemons over gRPC, tenancy on."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from engram import errors
from engram.api import Stats
from engram.cli.stats import stats_renderable
from engram.client import EngramClient
from engram.server import RunningServer

from helpers import tiny_model, tokens

ALICE, BOB, ADMIN = "alice-token", "bob-token", "admin-token"
AUTH = {"auth.tenants.alice.token": ALICE, "auth.tenants.alice.namespaces": "alice,team",
        "auth.tenants.bob.token": BOB, "auth.tenants.bob.namespaces": "bob,team",
        "auth.admin_tokens": ADMIN, "auth.salt_secret": "test-secret"}


def as_(srv: RunningServer, token: str, namespace: str) -> EngramClient:
    return EngramClient(srv.address, token=token, namespace=namespace)


async def test_a_tenant_past_its_share_of_live_session_tokens_is_refused_while_another_opens(
        server_factory: Any) -> None:
    """No quota anywhere: alice's sessions past her 1,000 tokens are RESOURCE_EXHAUSTED, saying what her own hold
    (not bob's); bob's still open; a fork sharing its parent's tokens counts once; a refused append changes nothing;
    closing gives the room back; the daemon's bound refuses an admin too, without telling anyone's usage."""
    srv = await server_factory(**AUTH, **{"server.max_live_session_tokens": 2000,
                                          "server.max_live_session_tokens_per_tenant": 1000})
    spec = tiny_model()
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b, as_(srv, ADMIN, "ops") as admin:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        await admin.register_model(spec)
        first = await a.open_session(fp, mode="persist", tokens=tokens(400, seed=1))
        second = await a.open_session(fp, mode="persist", tokens=tokens(400, seed=2))
        with pytest.raises(errors.ResourceExhausted, match=r"server\.max_live_session_tokens_per_tenant") as full:
            await a.open_session(fp, mode="persist", tokens=tokens(400, seed=3))
        assert "hold 800 of its 1000" in str(full.value)  # her own sessions' tokens, her share
        child = await a.fork_session(first.session_id)  # shares its parent's 400 tokens: nothing more held
        assert child.tokens == 400
        with pytest.raises(errors.ResourceExhausted, match="hold 800 of its 1000"):  # 800 - 400 + 700
            await a.append_session(second.session_id, tokens(300, seed=4))
        assert (await a.append_session(second.session_id, tokens(0))).tokens == 400  # the refusal changed nothing
        # bob's share is his own: alice's full one refuses him nothing
        bobs = [await b.open_session(fp, mode="persist", tokens=tokens(400, seed=5 + i)) for i in range(2)]
        with pytest.raises(errors.ResourceExhausted, match="hold 800 of its 1000") as bob_full:
            await b.open_session(fp, mode="persist", tokens=tokens(400, seed=7))
        assert "alice" not in str(bob_full.value)
        # the daemon's bound (1,600 held): an admin has no share, but the daemon's bound holds
        await admin.open_session(fp, mode="persist", tokens=tokens(300, seed=8))
        with pytest.raises(errors.ResourceExhausted, match=r"server\.max_live_session_tokens\)") as daemon_full:
            await admin.open_session(fp, mode="persist", tokens=tokens(200, seed=9))
        assert not re.search(r"\b(1900|1600|800)\b", str(daemon_full.value))  # nobody's usage
        # closing gives the room back: the parent's tokens stay held while its fork lives
        await a.close_session(first.session_id)
        with pytest.raises(errors.ResourceExhausted, match="hold 800 of its 1000"):
            await a.open_session(fp, mode="persist", tokens=tokens(400, seed=3))
        await a.close_session(child.session_id)
        await a.open_session(fp, mode="persist", tokens=tokens(400, seed=3))
        await b.close_session(bobs[0].session_id)
        await admin.open_session(fp, mode="persist", tokens=tokens(200, seed=9))


def rendered(stats: Stats) -> str:
    out = Console(width=200, record=True, file=io.StringIO())
    out.print(stats_renderable(stats))
    return out.export_text()


async def test_stats_the_cli_and_metrics_show_the_live_session_tokens_against_their_bound(
        server_factory: Any) -> None:
    """How close a caller is to the bound on live sessions' tokens: a tenant's Stats and `engram stats` show its
    own tokens against its share (not another tenant's, nor the daemon's total), an admin's every session's against
    the daemon's bound, and /metrics the daemon's; a fork sharing its parent's tokens counts once, a close gives
    them back. Before, Stats had no such figure (a gap left by session 45)."""
    srv = await server_factory(**AUTH, **{"server.max_live_session_tokens": 5000,
                                          "server.max_live_session_tokens_per_tenant": 1000,
                                          "server.metrics_port": -1, "server.metrics_token": "scrape-tok"})
    spec = tiny_model()
    async with as_(srv, ALICE, "alice") as a, as_(srv, BOB, "bob") as b, as_(srv, ADMIN, "ops") as admin:
        fp = await a.register_model(spec)
        await b.register_model(spec)
        first = await a.open_session(fp, mode="persist", tokens=tokens(400, seed=1))
        await a.open_session(fp, mode="persist", tokens=tokens(300, seed=2))
        await a.fork_session(first.session_id)  # a view of its parent's tokens: nothing more held
        bobs_session = await b.open_session(fp, mode="persist", tokens=tokens(200, seed=3))
        mine, bobs, every = await a.stats(), await b.stats(), await admin.stats()
        assert (mine.replay.session_tokens, mine.replay.session_tokens_bound) == (700, 1000)
        assert (bobs.replay.session_tokens, bobs.replay.session_tokens_bound) == (200, 1000)
        assert (every.replay.session_tokens, every.replay.session_tokens_bound) == (900, 5000)
        assert re.search(r"session tokens held \(your token's\)\s+│\s+700 of 1000 \(70%\)", rendered(mine))
        assert re.search(r"session tokens held\s+│\s+900 of 5000 \(18%\)", rendered(every))
        assert srv.metrics is not None
        req = urllib.request.Request(f"http://127.0.0.1:{srv.metrics.port}/metrics",
                                     headers={"Authorization": "Bearer scrape-tok"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            metrics = {s.name: s.value for f in text_string_to_metric_families(resp.read().decode()) for s in f.samples}
        assert metrics["engram_session_tokens"] == 900
        await a.close_session(first.session_id)  # its fork still holds the 400
        assert (await a.stats()).replay.session_tokens == 700
        await b.close_session(bobs_session.session_id)
        assert (await admin.stats()).replay.session_tokens == 700
        assert (await b.stats()).replay.session_tokens == 0


async def test_an_admins_fork_of_a_tenants_session_counts_in_no_share(server_factory: Any) -> None:
    """The admin's fork of alice's session copies its tokens out of her share (an admin has none): shared, hers
    would stay counted to her for as long as the fork lived. A tenant cannot fork another tenant's session at all
    (tests/test_shared_namespace.py)."""
    srv = await server_factory(**AUTH, **{"server.max_live_session_tokens_per_tenant": 1000})
    spec = tiny_model()
    async with as_(srv, ALICE, "team") as a, as_(srv, ADMIN, "team") as admin:
        fp = await a.register_model(spec)
        await admin.register_model(spec)
        hers = await a.open_session(fp, mode="persist", tokens=tokens(600, seed=1))
        theirs = await admin.fork_session(hers.session_id)
        await a.close_session(hers.session_id)  # her share is whole again, the admin's fork still open
        await a.open_session(fp, mode="persist", tokens=tokens(1000, seed=3))
        await admin.close_session(theirs.session_id)


async def test_sessions_closed_idle_are_logged_within_a_budget(server_factory: Any,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """300 sessions abandoned at once: at most 20 lines name one each, the rest are counted in a line a pass
    (each closed session was a line: 4,002 lines for 4,000 sessions, an audit)."""
    caplog.set_level(logging.INFO, logger="engram.sessions")
    srv = await server_factory(**{"server.session_idle_s": 0.3})
    n = 300
    async with EngramClient(srv.address, namespace="n") as c:
        fp = await c.register_model(tiny_model())
        await asyncio.gather(*(c.open_session(fp, mode="persist", tokens=tokens(8, seed=i)) for i in range(n)))
        for _ in range(100):
            if (await c.stats()).sessions_closed_idle == n:
                break
            await asyncio.sleep(0.05)
        assert (await c.stats()).sessions_closed_idle == n
    lines = [r.getMessage() for r in caplog.records if r.name == "engram.sessions" and "closed" in r.getMessage()]
    named = [m for m in lines if m.startswith("closed session ")]
    counted = [int(re.match(r"closed (\d+) more sessions", m).group(1))  # type: ignore[union-attr]
               for m in lines if re.match(r"closed \d+ more sessions", m)]
    assert len(named) <= 20 and len(named) + sum(counted) == n, lines
    assert len(lines) < 60, lines  # a line a pass for the rest, not a line a session


SESSION_BOUND = r"a session may hold at most 64 tokens \(server.max_tokens_per_request\), this one would hold {}"


async def test_a_session_past_its_length_bound_is_one_answer_at_open_and_at_append(server_factory: Any) -> None:
    """A session's length bound is server.max_tokens_per_request, the same number as a request's: an OpenSession
    past it was RESOURCE_EXHAUSTED "split the request", and the split (an Open, then an Append) was INVALID_ARGUMENT
    "a session may hold at most N tokens" (an audit, session 47). Open and Append past it now get that one answer,
    naming the bound, the setting and the length the session would have; nothing of the session changes."""
    srv = await server_factory(**{"server.max_tokens_per_request": 64})
    async with EngramClient(srv.address, namespace="n") as c:
        fp = await c.register_model(tiny_model())
        with pytest.raises(errors.InvalidArgument, match=SESSION_BOUND.format(65)):
            await c.open_session(fp, mode="persist", tokens=tokens(65))
        s = await c.open_session(fp, mode="persist", tokens=tokens(60))
        with pytest.raises(errors.InvalidArgument, match=SESSION_BOUND.format(65)):  # the split's second half
            await c.append_session(s.session_id, tokens(5))
        with pytest.raises(errors.InvalidArgument, match=SESSION_BOUND.format(125)):  # one request past it too
            await c.append_session(s.session_id, tokens(65))
        assert (await c.append_session(s.session_id, tokens(4))).tokens == 64

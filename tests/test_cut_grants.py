"""A call whose answer grants what only the answer names (ReservePut's reservation, GetPrefix's lease with
hold_for_get, an OpenSession's or ForkSession's session under an id the daemon picks), cut after the daemon's handler
has granted it, leaves nothing held by nobody.

Session 50's handlers give grpc's cancel a few turns of the loop to land (`_cancel_lands`); a busy loop passes it
on later than that, and a deadline may pass with no cancel ever reaching the handler, which has answered into the
gone call (a review, session 51: 3 of 9 cut ReservePuts kept their slots, 11 leases and 29 sessions stayed). Now
EngramClient does not cut such a call when its caller leaves (a cancel, its timeout_s): it lets the call finish and
gives the grant back itself (ReleaseLeases now gives a reservation up); and the daemon gives it back when the
call's deadline passed before its answer.

The late cancel is made deterministic by one hook: the daemon's `_cancel_lands` (monkeypatched) runs as before,
then cancels the caller's task, or blocks the daemon's event loop past the caller's bound, as a busy loop would
(the daemon and the client share the test's loop, so the cut lands only after the handler has answered). No
wire-level way holds a unary answer between the handler and the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from engram import errors
from engram.client import EngramClient, SyncEngramClient
from engram.server import service as service_module
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc
from engram.wire import convert

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens, until

GRANTS = ["ReservePut", "GetPrefix", "OpenSession", "ForkSession"]
PREFIX_BLOCKS = 4


class Grants:
    """A daemon with a stored prefix and a parent session in namespace "t", and what it holds for nobody."""

    def __init__(self, srv: Any, fp: bytes, used: int, prefix: Any) -> None:
        self.srv, self.fp, self.used, self.prefix = srv, fp, used, prefix

    @classmethod
    async def start(cls, server_factory: Any) -> Grants:
        srv = await server_factory(**{"server.lease_s": 60.0})
        spec = tiny_model()
        prefix = tokens(PREFIX_BLOCKS * BLOCK_TOKENS, seed=3)
        async with EngramClient(srv.address, namespace="t") as c:
            fp = await c.register_model(spec)
            await c.put(fp, prefix, random_kv(spec, len(prefix), seed=3))
            await c.open_session(fp, mode="persist", session_id="parent", tokens=prefix)
            used = (await c.stats()).tier("dram").used_bytes
        return cls(srv, fp, used, prefix)

    async def nothing_held(self) -> bool:
        """No reservation, no lease, no session but the parent, every block referenced by the parent alone."""
        inplace, leases = self.srv.service.inplace, self.srv.service.leases
        async with EngramClient(self.srv.address, namespace="t") as c:
            used = (await c.stats()).tier("dram").used_bytes
            sessions = [s.info.session_id for s in await c.list_sessions()]
        return (not (inplace._making or inplace._open or inplace._lapsed) and used == self.used
                and len(leases) == 0 and all(m.leases == 0 for m in self.srv.store.blocks("t"))
                and sessions == ["parent"] and all(m.refs == 1 for m in self.srv.store.blocks("t")))

    async def through(self, c: EngramClient, grant: str) -> None:
        """The client call that makes `grant`: an in-place put (its ReservePut), a hit, a session of the daemon's id."""
        spec = tiny_model()
        if grant == "ReservePut":
            fresh = tokens(2 * BLOCK_TOKENS, seed=9)
            await c.put(self.fp, fresh, random_kv(spec, len(fresh), seed=9))
        elif grant == "GetPrefix":
            await c.get_prefix(self.fp, self.prefix)
        elif grant == "OpenSession":
            await c.open_session(self.fp, mode="persist", tokens=self.prefix)
        else:
            await c.fork_session("parent")

    def raw_request(self, grant: str) -> bytes:
        spec = tiny_model()
        fresh = tokens(2 * BLOCK_TOKENS, seed=9)
        msg: Any = {
            "ReservePut": lambda: pb.ReservePutRequest(namespace="t", model_fingerprint=self.fp, blocks=[
                pb.BlockHeader(tokens=convert.tokens_to_pb(fresh[i:i + BLOCK_TOKENS]), dtype=int(spec.layout.dtype),
                               shape=list(spec.layout.block_shape(BLOCK_TOKENS)),
                               payload_nbytes=spec.layout.block_nbytes(BLOCK_TOKENS), codec="raw")
                for i in range(0, len(fresh), BLOCK_TOKENS)]),
            "GetPrefix": lambda: pb.GetPrefixRequest(namespace="t", model_fingerprint=self.fp,
                                                     tokens=self.prefix.tolist(), zero_copy=True, hold_for_get=True),
            "OpenSession": lambda: pb.OpenSessionRequest(namespace="t", model_fingerprint=self.fp,
                                                         mode=pb.REPLAY_MODE_PERSIST, tokens=self.prefix.tolist()),
            "ForkSession": lambda: pb.ForkSessionRequest(parent=pb.SessionRef(namespace="t", session_id="parent")),
        }[grant]()
        return bytes(msg.SerializeToString())


def after_the_cancel_turns(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> None:
    """The daemon's next `_cancel_lands` (the handler's grant made, its answer about to be returned with no await
    left) runs as before, then `then()`: a cut that lands only after the handler has answered."""
    original = service_module._cancel_lands
    armed = [then]

    async def turns_then_cut() -> None:
        await original()
        if armed:
            armed.pop()()

    monkeypatch.setattr(service_module, "_cancel_lands", turns_then_cut)


def busy_until(t: float) -> Callable[[], None]:
    """Block the (shared) event loop until time.monotonic() reaches t: a daemon's busy loop, during which bounds
    that end before t pass without any task seeing them until it is free again."""
    return lambda: time.sleep(max(0.0, t - time.monotonic()))


@pytest.mark.parametrize("transport", ["unix"])
@pytest.mark.parametrize("grant", ["ReservePut", "OpenSession", "ForkSession"])
async def test_a_grant_call_whose_caller_cancels_once_the_daemon_granted_leaves_nothing_held(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch, grant: str) -> None:
    """The caller of an in-place put (its ReservePut), an open_session or a fork_session of the daemon's id cancels
    its task once the daemon has granted and passed its cancel turns: the client lets the call finish and gives the
    reservation up (ReleaseLeases naming it) or closes the session. It cut the call, whose answer the daemon had
    already returned: the reservation held its slots two terms of server.lease_s, the session stayed open for
    server.session_idle_s (a day). (GetPrefix's client already let the call finish on a cancel: its case is the
    timeout's, below.)"""
    g = await Grants.start(server_factory)
    async with EngramClient(g.srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(tiny_model())
        caller: list[asyncio.Task[Any]] = []
        after_the_cancel_turns(monkeypatch, lambda: caller[0].cancel())
        caller.append(asyncio.create_task(g.through(c, grant)))
        with pytest.raises(asyncio.CancelledError):
            await caller[0]
        await until(g.nothing_held, f"the cut {grant}'s grant given back", timeout=10)


@pytest.mark.parametrize("transport", ["unix"])
async def test_an_in_place_put_whose_caller_cancels_while_it_writes_gives_its_reservation_up_once_written(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller of an in-place put cancels it while the client writes a run into its reserved slots (the write, in
    a thread, held here until the test lets it go): the reservation stays while the write runs (a slot freed under
    it would take another block's bytes), then is given up, its slots freed, well before server.lease_s (60 s).
    It was left to lapse: its slots held two terms."""
    g = await Grants.start(server_factory)
    async with EngramClient(g.srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(tiny_model())
        entered, go = threading.Event(), threading.Event()
        write = c._writer.write

        def held_write(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            assert go.wait(30), "the test never let the write go"
            return write(*args, **kwargs)

        monkeypatch.setattr(c._writer, "write", held_write)
        put = asyncio.create_task(g.through(c, "ReservePut"))
        while not entered.is_set():
            assert not put.done(), "the put ended before it wrote"
            await asyncio.sleep(0.01)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        await asyncio.sleep(0.2)  # a give-up that did not wait for the write would have freed the slots by now
        assert g.srv.service.inplace._open, "the reservation was given up under a write still running"
        go.set()
        await until(g.nothing_held, "the cancelled put's reservation given up once its write ended", timeout=10)


@pytest.mark.parametrize("transport", ["unix"])
@pytest.mark.parametrize("grant", GRANTS)
async def test_a_grant_call_cut_by_the_clients_timeout_once_the_daemon_granted_leaves_nothing_held(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch, grant: str) -> None:
    """The client's own bound (timeout_s = 1 s) passes while the daemon, having granted, is busy (its loop held to
    1.5 s): the caller gets DeadlineExceeded as before, and the call, let finish, has its grant given back. The bound
    cut the call, which the daemon had answered: the reservation, the lease (60 s here) or the session stayed."""
    g = await Grants.start(server_factory)
    async with EngramClient(g.srv.address, namespace="t", in_place_min_bytes=0, timeout_s=1.0) as c:
        await c.register_model(tiny_model())
        after_the_cancel_turns(monkeypatch, busy_until(time.monotonic() + 1.5))
        with pytest.raises(errors.DeadlineExceeded):
            await g.through(c, grant)
        await until(g.nothing_held, f"the {grant} cut by the client's bound given back", timeout=10)


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_sync_clients_open_session_cut_by_its_timeout_leaves_no_session(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SyncEngramClient's open_session runs the async client's on its own loop: cut by its timeout_s while the
    daemon, having opened the session under an id of its own, is busy, it leaves no session either."""
    g = await Grants.start(server_factory)

    def wait_for_the_close(c: SyncEngramClient) -> None:
        deadline = time.monotonic() + 10  # the client closes it once the answer comes (close() would cut that)
        while len(g.srv.sessions._sessions) > 1:  # read from this thread: len() of the daemon's table
            assert time.monotonic() < deadline, "the session the daemon opened was never closed"
            time.sleep(0.05)

    await asyncio.to_thread(_open_session_cut_by_a_sync_timeout, g, monkeypatch, wait_for_the_close)
    await until(g.nothing_held, "the sync client's cut OpenSession's session closed", timeout=10)


def _open_session_cut_by_a_sync_timeout(g: Grants, monkeypatch: pytest.MonkeyPatch,
                                        then: Callable[[SyncEngramClient], None]) -> None:
    """A SyncEngramClient (timeout_s 1) whose open_session the busy daemon answers too late, `then` done with the
    client still open; the client closed after it. Run from a thread."""
    with SyncEngramClient(g.srv.address, namespace="t", timeout_s=1.0) as c:
        c.register_model(tiny_model())
        after_the_cancel_turns(monkeypatch, busy_until(time.monotonic() + 1.5))
        with pytest.raises(errors.DeadlineExceeded):
            c.open_session(g.fp, mode="persist", tokens=g.prefix)
        then(c)


@pytest.mark.parametrize("transport", ["unix"])
@pytest.mark.parametrize("grant", GRANTS)
async def test_a_grant_call_whose_deadline_passes_before_its_answer_gives_the_grant_back(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch, grant: str) -> None:
    """A raw gRPC caller's deadline (0.5 s) passes while the daemon, having granted, is busy (its loop held to 1 s),
    so no cancel reaches the handler before it answers: it reads the deadline, gives the grant back and ends the
    call DEADLINE_EXCEEDED. It answered into the gone call, and the grant stayed for nobody."""
    g = await Grants.start(server_factory)
    async with grpc.aio.insecure_channel(g.srv.address) as ch:
        call = ch.unary_unary(f"/engram.v1.Engram/{grant}", request_serializer=None, response_deserializer=None)
        after_the_cancel_turns(monkeypatch, busy_until(time.monotonic() + 1.0))
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await call(g.raw_request(grant), timeout=0.5)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(g.nothing_held, f"the {grant} past its deadline given back", timeout=10)


@pytest.mark.parametrize("transport", ["unix"])
async def test_release_leases_naming_a_reservation_gives_it_up_and_frees_its_slots_at_once(
        server_factory: Any) -> None:
    """ReleaseLeases naming an open reservation's id (its slots' lease_id) gives it up: its slots are freed at once,
    a commit of it is NOT_FOUND after, and naming it again is NOT_FOUND. With a lease in the same request both end;
    an id that is neither is NOT_FOUND naming its place in the request, and nothing is released. Before, a
    reservation's id was NOT_FOUND here: a client whose caller left before the ReservePut's answer had no way to let
    go of its slots but to let them lapse (two terms of server.lease_s)."""
    g = await Grants.start(server_factory)
    inplace, leases = g.srv.service.inplace, g.srv.service.leases
    async with grpc.aio.insecure_channel(g.srv.address) as ch:
        stub = pb_grpc.EngramStub(ch)
        res = await stub.ReservePut(pb.ReservePutRequest.FromString(g.raw_request("ReservePut")))
        hit = await stub.GetPrefix(pb.GetPrefixRequest.FromString(g.raw_request("GetPrefix")))
        assert res.reservation_id in inplace._open and all(d.lease_id == res.reservation_id for d in res.slots)
        assert hit.lease_id and len(leases) == 1
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t",
                                                             lease_ids=[res.reservation_id, hit.lease_id, 12345]))
        assert bad.value.code() == grpc.StatusCode.NOT_FOUND and "lease 2 (12345)" in bad.value.details()
        assert res.reservation_id in inplace._open and len(leases) == 1  # nothing released
        done = await stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t",
                                                                lease_ids=[res.reservation_id, hit.lease_id]))
        assert done.released == 2
        for again in (stub.CommitPut(pb.CommitPutRequest(namespace="t", reservation_id=res.reservation_id)),
                      stub.ReleaseLeases(pb.ReleaseLeasesRequest(namespace="t", lease_ids=[res.reservation_id]))):
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await again
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    await until(g.nothing_held, "the given-up reservation's slots freed, the lease ended", timeout=10)

# A review of the merged change (session 51): a cancel during the commits, close() right after a cut call, a
# sync client closed while an in-place write outlasts timeout_s


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
    """As the sync case above, but the worker closes the client at once after the DeadlineExceeded (a `with` block
    ending on the error): close() cut the call let finish, and the daemon's session stayed (a review, session 51)."""
    g = await Grants.start(server_factory)
    await asyncio.to_thread(_open_session_cut_by_a_sync_timeout, g, monkeypatch, lambda c: None)
    await asyncio.sleep(1.0)
    assert len(g.srv.sessions._sessions) == 1, "the session the daemon opened stayed for nobody"


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_sync_client_closed_while_an_in_place_write_outlasts_timeout_s_leaves_no_pending_task(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
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
        t = threading.Thread(target=lambda: _swallow(lambda: _put_fresh_sync(c, g)))
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


def _put_fresh_sync(c: SyncEngramClient, g: Grants) -> None:
    fresh = tokens(2 * BLOCK_TOKENS, seed=9)
    c.put(g.fp, fresh, random_kv(tiny_model(), len(fresh), seed=9))


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_failed_commit_of_run_one_keeps_run_twos_slots_while_the_client_writes_them(
        server_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run 1's CommitPut fails at the daemon (here: its seal raises) while the client still writes run 2 in its
    thread: the reservation's slots, run 2's included, are freed a term later, not under the running write (a next
    put could take them and the late write land in its block: a review, session 51)."""
    g = await Grants.start(server_factory)
    monkeypatch.setattr(EngramClient, "_commit_runs",
                        staticmethod(lambda slots, first, n: [(1, slots[:1]), (0, slots[1:])]))
    inplace = g.srv.service.inplace

    async def failing_seal(batch: Any) -> None:
        raise errors.DataLoss("injected: run 1's seal failed")

    monkeypatch.setattr(inplace, "_seal", failing_seal)
    entered, go = threading.Event(), threading.Event()
    async with EngramClient(g.srv.address, namespace="t", in_place_min_bytes=0) as c:
        await c.register_model(tiny_model())
        write = c._writer.write
        calls = [0]

        def second_write_held(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                entered.set()
                assert go.wait(30)
            return write(*args, **kwargs)

        monkeypatch.setattr(c._writer, "write", second_write_held)
        put = asyncio.create_task(g.through(c, "ReservePut"))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # commit 1 has failed at the daemon by now
        held_while_writing = bool(inplace._open or inplace._lapsed) or inplace._held > 0
        go.set()
        with pytest.raises(errors.DataLoss):
            await put
        assert held_while_writing, "run 2's slot was freed while the client's thread still wrote it"

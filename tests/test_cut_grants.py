"""A call whose answer grants what only the answer names (ReservePut's reservation, GetPrefix's lease with
hold_for_get, an OpenSession's or ForkSession's session under an id the daemon picks), cut after the daemon's handler
has granted it, leaves nothing held by nobody.

Session 50's handlers give grpc's cancel a few turns of the loop to land (`_cancel_lands`); a busy loop passes it
on later than that, and a deadline may pass with no cancel ever reaching the handler, which has answered into the
gone call (a review, session 51: 3 of 9 cut ReservePuts kept their slots, 11 leases and 29 sessions stayed). Now
the daemon gives the grant back when the call's deadline passed before its answer, and ReleaseLeases gives a
reservation up (how a client that lets a cut call finish lets go of its slots).

The late cancel is made deterministic by one hook: the daemon's `_cancel_lands` (monkeypatched) runs as before,
then cancels the caller's task, or blocks the daemon's event loop past the caller's bound, as a busy loop would
(the daemon and the client share the test's loop, so the cut lands only after the handler has answered). No
wire-level way holds a unary answer between the handler and the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from engram.client import EngramClient
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

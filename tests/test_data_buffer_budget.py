"""The data channel's receive buffers under one daemon-wide budget (server.receive_buffer_bytes,
engram/server/recvbudget.py), against a real daemon over TCP and a unix socket: many connections sending large
puts slowly held up to 64 MiB each (512 of them: 32 GiB); now they hold at most the budget, the rest wait (their
sockets not read) and are served once room comes, or are refused RESOURCE_EXHAUSTED past
server.receive_buffer_wait_s, their connection still framed; one tenant holds at most its share."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_data_channel import block_header, expect_error, four_mib_model, raw_conn, raw_payload

from engram import errors
from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb
from engram.wire import data as wire

from helpers import random_kv, tokens

BLOCK = 4 * 2**20  # four_mib_model's raw block
BUDGET = 16 * 2**20
# gRPC Put streams each hold server.max_message_bytes of the budget, which must fit half of it (config.py).
SMALL = {"server.max_block_bytes": "4MiB", "server.receive_buffer_bytes": BUDGET, "server.max_message_bytes": "2MiB",
         "server.chunk_bytes": "1MiB"}


class SlowPut:
    """A raw connection sending a PUT of one 4 MiB block but its last bytes (a sender that has almost finished);
    the send runs in a task: one the daemon does not read waits."""

    def __init__(self, conn: wire.Conn, ns: str, fp: bytes, seed: int, tail: int = 1000) -> None:
        spec = four_mib_model()
        self.conn = conn
        payload = raw_payload(random_kv(spec, 512, seed=seed))
        self.meta = pb.DataPut(header=pb.PutHeader(namespace=ns, model_fingerprint=fp),
                               blocks=[block_header(spec, tokens(512, seed=seed), payload)]).SerializeToString()
        self.payload = payload
        self.tail = payload[-tail:]
        self.sending = asyncio.create_task(conn.send(wire.FRAME.pack(wire.PUT, len(self.meta), len(payload)) +
                                                     self.meta, payload[:-tail]))

    async def finish(self) -> pb.PutResponse:
        await self.sending
        await self.conn.send(self.tail)
        kind, reply, _ = await self.conn.read_frame()
        assert kind == wire.PUT_OK, wire.error_of(reply)
        return pb.PutResponse.FromString(bytes(reply))


async def slow_puts(srv, n: int, *, ns: str = "tenant-a", token: str = "", seed: int = 0) -> list[SlowPut]:  # type: ignore[no-untyped-def]
    async with EngramClient(srv.address, namespace=ns, token=token, zero_copy=False) as c:
        fp = await c.register_model(four_mib_model())
    return [SlowPut(await raw_conn(srv, token), ns, fp, seed + i) for i in range(n)]


async def peak_while(srv, seconds: float) -> int:  # type: ignore[no-untyped-def]
    """The most the daemon's data channel held in receive buffers, sampled over `seconds`."""
    port, peak, end = srv.service.dataport, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, port.buffered_bytes())
        await asyncio.sleep(0.005)
    return peak


async def test_busy_connections_hold_at_most_receive_buffer_bytes_and_the_rest_wait_and_are_served(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Ten connections each sending a 4 MiB put slowly to a daemon with a 16 MiB budget: the daemon's buffers never
    pass 16 MiB (it held 40 MiB, every connection its whole block), the connections past it wait unread, and every
    put is stored once the ones before finish: backpressure, not failure."""
    srv = await server_factory(**SMALL, **{"server.receive_buffer_wait_s": 60, "server.metrics_port": -1})
    puts = await slow_puts(srv, 10)
    peak = await peak_while(srv, 1.5)
    port = srv.service.dataport
    assert peak <= BUDGET, f"the data channel held {peak} bytes in receive buffers, over its budget of {BUDGET}"
    assert port.budget.used <= BUDGET and port.budget.waits >= 1
    held = srv.metrics.registry.get_sample_value("engram_receive_buffer_budget_held_bytes")
    assert 2 * BLOCK <= held <= BUDGET
    replies = await asyncio.wait_for(asyncio.gather(*(p.finish() for p in puts)), 60)
    assert all(r.stored == 1 for r in replies)
    assert len(srv.store) == 10
    assert port.budget.refusals == 0
    for p in puts:
        p.conn.close()
    for _ in range(500):  # the connections' ends give their buffers back
        if port.budget.used == 0:
            break
        await asyncio.sleep(0.01)
    assert port.budget.used == 0 and port.buffered_bytes() == 0


async def test_a_put_that_finds_the_buffers_full_past_receive_buffer_wait_s_is_refused_and_its_connection_serves_on(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """While three slow puts hold the 16 MiB budget, a client's put waits server.receive_buffer_wait_s and is told
    RESOURCE_EXHAUSTED naming the setting (not cut by its own timeout_s, nor stored past the budget); a raw
    connection refused so is still framed and its next put, once room came, is stored."""
    srv = await server_factory(**SMALL, **{"server.receive_buffer_wait_s": 0.5})
    port = srv.service.dataport
    holders = await slow_puts(srv, 3)
    for _ in range(500):
        if port.buffered_bytes() >= 3 * (BLOCK - 1000):
            break
        await asyncio.sleep(0.01)
    assert port.buffered_bytes() >= 3 * (BLOCK - 1000), "the three slow puts never arrived"
    spec = four_mib_model()
    async with EngramClient(srv.address, namespace="tenant-a", zero_copy=False, timeout_s=10) as c:
        fp = await c.register_model(spec)
        t0 = time.monotonic()
        # The daemon's refusal (the message names the budget), not the client's own cut at timeout_s
        with pytest.raises(errors.ResourceExhausted, match=r"server\.receive_buffer_bytes"):
            await c.put(fp, tokens(512, seed=90), random_kv(spec, 512, seed=90))
        assert time.monotonic() - t0 >= 0.5  # after receive_buffer_wait_s
    victim = SlowPut(await raw_conn(srv), "tenant-a", fp, seed=91, tail=1)
    await victim.sending
    await victim.conn.send(victim.tail)
    await expect_error(victim.conn, errors.ResourceExhausted, "server.receive_buffer_wait_s")
    assert port.budget.refusals == 2
    assert all(r.stored == 1 for r in await asyncio.gather(*(h.finish() for h in holders)))
    again = SlowPut(victim.conn, "tenant-a", fp, seed=92)
    assert (await again.finish()).stored == 1
    for p in [*holders, victim]:
        p.conn.close()


async def test_one_tenants_slow_puts_hold_at_most_its_share_and_another_tenant_is_served(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    """Bob's five slow 4 MiB puts against a 32 MiB budget of which a tenant may hold half: his connections hold at
    most 16 MiB, the rest of his wait, and Alice's put is stored at once meanwhile; Bob's are all stored once he
    finishes sending."""
    srv = await server_factory(**{**SMALL, "server.receive_buffer_bytes": 2 * BUDGET,
                                  "server.receive_buffer_wait_s": 60, "auth.tenants.alice.token": "a-tok",
                                  "auth.tenants.bob.token": "b-tok", "auth.salt_secret": "s"})
    port = srv.service.dataport
    bobs = await slow_puts(srv, 5, ns="bob", token="b-tok")
    peak = await peak_while(srv, 1.5)
    assert peak <= BUDGET, f"Bob's connections held {peak} bytes, over his share of {BUDGET}"
    assert port.budget.waits >= 1
    spec = four_mib_model()
    async with EngramClient(srv.address, token="a-tok", namespace="alice", zero_copy=False, timeout_s=10) as c:
        fp = await c.register_model(spec)
        # Bob's puts send nothing more until finish() below, so a put of Alice's waiting behind his share would
        # wait out her timeout_s and fail DeadlineExceeded: stored means she was not queued behind him.
        assert (await c.put(fp, tokens(512, seed=80), random_kv(spec, 512, seed=80))).stored == 1
    assert all(r.stored == 1 for r in await asyncio.wait_for(asyncio.gather(*(b.finish() for b in bobs)), 60))
    for b in bobs:
        b.conn.close()

"""Background puts giving way to loads (engram/loadgate.py): the gate's waiting, and a client's puts through it
against a real daemon on this host (in place from host memory, as a GPU worker's go, so the writer's check
before each block runs)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

from engram.client import EngramClient
from engram.loadgate import LoadGate

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens


def test_a_put_goes_at_once_when_no_load_is_in_flight() -> None:
    gate = LoadGate()
    assert gate.give_way() == 0.0 and gate.waits == 0


def test_a_put_waits_until_every_load_in_flight_is_over() -> None:
    gate = LoadGate(max_wait_s=30)
    done = threading.Event()

    def put() -> None:
        gate.give_way()
        done.set()

    with gate.loading():
        with gate.loading():
            t = threading.Thread(target=put)
            t.start()
            assert not done.wait(0.2)  # two loads in flight
        assert not done.wait(0.2)  # one still is
    assert done.wait(10)
    t.join()
    assert gate.waits == 1 and gate.loads == 0


def test_a_put_waits_at_most_max_wait_for_loads_that_do_not_end() -> None:
    gate = LoadGate(max_wait_s=0.05)
    with gate.loading():
        t0 = time.monotonic()
        waited = gate.give_way()
        assert 0.05 <= waited <= time.monotonic() - t0
    assert gate.waits == 1 and gate.waited_s == waited


class CountingGate(LoadGate):
    def __init__(self, max_wait_s: float) -> None:
        super().__init__(max_wait_s)
        self.asked = 0

    def give_way(self) -> float:
        self.asked += 1
        return super().give_way()


@contextlib.asynccontextmanager
async def giving_way(server_factory, gate: LoadGate) -> AsyncIterator[tuple[EngramClient, bytes]]:  # type: ignore[no-untyped-def]
    """A client on a fresh daemon whose puts go in place from host memory and give way to `gate`."""
    srv = await server_factory()
    async with EngramClient(srv.address, namespace="g", in_place_min_bytes=0) as c:
        fp = await c.register_model(tiny_model())
        c.give_way_to(gate)
        yield c, fp


async def test_an_in_place_put_asks_the_gate_before_each_block_and_waits_while_a_load_runs(
        server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    gate = CountingGate(max_wait_s=0.02)
    async with giving_way(server_factory, gate) as (c, fp):
        toks = tokens(5 * BLOCK_TOKENS)
        put = await c.put(fp, toks, random_kv(spec, len(toks)))
        assert put.stored == 5 and gate.asked == 5 and gate.waits == 0  # asked per block, never waited

        with gate.loading():  # a load that outlasts the put: it waits (boundedly) before the put and every block
            toks = tokens(5 * BLOCK_TOKENS, seed=1)
            put = await c.put(fp, toks, random_kv(spec, len(toks), seed=1))
        assert put.stored == 5 and gate.waits == 6 and gate.waited_s >= 6 * 0.02

        c.give_way_to(None)
        asked = gate.asked
        toks = tokens(2 * BLOCK_TOKENS, seed=2)
        with gate.loading():
            assert (await c.put(fp, toks, random_kv(spec, len(toks), seed=2))).stored == 2
        assert gate.asked == asked  # not giving way any more


async def test_a_put_stores_nothing_until_the_load_it_gives_way_to_is_over(server_factory) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_model()
    gate = LoadGate(max_wait_s=30)
    async with giving_way(server_factory, gate) as (c, fp):
        toks = tokens(3 * BLOCK_TOKENS, seed=3)
        before = (await c.stats()).blocks_put
        with gate.loading():
            put = asyncio.ensure_future(c.put(fp, toks, random_kv(spec, len(toks), seed=3)))
            await asyncio.sleep(0.3)
            assert not put.done() and (await c.stats()).blocks_put == before
        assert (await asyncio.wait_for(put, 10)).stored == 3
        assert (await c.stats()).blocks_put == before + 3 and gate.waits == 1

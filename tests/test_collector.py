"""The daemon's garbage-collection schedule (engram/collector.py): survivors are frozen each period (young cyclic
garbage collected first, not frozen), frozen blocks are still freed when the store drops them, cyclic garbage
frozen while alive is found by the periodic full collection, `engram serve` runs the schedule, and its failed calls
leave no cyclic garbage to freeze. The collector's state is the process's, so each test restores it."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engram.client import EngramClient
from engram.collector import CollectorSchedule
from engram.config import ConfigError, load_config
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc as pb_grpc

from helpers import BLOCK_TOKENS, dram_store, engram_daemon, put_tokens, tiny_model, tokens


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[Node, weakref.ref[Node]]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's objects back in the collector's sight
    gc.collect()


def test_a_step_freezes_survivors_after_collecting_young_cyclic_garbage() -> None:
    schedule = CollectorSchedule(freeze_s=1.0, full_s=3600.0)
    garbage = cycle()[1]  # unreachable already: the young collection frees it
    kept = [Node() for _ in range(1000)]
    before = gc.get_freeze_count()
    schedule.step(now=schedule._last_full + 1)
    assert garbage() is None
    assert gc.get_freeze_count() >= before + len(kept) and schedule.freezes == 1
    assert schedule.full_collections == 0 and gc.get_count()[2] == 0  # nothing left for a full pass to walk


def test_cyclic_garbage_frozen_while_alive_waits_for_the_full_collection() -> None:
    schedule = CollectorSchedule(freeze_s=1.0, full_s=10.0)
    start = schedule._last_full
    node, ref = cycle()
    schedule.step(now=start + 1)  # frozen while it is alive
    del node
    schedule.step(now=start + 2)
    gc.collect()  # an ordinary full collection does not see frozen objects
    assert ref() is not None
    schedule.step(now=start + 10)  # full_s later: the heap is unfrozen and collected whole
    assert ref() is None and schedule.full_collections == 1 and schedule.freed_by_full >= 2
    assert gc.get_freeze_count() > 0  # and frozen again


async def test_frozen_blocks_are_freed_when_the_store_evicts_them() -> None:
    """Blocks are not in reference cycles: evicted, their objects go by reference counting though frozen (the
    victim arrays may keep an evicted block's entry until they next meet it: alive, not garbage)."""
    store, fp = dram_store(8)
    bt = tiny_model().layout.block_tokens
    first = {m.key for m in await put_tokens(store, "ns", fp, tokens(4 * bt, seed=1))}
    CollectorSchedule().step()  # the four blocks' objects frozen
    await put_tokens(store, "ns", fp, tokens(8 * bt, seed=2))  # evicts them
    assert not [k for k in first if k in store.index]
    gc.unfreeze()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a full collection finds unreachable is kept in gc.garbage to look at
    try:
        gc.collect()
        cyclic = [o for o in gc.garbage if type(o).__name__ in ("BlockMeta", "Slot", "Run")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []  # evicted blocks were freed by reference counting, not left to the collector


async def test_the_schedule_runs_until_cancelled() -> None:
    schedule = CollectorSchedule(freeze_s=0.01, full_s=0.05)
    task = asyncio.create_task(schedule.run())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert schedule.freezes >= 5 and schedule.full_collections >= 1


def test_the_schedule_is_configured_and_checked() -> None:
    cfg = load_config(env={}, overrides={"server.gc_freeze_s": 0.5, "server.gc_full_s": 60})
    assert (cfg.server.gc_freeze_s, cfg.server.gc_full_s) == (0.5, 60)
    for bad in ({"server.gc_freeze_s": -1}, {"server.gc_freeze_s": 10, "server.gc_full_s": 5},
                {"server.gc_full_s": float("nan")}):
        with pytest.raises(ConfigError, match="gc_"):
            load_config(env={}, overrides=bad)


def test_engram_serve_runs_the_schedule(tmp_path: Path) -> None:
    with engram_daemon(tmp_path, "--log-level", "info", "--set", "server.gc_freeze_s=0.05",
                       "--set", "server.gc_full_s=0.2") as (_, proc):
        import time

        time.sleep(1.0)
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert "full garbage collection" in out, out[-2000:]


FULL_COLLECTION = re.compile(r"full garbage collection: (\d+) unreachable objects freed")


async def failed_calls(address: str, rounds: int) -> None:
    """Unary calls the daemon refuses, 24 at a time, `rounds` times: 8 each of a Put whose payload is not the size
    its header says, a Lookup naming a model nobody registered and a Lookup whose bytes are not a request."""
    spec = tiny_model()
    async with EngramClient(address, namespace="ns") as client:
        fp = await client.register_model(spec)
    payload = b"x" * 4000
    header = pb.BlockHeader(tokens=list(range(BLOCK_TOKENS)), dtype=int(spec.layout.dtype),
                            shape=list(spec.layout.block_shape(BLOCK_TOKENS)), payload_nbytes=len(payload) + 1)

    async def bad_put() -> AsyncIterator[pb.PutRequest]:
        yield pb.PutRequest(header=pb.PutHeader(namespace="ns", model_fingerprint=fp))
        yield pb.PutRequest(chunk=pb.BlockChunk(header=header, data=payload, last=True))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngramStub(channel)
        raw_lookup = channel.unary_unary("/engram.v1.Engram/Lookup")
        calls = [(lambda: stub.Put(bad_put()), grpc.StatusCode.INVALID_ARGUMENT),
                 (lambda: stub.Lookup(pb.LookupRequest(namespace="ns", model_fingerprint=b"\1" * 16, tokens=[1])),
                  grpc.StatusCode.NOT_FOUND),
                 (lambda: raw_lookup(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT)]

        async def refused(call: Any, code: grpc.StatusCode) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            assert info.value.code() == code, info.value.details()

        for _ in range(rounds):
            await asyncio.gather(*(refused(*calls[i % 3]) for i in range(8 * 3)))


def test_failed_calls_leave_no_cyclic_garbage_for_the_full_collection(tmp_path: Path) -> None:
    """A real `engram serve` on its collector's schedule (survivors frozen every 50 ms, the heap collected whole
    every 2 s, which logs how much cyclic garbage it found frozen) answers 3,000 failed unary calls: the full
    collections from then on find next to nothing. Each failed call left a reference cycle (the AbortError grpc
    keeps in the call's state, the traceback whose frames hold the context), which the schedule froze while it
    was alive (the call in flight, or kept a while after): 13 objects a call found here, and 1-4 MB per 1,000
    calls held until the hourly full collection by a daemon on the default schedule."""
    with engram_daemon(tmp_path, "--log-level", "info", "--set", "server.gc_freeze_s=0.05",
                       "--set", "server.gc_full_s=2") as (address, proc):
        assert proc.stdout is not None
        out = proc.stdout
        lines: list[str] = []

        def read() -> None:
            for line in out:
                lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        start = len(lines)
        asyncio.run(failed_calls(address, 125))  # 3,000 calls
        end = len(lines)

        def full_collections(since: int) -> list[int]:
            return [int(m.group(1)) for line in lines[since:] if (m := FULL_COLLECTION.search(line))]

        deadline = time.monotonic() + 15
        while len(full_collections(end)) < 2 and time.monotonic() < deadline:  # every call's garbage went through one
            time.sleep(0.1)
        assert len(full_collections(end)) >= 2, "".join(lines[-20:])
        freed = full_collections(start)
        proc.kill()
    assert sum(freed) < 1000, freed  # about 100 (grpc's own, of calls in flight at a freeze); 40,000 before


def test_step_if_due_steps_once_a_period_for_a_loop_that_never_yields() -> None:
    sched = CollectorSchedule(freeze_s=1.0)
    try:
        t0 = sched._next
        for t in (t0, t0 + 0.5, t0 + 0.99, t0 + 1.0, t0 + 1.5, t0 + 2.1):
            sched.step_if_due(t)
        assert sched.freezes == 3  # at t0, t0 + 1.0 and t0 + 2.1
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()

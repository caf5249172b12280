"""A daemon that stops answering costs a worker's call the client's timeout_s, not as long as the daemon stalls;
a daemon that is slow but moves is waited for, however long the transfer.

The stopped daemon is a real `engram serve` subprocess sent SIGSTOP (a hung daemon, a frozen host), continued
in a finally. Before the client had a timeout, every call to it (a lookup, a load, a put, ping, a new client's
register_model) was still blocked 20 s later (an audit, session 45). Each call here runs in a thread given a
hard limit, so a call that hangs fails the test instead of holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from engram import errors
from engram.client import EngramClient, SyncEngramClient
from engram.config import load_config
from engram.control import ControlClient
from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec
from engram.server import start_server
from engram.v1 import engram_pb2 as pb
from engram.wire import channel, deadline

from helpers import engram_daemon, random_kv, tiny_model, tokens

TIMEOUT_S = 1.0
SLACK_S = 3.0  # a loaded 2-core machine's scheduling, and a data-channel send cut at its second look
SPEC = tiny_model()
BIG = ModelSpec("big-blocks", "seed-0", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8,
                                                 head_dim=128, block_tokens=256), codec="raw")


@contextlib.contextmanager
def stopped(proc: subprocess.Popen[str]) -> Iterator[None]:
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def failures(calls: dict[str, Callable[[], Any]], limit_s: float) -> dict[str, tuple[float, BaseException | None]]:
    """Each call in a thread of its own, all at once: (seconds, what it raised) by name. A call still blocked
    after limit_s fails the test (its thread ends once the daemon continues)."""
    out: dict[str, tuple[float, BaseException | None]] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.monotonic()
        try:
            fn()
            out[name] = (time.monotonic() - t0, None)
        except BaseException as exc:  # what it raised is the result
            out[name] = (time.monotonic() - t0, exc)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    end = time.monotonic() + limit_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    blocked = sorted(set(calls) - set(out))
    assert not blocked, f"still blocked after {limit_s} s on a stopped daemon: {blocked}"
    return out


def assert_timed_out(results: dict[str, tuple[float, BaseException | None]]) -> None:
    for name, (seconds, exc) in results.items():
        assert isinstance(exc, errors.DeadlineExceeded), f"{name}: {exc!r}"
        assert "timeout_s" in str(exc) and f"{TIMEOUT_S:g} s" in str(exc), f"{name}: {exc}"
        assert seconds >= TIMEOUT_S * 0.9, f"{name} gave up after {seconds:.2f} s, before the timeout"


def test_unary_calls_and_a_load_to_a_stopped_daemon_fail_within_the_timeout_and_work_once_it_continues(
        tmp_path: Path) -> None:
    """ping, a lookup, a load (GetPrefix) and a new client's register_model (what an engine's start does) each
    fail DeadlineExceeded within the timeout; once the daemon continues the same client looks up and loads."""
    toks = tokens(48, seed=1)
    kv = random_kv(SPEC, len(toks), seed=1)
    with engram_daemon(tmp_path) as (address, proc), \
            SyncEngramClient(address, namespace="t", timeout_s=TIMEOUT_S) as client:
        fp = client.register_model(SPEC)
        client.put(fp, toks, kv)
        dest = torch.empty_like(kv)
        assert client.load_prefix_into(fp, toks, dest).loaded_tokens == len(toks)  # the pool mapped already
        late: list[SyncEngramClient] = []

        def start_an_engine() -> None:
            late.append(SyncEngramClient(address, namespace="t", timeout_s=TIMEOUT_S))
            late[-1].register_model(SPEC)

        with stopped(proc):
            results = failures({"ping": client.ping, "lookup": lambda: client.lookup(fp, toks),
                                "load": lambda: client.load_prefix_into(fp, toks, torch.empty_like(kv)),
                                "register_model on a new client": start_an_engine},
                               TIMEOUT_S + SLACK_S)
        assert_timed_out(results)
        assert client.ping() > 0
        assert client.lookup(fp, toks).matched_tokens == len(toks)
        dest = torch.empty_like(kv)
        assert client.load_prefix_into(fp, toks, dest).loaded_tokens == len(toks) and torch.equal(dest, kv)
        assert late[0].register_model(SPEC) == fp
        late[0].close()


def test_puts_and_gets_to_a_stopped_daemon_fail_within_the_timeout_on_the_data_channel_and_grpc(
        tmp_path: Path) -> None:
    """The byte paths: a put and a get over the data channel and over gRPC streams (clients that do not map the
    daemon's pool) each fail DeadlineExceeded, not retried on another connection; once the daemon continues
    they store and fetch again."""
    toks = tokens(64, seed=2)
    kv = random_kv(SPEC, len(toks), seed=2)
    with engram_daemon(tmp_path) as (address, proc), \
            SyncEngramClient(address, namespace="t", timeout_s=TIMEOUT_S, zero_copy=False) as data, \
            SyncEngramClient(address, namespace="t", timeout_s=TIMEOUT_S, zero_copy=False,
                             data_channel=False) as streams:
        fp = data.register_model(SPEC)
        streams.register_model(SPEC)
        keys = list(data.put(fp, toks, kv).keys)
        assert len(data.get(fp, keys)) == len(keys) and len(streams.get(fp, keys)) == len(keys)
        with stopped(proc):
            results = failures({
                "data channel put": lambda: data.put(fp, toks, kv, skip_cached=False),
                "data channel get": lambda: data.get(fp, keys),
                "gRPC put": lambda: streams.put(fp, toks, kv, skip_cached=False),
                "gRPC get": lambda: streams.get(fp, keys),
            }, 2 * TIMEOUT_S + SLACK_S)
        assert_timed_out(results)
        for client in (data, streams):
            assert client.put(fp, toks, kv, skip_cached=False).deduplicated == len(keys)
            got = client.get(fp, keys)
            assert torch.equal(torch.cat(got, dim=2), kv)


def test_a_client_holding_leases_closes_within_the_timeout_when_its_daemon_is_stopped(tmp_path: Path) -> None:
    """A load's lease is ended by the client's next load or a ReleaseLeases a moment later; close ends it. With
    the daemon stopped that release waited for it, and so did close()."""
    toks = tokens(32, seed=3)
    kv = random_kv(SPEC, len(toks), seed=3)
    with engram_daemon(tmp_path) as (address, proc):
        client = SyncEngramClient(address, namespace="t", timeout_s=TIMEOUT_S)
        fp = client.register_model(SPEC)
        client.put(fp, toks, kv)
        assert client.load_prefix_into(fp, toks, torch.empty_like(kv)).mapped_blocks > 0  # a lease is held
        with stopped(proc):
            results = failures({"close": client.close}, TIMEOUT_S + SLACK_S)
        assert results["close"][1] is None


async def test_unary_and_control_calls_to_a_stopped_daemon_raise_deadline_exceeded_whichever_timer_ends_them(
        tmp_path: Path) -> None:
    """Unary calls carry the client's bound as their gRPC deadline now (so the daemon knows it), and gRPC's own
    timer may end such a call before the client's: it fails gRPC's bare DEADLINE_EXCEEDED ("Deadline Exceeded"),
    which deadline.answer let through as a grpc error, not the client's DeadlineExceeded naming timeout_s. Each
    call here, to a stopped daemon, raises that DeadlineExceeded; the last is made with a gRPC deadline shorter
    than the client's bound, so gRPC's timer ends it. The outer wait_for only keeps a hang from holding the test."""
    with engram_daemon(tmp_path) as (address, proc):
        async with EngramClient(address, namespace="t", timeout_s=TIMEOUT_S) as client, \
                ControlClient(address, namespace="t", timeout_s=TIMEOUT_S) as control:
            fp = await client.register_model(SPEC)
            toks = tokens(32, seed=4)
            await client.put(fp, toks, random_kv(SPEC, len(toks), seed=4))
            assert (await control.stats()).namespaces
            with stopped(proc):
                calls = {"lookup": client.lookup(fp, toks), "register_model": client.register_model(SPEC),
                         "release_leases": client.release_leases([1]), "stats": control.stats(),
                         "list_namespaces": control.list_namespaces(), "describe_namespace": control.describe_namespace(),
                         "list_sessions": control.list_sessions(),
                         "gRPC's own deadline": deadline.answer(client._stub.Stats(pb.StatsRequest(), timeout=0.2),
                                                                TIMEOUT_S, address)}
                results = await asyncio.wait_for(asyncio.gather(*calls.values(), return_exceptions=True), 30)
            for name, exc in zip(calls, results, strict=True):
                assert isinstance(exc, errors.DeadlineExceeded), f"{name}: {exc!r}"
                assert "timeout_s" in str(exc) and f"{TIMEOUT_S:g} s" in str(exc), f"{name}: {exc}"
            assert (await client.lookup(fp, toks)).matched_tokens == len(toks)


async def test_a_slow_daemon_that_keeps_sending_and_taking_is_waited_for_past_the_timeout(tmp_path: Path) -> None:
    """A daemon whose disk takes 0.3 s a block: a Get of 8 blocks from NVMe runs 2.4 s, a write-through Put of 8
    blocks as long, each well past a 1 s timeout, over gRPC and the data channel. Each moves every 0.3 s, and none
    is cut: the timeout bounds a stream's wait for its next message or bytes, not its length (a total deadline cut
    the Get; a client counting only its own sends and receives cut the data channel's Put, its blocks all sent)."""
    nvme = tmp_path / "nvme"
    base = {"server.port": 0, "tiers.dram.capacity": "128MiB", "tiers.dram.prefault": False,
            "tiers.nvme.path": str(nvme), "tiers.write_policy": "write-through", "tiers.dram.pool": "private"}
    chains = [(tokens(8 * 16, seed=seed), random_kv(SPEC, 8 * 16, seed=seed)) for seed in (4, 5)]
    first = await start_server(load_config(env={}, overrides={**base, "server.unix_socket": str(tmp_path / "a.sock")}))
    try:
        async with EngramClient(first.address, namespace="t") as client:
            fp = await client.register_model(SPEC)
            keys = [list((await client.put(fp, toks, kv)).keys) for toks, kv in chains]
    finally:
        await first.stop(0)
    srv = await start_server(load_config(env={}, overrides={**base, "server.unix_socket": str(tmp_path / "b.sock")}))
    try:
        nvme_tier = srv.store.tiers[-1]
        nvme_tier.fault_hook = lambda op, path: time.sleep(0.3) if op in ("read", "write") else None
        for i, data_channel in enumerate((True, False)):  # a chain each: a block read once is in DRAM after
            async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S, zero_copy=False,
                                    data_channel=data_channel) as client:
                await client.register_model(SPEC)
                t0 = time.monotonic()
                got = await client.get(fp, keys[i])  # each block read from NVMe as it is sent
                assert time.monotonic() - t0 > 2 * TIMEOUT_S
                assert torch.equal(torch.cat(got, dim=2), chains[i][1])
                # Over the data channel 8 tiny blocks lie in the kernel's buffers at once: the daemon reading them is
                # the only progress. gRPC's flow-control window (MiBs) would hold them all too, and the client sees
                # no more of the daemon's reading than that: 2 MiB blocks, one or two in the window at a time.
                spec = SPEC if data_channel else BIG
                model = await client.register_model(spec)
                other = tokens(8 * spec.layout.block_tokens, seed=6 + i)
                t0 = time.monotonic()
                put = await client.put(model, other, random_kv(spec, len(other), seed=6))  # each block stored as it comes
                assert time.monotonic() - t0 > 2 * TIMEOUT_S and put.stored == 8
    finally:
        await srv.stop(0)


async def test_a_tcp_data_channel_put_the_daemon_stores_from_its_buffers_on_a_slow_disk_is_waited_for(
        tmp_path: Path) -> None:
    """Over TCP the kernel acknowledges a Put of small blocks into the daemon's receive buffer at once, and the
    client's counters stop moving while the daemon stores them one by one (0.3 s a block, write-through): before the
    daemon sent PROGRESS frames (DataPut.progress_every_ms) such a put was cut at timeout_s every time (a review,
    session 45: 8 blocks, a 1 s timeout; a unix socket passed, its queue seen shrinking)."""
    base = {"server.host": "127.0.0.1", "server.port": 0, "tiers.dram.capacity": "128MiB",
            "tiers.dram.prefault": False, "tiers.nvme.path": str(tmp_path / "nvme"),
            "tiers.write_policy": "write-through", "tiers.dram.pool": "private"}
    srv = await start_server(load_config(env={}, overrides=base))
    try:
        assert not srv.address.startswith("unix:")
        srv.store.tiers[-1].fault_hook = lambda op, path: time.sleep(0.3) if op == "write" else None
        async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S, zero_copy=False) as client:
            fp = await client.register_model(SPEC)
            toks = tokens(8 * 16, seed=10)
            kv = random_kv(SPEC, len(toks), seed=10)
            t0 = time.monotonic()
            put = await client.put(fp, toks, kv)
            assert time.monotonic() - t0 > 2 * TIMEOUT_S and put.stored == 8
            assert srv.service.dataport is not None and srv.service.dataport.served["put"] == 1  # not gRPC's Put
            n, got = await client.get_prefix(fp, toks)
            assert n == len(toks) and torch.equal(got, kv)
    finally:
        await srv.stop(0)


async def test_a_load_and_an_in_place_put_whose_daemon_moves_kv_on_a_slow_disk_are_waited_for(
        monkeypatch: Any, tmp_path: Path) -> None:
    """GetPrefix brings a prefix up from NVMe into the pool before it answers, and a write-through CommitPut writes
    its blocks to NVMe before it answers: one answer, after seconds of healthy work on a slow disk (0.3 s a block
    here). Bounded by timeout_s alone, a 2.4 s load failed DeadlineExceeded at a 1 s timeout every time it was
    tried, and an in-place put after 3 of its 8 blocks (an audit, session 45). Such a call's bound adds its bytes at
    deadline.WORK_BYTES_PER_S, lowered here to a block per 0.5 s so these small blocks count as a big prefix."""
    from engram.wire import deadline

    monkeypatch.setattr(deadline, "WORK_BYTES_PER_S", SPEC.layout.block_nbytes(16) / 0.5)
    nvme = tmp_path / "nvme"
    base = {"server.port": 0, "tiers.dram.capacity": "128MiB", "tiers.dram.prefault": False,
            "tiers.nvme.path": str(nvme), "tiers.write_policy": "write-through",
            "server.unix_socket": str(tmp_path / "a.sock")}
    n = 40  # blocks: the daemon reads about four at a time, 3 s in all
    toks, kv = tokens(n * 16, seed=8), random_kv(SPEC, n * 16, seed=8)
    first = await start_server(load_config(env={}, overrides=base))
    try:
        async with EngramClient(first.address, namespace="t") as client:
            fp = await client.register_model(SPEC)
            assert (await client.put(fp, toks, kv)).stored == n
    finally:
        await first.stop(0)
    srv = await start_server(load_config(env={}, overrides={**base, "server.unix_socket": str(tmp_path / "b.sock")}))
    try:
        srv.store.tiers[-1].fault_hook = lambda op, path: time.sleep(0.3) if op in ("read", "write") else None
        async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S, in_place_min_bytes=0) as client:
            await client.register_model(SPEC)
            dest = torch.zeros_like(kv)
            t0 = time.monotonic()
            loaded = await client.load_prefix_into(fp, toks, dest)  # the blocks come up from NVMe first
            assert time.monotonic() - t0 > 2 * TIMEOUT_S
            assert loaded.matched_tokens == len(toks) and torch.equal(dest, kv)
            other, more = tokens(n * 16, seed=9), random_kv(SPEC, n * 16, seed=9)
            t0 = time.monotonic()
            put = await client.put(fp, other, more)  # in place: CommitPut writes each block through to NVMe
            assert time.monotonic() - t0 > 2 * TIMEOUT_S and put.stored == n
            assert srv.store.counters.blocks_put == n
    finally:
        await srv.stop(0)


async def test_an_in_place_put_of_many_small_blocks_on_a_slow_disk_is_waited_for_by_its_blocks(
        monkeypatch: Any, tmp_path: Path) -> None:
    """A write-through CommitPut writes each block to NVMe before it answers: with small blocks the time is the
    blocks', not the bytes'. Bounded by timeout_s and its bytes alone, 4,000 blocks of 4 KiB failed
    DeadlineExceeded at timeout_s = 5 s while the daemon went on committing (an audit, session 48). The bound adds
    its blocks at deadline.WORK_BLOCKS_PER_S, lowered here to 10 a second against a disk taking 0.05 s a block."""
    from engram.wire import deadline

    monkeypatch.setattr(deadline, "WORK_BLOCKS_PER_S", 10)
    base = {"server.port": 0, "tiers.dram.capacity": "128MiB", "tiers.dram.prefault": False,
            "tiers.nvme.path": str(tmp_path / "nvme"), "tiers.write_policy": "write-through",
            "server.unix_socket": str(tmp_path / "a.sock")}
    n = 40  # blocks of 4 KiB: 2 s of writes, their bytes' allowance a few ms
    srv = await start_server(load_config(env={}, overrides=base))
    try:
        srv.store.tiers[-1].fault_hook = lambda op, path: time.sleep(0.05) if op == "write" else None
        async with EngramClient(srv.address, namespace="t", timeout_s=TIMEOUT_S, in_place_min_bytes=0) as client:
            fp = await client.register_model(SPEC)
            t0 = time.monotonic()
            put = await client.put(fp, tokens(n * 16, seed=3), random_kv(SPEC, n * 16, seed=3))
            assert time.monotonic() - t0 > 1.5 * TIMEOUT_S and put.stored == n and put.write_ms > 0
    finally:
        await srv.stop(0)


async def test_an_idle_channel_pinging_at_the_daemons_allowed_rate_is_not_sent_away(monkeypatch: Any,
                                                                                    tmp_path: Path) -> None:
    """A client pings an idle connection every channel.KEEPALIVE_S; the daemon accepts pings that often, with or
    without calls (grpc's default policy answered the third early one with GOAWAY too_many_pings and closed the
    connection). The interval is shortened here, on both sides, to 0.2 s (grpc sends one a second at most):
    six pings in 6 s, one connection throughout, where the third early one was sent away."""
    monkeypatch.setattr(channel, "KEEPALIVE_S", 0.2)
    srv = await start_server(load_config(env={}, overrides={
        "server.port": 0, "server.unix_socket": str(tmp_path / "e.sock"), "tiers.dram.capacity": "64MiB",
        "tiers.dram.prefault": False}))
    try:
        async with EngramClient(srv.address, timeout_s=TIMEOUT_S) as client:
            await client.ping()
            states = set()
            for _ in range(60):
                await asyncio.sleep(0.1)
                states.add(client._channel.get_state())
            assert states == {grpc.ChannelConnectivity.READY}
            await client.ping()
    finally:
        await srv.stop(0)


def test_an_idle_client_notices_a_daemon_that_stopped_answering_by_its_keepalive(monkeypatch: Any,
                                                                                  tmp_path: Path) -> None:
    """A daemon gone without a reset (a host powered off) left an idle client's connection open: its next call
    went out on it and waited. Keepalive closes a connection whose ping is not answered within KEEPALIVE_S / 2
    (0.2 s and 0.1 s here, on the client's side only; grpc pings once a second at most): the stopped daemon's is
    closed while no call is made."""
    monkeypatch.setattr(channel, "KEEPALIVE_S", 0.2)
    states: set[grpc.ChannelConnectivity] = set()

    async def idle_through_a_stop(address: str, proc: subprocess.Popen[str]) -> None:
        async with EngramClient(address, timeout_s=TIMEOUT_S) as client:
            await client.ping()
            with stopped(proc):
                for _ in range(30):
                    await asyncio.sleep(0.1)
                    states.add(client._channel.get_state())

    with engram_daemon(tmp_path) as (address, proc):
        asyncio.run(idle_through_a_stop(address, proc))
    assert states - {grpc.ChannelConnectivity.READY}, "the connection to the stopped daemon stayed open"


async def test_a_client_whose_timeout_s_is_centuries_long_still_gets_its_answers(server_factory) -> None:  # type: ignore[no-untyped-def]
    """timeout_s = sys.maxsize (a caller's "wait as long as it takes"; any positive finite number is taken) is each
    call's gRPC deadline now, and gRPC ends at once, DEADLINE_EXCEEDED, a call whose deadline is past its clock's
    range (about 7e9 s from now): a register, a lookup, a load, stats, a session's open and close each failed
    "did not answer within 9.22e+18 s" against a daemon that answers in milliseconds (a review, session 54). Each
    is answered, and the block put is loaded."""
    srv = await server_factory()
    async with EngramClient(srv.address, namespace="t", timeout_s=sys.maxsize, data_channel=False) as c:
        fp = await c.register_model(SPEC)
        toks = tokens(32, seed=21)
        kv = random_kv(SPEC, len(toks), seed=21)
        await c.put(fp, toks, kv)
        assert (await c.lookup(fp, toks)).matched_tokens == len(toks)
        assert (await c.stats()).namespaces
        n, got = await c.get_prefix(fp, toks)
        assert n == len(toks) and torch.equal(got, kv)
        session = await c.open_session(fp, mode="persist", tokens=toks)
        await c.close_session(session.session_id)

"""A client's close() ends the calls then in flight, and every later call, with ClientClosed; nothing waits on.

Against a real `engram serve` subprocess. Before, SyncEngramClient.close() stopped its event loop and left the
calls other threads had in flight unresolved: those threads were still blocked 80 s later on the data-channel
and in-place put paths, and a gRPC put got a bare CancelledError; a call after close failed RuntimeError "Event
loop is closed", and the async client's grpc UsageError "Channel is closed" (an audit, session 48).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest

from engram import errors
from engram.client import EngramClient, SyncEngramClient
from engram.layout import KVLayout, LayerKind, LayerSpec, ModelSpec

from helpers import engram_daemon, random_kv, tiny_model, tokens

SPEC = ModelSpec("close-test", "seed-0", KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 4, num_kv_heads=4,
                                                  head_dim=64, block_tokens=16), codec="raw")
PATHS = {"data-channel": {}, "in-place": {"in_place_min_bytes": 0},
         "grpc": {"data_channel": False, "zero_copy": False}}
THREADS = 4
ENDS_WITHIN_S = 10.0  # timeout_s (3 s) and a loaded 2-core machine's slack


@pytest.mark.parametrize("path", PATHS)
def test_close_ends_the_calls_other_threads_have_in_flight_with_client_closed(tmp_path: Path, path: str) -> None:
    n = 8192  # 4 MiB of KV a put: each thread is mid-call most of the time
    kv = random_kv(SPEC, n)
    with engram_daemon(tmp_path, env={"ENGRAM_TIERS__DRAM__CAPACITY": "256MiB"}) as (address, _):
        client = SyncEngramClient(address, timeout_s=3, **PATHS[path])
        fp = client.register_model(SPEC)
        ended: dict[int, BaseException] = {}
        calls = [0] * THREADS

        def work(i: int) -> None:
            try:
                for rep in range(10**6):  # until close() ends it
                    toks = tokens(n, seed=1 + i * 10**6 + rep)
                    client.put(fp, toks, kv)
                    calls[i] += 1
                    client.get_prefix(fp, toks)
                    calls[i] += 1
            except BaseException as exc:  # what ended it is the result
                ended[i] = exc

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(THREADS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(calls) < THREADS and time.monotonic() < deadline:  # all of them at work
            time.sleep(0.05)
        client.close()
        closed_at = time.monotonic()
        for t in threads:
            t.join(max(0.0, closed_at + ENDS_WITHIN_S - time.monotonic()))
        blocked = [i for i, t in enumerate(threads) if t.is_alive()]
        assert not blocked, f"threads {blocked} still blocked {ENDS_WITHIN_S} s after close() ({path})"
        for i, exc in ended.items():
            assert isinstance(exc, errors.ClientClosed), f"thread {i}: {exc!r}"
            assert "closed" in str(exc), exc
        assert any("while this call ran" in str(exc) for exc in ended.values()), ended

        with pytest.raises(errors.ClientClosed, match="the client is closed"):
            client.lookup(fp, tokens(16))
        client.close()  # again: nothing


async def test_a_call_on_a_closed_async_client_raises_client_closed(tmp_path: Path) -> None:
    spec = tiny_model()
    with engram_daemon(tmp_path) as (address, _):
        client = EngramClient(address)
        fp = await client.register_model(spec)
        await client.close()
        for call in (client.lookup(fp, tokens(16)), client.stats(), client.ping(),
                     client.put(fp, tokens(16), random_kv(spec, 16))):
            with pytest.raises(errors.ClientClosed, match="the client is closed"):
                await call


@pytest.mark.parametrize("path", PATHS)
async def test_async_close_ends_the_calls_other_tasks_have_in_flight_with_client_closed(tmp_path: Path,
                                                                                         path: str) -> None:
    """The async client's close() closes its channels under the calls other tasks await: each of them raises
    ClientClosed ('while this call ran'), as the sync client's do. They got a bare asyncio.CancelledError (in-place
    and gRPC puts), which a task reads as its own cancellation, or grpc's UsageError (an audit, session 48). The
    data channel's calls ended ClientClosed before too (their next call's, after close)."""
    n = 8192
    kv = random_kv(SPEC, n)
    with engram_daemon(tmp_path, env={"ENGRAM_TIERS__DRAM__CAPACITY": "256MiB"}) as (address, _):
        client = EngramClient(address, timeout_s=3, **PATHS[path])
        fp = await client.register_model(SPEC)
        calls = [0] * THREADS

        async def work(i: int) -> None:
            for rep in range(10**6):  # until close() ends it
                toks = tokens(n, seed=1 + i * 10**6 + rep)
                await client.put(fp, toks, kv)
                calls[i] += 1
                await client.get_prefix(fp, toks)
                calls[i] += 1

        tasks = [asyncio.create_task(work(i)) for i in range(THREADS)]
        deadline = time.monotonic() + 30
        while sum(calls) < THREADS and time.monotonic() < deadline:  # all of them at work
            await asyncio.sleep(0.05)
        await client.close()
        done, pending = await asyncio.wait(tasks, timeout=ENDS_WITHIN_S)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} tasks still waiting {ENDS_WITHIN_S} s after close() ({path})"
        ended = [task.exception() if not task.cancelled() else asyncio.CancelledError("the task ended cancelled")
                 for task in tasks]
        for i, exc in enumerate(ended):  # cut mid-call ("while this call ran"), or its next call after close
            assert isinstance(exc, errors.ClientClosed), f"task {i}: {exc!r}"
        if path == "grpc":  # close() cuts gRPC calls at once; the others' calls may end first, while close awaits
            assert any("while this call ran" in str(exc) for exc in ended), ended


async def test_async_close_cuts_the_data_channel_requests_in_flight_at_once(tmp_path: Path) -> None:
    """Gets and puts in flight on the data channel of a daemon that stopped answering (SIGSTOP): one on the pooled
    connection, the others dialling theirs. close() cuts them: each raises ClientClosed ('while this call ran')
    at once. They ran on until timeout_s (30 s here; a 3.3 s close in session 49's cancel audit) while close() cut
    the gRPC calls at once, and each then put its connection back into the closed channel's pool, left open."""
    with engram_daemon(tmp_path) as (address, proc):
        client = EngramClient(address, timeout_s=30, zero_copy=False)  # the bytes path: the data channel
        fp = await client.register_model(SPEC)
        keys = (await client.put_blocks(fp, [(tokens(16, seed=1), random_kv(SPEC, 16, seed=1))])).keys
        await client.get(fp, keys)  # the channel is open, one connection idle in its pool
        proc.send_signal(signal.SIGSTOP)
        try:
            calls = [asyncio.create_task(client.get(fp, keys)) for _ in range(2)]
            calls += [asyncio.create_task(client.put_blocks(fp, [(tokens(16, seed=2 + i), random_kv(SPEC, 16))]))
                      for i in range(2)]
            await asyncio.sleep(0.5)
            assert not any(call.done() for call in calls)
            await client.close()
            done, pending = await asyncio.wait(calls, timeout=ENDS_WITHIN_S / 2)
            for call in pending:
                call.cancel()
            assert not pending, f"{len(pending)} calls still waiting {ENDS_WITHIN_S / 2} s after close()"
            for call in calls:
                with pytest.raises(errors.ClientClosed, match="while this call ran"):
                    await call
        finally:
            proc.send_signal(signal.SIGCONT)


async def test_an_async_call_begun_while_close_runs_is_refused_client_closed(tmp_path: Path) -> None:
    """close() releases the client's held leases before it closes the channel; a call another task begins in
    between is refused ClientClosed at once. It ran, and close then cut it: a bare CancelledError, its task ended
    cancelled (a review, session 49)."""
    with engram_daemon(tmp_path, env={"ENGRAM_TIERS__DRAM__CAPACITY": "256MiB"}) as (address, _):
        client = EngramClient(address, timeout_s=5, data_channel=False, in_place_min_bytes=2**40)
        fp = await client.register_model(SPEC)
        toks = tokens(64, seed=1)
        await client.put(fp, toks, random_kv(SPEC, 64))
        await client.get_prefix(fp, toks)  # zero-copy: a lease held until the next load, or close
        closing = asyncio.create_task(client.close())
        await asyncio.sleep(0)  # close() began, and awaits the lease's release
        put = asyncio.create_task(client.put(fp, tokens(16384, seed=2), random_kv(SPEC, 16384)))
        await closing
        with pytest.raises(errors.ClientClosed, match="the client is closed"):
            await put

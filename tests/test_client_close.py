"""A client's close() ends the calls then in flight, and every later call, with ClientClosed; nothing waits on.

Against a real `engram serve` subprocess. Before, SyncEngramClient.close() stopped its event loop and left the
calls other threads had in flight unresolved: those threads were still blocked 80 s later on the data-channel
and in-place put paths, and a gRPC put got a bare CancelledError; a call after close failed RuntimeError "Event
loop is closed", and the async client's grpc UsageError "Channel is closed" (an audit, session 48).
"""

from __future__ import annotations

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

"""The daemon's data channel moves a large payload a piece at a time, giving its event loop a turn between pieces
(engram/wire/data.py, STEP_BYTES): a client on another core keeps the socket ready, so a 16 MiB Put or Get was
sent or received in one step of the loop, and every other client's small call waited behind it (20-60 ms steps
under load, session 49)."""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import sys
import time
from typing import Any

import pytest

from helpers import NEUTRAL_CWD

# A client in a process of its own (the daemon's peer on another core): it puts a chain of 8 blocks of 2 MiB, then
# puts it again (deduplicated: the daemon receives the 16 MiB and stores nothing, so receiving is the request's work)
# and gets it back, in turn, one request each, printing each op's window on the host's one clock (perf_counter).
CLIENT = """
import asyncio, json, sys, time
import numpy as np, torch
from engram.client import EngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

async def main(address):
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),) * 2, num_kv_heads=8, head_dim=128, dtype=DType.BF16,
                      block_tokens=256)
    spec = ModelSpec("turns", "w", layout, codec="raw")
    gen = torch.Generator().manual_seed(1)
    chain = [(np.arange(i * 256, (i + 1) * 256, dtype=np.int32),
              torch.randn(layout.block_shape(256), generator=gen).to(torch.bfloat16)) for i in range(8)]
    async with EngramClient(address, zero_copy=False, timeout_s=120) as c:
        fp = await c.register_model(spec)
        keys = (await c.put_blocks(fp, chain)).keys
        await c.get(fp, keys)
        print("ready", flush=True)
        sys.stdin.readline()
        for op in ("put", "get") * 6:
            t0 = time.perf_counter()
            if op == "put":
                assert (await c.put_blocks(fp, chain)).deduplicated == 8
            else:
                await c.get(fp, keys)
            print(json.dumps([op, t0, time.perf_counter()]), flush=True)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_16_mib_put_or_get_gives_the_daemons_loop_turns_while_its_bytes_move(server_factory: Any) -> None:
    """Another process puts 16 MiB (8 blocks of 2 MiB) and gets it back over the data channel, op after op, while
    a ticker on the (in-process) daemon's loop measures its steps in the loop thread's CPU time. Each op's longest
    step is a small part of the CPU the loop spent during the op (the median over 6 puts and 6 gets: a fraction,
    not a time, so a loaded machine slows both alike). Main moved the bytes while the peer kept up in one step:
    about half of each op."""
    srv = await server_factory()
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, srv.address, cwd=NEUTRAL_CWD,
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert client.stdin is not None and client.stdout is not None
    steps: list[tuple[float, float]] = []  # each step of the loop: (its end on the host's clock, its CPU time)
    stop = asyncio.Event()

    async def ticker() -> None:
        # CPU time of the loop's thread: a step is the daemon's work, not the time the host ran another process
        # (2 cores shared with a client that keeps up and with whatever else runs)
        last = time.thread_time()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.thread_time()
            steps.append((time.perf_counter(), now - last))
            last = now

    ops: list[tuple[str, float, float]] = []
    try:
        assert (await asyncio.wait_for(client.stdout.readline(), 120)).strip() == b"ready"
        ticking = asyncio.create_task(ticker())
        gc.disable()  # a collection of the test process's heap is not the daemon's step
        try:
            client.stdin.write(b"go\n")
            while line := await asyncio.wait_for(client.stdout.readline(), 120):
                op, t0, t1 = json.loads(line)
                ops.append((op, t0, t1))
        finally:
            gc.enable()
            stop.set()
            await ticking
        assert await client.wait() == 0
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
    assert len(ops) == 12
    shares: dict[str, list[float]] = {"put": [], "get": []}
    for op, t0, t1 in ops:
        during = [cpu for end, cpu in steps if t0 < end <= t1]
        shares[op].append(max(during) / sum(during))
    for op, got in shares.items():  # this: 0.05-0.15; main: 0.35-0.7
        assert statistics.median(got) < 0.25, (op, got)

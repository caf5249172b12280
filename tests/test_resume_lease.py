"""The blocks a Resume answers with stay leased from the lookup that finds them until its answer is built (and,
with the global KV, sent): an eviction between SessionManager.resume's return and the service's stream (two loop
hops, in which a concurrent put made room) left a block with no copy in the answer, and the Resume failed INTERNAL
with an IndexError and a traceback in the log (an audit of replay sessions, session 47). On every path: a replay,
a hot window, a model with nothing to rebuild. A block lost all the same (its only copy found damaged by another
reader) is FAILED_PRECONDITION, put it again, never INTERNAL.

The race is made to happen every time: the daemon's SessionManager.resume is wrapped so that, after it answers and
before the service sees the answer, a second client's put needs the memory the session's blocks fill."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_sessions_replay import BT, P, block_tensor, tokens_for

from engram import errors
from engram.client import EngramClient
from engram.errors import DataLoss
from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern
from engram.replay.runtime import model_spec_for
from engram.server import RunningServer

# DRAM only, room for about 5 of the session's 4 blocks of 8 KiB: a put of 3 more must evict some of them.
CAPACITY = "48KiB"


def _after_answer(srv: RunningServer, then: Callable[[], Awaitable[None]]) -> None:
    """Run `then` after the daemon's SessionManager.resume answers, before the service's Resume handler wakes."""
    answer = srv.sessions.resume

    async def resume(*args: Any, **kw: Any) -> Any:
        r = await answer(*args, **kw)
        await then()
        return r

    srv.sessions.resume = resume  # type: ignore[method-assign]


async def _session(client: EngramClient, model: HybridDecoder, toks: np.ndarray) -> tuple[bytes, str]:
    fp = await client.register_model(model_spec_for(model, block_tokens=BT, codec="raw"))
    await client.put(fp, toks, block_tensor(model, toks))
    return fp, (await client.open_session(fp, tokens=toks)).session_id


@pytest.mark.parametrize("path", ["replay", "hot", "nothing-to-rebuild"])
@pytest.mark.parametrize("with_global_kv", [True, False], ids=["with-global-kv", "refs-only"])
async def test_a_put_between_the_resumes_answer_and_its_stream_does_not_evict_its_blocks(
        server_factory: Any, model_file: Path, model: HybridDecoder, path: str, with_global_kv: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    srv = await server_factory(**{"replay.models": str(model_file), "tiers.dram.capacity": CAPACITY})
    srv.store.wait_for_room_s = 0.0  # a put that finds only leased blocks fails at once rather than wait for them
    if path == "nothing-to-rebuild":  # a window of 1: no row to rebuild, no replay
        model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=1, dtype=torch.float32, seed=5))
    toks = tokens_for(P, seed=61)
    async with EngramClient(srv.address, namespace="a") as client, EngramClient(srv.address, namespace="a") as other:
        fp, sid = await _session(client, model, toks)
        await other.register_model(model_spec_for(model, block_tokens=BT, codec="raw"))
        if path == "hot":
            assert (await client.resume(sid)).source == "replay"  # the window is hot from here
        before = {b.key for b in (await client.lookup(fp, toks)).blocks}
        assert len(before) == 4

        async def put_other() -> None:
            others = tokens_for(3 * BT, seed=62)
            with contextlib.suppress(errors.ResourceExhausted):  # the session's blocks leased: no room, at once
                await other.put(fp, others, block_tensor(model, others))

        _after_answer(srv, put_other)
        caplog.set_level(logging.ERROR, logger="engram")
        if with_global_kv:
            r, kv = await client.resume_kv(fp, sid)
            assert torch.equal(kv, block_tensor(model, toks))
        else:
            r = await client.resume(sid)
        assert r.source == ("hot" if path == "hot" else "replay") and r.position == P
        assert {b.key for b in r.blocks} == before and all(b.tier == "dram" for b in r.blocks)
        assert "internal error" not in caplog.text
        # The leases ended with the stream: the same put now makes its room (by evicting the session's blocks).
        await put_other()
        assert (await client.lookup(fp, toks)).matched_tokens < P


async def test_a_block_lost_between_the_resumes_answer_and_its_stream_is_failed_precondition(
        server_factory: Any, model_file: Path, model: HybridDecoder, caplog: pytest.LogCaptureFixture) -> None:
    """A lease keeps a block from eviction, not from a damaged copy's removal: another reader that finds the only
    copy damaged drops the block. The Resume says to put it again (FAILED_PRECONDITION), as for one never put."""
    srv = await server_factory(**{"replay.models": str(model_file), "tiers.dram.capacity": CAPACITY})
    toks = tokens_for(P, seed=63)
    async with EngramClient(srv.address, namespace="a") as client:
        fp, sid = await _session(client, model, toks)
        last = srv.store.lookup("a", fp, toks).blocks[-1]

        async def damage_and_read() -> None:
            view = srv.store.placement.tier("dram").view(last.key)
            view[0] ^= 0xFF
            with pytest.raises(DataLoss):
                await srv.store.read(last)  # the other reader: the copy is dropped, and with it the block
            assert not last.locations

        _after_answer(srv, damage_and_read)
        caplog.set_level(logging.ERROR, logger="engram")
        with pytest.raises(errors.FailedPrecondition, match=r"positions \[48, 53\) is not stored.*put it again"):
            await client.resume(sid)
        assert "internal error" not in caplog.text


async def test_a_resume_whose_client_went_before_its_answer_gives_its_leases_back(
        server_factory: Any, model_file: Path, model: HybridDecoder) -> None:
    """The lease SessionManager.resume hands over is given back when nobody takes the answer: the client cancelled
    while the answer was on its way (a block leased for ever is never evicted). Guards the lease above: with none
    handed over, the tree before it passes this too."""
    srv = await server_factory(**{"replay.models": str(model_file), "tiers.dram.capacity": CAPACITY})
    toks = tokens_for(P, seed=64)
    gate, answered = asyncio.Event(), asyncio.Event()
    async with EngramClient(srv.address, namespace="a") as client:
        fp, sid = await _session(client, model, toks)
        blocks = srv.store.lookup("a", fp, toks).blocks

        async def hold_the_answer() -> None:
            answered.set()
            try:
                await gate.wait()
            except asyncio.CancelledError:  # the handler's cancel came too late for this task: it answers anyway
                await gate.wait()

        _after_answer(srv, hold_the_answer)
        call = asyncio.ensure_future(client.resume_kv(fp, sid))
        await answered.wait()
        assert all(b.leases == 1 for b in blocks)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        for _ in range(200):  # the daemon sees the cancellation, then the task answers nobody
            await asyncio.sleep(0.01)
            gate.set()
            if all(b.leases == 0 for b in blocks):
                break
        assert [b.leases for b in blocks] == [0] * len(blocks)

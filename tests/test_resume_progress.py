"""A Resume whose replay takes longer than the client's timeout_s is waited for: the daemon sends nothing while it
replays, and the client's stall bound (no message within timeout_s) cut it DeadlineExceeded though the daemon was
working (a gap left by session 45: a long window's replay on a CPU, or a real model's, passes 30 s). The client asks
for progress messages (ResumeRequest.progress_every_ms) and the daemon sends them while it works; a client from
before asks for none and sees none. A real daemon over a unix socket replays with a seeded model, held on its replay
thread for twice the client's timeout first (a real long replay's CPU time made the test's length, and the stalls of
an event loop sharing a loaded 2-core CI machine with it: 6-20 s a replay, gaps of 0.5 s between messages)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engram.client import EngramClient
from engram.replay import HybridConfig, HybridDecoder, exact_bound, gpt_oss_pattern, save_decoder
from engram.replay.runtime import model_spec_for
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc
from engram.wire.channel import open_channel

BT = 64
WINDOW = 64
# Progress every 1/2 s: a second of slack for an event loop on a loaded CPU (0.3 s failed once at load 10, 0.75 s on
# CI's 2-core machine). The replay is held twice as long, so it outlasts the timeout on any machine, idle or loaded.
TIMEOUT_S = 1.5
REPLAY_S = 2 * TIMEOUT_S


@pytest.fixture
def replay_model(tmp_path: Path) -> tuple[HybridDecoder, Path]:
    model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=WINDOW, dtype=torch.float32, seed=3))
    path = tmp_path / "replay-model.safetensors"
    save_decoder(model, path)
    return model, path


@pytest.mark.parametrize("transport", ["unix"])
async def test_a_resume_whose_replay_outlasts_the_timeout_is_waited_for_and_an_old_client_sees_no_progress(
        server_factory: Any, replay_model: tuple[HybridDecoder, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, path = replay_model
    srv = await server_factory(**{"replay.models": str(path)})
    real_rebuild = srv.sessions.runtime.rebuild

    def long_rebuild(*args: Any) -> Any:  # a long replay: the real one, on the replay thread after REPLAY_S
        time.sleep(REPLAY_S)
        return real_rebuild(*args)

    monkeypatch.setattr(srv.sessions.runtime, "rebuild", long_rebuild)
    n = exact_bound(model.replay_spec) + BT  # past the exact bound: the whole cone is replayed
    toks = np.random.default_rng(0).integers(0, 256, n, dtype=np.int32)
    # Stored global KV of the right shape; what it holds does not change the replay's work.
    kv = torch.randn((2, 2, n, 2, 16), generator=torch.Generator().manual_seed(0))
    async with EngramClient(srv.address, namespace="agents") as setup:
        fp = await setup.register_model(model_spec_for(model, block_tokens=BT, codec="raw"))
        await setup.put(fp, toks, kv)
        sid = (await setup.open_session(fp, tokens=toks)).session_id

    async with EngramClient(srv.address, namespace="agents", timeout_s=TIMEOUT_S) as client:
        t0 = time.perf_counter()
        r = await client.resume(sid)
        took = time.perf_counter() - t0
    assert r.source == "replay" and r.replayed_tokens == exact_bound(model.replay_spec)
    assert r.replay_s > TIMEOUT_S and took > TIMEOUT_S  # the replay did outlast the client's timeout

    # A client asking for progress sees it while the daemon replays; one from before (no progress_every_ms) gets
    # exactly the messages it knows.
    channel = open_channel(srv.address)
    stub = engram_pb2_grpc.EngramStub(channel)
    ref = pb.SessionRef(namespace="agents", session_id=sid)
    try:
        for asks in (True, False):
            async with EngramClient(srv.address, namespace="agents") as c:
                await c.suspend_session(sid)  # its window dropped: the next Resume replays again
            req = pb.ResumeRequest(session=ref, progress_every_ms=int(TIMEOUT_S * 1000 / 3) if asks else 0)
            messages = [m async for m in stub.Resume(req)]
            items = [m.WhichOneof("item") for m in messages]
            if asks:
                assert items.count("progress") >= 2 and items.index("header") > items.index("progress")
                assert {m.progress.stage for m in messages if m.HasField("progress")} >= {"replaying"}
            else:
                assert set(items) == {"header", "window_chunk"}
    finally:
        await channel.close()

"""A Resume with the global KV against a real `engram serve` process: clients that open the stream and then stop
reading hold the daemon to about a block each (the block being sent and HTTP/2's window), not to the decoded
prefix. Decoded whole, every such Resume held the prefix (and its serialized chunks) until its stream ended:
12 of them on a 64 MiB prefix grew the daemon by 1.7 GB (an audit)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import torch

from engram.client import EngramClient
from engram.replay import HybridConfig, HybridDecoder, gpt_oss_pattern, save_decoder
from engram.replay.runtime import model_spec_for
from engram.v1 import engram_pb2 as pb
from engram.v1 import engram_pb2_grpc

from helpers import engram_daemon

TOKENS = 4096  # 8 KiB a token (2 global layers, K and V of 8 heads of 64 floats): a prefix of 32 MiB
BLOCK_TOKENS = 128
BLOCK_MIB = 1
PREFIX_MIB = 32
STALLED = 8
# What a stalled call may hold: the block being sent, its message and serialized copies, and grpc's buffers
# (5-7 MiB a call measured here, as a stalled Get holds); decoded whole it held 2.2 prefixes (70 MiB)
PER_CALL_MIB = 10 * BLOCK_MIB


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


async def peak_rss_mib(pid: int, seconds: float) -> float:
    peak = 0.0
    for _ in range(int(seconds / 0.1)):
        peak = max(peak, rss_mib(pid))
        await asyncio.sleep(0.1)
    return peak


async def test_resumes_stalled_after_their_first_message_hold_about_a_block_each_not_the_prefix(tmp_path: Path) -> None:
    model = HybridDecoder(HybridConfig(layers=gpt_oss_pattern(4), window=8, dtype=torch.float32, seed=3,
                                       n_heads=8, n_kv_heads=8, head_dim=64, d_model=64))
    save_decoder(model, tmp_path / "model.safetensors")
    env = {"ENGRAM_REPLAY__MODELS": str(tmp_path / "model.safetensors"), "ENGRAM_TIERS__DRAM__CAPACITY": "128MiB",
           "ENGRAM_TIERS__DRAM__PREFAULT": "false"}
    toks = np.random.default_rng(1).integers(0, 256, TOKENS, dtype=np.int32)
    kv = torch.randn(2, 2, TOKENS, 8, 64, generator=torch.Generator().manual_seed(2))
    assert kv.numel() * 4 == PREFIX_MIB << 20
    with engram_daemon(tmp_path, env=env) as (address, proc):
        async with EngramClient(address) as client:
            fp = await client.register_model(model_spec_for(model, block_tokens=BLOCK_TOKENS, codec="raw"))
            await client.put(fp, toks, kv)
            sid = (await client.open_session(fp, mode="exact", tokens=toks)).session_id
            # Read whole, the global KV is the stored KV bit for bit, replayed and hot.
            r, got = await client.resume_kv(fp, sid)
            assert r.source == "replay" and torch.equal(got, kv)
            r, got = await client.resume_kv(fp, sid)
            assert r.source == "hot" and torch.equal(got, kv)
            del got
            idle = rss_mib(proc.pid)

            # One connection each (HTTP/2's window is per stream and per connection), one message read, then none.
            channels = [grpc.aio.insecure_channel(address) for _ in range(STALLED)]
            req = pb.ResumeRequest(session=pb.SessionRef(namespace="default", session_id=sid), with_global_kv=True,
                                   global_kv_by_block=True)
            calls = [engram_pb2_grpc.EngramStub(ch).Resume(req) for ch in channels]
            try:
                firsts = await asyncio.gather(*(call.read() for call in calls))
                assert all(m.WhichOneof("item") == "header" for m in firsts)
                await asyncio.sleep(1)  # the daemon goes as far as flow control lets it
                growth = await peak_rss_mib(proc.pid, 2) - idle
            finally:
                for call in calls:
                    call.cancel()
                for ch in channels:
                    await ch.close()
            assert growth < PER_CALL_MIB * STALLED, f"the daemon grew {growth:.0f} MiB for {STALLED} stalled Resumes"
            # And the daemon still answers.
            r, got = await client.resume_kv(fp, sid)
            assert r.source == "hot" and torch.equal(got, kv)

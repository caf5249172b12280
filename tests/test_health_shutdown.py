"""The gRPC health service of a real `engram serve` says NOT_SERVING as soon as SIGTERM arrives, while the calls
then in flight still finish within server.shutdown_grace_s: a load balancer watching health stops sending new
calls before the daemon goes, and the calls it sent are not cut. No test held either (an audit, session 48,
checked it by hand)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engram.block import checksum
from engram.client import EngramClient
from engram.v1 import engram_pb2 as pb
from engram.wire import convert

from helpers import engram_daemon, random_kv, tiny_model, tokens

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PIECES, PAUSE_S = 6, 0.4  # the Put in flight sends its block in 6 pieces, 0.4 s apart: 2 s, within the 10 s grace


async def test_health_says_not_serving_at_sigterm_while_the_calls_in_flight_finish(tmp_path: Path) -> None:
    spec = tiny_model()
    toks = tokens(16, seed=5)
    data = random_kv(spec, 16, seed=5).contiguous().view(torch.uint8).numpy().tobytes()
    header = pb.BlockHeader(tokens=convert.tokens_to_pb(toks), dtype=int(spec.layout.dtype),
                            shape=list(spec.layout.block_shape(16)), payload_nbytes=len(data),
                            checksum=checksum(data), codec="raw")
    with engram_daemon(tmp_path, "--set", "server.shutdown_grace_s=10") as (address, proc):
        async with EngramClient(address, namespace="h") as client:
            fp = await client.register_model(spec)
        async with grpc.aio.insecure_channel(address) as channel:
            said: list[tuple[float, int]] = []  # (when, status) as the Watch stream says it
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

            async def follow() -> None:
                async for resp in watch:
                    said.append((time.monotonic(), resp.status))

            following = asyncio.create_task(follow())
            for _ in range(100):  # the Watch's first answer
                if said:
                    break
                await asyncio.sleep(0.05)
            sent_first = asyncio.Event()

            async def slowly() -> AsyncIterator[pb.PutRequest]:
                yield pb.PutRequest(header=pb.PutHeader(namespace="h", model_fingerprint=fp))
                step = -(-len(data) // PIECES)
                for i in range(PIECES):
                    piece = data[i * step : (i + 1) * step]
                    chunk = pb.BlockChunk(data=piece, last=i == PIECES - 1)
                    if i == 0:
                        chunk.header.CopyFrom(header)
                    yield pb.PutRequest(chunk=chunk)
                    sent_first.set()
                    await asyncio.sleep(PAUSE_S)

            put = channel.stream_unary("/engram.v1.Engram/Put", request_serializer=pb.PutRequest.SerializeToString,
                                       response_deserializer=pb.PutResponse.FromString)
            call = put(slowly())
            await asyncio.wait_for(sent_first.wait(), 10)
            assert [s for _, s in said] == [SERVING]
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            reply = await asyncio.wait_for(call, 20)  # the Put in flight finishes, within the grace
            finished = time.monotonic()
            assert reply.stored == 1 and len(reply.keys) == 1
            not_serving = [when for when, s in said if s == NOT_SERVING]
            assert not_serving, f"the health Watch said {said} by the end of the Put in flight"
            assert signalled <= not_serving[0] < finished, (signalled, said, finished)  # while the Put ran
            following.cancel()
        assert proc.wait(30) == 0

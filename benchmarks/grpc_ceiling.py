"""The ceiling of grpc-python itself on this machine: a server subprocess that answers every call with the
same N-byte payload (one unary-stream message, as Engram's Get), and a client timing 300 calls. No store,
no checksum, no tensor: what put_get.py's Engram figures can at best reach.

    N=1048576 .venv/bin/python -m benchmarks.grpc_ceiling client 127.0.0.1:45671
    N=1048576 .venv/bin/python -m benchmarks.grpc_ceiling client unix:/tmp/grpc-ceiling.sock
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc

from engram.v1 import engram_pb2 as pb

N = int(os.environ.get("N", 1 << 20))
OPTS = eval(os.environ.get("OPTS", "[]"))
base = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
payload = os.urandom(N)


async def serve(addr):
    async def handler(req, ctx):
        yield pb.GetResponse(chunk=pb.BlockChunk(data=payload, last=True))

    server = grpc.aio.server(options=base + OPTS)
    h = grpc.method_handlers_generic_handler(
        "t.T",
        {"G": grpc.unary_stream_rpc_method_handler(handler, lambda b: b, lambda m: m.SerializeToString())},
    )
    server.add_generic_rpc_handlers((h,))
    server.add_insecure_port(addr)
    await server.start()
    await server.wait_for_termination()


async def client(addr):
    ch = grpc.aio.insecure_channel(addr, options=base + OPTS)
    call = ch.unary_stream(
        "/t.T/G", request_serializer=lambda b: b, response_deserializer=pb.GetResponse.FromString
    )

    async def one():
        async for _m in call(b""):
            pass

    await ch.channel_ready()
    for _ in range(30):
        await one()
    lat = []
    for _ in range(300):
        t0 = time.perf_counter()
        await one()
        lat.append(time.perf_counter() - t0)
    lat.sort()
    print(
        f"{addr[:4]} {OPTS}: p50 {lat[150] * 1e3:.2f} ms, mean {statistics.mean(lat) * 1e3:.2f} ms -> {N / statistics.mean(lat) / 1e9:.2f} GB/s"
    )


if sys.argv[1] == "serve":
    asyncio.run(serve(sys.argv[2]))
else:
    addr = sys.argv[2]
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_ceiling", "serve", addr])
    time.sleep(1.5)
    try:
        asyncio.run(client(addr))
    finally:
        p.kill()

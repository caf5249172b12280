"""GB/s of the data channel's receive loop (engram/wire/data.py `Conn.recv_into`), or with --send its send loop
(`Conn.send`, a daemon's GET answers), over a socketpair, without a stall limit (a client) and with one (the
daemon's server.data_stall_s): what the stall watch costs per byte. 1 MiB messages, the other end a task on the
same loop; three rounds, each setting alternating.
Run: .venv/bin/python benchmarks/data_recv.py [--send] [--mib 1] [--messages 2000]"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

from engram.wire.data import Conn, tune


async def rate(stall_s: float | None, mib: int, messages: int) -> float:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    loop = asyncio.get_running_loop()
    rx = Conn(a, stall_s=stall_s)
    payload = bytes(mib << 20)
    buf = memoryview(bytearray(mib << 20))

    async def send() -> None:
        for _ in range(messages):
            await loop.sock_sendall(b, payload)

    sender = asyncio.create_task(send())
    t0 = time.perf_counter()
    for _ in range(messages):
        await rx.recv_into(buf)
    seconds = time.perf_counter() - t0
    await sender
    rx.close()
    b.close()
    return messages * len(payload) / seconds / 1e9


async def send_rate(stall_s: float | None, mib: int, messages: int) -> float:
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
        tune(sock)  # the daemon's socket buffers
    loop = asyncio.get_running_loop()
    tx = Conn(a, stall_s=stall_s)
    payload = bytes(mib << 20)
    buf = memoryview(bytearray(mib << 20))

    async def receive() -> None:
        left = messages * len(payload)
        while left:
            left -= await loop.sock_recv_into(b, buf[: min(left, len(buf))])

    receiver = asyncio.create_task(receive())
    t0 = time.perf_counter()
    for _ in range(messages):
        await tx.send(payload)
    await receiver
    seconds = time.perf_counter() - t0
    tx.close()
    b.close()
    return messages * len(payload) / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--send", action="store_true", help="the send loop instead of the receive loop")
    args = ap.parse_args()
    measure = send_rate if args.send else rate
    for _ in range(3):
        for stall_s in (None, 30.0):
            got = asyncio.run(measure(stall_s, args.mib, args.messages))
            print(f"{'send' if args.send else 'receive'} stall_s={stall_s}: {got:.2f} GB/s")


if __name__ == "__main__":
    main()

"""GB/s of the data channel's receive loop (engram/wire/data.py `Conn.recv_into`) over a socketpair, without a
stall limit (a client) and with one (the daemon's server.data_stall_s): what the stall watch costs per byte.
1 MiB messages, the sender a task on the same loop; three rounds, each setting alternating.
Run: .venv/bin/python benchmarks/data_recv.py [--mib 1] [--messages 2000]"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

from engram.wire.data import Conn


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--messages", type=int, default=2000)
    args = ap.parse_args()
    for _ in range(3):
        for stall_s in (None, 30.0):
            got = asyncio.run(rate(stall_s, args.mib, args.messages))
            print(f"stall_s={stall_s}: {got:.2f} GB/s")


if __name__ == "__main__":
    main()

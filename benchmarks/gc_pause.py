"""Garbage-collector pauses of a store whose blocks turn over, with CPython's own schedule and with the daemon's
(engram/collector.py: survivors frozen every second, the whole heap collected once an hour).

A BlockStore with one DRAM tier holding CAPACITY small blocks (the tiny test model's), filled and turned over by
puts of 8-block chains until TOTAL blocks were put (evicting as it goes), in this process, on the event loop, as
the daemon's puts are. Start-up's objects are frozen first, as `engram serve` does. Every full collection's time
is recorded (gc.callbacks): each is a pause of the event loop, i.e. of every request in flight.

    .venv/bin/python -m benchmarks.gc_pause [--capacity 20000,100000] [--total-x 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import machine
from engram.collector import CollectorSchedule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import dram_store, put_tokens, tiny_model, tokens  # the tests' tiny store and model


async def run(capacity: int, total: int, schedule: CollectorSchedule | None) -> dict[str, Any]:
    store, fp = dram_store(capacity)
    bt = tiny_model().layout.block_tokens
    pauses: list[float] = []
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append(time.perf_counter() - started[0])

    gc.collect()
    gc.freeze()
    gc.callbacks.append(timed)
    try:
        t0 = last = time.perf_counter()
        for i in range(total // 8):
            await put_tokens(store, "ns", fp, tokens(8 * bt, seed=i))
            if schedule is not None and time.perf_counter() - last >= schedule.freeze_s:
                schedule.step()
                last = time.perf_counter()
        seconds = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()
        gc.collect()
    return {"schedule": "engram" if schedule else "cpython", "capacity": capacity, "puts": total,
            "seconds": round(seconds, 1), "full_collections": len(pauses),
            "longest_ms": round(max(pauses, default=0.0) * 1e3, 1), "total_ms": round(sum(pauses) * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", default="20000,100000")
    ap.add_argument("--total-x", type=int, default=3, help="blocks put, in multiples of the capacity")
    args = ap.parse_args()
    print(f"# gc_pause {datetime.date.today()} on {machine()}")
    print("| schedule | capacity (blocks) | blocks put | seconds | full collections | longest ms | total ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cap in (int(c) for c in args.capacity.split(",")):
        for schedule in (None, CollectorSchedule(freeze_s=1.0, full_s=3600.0)):
            r = asyncio.run(run(cap, cap * args.total_x, schedule))
            print(f"| {r['schedule']} | {cap:,} | {r['puts']:,} | {r['seconds']} | {r['full_collections']} | "
                  f"{r['longest_ms']} | {r['total_ms']} |", flush=True)


if __name__ == "__main__":
    main()

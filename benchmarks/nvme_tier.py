"""NVMe tier throughput and latency on this machine's disk, against fio on the same directory.

For block sizes 1, 4 and 16 MiB and queue depths 1, 4 and 16: write N blocks through NvmeTier (temp file,
fsync, rename, fsync of the directory: the durable path, by group commit: the writes queued together share the
directory syncs; the mean batch is printed) with QD writes in flight, then drop the page cache
and read them all back (header and payload checksums verified) with QD reads in flight. fio runs the same
sizes as the baseline: sequential write of the same bytes with an fsync per block, and sequential read after
a cache drop, with QD jobs. The I/O backend (thread pool hop per block, or aiofiles' hop per operation) is
compared at QD 4.

    sudo .venv/bin/python -m benchmarks.nvme_tier [--dir /path/on/the/disk] [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiofiles
import aiofiles.os

from benchmarks._harness import cells, machine, percentiles
from engram.block import BlockRecord, checksum
from engram.layout import DType
from engram.tiers.blockfile import encode
from engram.tiers.nvme import NvmeTier

MiB = 2**20
BATCH: dict[tuple[int, int], float] = {}  # (block MiB, QD) -> mean blocks per group commit


@dataclass
class Row:
    system: str
    op: str
    block_mib: int
    qd: int
    gbps: float
    p50_ms: float
    p99_ms: float


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def record(i: int, nbytes: int, payload: bytes) -> BlockRecord:
    key = i.to_bytes(16, "little")
    return BlockRecord(key, b"\0" * 16, b"b" * 16, "bench", DType.BF16, True, (1, 2, 256, 1, nbytes // 1024),
                       b"\0\0\0\0" * 256, nbytes, checksum(payload))


async def engram_run(root: Path, block_mib: int, qd: int, n: int) -> list[Row]:
    shutil.rmtree(root, ignore_errors=True)
    tier = NvmeTier(root, 1 << 50, io_threads=qd)
    size = block_mib * MiB
    payloads = [os.urandom(size) for _ in range(min(n, 4))]
    recs = [record(i, size, payloads[i % len(payloads)]) for i in range(n)]
    sem = asyncio.Semaphore(qd)
    wl: list[float] = []
    rl: list[float] = []

    async def put(i: int) -> None:
        async with sem:
            need = tier.space_for(recs[i])
            assert tier.reserve(need)
            t0 = time.perf_counter()
            await tier.write(recs[i], payloads[i % len(payloads)], need)
            wl.append(time.perf_counter() - t0)

    async def get(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            data = await tier.read(recs[i].key)
            rl.append(time.perf_counter() - t0)
            assert len(data) == size

    t0 = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(n)))
    w_s = time.perf_counter() - t0
    batches, blocks = tier.commit_stats
    BATCH[(block_mib, qd)] = blocks / max(1, batches)
    drop_caches()
    t0 = time.perf_counter()
    await asyncio.gather(*(get(i) for i in range(n)))
    r_s = time.perf_counter() - t0
    await tier.close()
    shutil.rmtree(root, ignore_errors=True)
    total = n * size
    return [Row("engram", "write", block_mib, qd, total / w_s / 1e9, *percentiles(wl)),
            Row("engram", "read", block_mib, qd, total / r_s / 1e9, *percentiles(rl))]


async def aiofiles_write(root: Path, block_mib: int, qd: int, n: int) -> Row:
    """The same durable write with aiofiles: one thread hop per open/write/fsync/close/rename."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "tmp").mkdir(parents=True)
    size = block_mib * MiB
    payload = os.urandom(size)
    rec = record(0, size, payload)
    header, stored = encode(rec, payload, compress=False)
    sem = asyncio.Semaphore(qd)
    lat: list[float] = []

    async def put(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            tmp, final = root / "tmp" / f"{i}.tmp", root / f"{i}.blk"
            async with aiofiles.open(tmp, "wb") as fh:
                await fh.write(header)
                await fh.write(stored)
                await fh.flush()
                await asyncio.to_thread(os.fsync, fh.fileno())
            await aiofiles.os.replace(tmp, final)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(n)))
    dt = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return Row("aiofiles", "write", block_mib, qd, n * size / dt / 1e9, *percentiles(lat))


def fio(root: Path, op: str, block_mib: int, qd: int, n: int) -> Row:
    root.mkdir(parents=True, exist_ok=True)
    size = n * block_mib // qd
    args = ["fio", "--name=engram", f"--directory={root}", f"--rw={'write' if op == 'write' else 'read'}",
            f"--bs={block_mib}M", f"--size={max(size, block_mib)}M", f"--numjobs={qd}", "--ioengine=psync",
            "--group_reporting", "--output-format=json"]
    if op == "write":
        args.append("--fsync=1")
    else:
        subprocess.run([*args[:3], "--rw=write", *args[4:]], check=True, capture_output=True)
        drop_caches()
    out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]["write" if op == "write" else "read"]
    lat = job.get("clat_ns", {}).get("percentile", {})
    shutil.rmtree(root, ignore_errors=True)
    return Row("fio", op, block_mib, qd, job["bw_bytes"] / 1e9, lat.get("50.000000", 0) / 1e6,
               lat.get("99.000000", 0) / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="engram-nvme-bench-"))
    total_mib = 256 if args.quick else 1024
    rows: list[Row] = []
    cache_dropped = drop_caches()
    with cells(9, "nvme_tier") as done:
        for block_mib in (1, 4, 16):
            n = total_mib // block_mib
            for qd in (1, 4, 16):
                rows += asyncio.run(engram_run(base / "engram", block_mib, qd, n))
                rows.append(fio(base / "fio", "write", block_mib, qd, total_mib))
                rows.append(fio(base / "fio", "read", block_mib, qd, total_mib))
                done(f"{block_mib} MiB QD{qd}")
            rows.append(asyncio.run(aiofiles_write(base / "aio", block_mib, 4, n)))
    shutil.rmtree(base, ignore_errors=True)
    print(f"# nvme_tier: {datetime.date.today()} on {machine()}; {total_mib} MiB per cell; "
          f"page cache dropped before reads: {cache_dropped}\n")
    print("| op | block | QD | engram GB/s | fio GB/s | engram/fio | engram p50 / p99 ms | blocks per commit |")
    print("|---|---|---|---|---|---|---|---|")
    for op in ("write", "read"):
        for block_mib in (1, 4, 16):
            for qd in (1, 4, 16):
                e = next(r for r in rows if (r.system, r.op, r.block_mib, r.qd) == ("engram", op, block_mib, qd))
                f = next(r for r in rows if (r.system, r.op, r.block_mib, r.qd) == ("fio", op, block_mib, qd))
                batch = f"{BATCH[(block_mib, qd)]:.1f}" if op == "write" else ""
                print(f"| {op} | {block_mib} MiB | {qd} | {e.gbps:.2f} | {f.gbps:.2f} | {e.gbps / f.gbps:.0%} | "
                      f"{e.p50_ms:.1f} / {e.p99_ms:.1f} | {batch} |")
    durable = [(e.gbps / f.gbps) for e in rows for f in rows if e.system == "engram" and f.system == "fio"
               and e.op == f.op == "write" and e.qd == f.qd >= 4 and e.block_mib == f.block_mib]
    print(f"\ndurable writes at QD >= 4: engram/fio from {min(durable):.0%} to {max(durable):.0%} "
          f"(goal: >= 70%)")
    print("\n| backend (durable write, QD 4) | block | GB/s | p50 / p99 ms |\n|---|---|---|---|")
    for r in rows:
        if r.system == "aiofiles" or (r.system == "engram" and r.op == "write" and r.qd == 4):
            name = "aiofiles (hop per operation)" if r.system == "aiofiles" else "thread pool (hop per block)"
            print(f"| {name} | {r.block_mib} MiB | {r.gbps:.2f} | {r.p50_ms:.1f} / {r.p99_ms:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()

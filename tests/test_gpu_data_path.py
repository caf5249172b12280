"""The GPU data path on a real CUDA device (skipped without one; the lead runs these on the H200): the
shared DRAM pool is pinned, batched transfers on the CUDA stream give the same bytes as the CPU path, the
HBM tier on the device holds the store's blocks, and two processes (a daemon and a worker) exchange blocks
through the pinned pool and through CUDA IPC, bit-identical to the bytes path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram.block import BlockRecord
from engram.layout import DType
from engram.tiers.dram import shared_dram_tier
from engram.tiers.hbm import hbm_tier
from engram.tiers.pool import PoolTier
from engram.transfer import TransferEngine, gather, scatter

from helpers import wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200)")]


async def fill(pool: PoolTier, sizes: list[int], seed: int) -> dict[bytes, bytes]:
    gen = torch.Generator().manual_seed(seed)
    blocks = {}
    for i, size in enumerate(sizes):
        key = f"b{seed}-{i}".encode()
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        rec = BlockRecord(key, b"p", b"fp", "ns", DType.BF16, True, (size,), b"", size, 0)
        need = pool.space_for(rec)
        assert pool.reserve(need)
        await pool.write(rec, payload, need)
        blocks[key] = payload
    return blocks


async def test_the_shared_pool_is_pinned_and_released(tmp_path: Path) -> None:
    pool = shared_dram_tier(8 * 2**20, "/dev/shm", pin=True)
    assert pool.segment is not None and pool.segment.pinned and pool.buffer.is_pinned()
    path = pool.segment.path
    await pool.close()
    assert not path.exists()


@pytest.mark.parametrize("page_bytes", [2**16, 2**16 + 512])  # page rows on one device, and not
async def test_cuda_transfers_match_the_cpu_path_bit_for_bit(page_bytes: int) -> None:
    sizes = [2**16, 1000, 3 * 2**13 + 7, 1, 2**16 - 1] * 8  # each fits a 64 KiB page
    dram = shared_dram_tier(16 * 2**20, "/dev/shm", 2**12, pin=True)
    hbm = hbm_tier(16 * 2**20, "cuda", 2**12)
    cpu = hbm_tier(16 * 2**20, "cpu", 2**12)
    try:
        for pool in (dram, hbm, cpu):
            blocks = await fill(pool, sizes, seed=1)
        keys = list(blocks)
        order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(2)).tolist()
        pairs = [(keys[i], p) for p, i in enumerate(order)]
        engine = TransferEngine("cuda")
        ref = torch.zeros(len(keys), page_bytes, dtype=torch.uint8)
        gather(TransferEngine(), cpu, pairs, ref).synchronize()
        for pool in (dram, hbm):  # host -> device (pinned, memcpy path) and device -> device (page rows)
            pages = torch.zeros(len(keys), page_bytes, dtype=torch.uint8, device="cuda")
            done = gather(engine, pool, pairs, pages)
            assert done.event is not None  # it ran on the transfer stream
            await done.wait()
            got = pages.cpu()
            for key, page in pairs:
                n = len(blocks[key])
                assert torch.equal(got[page, :n], ref[page, :n]), f"{pool.name}: block {key!r} differs"
                assert bytes(got[page, :n].numpy()) == blocks[key]
            # And back: scatter the pages into new blocks of the pool.
            triples = [(b"s" + k, p, len(blocks[k])) for k, p in pairs]
            reserved = []
            for _, _, n in triples:
                need = pool.pages_for(n) * pool.page_bytes
                if not pool.reserve(need):
                    break
                reserved.append(need)
            triples = triples[: len(reserved)]
            scatter(engine, pages, triples, pool, reserved).synchronize()
            for (new, _, _), (key, _) in zip(triples, pairs, strict=False):
                assert await pool.read(new) == blocks[key]
    finally:
        for pool in (dram, hbm, cpu):
            await pool.close()


def test_daemon_and_worker_processes_exchange_blocks_through_the_pool_and_cuda_ipc(tmp_path: Path) -> None:
    sock = tmp_path / "engram.sock"
    cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "warning",
           "--dram-capacity", "64MiB", "--set", "tiers.hbm.capacity=4MiB", "--set", "tiers.hbm.device=cuda"]
    daemon = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(f"unix:{sock}", daemon, timeout=120)
        worker = Path(__file__).with_name("gpu_worker.py")
        out = subprocess.run([sys.executable, "-X", "faulthandler", str(worker), f"unix:{sock}"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     filter(None, (str(worker.parent), os.environ.get("PYTHONPATH"))))})
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["identical"], report
        assert report["descriptors"] > 0, "no block came through the pinned pool"
        assert report["ipc_blocks"] > 0, "no block came through CUDA IPC"
        print(report)  # the counts, for the run's log
    finally:
        daemon.terminate()
        daemon.communicate(timeout=30)  # reaps it and closes its output pipe

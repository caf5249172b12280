"""Write-back's stated loss window (docs/RELIABILITY.md), and what a clean stop flushes.

Expected behaviour:
- a block held only in DRAM is copied to NVMe once it is tiers.write_back_window_s old (its DRAM copy stays);
  once Stats.write_back_pending_blocks is 0, a SIGKILL loses none of the acknowledged blocks;
- at most tiers.write_back_window_bytes are ever held only in DRAM: puts wait for a slow disk;
- SIGTERM copies what only DRAM holds to NVMe before exit (tiers.shutdown_flush_s), so a clean restart
  loses nothing; with shutdown_flush_s = 0 those blocks are gone (the contrast that shows the flush works);
- blocks write-through acknowledged as not durable (degrade) reach NVMe once the disk is back.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from engram.block import BlockHeader, checksum
from engram.client import EngramClient, SyncEngramClient
from engram.codec.stored import RAW, encode
from engram.config import load_config
from engram.keys import root_key
from engram.server.app import build_store
from engram.store import BlockStore

from helpers import BLOCK_TOKENS, ENGRAM, NEUTRAL_CWD, put_raw_chain, random_kv, tiny_model, tokens, wait_for

SPEC = tiny_model()
BLOCK = SPEC.layout.block_nbytes(BLOCK_TOKENS)
NS = "window"


async def put_chain(store: BlockStore, seed: int, n_blocks: int) -> list[bytes]:
    return await put_raw_chain(store, NS, SPEC, seed, n_blocks)


async def open_store(root: Path, **tiers: object) -> BlockStore:
    store = await build_store(load_config(env={}, overrides={
        "tiers.nvme.path": str(root), "tiers.dram.capacity": 256 * BLOCK, "tiers.dram.pool": "private",
        **{f"tiers.{k}": v for k, v in tiers.items()}}))
    store.registry.register(SPEC)
    return store


async def test_blocks_reach_nvme_once_the_window_has_passed_and_keep_their_dram_copy(tmp_path: Path) -> None:
    store = await open_store(tmp_path, write_back_window_s=0.2)
    keys = await put_chain(store, 1, 6)
    assert store.write_back_pending().blocks == 6  # DRAM only, for now
    for _ in range(200):
        if store.write_back_pending().blocks == 0:
            break
        await asyncio.sleep(0.02)
    assert store.write_back_pending().blocks == 0 and store.counters.blocks_flushed == 6
    assert [store.block(k).locations for k in keys] == [["dram", "nvme"]] * 6  # type: ignore[union-attr]
    await store.close()


async def test_the_byte_bound_holds_puts_back_for_a_slow_disk(tmp_path: Path) -> None:
    store = await open_store(tmp_path, write_back_window_s=0, write_back_window_bytes=3 * BLOCK)

    def slow(op: str, path: Path) -> None:
        if op == "write":
            time.sleep(0.02)  # a slow disk (in the I/O thread; the event loop goes on)

    store.tiers[-1].fault_hook = slow  # type: ignore[attr-defined]
    highest = 0
    for seed in range(4):
        toks = tokens(3 * BLOCK_TOKENS, seed=seed)
        kv = random_kv(SPEC, len(toks), seed=seed)
        parent = root_key(NS, SPEC.fingerprint)
        for i in range(3):
            block = kv[:, :, i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
            payload = encode(block, RAW)
            header = BlockHeader(toks[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS], SPEC.layout.dtype,
                                 tuple(block.shape), len(payload), checksum(payload))
            parent = (await store.put(NS, SPEC.fingerprint, parent, header, payload, index=i)).key
            highest = max(highest, store.write_back_pending().bytes)
    assert highest <= 3 * BLOCK  # never more than the window held only in DRAM
    assert store.counters.blocks_flushed >= 12 - 3
    await store.close()


async def test_write_through_blocks_acknowledged_not_durable_reach_nvme_when_the_disk_is_back(tmp_path: Path) -> None:
    store = await open_store(tmp_path, write_policy="write-through", on_nvme_failure="degrade", retry_s=0.05)
    full = {"on": True}

    def hook(op: str, path: Path) -> None:
        if op == "write" and full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")

    store.tiers[-1].fault_hook = hook  # type: ignore[attr-defined]
    keys = await put_chain(store, 2, 4)
    assert store.counters.blocks_not_durable == 4 and store.write_back_pending().blocks == 4
    full["on"] = False
    for _ in range(300):
        if store.write_back_pending().blocks == 0:
            break
        await asyncio.sleep(0.02)
    assert all("nvme" in store.block(k).locations for k in keys)  # type: ignore[union-attr]
    assert store.health["nvme"].state == "ok"
    await store.close()


# ---- across a real process: SIGKILL after the window, SIGTERM with and without the shutdown flush ---------


def serve(sock: Path, nvme: Path, *sets: str) -> subprocess.Popen[str]:
    args = [*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "info", "--dram-capacity", "4MiB",
            "--set", f"tiers.nvme.path={nvme}", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=NEUTRAL_CWD)
    wait_for(f"unix:{sock}", proc)
    return proc


def put_all(address: str, n: int) -> list[tuple[np.ndarray, torch.Tensor]]:
    out = []
    with SyncEngramClient(address, namespace=NS) as client:
        fp = client.register_model(SPEC)
        for seed in range(n):
            toks = tokens(2 * BLOCK_TOKENS + 3, seed=100 + seed)
            kv = random_kv(SPEC, len(toks), seed=100 + seed)
            client.put(fp, toks, kv)
            out.append((toks, kv))
    assert fp == SPEC.fingerprint
    return out


def count_back(address: str, puts: list[tuple[np.ndarray, torch.Tensor]]) -> int:
    with SyncEngramClient(address, namespace=NS) as client:
        fp = client.register_model(SPEC)
        whole = 0
        for toks, kv in puts:
            n, got = client.get_prefix(fp, toks)
            if n:
                assert torch.equal(got, kv[:, :, :n])  # whatever comes back is intact
            whole += n == len(toks)
        return whole


def finish(proc: subprocess.Popen[str], sig: int) -> str:
    proc.send_signal(sig)
    proc.wait(60)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.stdout:
        proc.stdout.close()
    return out


def test_sigterm_flushes_what_only_dram_holds_and_sigkill_after_the_window_loses_nothing(tmp_path: Path) -> None:
    sock = tmp_path / "e.sock"
    # No background flush at all (window 0): only the shutdown flush can save these blocks.
    proc = serve(sock, tmp_path / "a", "tiers.write_back_window_s=0")
    puts = put_all(f"unix:{sock}", 20)
    out = finish(proc, signal.SIGTERM)
    assert proc.returncode == 0 and "copied to NVMe" in out, out
    proc = serve(sock, tmp_path / "a")
    try:
        assert count_back(f"unix:{sock}", puts) == 20
    finally:
        finish(proc, signal.SIGTERM)

    # The contrast: the same without the shutdown flush loses them (so the check above can fail).
    proc = serve(sock, tmp_path / "b", "tiers.write_back_window_s=0", "tiers.shutdown_flush_s=0")
    puts = put_all(f"unix:{sock}", 20)
    finish(proc, signal.SIGTERM)
    proc = serve(sock, tmp_path / "b")
    try:
        assert count_back(f"unix:{sock}", puts) == 0
    finally:
        finish(proc, signal.SIGTERM)

    # With a window: once nothing is pending, a SIGKILL loses none of the acknowledged blocks.
    proc = serve(sock, tmp_path / "c", "tiers.write_back_window_s=0.2")
    puts = put_all(f"unix:{sock}", 20)
    with SyncEngramClient(f"unix:{sock}", namespace=NS) as client:
        deadline = time.monotonic() + 30
        while client.stats().write_back_pending_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().write_back_pending_blocks == 0
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, signal.SIGKILL)
    proc = serve(sock, tmp_path / "c")
    try:
        assert count_back(f"unix:{sock}", puts) == 20
    finally:
        finish(proc, signal.SIGTERM)
    _ = EngramClient  # the async client is the same path; the sync one drives a subprocess here


async def test_a_stop_just_after_the_disk_has_room_again_flushes_what_only_dram_holds(server_factory,  # type: ignore[no-untyped-def]
                                                                                       tmp_path: Path) -> None:
    """A full disk marks the NVMe tier degraded for tiers.retry_s; a stop within that time of the disk having room
    again copied nothing (the shutdown flush stopped at the mark) and every block held only in DRAM was lost (an
    audit, session 47). The shutdown flush tries the disk whatever the mark, and stops only at a failure of its
    own: with the disk still full it gives up at the first block, not after tiers.shutdown_flush_s."""
    config = {"tiers.nvme.path": str(tmp_path / "nvme"), "tiers.dram.pool": "private",
              "tiers.write_back_window_s": 0.05, "tiers.retry_s": 60}
    seqs = {seed: tokens(3 * BLOCK_TOKENS, seed=seed) for seed in range(4)}
    kvs = {seed: random_kv(SPEC, len(t), seed=seed) for seed, t in seqs.items()}

    async def put_while_full(full: dict[str, bool]):  # type: ignore[no-untyped-def]
        srv = await server_factory(**config)

        def hook(op: str, path: Path) -> None:
            if full["on"] and op == "write":
                raise OSError(errno.ENOSPC, "No space left on device")

        srv.store.tiers[-1].fault_hook = hook
        async with EngramClient(srv.address, namespace=NS) as client:
            fp = await client.register_model(SPEC)
            for seed, toks in seqs.items():
                await client.put(fp, toks, kvs[seed])
            for _ in range(500):  # the flusher tries a block and finds the disk full
                if srv.store.health["nvme"].state == "degraded":
                    break
                await asyncio.sleep(0.01)
            stats = await client.stats()
            assert stats.tier("nvme").state == "degraded" and stats.write_back_pending_blocks == 12
        return srv

    full = {"on": True}
    srv = await put_while_full(full)
    full["on"] = False  # room again, well within tiers.retry_s
    await srv.stop(0)
    srv = await server_factory(**config)
    async with EngramClient(srv.address, namespace=NS) as client:
        fp = await client.register_model(SPEC)
        for seed, toks in seqs.items():
            n, got = await client.get_prefix(fp, toks)
            assert n == len(toks) and got is not None and torch.equal(got, kvs[seed])
    await srv.stop(0)

    config["tiers.nvme.path"] = str(tmp_path / "still-full")
    srv = await put_while_full({"on": True})
    t0 = time.monotonic()
    flushed = await srv.store.flush(30.0)  # what the stop runs first
    assert (flushed.flushed, flushed.left) == (0, 12) and time.monotonic() - t0 < 5

"""A real daemon subprocess killed with SIGKILL in the middle of a stream of writes, then restarted on the
same NVMe directory: every acknowledged block is there and verifies, and nothing corrupt is served."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engram import errors
from engram.client import SyncEngramClient

from helpers import BLOCK_TOKENS, random_kv, tiny_model, tokens, wait_for

SPEC = tiny_model()


def start_daemon(sock: Path, nvme: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "warning",
           "--dram-capacity", "256KiB", "--set", f"tiers.nvme.path={nvme}",
           "--set", "tiers.write_policy=write-through"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=sock.parent)
    wait_for(f"unix:{sock}", proc)
    return proc


@contextlib.contextmanager
def serving(cmd: list[str], sock: Path, *, crash: bool) -> Iterator[None]:
    """A daemon of `cmd` on `sock` while the block runs; then SIGKILLed (crash) or stopped with SIGTERM."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=sock.parent)
    try:
        wait_for(f"unix:{sock}", proc)
        yield
    finally:
        if crash:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        else:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        if proc.stdout:
            proc.stdout.close()


def writer(address: str, acked: list[tuple[np.ndarray, torch.Tensor]], stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    try:
        with SyncEngramClient(address, namespace="crash") as client:
            fp = client.register_model(SPEC)
            i = 0
            while not stop.is_set():
                n = rng.randrange(1, 4) * BLOCK_TOKENS + rng.randrange(0, BLOCK_TOKENS)
                toks = tokens(n, seed=seed * 100_000 + i)
                kv = random_kv(SPEC, n, seed=seed * 100_000 + i)
                client.put(fp, toks, kv)
                acked.append((toks, kv))  # only after the daemon acknowledged the whole put
                i += 1
    except (errors.EngramError, RuntimeError):
        pass  # the daemon died under us: that is the point


def test_sigkill_mid_write_loses_no_acknowledged_block(tmp_path: Path) -> None:
    sock, nvme = tmp_path / "engram.sock", tmp_path / "nvme"
    acked: list[tuple[np.ndarray, torch.Tensor]] = []
    for round_ in range(2):
        proc = start_daemon(sock, nvme)
        stop = threading.Event()
        threads = [threading.Thread(target=writer, args=(f"unix:{sock}", acked, stop, round_ * 10 + w))
                   for w in range(2)]
        for t in threads:
            t.start()
        time.sleep(1.0 + random.random())
        before = len(acked)
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown, no flush: mid-stream
        proc.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
        if proc.stdout:
            proc.stdout.close()
        assert before > 0, "the writers acknowledged nothing before the kill"

    proc = start_daemon(sock, nvme)
    try:
        with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
            fp = client.register_model(SPEC)
            for toks, kv in acked:
                n, got = client.get_prefix(fp, toks)
                assert n == len(toks), "an acknowledged block is missing after the crash"
                assert torch.equal(got, kv)
            report = client.check(fix=False)
            assert not report.findings, report.findings  # recovery removed every torn write
            stats = client.stats()
            assert stats.tiers[1].blocks >= sum(-(-len(t) // BLOCK_TOKENS) for t, _ in acked)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        if proc.stdout:
            proc.stdout.close()
    assert list((nvme / "tmp").iterdir()) == []


def _settled(client: SyncEngramClient) -> None:
    """Wait until nothing is held only in DRAM (write-back's flusher caught up; at once under write-through)."""
    deadline = time.monotonic() + 30
    while client.stats().write_back_pending_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats().write_back_pending_blocks == 0


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_a_block_evicted_from_nvme_while_dram_holds_it_costs_no_acknowledged_block_at_a_sigkill(
        tmp_path: Path, policy: str) -> None:
    """An audit's sequence (session 43): a chain [X1, X2] on DRAM and NVMe; other chains fill NVMe, whose eviction
    takes the leaf X2; then X1 X2 X3 is put. NVMe used to drop only its copy of X2, leaving it in DRAM alone:
    the put's Lookup skipped X1 and X2, X3 was acknowledged durable (nothing pending), and after a SIGKILL X2
    was gone and X3 dropped as an orphan. Every block the daemon held before the kill, all acknowledged
    durable (or flushed), must be found after the restart."""
    sock, nvme = tmp_path / "e.sock", tmp_path / "nvme"
    sets = ("--dram-capacity", "1MiB", "--set", f"tiers.nvme.path={nvme}", "--set", "tiers.nvme.capacity=48KiB",
            "--set", f"tiers.write_policy={policy}", "--set", "tiers.write_back_window_s=0.05")
    cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "warning", *sets]
    chain = tokens(3 * BLOCK_TOKENS, seed=7)
    kv = random_kv(SPEC, len(chain), seed=7)
    others = [(tokens(BLOCK_TOKENS, seed=100 + i), random_kv(SPEC, BLOCK_TOKENS, seed=100 + i)) for i in range(20)]
    with serving(cmd, sock, crash=True), SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        fp = client.register_model(SPEC)
        client.put(fp, chain[: 2 * BLOCK_TOKENS], kv[:, :, : 2 * BLOCK_TOKENS])
        _settled(client)
        for toks, other in others:  # more than NVMe holds: it evicts leaves, X2 among the first
            client.put(fp, toks, other)
            _settled(client)
        result = client.put(fp, chain, kv)
        assert result.not_durable == 0
        _settled(client)
        assert client.stats().blocks_not_durable == 0
        held = [client.lookup(fp, toks).matched_tokens for toks, _ in [(chain, kv), *others]]
        assert held[0] == len(chain)
    with serving(cmd, sock, crash=False), SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        fp = client.register_model(SPEC)
        back = [client.lookup(fp, toks).matched_tokens for toks, _ in [(chain, kv), *others]]
        assert back == held, "a block held (and acknowledged durable) before the SIGKILL is gone"
        n, got = client.get_prefix(fp, chain)
        assert n == len(chain) and torch.equal(got, kv)


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_a_block_whose_nvme_file_check_fix_drops_survives_a_sigkill(tmp_path: Path, policy: str) -> None:
    """A chain on DRAM and NVMe; its middle block's file is damaged on disk, and `check --fix` (the daemon's
    Check) drops that copy while DRAM keeps a sound one. The block stayed acknowledged in DRAM alone, nothing
    pending in Stats, and a SIGKILL lost it and the block after it. Now it is written to NVMe again (under
    write-back it is pending meanwhile, and Stats says so): after the SIGKILL the whole chain is back."""
    sock, nvme = tmp_path / "e.sock", tmp_path / "nvme"
    sets = ("--dram-capacity", "1MiB", "--set", f"tiers.nvme.path={nvme}", "--set", f"tiers.write_policy={policy}",
            "--set", "tiers.write_back_window_s=2")
    cmd = [sys.executable, "-m", "engram", "serve", "--unix-socket", str(sock), "--log-level", "error", *sets]
    chain = tokens(3 * BLOCK_TOKENS, seed=8)
    kv = random_kv(SPEC, len(chain), seed=8)
    with serving(cmd, sock, crash=True), SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        fp = client.register_model(SPEC)
        middle = client.put(fp, chain, kv).keys[1]
        _settled(client)
        [file] = (nvme / "blocks").rglob(f"{middle.hex()}.*")
        data = bytearray(file.read_bytes())
        data[-1] ^= 0x40  # a payload byte
        file.write_bytes(bytes(data))
        report = client.check(fix=True)
        assert [f.fixed for f in report.findings] == [True]
        pending = client.stats().write_back_pending_blocks
        assert pending == (1 if policy == "write-back" else 0)  # write-through: written again already
        _settled(client)
        assert client.check(fix=False).findings == ()
    with serving(cmd, sock, crash=False), SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        fp = client.register_model(SPEC)
        n, got = client.get_prefix(fp, chain)
        assert n == len(chain), "an acknowledged block is gone after the SIGKILL"
        assert torch.equal(got, kv)

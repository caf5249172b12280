"""SIGKILL at the two moments where the daemon moves or removes files on its own: a demotion (DRAM -> NVMe,
write-back) and a `check --fix`. Real `engram serve` subprocesses, killed, restarted on the same directory.

Expected behaviour:
- killed mid-demotion: the restart recovers (a torn temp file is removed), `check` is clean, every block a
  Lookup finds reads back exactly as it was put (nothing torn is served), and the blocks demoted before the
  kill are still there. (What only DRAM held is lost under write-back: its stated loss window,
  test_write_back_window.py.)
- killed mid-`check --fix`: no acknowledged write-through block is lost, `check` is clean afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import torch

from engram import errors
from engram.client import SyncEngramClient
from engram.layout import DType, KVLayout, LayerKind, LayerSpec, ModelSpec

from helpers import BLOCK_TOKENS, ENGRAM, NEUTRAL_CWD, random_kv, tiny_model, tokens, wait_for

SPEC = tiny_model()


def serve(sock: Path, nvme: Path, *sets: str) -> subprocess.Popen[str]:
    args = [*ENGRAM, "serve", "--unix-socket", str(sock), "--log-level", "warning",
            "--set", f"tiers.nvme.path={nvme}", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=NEUTRAL_CWD)
    wait_for(f"unix:{sock}", proc, timeout=60)
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    if proc.stdout:
        proc.stdout.close()


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    if proc.stdout:
        proc.stdout.close()


def writer(address: str, spec: ModelSpec, acked: list[tuple[np.ndarray, torch.Tensor]], stop_: threading.Event,
           seed: int, blocks: int = 3) -> None:
    try:
        with SyncEngramClient(address, namespace="crash") as client:
            fp = client.register_model(spec)
            i = 0
            while not stop_.is_set():
                bt = spec.layout.block_tokens
                toks = tokens(blocks * bt, seed=seed * 100_000 + i)
                kv = random_kv(spec, len(toks), seed=seed * 100_000 + i)
                client.put(fp, toks, kv)
                acked.append((toks, kv))
                i += 1
    except (errors.EngramError, RuntimeError):
        pass  # the daemon died under us


def test_sigkill_mid_demotion_serves_nothing_torn_and_keeps_what_was_demoted(tmp_path: Path) -> None:
    sock, nvme = tmp_path / "e.sock", tmp_path / "nvme"
    # 16 blocks of DRAM under a steady stream of puts: demotions run all the time; no background flush.
    proc = serve(sock, nvme, "tiers.dram.capacity=64KiB", "tiers.write_back_window_s=0")
    acked: list[tuple[np.ndarray, torch.Tensor]] = []
    stop_ = threading.Event()
    threads = [threading.Thread(target=writer, args=(f"unix:{sock}", SPEC, acked, stop_, w)) for w in range(2)]
    for t in threads:
        t.start()
    with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        deadline = time.monotonic() + 60
        while client.stats().tier("dram").demotions < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        demoted_before = client.stats().tier("nvme").blocks
    assert demoted_before > 0
    kill(proc)  # demotions in flight
    stop_.set()
    for t in threads:
        t.join(30)

    proc = serve(sock, nvme)
    try:
        with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
            fp = client.register_model(SPEC)
            assert client.stats().tier("nvme").blocks >= demoted_before - 1  # at most the one in flight
            found = 0
            for toks, kv in acked:
                n, got = client.get_prefix(fp, toks)
                if n:
                    assert torch.equal(got, kv[:, :, :n]), "a block served after the crash is not what was put"
                    found += 1
            assert found > 0
            assert not client.check(fix=False).findings
    finally:
        stop(proc)
    assert list((nvme / "tmp").iterdir()) == []


def _big() -> ModelSpec:
    layout = KVLayout(layers=(LayerSpec(LayerKind.GLOBAL),), num_kv_heads=8, head_dim=64, dtype=DType.BF16,
                      block_tokens=128)  # 256 KiB blocks: a check of a few hundred takes a moment
    return ModelSpec(name="crash-check", weights_id="w", layout=layout, codec="raw")


def test_sigkill_mid_check_fix_loses_no_acknowledged_block(tmp_path: Path) -> None:
    sock, nvme = tmp_path / "e.sock", tmp_path / "nvme"
    spec = _big()
    puts = []
    proc = serve(sock, nvme, "tiers.write_policy=write-through", "tiers.dram.capacity=16MiB",
                 "tiers.dram.pool=private")
    try:
        with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
            fp = client.register_model(spec)
            for seed in range(150):
                toks = tokens(4 * 128, seed=seed)
                kv = random_kv(spec, len(toks), seed=seed)
                client.put(fp, toks, kv)  # acknowledged: on NVMe
                puts.append((toks, kv))
    except BaseException:
        kill(proc)
        raise
    with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
        t0 = time.perf_counter()
        client.check(fix=True)
        check_s = time.perf_counter() - t0  # how long one check takes here: the kills land inside one
    mid_check = 0
    for fraction in (0.2, 0.5, 0.8):
        outcome: list[object] = []
        ready = threading.Event()
        client = SyncEngramClient(f"unix:{sock}", namespace="crash")
        client.stats()  # connected: the check goes out at once

        def run_check(client: SyncEngramClient = client, outcome: list[object] = outcome,
                      ready: threading.Event = ready) -> None:
            ready.set()
            try:
                outcome.append(client.check(fix=True))
            except (errors.EngramError, RuntimeError) as exc:
                outcome.append(exc)

        t = threading.Thread(target=run_check)
        t.start()
        ready.wait(10)
        time.sleep(fraction * check_s)
        kill(proc)
        t.join(30)
        client.close()
        mid_check += bool(outcome) and isinstance(outcome[0], Exception)
        proc = serve(sock, nvme, "tiers.write_policy=write-through", "tiers.dram.capacity=16MiB",
                     "tiers.dram.pool=private")
        with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
            fp = client.register_model(spec)
            for toks, kv in puts:
                n, got = client.get_prefix(fp, toks)
                assert n == len(toks), "an acknowledged block was lost to a check killed mid-way"
                assert torch.equal(got, kv)
    try:
        with SyncEngramClient(f"unix:{sock}", namespace="crash") as client:
            assert not client.check(fix=False).findings
    finally:
        stop(proc)
    assert mid_check >= 1, "no kill landed while a check ran: the test did not test anything"
    _ = BLOCK_TOKENS

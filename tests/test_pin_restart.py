"""Pins outlive the daemon: a real `engram serve` on a unix socket and an NVMe directory, stopped (SIGKILL: the
journal is replayed; SIGTERM: its snapshot is read) and started again on it. Before, every pinned block came back
unpinned and was evicted like any other, though its client had been told it was pinned."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from engram.client import SyncEngramClient

from helpers import BLOCK_TOKENS, engram_daemon, random_kv, tiny_model, tokens

SPEC = tiny_model()  # 4 KiB blocks: the NVMe tier's 512 KiB holds 128


def chain(client: SyncEngramClient, fp: bytes, blocks: int, seed: int, *, pin: bool) -> list[bytes]:
    toks = tokens(blocks * BLOCK_TOKENS, seed=seed)
    return list(client.put(fp, toks, random_kv(SPEC, len(toks), seed=seed), pin=pin).keys)


def pins_of(client: SyncEngramClient, keys: list[bytes]) -> list[int]:
    found = {b.key: b.pins for b in client.describe_blocks(key_prefixes=[k.hex() for k in keys]).blocks}
    return [found[k] for k in keys]


@pytest.mark.parametrize(("stop", "policy"), [("sigkill", "write-through"), ("sigterm", "write-back")])
def test_pinned_blocks_come_back_pinned_after_a_restart_and_are_not_evicted(
        tmp_path: Path, stop: str, policy: str) -> None:
    args = ("--set", f"tiers.nvme.path={tmp_path / 'nvme'}", "--set", "tiers.nvme.capacity=512KiB",
            "--set", f"tiers.write_policy={policy}")
    env = {"ENGRAM_TIERS__DRAM__CAPACITY": "256KiB"}
    with engram_daemon(tmp_path, *args, env=env) as (address, proc), \
            SyncEngramClient(address, namespace="ns") as c:
        fp = c.register_model(SPEC)
        pinned = chain(c, fp, 8, 1, pin=True)
        held = chain(c, fp, 8, 2, pin=False)
        assert c.pin(fp, held[-1:]) == 1  # the chain's last block: the whole chain is kept
        unpinned = chain(c, fp, 8, 3, pin=True)
        assert c.pin(fp, unpinned, unpin=True) == 8
        twice = chain(c, fp, 4, 4, pin=True)
        assert chain(c, fp, 4, 4, pin=True) == twice
        if stop == "sigterm":  # write-back: the blocks reach NVMe at the stop
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
    with engram_daemon(tmp_path, *args, env=env) as (address, _), SyncEngramClient(address, namespace="ns") as c:
        fp = c.register_model(SPEC)
        assert pins_of(c, pinned) == [1] * 8
        assert pins_of(c, held) == [0] * 7 + [1]
        assert pins_of(c, unpinned) == [0] * 8
        assert pins_of(c, twice) == [2] * 4
        for seed in range(100, 140):  # 160 unpinned blocks through a store of 64 + 128
            chain(c, fp, 4, seed, pin=False)
        for seed, n in ((1, 8), (2, 8), (4, 4)):  # the pinned chains, the oldest blocks, were not evicted
            assert c.lookup(fp, tokens(n * BLOCK_TOKENS, seed=seed)).matched_tokens == n * BLOCK_TOKENS
        assert c.pin(fp, twice, unpin=True) == 4 and pins_of(c, twice) == [1] * 4

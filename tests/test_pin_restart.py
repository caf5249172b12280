"""Pins outlive the daemon: a real `engram serve` on a unix socket and an NVMe directory, stopped (SIGKILL: the
journal is replayed; SIGTERM: its snapshot is read) and started again on it. Before, every pinned block came back
unpinned and was evicted like any other, though its client had been told it was pinned. Also when a full disk
dropped the NVMe tier's index journal (a daemon in this process, its fault hook failing the disk's writes)."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from engram.client import EngramClient, SyncEngramClient

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


# ---- a full disk: the journal dropped (a real daemon in this process, its NVMe I/O boundary failing) ---------


def _full(on: dict[str, bool]):  # type: ignore[no-untyped-def]
    """The NVMe tier's fault hook for a full disk while on["on"]: block files and the index journal fail ENOSPC."""

    def hook(op: str, path: Path) -> None:
        if on["on"] and op in ("write", "journal", "snapshot"):
            raise OSError(errno.ENOSPC, "No space left on device")

    return hook


async def _chain(client: EngramClient, fp: bytes, blocks: int, seed: int, *, pin: bool) -> list[bytes]:
    toks = tokens(blocks * BLOCK_TOKENS, seed=seed)
    return list((await client.put(fp, toks, random_kv(SPEC, len(toks), seed=seed), pin=pin)).keys)


async def _pins(client: EngramClient, keys: list[bytes]) -> list[int]:
    found = {b.key: b.pins for b in (await client.describe_blocks(key_prefixes=[k.hex() for k in keys])).blocks}
    return [found[k] for k in keys]


def _daemon_config(nvme: Path) -> dict[str, object]:
    return {"tiers.nvme.path": str(nvme), "tiers.nvme.capacity": "512KiB", "tiers.dram.capacity": "256KiB",
            "tiers.dram.pool": "private", "tiers.write_policy": "write-through", "tiers.retry_s": 0.2}


async def _pinned_chains_are_kept(client: EngramClient, fp: bytes, chains: dict[int, int]) -> None:
    """Unpinned blocks through a store of 64 + 128: the pinned chains (seed -> blocks), the oldest, are not evicted."""
    for seed in range(100, 140):
        await _chain(client, fp, 4, seed, pin=False)
    for seed, n in chains.items():
        assert (await client.lookup(fp, tokens(n * BLOCK_TOKENS, seed=seed))).matched_tokens == n * BLOCK_TOKENS


@pytest.mark.parametrize("at_stop", ["space back", "still full"])
async def test_pins_outlive_a_journal_a_full_disk_dropped_mid_run(server_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   at_stop: str) -> None:
    """A journal append failing ENOSPC drops the journal mid-run. It deleted the snapshot, the only record of the
    pins, and only a later block write opened a journal again: a stop with no write in between (a read-heavy
    while, a disk still full) came back with every pin lost, and the blocks they kept were evicted (an audit,
    session 47). Now the snapshot and journals stay, Stats says the journal is dropped, and the stop opens the
    journal again when it can, recording the pin changes made meanwhile; still full, the pins come back as
    recorded before the drop."""
    nvme = tmp_path / "nvme"
    srv = await server_factory(**_daemon_config(nvme))
    full = {"on": False}
    srv.store.tiers[-1].fault_hook = _full(full)
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(SPEC)
        pinned = await _chain(c, fp, 8, 1, pin=True)
        dropped_pin = await _chain(c, fp, 4, 2, pin=True)
        later_pin = await _chain(c, fp, 4, 3, pin=False)
        full["on"] = True
        assert await c.pin(fp, dropped_pin, unpin=True) == 4  # its first entry fails: the journal is dropped
        assert await c.pin(fp, later_pin) == 4
        nvme_stats = (await c.stats()).tier("nvme")
        assert nvme_stats.state == "degraded" and "index journal cannot be written" in nvme_stats.state_reason
        assert "No space left" in nvme_stats.state_reason
        assert await _pins(c, pinned) == [1] * 8  # in memory all along
        full["on"] = at_stop == "still full"
    await srv.stop(0)
    assert (nvme / "index" / "snapshot").exists()
    srv = await server_factory(**_daemon_config(nvme))
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(SPEC)
        assert await _pins(c, pinned) == [1] * 8
        if at_stop == "space back":  # the changes made while it was dropped, recorded at the stop
            assert await _pins(c, dropped_pin) == [0] * 4 and await _pins(c, later_pin) == [1] * 4
            kept = {1: 8, 3: 4}
        else:  # as recorded before the drop (RELIABILITY.md: not promised)
            assert await _pins(c, dropped_pin) == [1] * 4 and await _pins(c, later_pin) == [0] * 4
            kept = {1: 8, 2: 4}
        assert (await c.stats()).tier("nvme").state == "ok"
        await _pinned_chains_are_kept(c, fp, kept)


async def test_pins_outlive_a_start_on_a_full_disk_and_a_stop_before_it_has_room(
        server_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A start on a full disk serves without a journal, degraded. It deleted the snapshot the stop before had
    written, and a stop before the disk had room wrote none: the next start had no pins (an audit, session 47).
    The journal's writes fail below the tier here (os.write on its files), as the tier is made by the start."""
    nvme = tmp_path / "nvme"
    srv = await server_factory(**_daemon_config(nvme))
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(SPEC)
        pinned = await _chain(c, fp, 8, 1, pin=True)
    await srv.stop(0)  # a snapshot with the pins
    write = os.write
    full = {"on": True}

    def failing(fd: int, data: bytes) -> int:
        if full["on"] and Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith(("journal.", "snapshot")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", failing)
    srv = await server_factory(**_daemon_config(nvme))
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(SPEC)
        nvme_stats = (await c.stats()).tier("nvme")
        assert nvme_stats.state == "degraded" and "journal" in nvme_stats.state_reason
        assert await _pins(c, pinned) == [1] * 8
    await srv.stop(0)  # the disk still full
    full["on"] = False
    srv = await server_factory(**_daemon_config(nvme))
    async with EngramClient(srv.address, namespace="ns") as c:
        fp = await c.register_model(SPEC)
        assert await _pins(c, pinned) == [1] * 8
        await _pinned_chains_are_kept(c, fp, {1: 8})
